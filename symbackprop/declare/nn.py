"""Layer, activation and loss helpers: the namespace symbackprop.nn. Each
returns an ordinary SymPy expression: whatever a helper builds, a user
could have written by hand. The layers (linear, lstm_cell, gru_cell) are
here; the activations are in activations.py, the losses in losses.py, the
sums and means in reductions.py, attention's and convolution's layers in
attention.py and conv.py.

Matrices are row-major batches: X is (batch, features), W is (in, out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy as sp

from symbackprop.declare.activations import (  # noqa: F401  (the activations: nn.relu, ...)
    GELU_APPROXIMATIONS,
    LEAKY_SLOPE,
    Operand,
    elu,
    gelu,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    relu,
    sigmoid,
    silu,
    softmax,
    softplus,
    tanh,
)
from symbackprop.declare.attention import (  # noqa: F401  (attention and transformer layers)
    Sequences,
    add_positions,
    attention,
    causal_attention,
    embedding,
    first_positions,
    layer_norm,
    self_attention,
    sequence_mean,
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
from symbackprop.declare.losses import (  # noqa: F401  (the losses: nn.mse, ...)
    REDUCTIONS,
    binary_cross_entropy_with_logits,
    huber,
    l2_penalty,
    log_cosh,
    mse,
    one_hot,
    softmax_cross_entropy,
)
from symbackprop.declare.pick import pick  # noqa: F401  (nn.pick: a row's entry at a column)
from symbackprop.declare.reductions import (  # noqa: F401  (sums and means: nn.sum_all, ...)
    logsumexp_rows,
    mean_all,
    ones,
    row_sums,
    shallow_doit,
    sum_all,
)
from symbackprop.declare.standing import layered
from symbackprop.errors import ModelError


def linear(x: sp.MatrixExpr, w: sp.MatrixExpr, b: sp.MatrixExpr | None = None) -> sp.MatrixExpr:
    """x @ w, plus the row b broadcast over the batch: x*w + ones(n, 1)*b.
    Of blocks side by side (concat_columns), the sum of each block times
    its rows of w.

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
    blocks = column_blocks(x)
    if blocks is not None:  # blocks side by side: each times its rows of w, the placing never computed
        product = sp.MatAdd(*(linear(block, w[start:start + block.shape[1], :]) for block, start in blocks))
    else:  # SymPy's x * w, but for its doit, deep, down the whole stack below x
        product = shallow_doit(sp.MatMul(x, w))
    if b is None:
        return product  # SymPy's own product: a product it is in takes in its factors
    if b.shape[0] != 1:
        raise ModelError(f"the bias {b} must be a row (1 x out); its shape is {b.shape}")
    return shallow_doit(sp.MatAdd(layered(product), shallow_doit(sp.MatMul(ones(x.shape[0], 1), b))))



def concat_columns(blocks: Sequence[sp.MatrixExpr]) -> sp.MatrixExpr:
    """The blocks side by side (numpy's hstack), as the sum of each block
    times the 0/1 matrix placing its columns: exact (one product by 1 per
    entry; the rest adds zeros), and differentiated as any product.

    Args:
        blocks: matrices of one number of rows (symbolic or not) and fixed
            numbers of columns.

    Returns:
        The (rows, sum of the columns) matrix expression.

    Raises:
        ModelError: the blocks' rows differ, or a block's columns are not a number.
    """
    if len({b.shape[0] for b in blocks}) != 1:
        raise ModelError(f"blocks of rows {[b.shape[0] for b in blocks]} side by side: they differ")
    if not all(sp.sympify(b.shape[1]).is_Integer for b in blocks):
        raise ModelError(f"blocks of columns {[b.shape[1] for b in blocks]} side by side: each must be a number")
    widths = [int(b.shape[1]) for b in blocks]
    total, out, start = sum(widths), [], 0
    for block, width in zip(blocks, widths):
        place = sp.zeros(width, total)
        place[:, start:start + width] = sp.eye(width)
        out.append(block * sp.ImmutableMatrix(place))
        start += width
    return sp.MatAdd(*out) if len(out) > 1 else out[0]


def column_blocks(x: Any) -> list[tuple[sp.MatrixExpr, int]] | None:
    """[(block, first column)] of a matrix concat_columns made: a sum of
    blocks each times a 0/1 matrix placing its columns; None for any other.

    Args:
        x: any matrix expression.
    """
    if not isinstance(x, sp.MatAdd):
        return None
    found = []
    for term in x.args:
        factors: tuple[Any, ...] = tuple(term.args) if isinstance(term, sp.MatMul) else ()
        if len(factors) < 2 or not isinstance(factors[-1], sp.ImmutableMatrix):
            return None
        start = _placed_at(factors[-1])
        if start is None:
            return None
        found.append((factors[0] if len(factors) == 2 else sp.MatMul(*factors[:-1]), start))
    return found


def _placed_at(place: sp.ImmutableMatrix) -> int | None:
    """The first column of the identity a 0/1 placing matrix (w x total) holds, else None."""
    width, total = place.shape
    starts = [j for j in range(total) if place[0, j] != 0]
    if not starts or starts[0] + width > total:
        return None
    start = starts[0]
    wanted = sp.zeros(width, total)
    wanted[:, start:start + width] = sp.eye(width)
    return start if place == sp.ImmutableMatrix(wanted) else None


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
    outs = _put_back(out, back)
    return outs if isinstance(out, tuple) else outs[0]


def _put_back(out: Any, back: dict) -> tuple:
    """shallow's results with the stand-ins replaced, each hashed: SymPy
    hashes a node on first use, recursing into arguments not yet hashed, so
    the nodes xreplace rebuilt are hashed now, while those below them are
    (step k of an unrolled network costs a step, not a walk down k steps:
    a 100-step GRU was a RecursionError in nn.mse)."""
    outs = tuple(o.xreplace(back) for o in (out if isinstance(out, tuple) else (out,)))
    for o in outs:
        hash(o)
    return outs


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
