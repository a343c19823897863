"""floor, ceiling and sign: their derivative is 0 (PyTorch's, zeros_like,
at the jumps too; NaN at NaN, as every kink's), so a model that holds them
compiles; values and gradients against PyTorch's float64 autograd at points
away from the jumps, and the C's values at negative numbers and at exact
integers against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from oracles import relative_error

import symbackprop as sbp
from symbackprop import nn

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 2)
W = sp.MatrixSymbol("W", 2, 3)
a = sp.Symbol("a", real=True)


def steps(v):
    """A step function of each kind, times smooth ones (whose gradient is
    left); SymPy has no derivative of sign(sqrt(v + 5) - 2) (its argument
    is not known to be real)."""
    return sp.floor(2 * v) * sp.sin(v) + sp.ceiling(v - 0.25) * v**2 + sp.sign(sp.sqrt(v + 5) - 2) * sp.exp(v / 3)


def test_values_and_gradients_match_torch_away_from_the_jumps():
    torch = pytest.importorskip("torch")
    total = sbp.as_scalar(nn.sum_all(X * W))
    loss = sbp.as_scalar(nn.sum_all((X * W).applyfunc(steps))) + a * sp.floor(a * total) * total
    mod = sbp.compile(sbp.Model("steps", inputs=[X], params=[W, a], loss=loss))
    rng = np.random.default_rng(0)
    data = {"X": rng.standard_normal((7, 2)), "W": rng.standard_normal((2, 3)), "a": 1.3}
    z = data["X"] @ data["W"]
    for jumps in (2 * z, z - 0.25, np.sqrt(z + 5) - 2, 1.3 * z.sum()):  # no entry within 1e-3 of a jump
        assert np.min(np.abs(jumps - np.round(jumps))) > 1e-3
    loss, grads = mod.value_and_grad(**data)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k != "X") for k, v in data.items()}
    v = t["X"] @ t["W"]
    want = (torch.floor(2 * v) * torch.sin(v) + torch.ceil(v - 0.25) * v**2
            + torch.sign(torch.sqrt(v + 5) - 2) * torch.exp(v / 3)).sum() + t["a"] * torch.floor(t["a"] * v.sum()) * v.sum()
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-12)
    assert relative_error(grads["W"], t["W"].grad.numpy()) < 1e-12
    assert grads["a"] == pytest.approx(t["a"].grad.item(), rel=1e-12)


def test_a_step_alone_has_a_zero_gradient_at_its_jumps_too_and_nan_at_nan():
    """floor(a x) alone: its gradient is 0 everywhere (PyTorch's zeros_like,
    jumps included) but at NaN, where it is NaN as every kink's."""
    x = sp.Symbol("x", real=True)
    for f in (sp.floor, sp.ceiling, sp.sign):
        mod = sbp.compile(sbp.Model(f"step_{f.__name__}", inputs=[x], params=[a], loss=f(a * sp.sqrt(x + 3))))
        for point in (1.0, 6.0, -3.0, -2.75):  # jumps: a sqrt(x + 3) = 2, 3, 0 (sign's) and 1/2 is none
            assert mod.value_and_grad(x=point, a=1.0)[1]["a"] == 0.0
        assert np.isnan(mod.value_and_grad(x=np.nan, a=1.0)[1]["a"])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_c_values_at_negative_numbers_and_exact_integers(dtype):
    V = sp.MatrixSymbol("V", 1, 11)
    model = sbp.Model("step_values", inputs=[V], outputs={
        "floor": V.applyfunc(sp.floor), "ceiling": V.applyfunc(sp.ceiling), "sign": V.applyfunc(sp.sign)})
    mod = sbp.compile(model, dtype=dtype, functions=("forward",))
    points = np.array([[-2.5, -2.0, -1.0, -0.5, -1e-300 if dtype == "float64" else -1e-30, 0.0, 0.5, 1.0, 2.0, 2.5,
                        -3.75]], dtype=dtype)
    out = mod.forward(V=points)
    assert np.array_equal(out["floor"], np.floor(points))
    assert np.array_equal(out["ceiling"], np.ceil(points))
    assert np.array_equal(out["sign"], np.sign(points))
    assert out["floor"].tolist()[0][:4] == [-3.0, -2.0, -1.0, -1.0]
    assert out["ceiling"].tolist()[0][:4] == [-2.0, -2.0, -1.0, 0.0]
