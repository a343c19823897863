"""Layer, activation and loss helpers. Each returns an ordinary SymPy
expression: whatever a helper builds, a user could have written by hand.

Matrices are row-major batches: X is (batch, features), W is (in, out).
"""

from __future__ import annotations

import sympy as sp

from .errors import ModelError


def _rows_cols(x: sp.MatrixExpr) -> tuple:
    if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
        raise ModelError(f"expected a matrix expression, got {x!r}")
    return x.shape


def ones(rows, cols) -> sp.OneMatrix:
    return sp.OneMatrix(rows, cols)


def linear(x: sp.MatrixExpr, w: sp.MatrixExpr, b: sp.MatrixExpr | None = None) -> sp.MatrixExpr:
    """x @ w, plus the row b broadcast over the batch: x*w + ones(n, 1)*b."""
    out = x * w
    if b is not None:
        if b.shape[0] != 1:
            raise ModelError(f"the bias {b} must be a row (1 x out); its shape is {b.shape}")
        out = out + ones(x.shape[0], 1) * b
    return out


def _elementwise(x, fn):
    if isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
        return x.applyfunc(fn)
    return fn(x)


def sigmoid(x):
    """1 / (1 + exp(-x)), elementwise."""
    return _elementwise(x, lambda v: 1 / (1 + sp.exp(-v)))


def tanh(x):
    return _elementwise(x, sp.tanh)


def relu(x):
    """max(x, 0), elementwise; its derivative at exactly 0 is taken as 0."""
    return _elementwise(x, lambda v: sp.Max(v, 0))


def softplus(x):
    """log(1 + exp(x)), elementwise."""
    return _elementwise(x, lambda v: sp.log(1 + sp.exp(v)))


def sum_all(x: sp.MatrixExpr) -> sp.MatrixExpr:
    """The sum of every entry, as a 1x1 matrix: ones(1, rows) * x * ones(cols, 1)."""
    rows, cols = _rows_cols(x)
    return ones(1, rows) * x * ones(cols, 1)


def mean_all(x: sp.MatrixExpr) -> sp.MatrixExpr:
    rows, cols = _rows_cols(x)
    return sum_all(x) / (rows * cols)


def row_sums(x: sp.MatrixExpr) -> sp.MatrixExpr:
    """(rows x 1): the sum along each row."""
    return x * ones(x.shape[1], 1)


def mse(y: sp.MatrixExpr, target: sp.MatrixExpr) -> sp.MatrixExpr:
    """The mean over every entry of (y - target)**2 (as PyTorch's MSELoss)."""
    if y.shape != target.shape:
        raise ModelError(f"mse of shapes {y.shape} and {target.shape}")
    return mean_all(sp.HadamardPower(y - target, 2))


def logsumexp_rows(z: sp.MatrixExpr) -> sp.MatrixExpr:
    """(rows x 1): log(sum(exp(z))) along each row. Compiled stably, with the
    row's maximum subtracted before exp, whenever log, row sum and exp
    appear in this form."""
    return row_sums(z.applyfunc(sp.exp)).applyfunc(sp.log)


def softmax_cross_entropy(logits: sp.MatrixExpr, target: sp.MatrixExpr) -> sp.MatrixExpr:
    """The mean over rows of -sum(target * log_softmax(logits)); target rows
    are class probabilities (one-hot for hard labels) summing to 1."""
    if logits.shape != target.shape:
        raise ModelError(f"softmax_cross_entropy of shapes {logits.shape} and {target.shape}")
    rows = logits.shape[0]
    per_row = logsumexp_rows(logits) - row_sums(sp.HadamardProduct(target, logits))
    return sum_all(per_row) / rows


def l2_penalty(*weights: sp.MatrixExpr) -> sp.MatrixExpr:
    """The sum of squares of every entry of the given weights (1x1)."""
    if not weights:
        raise ModelError("l2_penalty needs at least one weight")
    terms = [sum_all(sp.HadamardPower(w, 2)) for w in weights]
    return sp.MatAdd(*terms) if len(terms) > 1 else terms[0]
