"""Deep chains declare, lower and differentiate on a few frames of stack:
an unrolled GRU or LSTM, a hand-written recurrence of SymPy products and
Hadamard products, a residual chain. SymPy asked a sum's shape of its
first term, a product's of its first factor, and so on down every step
(a 300-step GRU was a RecursionError in nn.mse); its sort keys and deep
doit walked down the same way, and lowering recursed once per level.

Each test runs under a recursion limit only `FRAMES` above the caller's
depth, so a walk that still takes a frame or more a step fails at these
lengths, as it did before; the values and gradients are numpy's, the
gradients checked against central differences of numpy's loss."""

import contextlib
import inspect
import sys

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.ir.lower import lower
from symbackprop.ir.node import SCALAR

FRAMES = 100  # the stack a declaration may take beyond its caller's
ROWS, HIDDEN = 3, 2


@contextlib.contextmanager
def shallow_stack(frames: int = FRAMES):
    """Python's recursion limit `frames` above the current depth."""
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(saved)


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


X, T = sp.MatrixSymbol("X", ROWS, HIDDEN), sp.MatrixSymbol("T", ROWS, HIDDEN)
W, U, B = (sp.MatrixSymbol(name, *shape) for name, shape in (("W", (HIDDEN, HIDDEN)), ("U", (HIDDEN, HIDDEN)),
                                                              ("B", (ROWS, HIDDEN))))
GATES = {"gru": "rzh", "lstm": "ifgo"}


def gate_weights(kind: str) -> list[list[sp.MatrixSymbol]]:
    return [[sp.MatrixSymbol(f"{k}{g}", *shape) for g in GATES[kind]]
            for k, shape in (("W", (HIDDEN, HIDDEN)), ("U", (HIDDEN, HIDDEN)), ("b", (1, HIDDEN)))]


def chain(kind: str, steps: int) -> tuple[sp.MatrixExpr, list[sp.MatrixSymbol]]:
    """The last state of `steps` steps of `kind`, and its params."""
    h: sp.MatrixExpr | None = None
    if kind in GATES:
        weights = gate_weights(kind)
        c = None
        for _ in range(steps):
            h, c = nn.lstm_cell(X, h, c, *weights) if kind == "lstm" else (nn.gru_cell(X, h, *weights), None)
        return h, [s for group in weights for s in group]
    h = X
    for _ in range(steps):
        if kind == "recurrence":  # SymPy's own products and sums
            h = nn.tanh(X * W + h * U + B)
        elif kind == "hadamard":
            h = sp.HadamardProduct(nn.sigmoid(h * U), h) + nn.tanh(X * W + B)
        elif kind == "residual":
            h = h + nn.tanh(h * W)
    return h, [W] if kind == "residual" else [W, U, B]


def chain_numpy(kind: str, steps: int, a: dict) -> np.ndarray:
    """What chain(kind, steps) computes, in numpy."""
    x, h, c = a["X"], None, None
    for _ in range(steps):
        if kind == "gru":
            zero = np.zeros_like(x @ a["Ur"]) if h is None else h
            r, z = sigmoid(x @ a["Wr"] + zero @ a["Ur"] + a["br"]), sigmoid(x @ a["Wz"] + zero @ a["Uz"] + a["bz"])
            h = (1 - z) * np.tanh(x @ a["Wh"] + a["bh"] + r * (zero @ a["Uh"])) + z * zero
        elif kind == "lstm":
            h, c = (np.zeros_like(x @ a["Ui"]),) * 2 if h is None else (h, c)
            i, f = sigmoid(x @ a["Wi"] + h @ a["Ui"] + a["bi"]), sigmoid(x @ a["Wf"] + h @ a["Uf"] + a["bf"])
            g, o = np.tanh(x @ a["Wg"] + h @ a["Ug"] + a["bg"]), sigmoid(x @ a["Wo"] + h @ a["Uo"] + a["bo"])
            c = f * c + i * g
            h = o * np.tanh(c)
        else:
            h = x if h is None else h
            if kind == "recurrence":
                h = np.tanh(x @ a["W"] + h @ a["U"] + a["B"])
            elif kind == "hadamard":
                h = sigmoid(h @ a["U"]) * h + np.tanh(x @ a["W"] + a["B"])
            else:
                h = h + np.tanh(h @ a["W"])
    return h


def values(params: list[sp.MatrixSymbol], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {str(p): 0.4 * rng.standard_normal(tuple(int(d) for d in p.shape)) for p in params}
    arrays.update(X=rng.standard_normal((ROWS, HIDDEN)), T=rng.standard_normal((ROWS, HIDDEN)))
    return arrays


KINDS = ["gru", "lstm", "recurrence", "hadamard", "residual"]
LOSSES = {"mse": lambda h: nn.mse(h, T), "sum_all": nn.sum_all, "linear_mse": lambda h: nn.mse(nn.linear(h, W), T),
          "softmax_cross_entropy": lambda h: nn.softmax_cross_entropy(h, T), "huber": lambda h: nn.huber(h, T),
          "raw": lambda h: nn.sum_all(sp.HadamardProduct(h - T, h) * W + sp.HadamardPower(h, 2)),
          "transposed": lambda h: sp.Trace(W * (h - T).T * B)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_deep_chain_declares_and_lowers_on_a_shallow_stack(kind):
    """100 steps (60 of the residual chain, whose sum SymPy flattens: each
    step adds a term) under a limit FRAMES above the caller: each loss,
    sbp.grad and the lowering to IR nodes."""
    steps = 60 if kind == "residual" else 100
    with shallow_stack():
        h, params = chain(kind, steps)
        assert h.shape == (ROWS, HIDDEN)
        for name, loss_of in LOSSES.items():
            loss = loss_of(h)
            assert isinstance(loss, sp.Trace) or loss.shape == (1, 1), name
        gradient = sbp.grad(nn.mse(h, T), params[0])
        assert gradient.shape == params[0].shape
        lowered = lower(sbp.Model(f"deep_{kind}", inputs=[X, T], params=params, loss=nn.mse(h, T)))
    assert lowered.loss.shape == SCALAR


def finite_difference(f, arrays: dict, name: str, direction: np.ndarray, eps: float = 1e-6) -> float:
    plus, minus = dict(arrays), dict(arrays)
    plus[name], minus[name] = arrays[name] + eps * direction, arrays[name] - eps * direction
    return (f(plus) - f(minus)) / (2 * eps)


def check_gradient(kind: str, steps: int) -> None:
    """value_and_grad of mse(last state, T), declared on a shallow stack,
    against numpy's loss and its central differences along random directions."""
    with shallow_stack():
        h, params = chain(kind, steps)
        model = sbp.Model(f"deep_{kind}_{steps}", inputs=[X, T], params=params, loss=nn.mse(h, T))
    mod = sbp.compile(model)
    arrays = values(params)
    loss, grads = mod.value_and_grad(**arrays)

    def numpy_loss(a: dict) -> float:
        return float(np.mean((chain_numpy(kind, steps, a) - a["T"]) ** 2))

    assert loss == pytest.approx(numpy_loss(arrays), rel=1e-10)
    rng = np.random.default_rng(1)
    for p in params:
        direction = rng.standard_normal(arrays[str(p)].shape)
        expected = finite_difference(numpy_loss, arrays, str(p), direction)
        assert np.sum(grads[str(p)] * direction) == pytest.approx(expected, rel=1e-6, abs=1e-9), p


@pytest.mark.parametrize("kind", ["gru", "hadamard"])
def test_a_deep_chains_gradient_is_numpys(kind):
    check_gradient(kind, 50)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gru", "lstm", "recurrence"])
def test_a_300_step_chains_gradient_is_numpys(kind):
    check_gradient(kind, 300)
