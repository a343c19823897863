"""Layer, activation and loss helpers. Each returns an ordinary SymPy
expression: whatever a helper builds, a user could have written by hand
(sigmoid and softplus are the functions of symbackprop.base.stable, which is
also what 1/(1 + exp(-z)) and log(1 + exp(z)) written by hand compile to).

Matrices are row-major batches: X is (batch, features), W is (in, out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import sympy as sp
from sympy.codegen.cfunctions import expm1
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction

from symbackprop.base import stable
from symbackprop.declare.attention import (  # noqa: F401  (attention and transformer layers)
    Sequences,
    add_positions,
    causal_attention,
    embedding,
    layer_norm,
    self_attention,
    sequences,
)
from symbackprop.declare.conv import (  # noqa: F401  (the convolutional layers: nn.conv2d, ...)
    Images,
    avg_pool2d,
    batch_norm,
    batch_stats,
    conv2d,
    conv_weight,
    flatten,
    images,
    max_pool2d,
)
from symbackprop.declare.pick import pick
from symbackprop.declare.standing import layered
from symbackprop.declare.tensor import Gather, Index, Softmax, gather
from symbackprop.errors import ModelError

# What the elementwise helpers take and return: a scalar expression, a matrix
# expression, or an explicit sympy.Matrix.
Operand: TypeAlias = sp.Expr | sp.MatrixExpr | sp.MatrixBase


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


def _shallow(expr: sp.MatrixExpr) -> sp.MatrixExpr:
    """SymPy's product or sum of these arguments as its operators build it,
    but for their doit, deep, of every argument: SymPy's doit rebuilds
    each scalar of an explicit Matrix as a tree (a shared subexpression
    once per path: minutes for sum_all(X * M) of entries 16 levels deep)
    and walks down every layer of a stack below it."""
    return expr.doit(deep=False)


def _minus(y: sp.MatrixExpr, target: sp.MatrixExpr) -> sp.MatrixExpr:
    """y - target, as SymPy's operator builds it (but for its deep doit)."""
    return _shallow(sp.MatAdd(y, _shallow(sp.MatMul(sp.S.NegativeOne, target))))


def linear(x: sp.MatrixExpr, w: sp.MatrixExpr, b: sp.MatrixExpr | None = None) -> sp.MatrixExpr:
    """x @ w, plus the row b broadcast over the batch: x*w + ones(n, 1)*b.

    Args:
        x: the batch, (n, in).
        w: the weights, (in, out).
        b: the bias, a row (1, out), or None for none.

    Returns:
        The (n, out) matrix expression.

    Raises:
        ModelError: b is not a row.
        sympy.ShapeError: x and w cannot be multiplied.
    """
    # SymPy's x * w, but for its doit, deep, down the whole stack below x
    product = _shallow(sp.MatMul(x, w))
    if b is None:
        return product  # SymPy's own product: a product it is in takes in its factors
    if b.shape[0] != 1:
        raise ModelError(f"the bias {b} must be a row (1 x out); its shape is {b.shape}")
    return _shallow(sp.MatAdd(layered(product), _shallow(sp.MatMul(ones(x.shape[0], 1), b))))


_FUNCTIONS: dict[Any, sp.Lambda] = {}  # an activation's Lambda, by its key (see _elementwise)


def _function(fn: Callable[[sp.Expr], sp.Expr], key: Any) -> sp.Lambda:
    """Lambda(v, fn(v)), built once per key: SymPy's evaluation of fn(v)
    (tanh's looks for an imaginary factor) was a third of a tanh layer's
    declaration."""
    try:
        found = _FUNCTIONS.get(key)
    except TypeError:  # an unhashable parameter: not kept
        key = found = None
    if found is None:
        v = sp.Dummy("v", real=True)
        found = sp.Lambda(v, fn(v))
        if key is not None and len(_FUNCTIONS) < 256:
            _FUNCTIONS[key] = found
    return found


def _elementwise(x, fn, key: Any = None):
    """fn applied to each entry of x; `key` names fn with its parameters
    (fn itself where it is a module's function, not a new lambda)."""
    if isinstance(x, sp.MatrixExpr):
        if x.shape == (1, 1):  # SymPy would call fn on the 1x1 matrix itself
            return sp.ImmutableMatrix([[fn(x[0, 0])]])
        return layered(ElementwiseApplyFunction(_function(fn, fn if key is None else key), x))
    if isinstance(x, sp.MatrixBase):
        return x.applyfunc(fn)
    return fn(x)


def sigmoid(x: Operand) -> Operand:
    """1 / (1 + exp(-x)), elementwise, computed without overflow at any x
    (its derivative s*(1 - s), from its value, as PyTorch).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, stable.sigmoid)


def tanh(x: Operand) -> Operand:
    """tanh(x), elementwise.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, sp.tanh)


def relu(x: Operand) -> Operand:
    """max(x, 0), elementwise; its derivative at exactly 0 is taken as 0.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: sp.Max(v, 0), "relu")


def softplus(x: Operand) -> Operand:
    """log(1 + exp(x)), elementwise, computed as max(x, 0) + log1p(exp(-|x|))
    (no overflow: softplus(800) = 800); its derivative is sigmoid(x).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, stable.softplus)


def log_sigmoid(x: Operand) -> Operand:
    """log(sigmoid(x)) = -softplus(-x), elementwise (PyTorch's logsigmoid):
    -800 at x = -800, where log of the computed sigmoid would be -inf.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: -stable.softplus(-v), "log_sigmoid")


def silu(x: Operand) -> Operand:
    """x * sigmoid(x), elementwise (PyTorch's silu, also called swish).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: v * stable.sigmoid(v), "silu")


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
    return _shallow(sp.MatMul(ones(1, rows), x, ones(cols, 1)))


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
    return _shallow(sp.MatMul(sum_all(x), sp.sympify(rows * cols) ** -1))


def row_sums(x: sp.MatrixExpr) -> sp.MatrixExpr:
    """The sum along each row.

    Args:
        x: a matrix expression.

    Returns:
        A (rows x 1) matrix expression: x * ones(cols, 1).
    """
    return _shallow(sp.MatMul(x, ones(x.shape[1], 1)))


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


def log_softmax(z: sp.MatrixExpr, axis: int = 1) -> sp.MatrixExpr:
    """(z - max) - log(sum(exp(z - max))) along `axis`, as PyTorch's: never
    z - logsumexp(z), where a large z loses the log of the sum. Its
    gradient is g - softmax(z) * sum(g).

    Args:
        z: a matrix expression, one row per example.
        axis: 1 (the default): along each row; 0: down each column.

    Returns:
        A matrix expression of z's shape.

    Raises:
        ModelError: axis is neither 0 nor 1.
    """
    return Softmax(z, axis, log=True)


def softmax(z: sp.MatrixExpr, axis: int = 1) -> sp.MatrixExpr:
    """exp(z - max) / sum(exp(z - max)) along `axis`: rows (axis 1) or
    columns (axis 0) summing to 1, as PyTorch's (a row with +inf or NaN is
    NaN throughout).

    Args:
        z: a matrix expression, one row per example.
        axis: 1 (the default): each row; 0: each column.

    Returns:
        A matrix expression of z's shape.

    Raises:
        ModelError: axis is neither 0 nor 1.
    """
    return Softmax(z, axis)


LEAKY_SLOPE = sp.Rational(1, 100)  # PyTorch's default negative slope


def leaky_relu(x: Operand, slope: sp.Expr | float = LEAKY_SLOPE) -> Operand:
    """x where x > 0, else slope*x, elementwise; the derivative at 0 is slope
    (as PyTorch).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.
        slope: the slope for negative x.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: sp.Piecewise((v, v > 0), (slope * v, True)), ("leaky_relu", slope))


def elu(x: Operand, alpha: sp.Expr | float = 1) -> Operand:
    """x where x > 0, else alpha*(exp(x) - 1), elementwise; the derivative at
    0 is alpha.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.
        alpha: the scale of the negative part.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: sp.Piecewise((v, v > 0), (alpha * expm1(v), True)), ("elu", alpha))


GELU_APPROXIMATIONS = ("none", "tanh")  # torch.nn.functional.gelu's names


def gelu(x: Operand, approximate: str = "none") -> Operand:
    """The Gaussian error linear unit x * Phi(x), elementwise, as PyTorch's
    torch.nn.functional.gelu(x, approximate=...) computes it:

    - "none" (the default, as PyTorch's): exact, x/2 * (1 + erf(x / sqrt(2)))
      (erf is C99's);
    - "tanh": x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), which is
      up to 1.8e-4 from the exact value.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.
        approximate: "none" or "tanh".

    Returns:
        An expression of x's shape.

    Raises:
        ModelError: approximate is neither "none" nor "tanh".
    """
    if approximate == "none":
        return _elementwise(x, lambda v: v / 2 * (1 + sp.erf(v / sp.sqrt(2))), "gelu")
    if approximate == "tanh":
        c = sp.sqrt(2 / sp.pi)
        return _elementwise(x, lambda v: v / 2 * (1 + sp.tanh(c * (v + sp.Rational(44715, 1000000) * v**3))),
                           "gelu_tanh")
    raise ModelError(f"gelu's approximate must be one of {list(GELU_APPROXIMATIONS)}; got {approximate!r}")


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



def shallow(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), with each matrix argument that is an expression (not a
    MatrixSymbol) stood in for by a placeholder symbol while fn builds its
    expression, then put back.

    SymPy's matrix operators re-simplify their whole operands (doit) every
    time, which costs time exponential in the depth of an expression that
    reuses its parts, such as the state of an unrolled recurrent network:
    apply helpers to such values through `shallow` (lstm_cell and gru_cell
    do). The result is an ordinary SymPy expression.

    Args:
        fn: the helper to apply.
        *args: its arguments.

    Returns:
        What fn returns (an expression, or a tuple of them), with the
        stand-ins replaced by the arguments.
    """
    back = {}
    stand_ins = []
    for arg in args:
        if isinstance(arg, sp.MatrixExpr) and not isinstance(arg, sp.MatrixSymbol):
            stand_in = sp.MatrixSymbol(sp.Dummy("shallow"), *arg.shape)
            back[stand_in] = arg
            arg = stand_in
        stand_ins.append(arg)
    out = fn(*stand_ins)
    if not back:
        return out
    if isinstance(out, tuple):
        return tuple(o.xreplace(back) for o in out)
    return out.xreplace(back)


def _gates(x, h, W, U, b, count: int, what: str) -> list:
    """x W[k] + h U[k] + b[k] for each gate k (the h term left out when h is None)."""
    if not (len(W) == len(b) == count and len(U) == count):
        raise ModelError(f"{what} needs {count} input weights, recurrent weights and biases (one per gate); "
                         f"got {len(W)}, {len(U)} and {len(b)}")
    out = []
    for w, u, bias in zip(W, U, b):
        z = linear(x, w, bias)
        if h is not None:
            z = z + h * u
        out.append(z)
    return out


def lstm_cell(
    x: sp.MatrixExpr,
    h: sp.MatrixExpr | None,
    c: sp.MatrixExpr | None,
    W: Sequence[sp.MatrixExpr],
    U: Sequence[sp.MatrixExpr],
    b: Sequence[sp.MatrixExpr],
) -> tuple[sp.MatrixExpr, sp.MatrixExpr]:
    """One step of an LSTM (the equations of PyTorch's LSTMCell, with one bias
    a gate), batch-major: for the gates input, forget, cell and output,

        i = sigmoid(x W[0] + h U[0] + b[0])     f = sigmoid(x W[1] + h U[1] + b[1])
        g = tanh(x W[2] + h U[2] + b[2])        o = sigmoid(x W[3] + h U[3] + b[3])
        c' = f * c + i * g                      h' = o * tanh(c')

    x is (batch, features); h and c are (batch, hidden), or None for the zero
    state of the first step; W[k] is (features, hidden), U[k] (hidden, hidden)
    and b[k] a row (1, hidden). Returns (h', c'). Unroll it over a fixed
    number of steps for a recurrent network (see `shallow` for what to apply
    to the states it returns).

    Args:
        x: the step's input, (batch, features).
        h: the hidden state, (batch, hidden), or None (the zero state).
        c: the cell state, (batch, hidden), or None with h.
        W: the 4 input weights, (features, hidden) each.
        U: the 4 recurrent weights, (hidden, hidden) each.
        b: the 4 biases, rows (1, hidden).

    Returns:
        (h', c'), the new hidden and cell states.

    Raises:
        ModelError: only one of h and c is None, or W, U or b does not have 4 entries.
    """
    if (h is None) != (c is None):
        raise ModelError("lstm_cell needs both states h and c, or neither (the zero state)")

    def cell(x, h, c):
        zi, zf, zg, zo = _gates(x, h, W, U, b, 4, "lstm_cell")
        i, f, g, o = sigmoid(zi), sigmoid(zf), tanh(zg), sigmoid(zo)
        c_new = sp.HadamardProduct(i, g)
        if c is not None:
            c_new = sp.HadamardProduct(f, c) + c_new
        return sp.HadamardProduct(o, tanh(c_new)), c_new

    return shallow(cell, x, h, c)


def gru_cell(
    x: sp.MatrixExpr,
    h: sp.MatrixExpr | None,
    W: Sequence[sp.MatrixExpr],
    U: Sequence[sp.MatrixExpr],
    b: Sequence[sp.MatrixExpr],
) -> sp.MatrixExpr:
    """One step of a GRU (PyTorch's GRUCell with its hidden bias b_hh zero),
    batch-major: for the gates reset, update and candidate,

        r = sigmoid(x W[0] + h U[0] + b[0])     z = sigmoid(x W[1] + h U[1] + b[1])
        m = tanh(x W[2] + b[2] + r * (h U[2]))  h' = (1 - z) * m + z * h

    with the shapes of lstm_cell; h is None for the zero state.

    Args:
        x: the step's input, (batch, features).
        h: the hidden state, (batch, hidden), or None (the zero state).
        W: the 3 input weights, (features, hidden) each.
        U: the 3 recurrent weights, (hidden, hidden) each.
        b: the 3 biases, rows (1, hidden).

    Returns:
        h', the new hidden state.

    Raises:
        ModelError: W, U or b does not have 3 entries.
    """

    def cell(x, h):
        zr, zz, zm = _gates(x, h, W, U, b, 3, "gru_cell")
        keep = sigmoid(zz).applyfunc(lambda v: 1 - v)
        if h is None:
            return sp.HadamardProduct(keep, tanh(zm))
        r, z = sigmoid(zr), sigmoid(zz)
        m = tanh(linear(x, W[2], b[2]) + sp.HadamardProduct(r, h * U[2]))
        return sp.HadamardProduct(keep, m) + sp.HadamardProduct(z, h)

    return shallow(cell, x, h)
