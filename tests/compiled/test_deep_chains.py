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
import math
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


# --- residual chains: h <- h + f_k(h), a step's weights its own ----------------------------------------------

V = sp.Symbol("v")
RESIDUAL_FORMS = {  # a step's term in SymPy, and in numpy (of h, W_k, b_k, x)
    "tanh_linear": (lambda h, w, b: nn.tanh(nn.linear(h, w, b)), lambda h, w, b, x: np.tanh(h @ w + b)),
    "gelu": (lambda h, w, b: nn.gelu(h * w),
             lambda h, w, b, x: h @ w / 2 * (1 + np.vectorize(math.erf)(h @ w / math.sqrt(2)))),
    "applyfunc": (lambda h, w, b: (h * w).applyfunc(sp.Lambda(V, sp.sin(V) / 2)), lambda h, w, b, x: np.sin(h @ w) / 2),
    "and_input": (lambda h, w, b: nn.tanh(h * w) + nn.linear(X, w, b),  # a term not computed from h too
                  lambda h, w, b, x: np.tanh(h @ w) + x @ w + b),
}


def residual_weights(steps: int) -> list[sp.MatrixSymbol]:
    return [sp.MatrixSymbol(f"{name}{k}", *shape) for k in range(steps)
            for name, shape in (("W", (HIDDEN, HIDDEN)), ("b", (1, HIDDEN)))]


def residual_chain(form: str, steps: int) -> sp.MatrixExpr:
    term, _ = RESIDUAL_FORMS[form]
    h, weights = X, residual_weights(steps)
    for k in range(steps):
        h = h + term(h, weights[2 * k], weights[2 * k + 1])
    return h


def residual_numpy(form: str, steps: int, a: dict) -> np.ndarray:
    _, term = RESIDUAL_FORMS[form]
    h = a["X"]
    for k in range(steps):
        h = h + term(h, a[f"W{k}"], a[f"b{k}"], a["X"])
    return h


def check_residual_gradient(form: str, steps: int) -> None:
    """value_and_grad of mse(the chain's last state, T) against numpy's
    loss and its central differences along random directions, one per
    step's weights (each W_k and b_k gets its own)."""
    with shallow_stack():
        h = residual_chain(form, steps)
        params = residual_weights(steps)
        model = sbp.Model(f"residual_{form}_{steps}", inputs=[X, T], params=params, loss=nn.mse(h, T))
    mod = sbp.compile(model)
    arrays = {name: value / 4 if name.startswith("W") else value for name, value in values(params).items()}

    def numpy_loss(a: dict) -> float:  # (small weights: 50 steps of h + gelu(h W) grow h less)
        return float(np.mean((residual_numpy(form, steps, a) - a["T"]) ** 2))

    loss, grads = mod.value_and_grad(**arrays)
    assert loss == pytest.approx(numpy_loss(arrays), rel=1e-10)
    rng = np.random.default_rng(2)
    directions = {str(p): rng.standard_normal(arrays[str(p)].shape) for p in params}
    rounding = 1e-9 * max(1.0, loss)  # central differences' rounding error: eps_machine * loss / 1e-6, and then some
    for name in (f"W{k}" for k in (0, steps // 2, steps - 1)):  # a few steps' weights one by one
        expected = finite_difference(numpy_loss, arrays, name, directions[name])
        assert np.sum(grads[name] * directions[name]) == pytest.approx(expected, rel=1e-6, abs=rounding), name
    eps, plus, minus = 1e-6, dict(arrays), dict(arrays)  # and every weight at once
    for name, d in directions.items():
        plus[name], minus[name] = arrays[name] + eps * d, arrays[name] - eps * d
    expected = (numpy_loss(plus) - numpy_loss(minus)) / (2 * eps)
    assert sum(np.sum(grads[n] * d) for n, d in directions.items()) == pytest.approx(expected, rel=1e-6, abs=rounding)


@pytest.mark.parametrize("form", list(RESIDUAL_FORMS))
def test_a_residual_chains_step_is_a_sum_of_two_terms(form):
    """Each step's sum stays a node (the sum before and the new term),
    not one sum of every earlier term that each step re-sorted: 1,000
    steps declare on a shallow stack, and the last state's shape is known."""
    steps = 1_000
    with shallow_stack():
        h = residual_chain(form, steps)
        assert h.shape == (ROWS, HIDDEN)
        assert nn.mse(h, T).shape == (1, 1)
    inner = [arg for arg in h.args if isinstance(arg, sp.MatAdd)]
    assert len(inner) == 1 and len(h.args) == len(residual_chain(form, 2).args)  # as many terms as at 2 steps


@pytest.mark.parametrize("form", list(RESIDUAL_FORMS))
def test_a_residual_chains_gradient_is_numpys(form):
    check_residual_gradient(form, 50)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [300, 1_000])
def test_a_long_residual_chains_gradient_is_numpys(steps):
    check_residual_gradient("tanh_linear", steps)


A, C = sp.MatrixSymbol("A", ROWS, HIDDEN), sp.MatrixSymbol("C", ROWS, HIDDEN)
S = A + C
STEP = S + nn.tanh(S * W)  # the sum S kept whole: the other term is computed from it


@pytest.mark.parametrize("built, expected", [
    (A + A, 2 * sp.MatMul(A)), (S + A, sp.MatAdd(sp.MatMul(2, A), C)), (S - C, A), (S - S, sp.ZeroMatrix(ROWS, HIDDEN)),
    (STEP - S, nn.tanh(S * W)), (STEP - A, sp.MatAdd(C, nn.tanh(S * W))),
    (STEP + A, sp.MatAdd(sp.MatMul(2, A), C, nn.tanh(S * W))), (STEP + STEP - S, sp.MatAdd(A, C, sp.MatMul(2, nn.tanh(S * W)))),
], ids=["A+A", "S+A", "S-C", "S-S", "step-S", "step-A", "step+A", "2step-S"])
def test_sums_still_combine_like_terms(built, expected):
    """A sum is kept whole only where no like terms are lost: SymPy's own
    sum otherwise (compared in value too, entry by entry)."""
    assert built == expected.doit()
    assert sp.simplify(sp.Matrix(built.as_explicit()) - sp.Matrix(expected.as_explicit())) == sp.zeros(ROWS, HIDDEN)
