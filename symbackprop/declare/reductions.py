"""Sums and means of matrix expressions (ones, sum_all, mean_all,
row_sums, logsumexp_rows), each the product with a ones vector SymPy's
operators build: the pieces losses and layers are written with. Public
through symbackprop.nn."""

from __future__ import annotations

import sympy as sp

from symbackprop.errors import ModelError


def _rows_cols(x: sp.MatrixExpr) -> tuple:
    if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
        raise ModelError(f"expected a matrix expression, got {x!r}")
    return x.shape


def ones(rows: int | sp.Expr, cols: int | sp.Expr) -> sp.OneMatrix:
    """The all-ones matrix (a broadcast, or a sum when multiplied by).

    Args:
        rows: its number of rows (an integer or a Symbol).
        cols: its number of columns.

    Returns:
        ``sympy.OneMatrix(rows, cols)``.
    """
    return sp.OneMatrix(rows, cols)


def shallow_doit(expr: sp.MatrixExpr) -> sp.MatrixExpr:
    """SymPy's product or sum of these arguments as its operators build it,
    but for their doit, deep, of every argument: SymPy's doit rebuilds
    each scalar of an explicit Matrix as a tree (a shared subexpression
    once per path: minutes for sum_all(X * M) of entries 16 levels deep)
    and walks down every layer of a stack below it.

    Args:
        expr: an unevaluated matrix product or sum (sp.MatMul, sp.MatAdd).

    Returns:
        expr.doit(deep=False).
    """
    return expr.doit(deep=False)


def sum_all(x: sp.MatrixExpr) -> sp.MatrixExpr:
    """The sum of every entry, as a 1x1 matrix: ones(1, rows) * x * ones(cols, 1).

    Args:
        x: a matrix expression.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: x is not a matrix.
    """
    rows, cols = _rows_cols(x)
    return shallow_doit(sp.MatMul(ones(1, rows), x, ones(cols, 1)))


def mean_all(x: sp.MatrixExpr) -> sp.MatrixExpr:
    """The mean of every entry, as a 1x1 matrix.

    Args:
        x: a matrix expression.

    Returns:
        A 1x1 matrix expression: sum_all(x) / (rows * cols).

    Raises:
        ModelError: x is not a matrix.
    """
    rows, cols = _rows_cols(x)
    return shallow_doit(sp.MatMul(sum_all(x), sp.sympify(rows * cols) ** -1))


def row_sums(x: sp.MatrixExpr) -> sp.MatrixExpr:
    """The sum along each row.

    Args:
        x: a matrix expression.

    Returns:
        A (rows x 1) matrix expression: x * ones(cols, 1).
    """
    return shallow_doit(sp.MatMul(x, ones(x.shape[1], 1)))


def logsumexp_rows(z: sp.MatrixExpr) -> sp.MatrixExpr:
    """log(sum(exp(z))) along each row. Compiled stably, with the row's
    maximum subtracted before exp, whenever log, row sum and exp appear in
    this form.

    Args:
        z: a matrix expression.

    Returns:
        A (rows x 1) matrix expression.
    """
    return row_sums(z.applyfunc(sp.exp)).applyfunc(sp.log)
