"""Losses (mse, softmax_cross_entropy, huber, ...), each a 1x1 matrix
expression reduced as PyTorch's `reduction` says, and one_hot and
l2_penalty. Public through symbackprop.nn."""

from __future__ import annotations

import sympy as sp

from symbackprop.base import stable
from symbackprop.declare.activations import log_softmax
from symbackprop.declare.pick import pick
from symbackprop.declare.reductions import mean_all, row_sums, shallow_doit, sum_all
from symbackprop.declare.tensor import Gather, Index, gather
from symbackprop.errors import ModelError


def _minus(y: sp.MatrixExpr, target: sp.MatrixExpr) -> sp.MatrixExpr:
    """y - target, as SymPy's operator builds it (but for its deep doit)."""
    return shallow_doit(sp.MatAdd(y, shallow_doit(sp.MatMul(sp.S.NegativeOne, target))))



REDUCTIONS = ("mean", "sum")  # as PyTorch's losses' `reduction` (but "none": a loss is 1x1)


def _reduced(terms: sp.MatrixExpr, reduction: str) -> sp.MatrixExpr:
    """A loss's terms summed, or averaged over their entries (one per row, or every entry)."""
    if reduction == "mean":
        return mean_all(terms)
    if reduction == "sum":
        return sum_all(terms)
    raise ModelError(f"a loss's reduction is one of {REDUCTIONS}; got {reduction!r}")


def mse(y: sp.MatrixExpr, target: sp.MatrixExpr, reduction: str = "mean") -> sp.MatrixExpr:
    """The mean (or sum) over every entry of (y - target)**2 (as PyTorch's MSELoss).

    Args:
        y: the prediction.
        target: the target, of y's shape.
        reduction: "mean" (the default) or "sum", as PyTorch's.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: the shapes differ, or an unknown reduction.
    """
    if y.shape != target.shape:
        raise ModelError(f"mse of shapes {y.shape} and {target.shape}")
    return _reduced(sp.HadamardPower(_minus(y, target), 2), reduction)


def one_hot(labels: Index, classes: int) -> sp.MatrixExpr:
    """Class labels as one-hot rows: row i is 1 in column labels[i], 0 elsewhere.

    Args:
        labels: an Index input of class numbers, 0 to classes - 1 (checked
            before each call, as any Index).
        classes: how many classes (an int).

    Returns:
        A (labels rows x classes) matrix expression: the rows of the
        identity matrix that `labels` gathers (no gradient flows to labels).

    Raises:
        ModelError: classes is not a number (the identity is explicit).
    """
    if not sp.sympify(classes).is_Integer:
        raise ModelError(f"one_hot needs the number of classes as an integer; got {classes}")
    return gather(sp.ImmutableMatrix(sp.eye(int(classes))), labels)


def softmax_cross_entropy(logits: sp.MatrixExpr, target: sp.MatrixExpr,
                          reduction: str = "mean") -> sp.MatrixExpr:
    """The mean (or sum) over rows of -sum(target * log_softmax(logits)),
    as PyTorch's CrossEntropyLoss.

    Args:
        logits: (n, classes) unnormalised scores.
        target: (n, classes) class probabilities (rows not summing to 1
            weigh the row's log-sum-exp by their sum, as PyTorch's),
            or an Index of n class numbers (the one-hot rows they gather:
            exactly -log_softmax(logits)[label], gradient softmax - one-hot).
        reduction: "mean" (the default: over the rows) or "sum", as PyTorch's.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: the shapes differ, or an unknown reduction.
    """
    if isinstance(target, Index):
        target = one_hot(target, logits.shape[1])
    if logits.shape != target.shape:
        raise ModelError(f"softmax_cross_entropy of shapes {logits.shape} and {target.shape}")
    labels = _one_hot_labels(target)
    # -sum(target * log_softmax), the log_softmax max-subtracted: lse - sum(target * logits)
    # lost the log of the sum against large logits (and assumed rows summing to 1); class
    # numbers: the target's entry of each row is picked, not summed over one-hot rows
    log_p = log_softmax(logits)
    chosen = pick(log_p, labels) if labels is not None else row_sums(sp.HadamardProduct(target, log_p))
    return _reduced(-chosen, reduction)


def _one_hot_labels(target: sp.MatrixExpr) -> Index | None:
    """The Index whose one-hot rows `target` is (as one_hot builds them), else None."""
    if not isinstance(target, Gather):
        return None
    array = target.array
    if not isinstance(array, sp.MatrixBase) or array != sp.eye(array.shape[0]):
        return None
    return target.index


def l2_penalty(*weights: sp.MatrixExpr) -> sp.MatrixExpr:
    """The sum of squares of every entry of the given weights.

    Args:
        *weights: matrix expressions.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: no weight is given.
    """
    if not weights:
        raise ModelError("l2_penalty needs at least one weight")
    terms = [sum_all(sp.HadamardPower(w, 2)) for w in weights]
    return sp.MatAdd(*terms) if len(terms) > 1 else terms[0]



def _difference(y, target, what: str):
    if y.shape != target.shape:
        raise ModelError(f"{what} of shapes {y.shape} and {target.shape}")
    return _minus(y, target)


def log_cosh(y: sp.MatrixExpr, target: sp.MatrixExpr) -> sp.MatrixExpr:
    """The mean of log(cosh(y - target)), written |d| + softplus(-2|d|) - log 2
    so that large differences do not overflow.

    Args:
        y: the prediction.
        target: the target, of y's shape.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: the shapes differ.
    """
    d = _difference(y, target, "log_cosh")
    return mean_all(d.applyfunc(lambda v: sp.Abs(v) + stable.softplus(-2 * sp.Abs(v)) - sp.log(2)))


def huber(y: sp.MatrixExpr, target: sp.MatrixExpr, delta: sp.Expr | float = 1) -> sp.MatrixExpr:
    """The mean Huber loss: d^2/2 where |d| <= delta, else delta*(|d| - delta/2),
    for d = y - target.

    Args:
        y: the prediction.
        target: the target, of y's shape.
        delta: where the loss turns from quadratic to linear.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: the shapes differ.
    """
    d = _difference(y, target, "huber")
    def per_entry(v):
        return sp.Piecewise((v**2 / 2, sp.Abs(v) <= delta), (delta * (sp.Abs(v) - delta / sp.Integer(2)), True))

    return mean_all(d.applyfunc(per_entry))


def binary_cross_entropy_with_logits(logits: sp.MatrixExpr, target: sp.MatrixExpr) -> sp.MatrixExpr:
    """The mean of -[t log sigmoid(z) + (1 - t) log(1 - sigmoid(z))], written
    softplus(z) - z t = max(z, 0) - z t + log1p(exp(-|z|)) so that it never
    overflows; its gradient is (sigmoid(z) - t) / count.

    Args:
        logits: the scores z.
        target: the probabilities t, of the logits' shape.

    Returns:
        A 1x1 matrix expression.

    Raises:
        ModelError: the shapes differ.
    """
    if logits.shape != target.shape:
        raise ModelError(f"binary_cross_entropy_with_logits of shapes {logits.shape} and {target.shape}")
    positive = logits.applyfunc(stable.softplus)
    return mean_all(positive - sp.HadamardProduct(logits, target))
