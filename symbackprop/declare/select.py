"""``where(cond, a, b)``: an elementwise select, built as it stands.

SymPy's ``Piecewise(...)`` constructor folds every Piecewise it finds under
a condition into the new one; when a condition reads a loop's result (an
argmin's "is f(x') < f(x)"), that drags the loop's step out into the outer
expression (minutes of SymPy work, and the loop's symbols leak out).
``where`` builds the Piecewise without that rewrite. The C evaluates only
the selected branch, and the derivative of a select is the select of the
branches' derivatives (zero into the branch not taken).
"""

from __future__ import annotations

import numbers

import sympy as sp
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import Boolean

from symbackprop.errors import ModelError
from symbackprop.messages import short


def where(cond: object, a: object, b: object) -> sp.Basic:
    """`a` where `cond` holds, else `b`, entry by entry.

    Args:
        cond: a SymPy condition (``sp.Lt(x, 0)``, ``sp.Eq(k, 10)``, an ``And``
            of them), or a list of rows of conditions of the branches' shape.
        a: the value where `cond` holds: a scalar expression or a matrix.
        b: the value elsewhere, of `a`'s shape (a scalar is broadcast).

    Returns:
        A scalar Piecewise, or an explicit matrix of them.

    Raises:
        ModelError: `cond` is not a condition, or the shapes disagree.

    Unlike ``jnp.where``, the branch not taken is not differentiated either:
    ``where(x > 0, sqrt(x), 0)`` has derivative 0 at ``x = -1`` (JAX: NaN).
    """
    if isinstance(cond, (list, tuple)):  # rows of conditions (a SymPy Matrix may not hold them)
        cond = _Rows(cond)
    shape = _shape(a, "a") or _shape(b, "b") or _shape(cond, "cond")
    if shape is None:
        return _select(_condition(cond), _scalar(a, "a"), _scalar(b, "b"))
    for value, what in ((cond, "cond"), (a, "a"), (b, "b")):
        own = _shape(value, what)
        if own is not None and own != shape:
            raise ModelError(f"where: {what} is {own[0]} x {own[1]}, the others {shape[0]} x {shape[1]}")

    def entry(value, i, j):
        return value[i, j] if _shape(value, "") is not None else value

    return sp.Matrix(shape[0], shape[1], lambda i, j: where(entry(cond, i, j), entry(a, i, j), entry(b, i, j)))


class _Rows:
    """A list of rows of conditions, read as a matrix is."""

    def __init__(self, rows: list | tuple) -> None:
        if not rows or not all(isinstance(r, (list, tuple)) and len(r) == len(rows[0]) for r in rows):
            raise ModelError("where: cond as a list must be a non-empty list of rows of equal length")
        self.rows, self.shape = rows, (len(rows), len(rows[0]))

    def __getitem__(self, ij: tuple[int, int]) -> object:
        return self.rows[ij[0]][ij[1]]


def _shape(value: object, what: str) -> tuple[int, int] | None:
    if isinstance(value, _Rows):
        return value.shape
    if isinstance(value, (sp.MatrixBase, sp.MatrixExpr)):
        if not all(isinstance(d, (int, sp.Integer)) for d in value.shape):
            raise ModelError(f"where: {what} has a symbolic shape {value.shape}; select within a map instead")
        return int(value.shape[0]), int(value.shape[1])
    return None


def _condition(cond: object) -> Boolean:
    if isinstance(cond, bool):
        return sp.true if cond else sp.false
    if not isinstance(cond, Boolean):
        raise ModelError(f"where: cond must be a condition (a comparison such as sp.Lt(x, 0)), got {short(cond)}")
    return cond


def _scalar(value: object, what: str) -> sp.Expr:
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return sp.sympify(value)
    if not isinstance(value, sp.Expr):
        raise ModelError(f"where: {what} must be a SymPy expression or a number, got {short(value)}")
    return value


def _select(cond: Boolean, a: sp.Expr, b: sp.Expr) -> sp.Expr:
    if cond == sp.true:
        return a
    if cond == sp.false:
        return b
    # b's own pairs follow (where(c1, x, where(c2, y, z)): one Piecewise)
    rest = b.args if isinstance(b, sp.Piecewise) else (sp.Tuple.__new__(ExprCondPair, b, sp.true),)
    return sp.Basic.__new__(sp.Piecewise, sp.Tuple.__new__(ExprCondPair, a, cond), *rest)
