"""value_grad_and_hvp: the loss, the gradients and the Hessian times a
direction from one call, checked against PyTorch float64 (double backward)."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.errors import ArgumentError

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def mod():
    n = sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
    W1, b1, W2 = sp.MatrixSymbol("W1", 3, 4), sp.MatrixSymbol("b1", 1, 4), sp.MatrixSymbol("W2", 4, 2)
    s = sp.Symbol("s")
    Y = nn.linear(nn.tanh(nn.linear(X, W1, b1)), W2) * s
    return sbp.compile(sbp.Model("vghvp_mlp", inputs=[X, T], params=[W1, b1, W2, s], loss=nn.mse(Y, T)))


def _torch(arrays, directions):
    t = {k: torch.tensor(np.asarray(v, dtype=float), dtype=torch.float64, requires_grad=k in ("W1", "b1", "W2", "s"))
         for k, v in arrays.items()}
    Y = (torch.tanh(t["X"] @ t["W1"] + t["b1"]) @ t["W2"]) * t["s"]
    loss = ((Y - t["T"]) ** 2).mean()
    names = ["W1", "b1", "W2", "s"]
    grads = torch.autograd.grad(loss, [t[k] for k in names], create_graph=True)
    dot = sum((g * torch.as_tensor(np.asarray(directions.get(k, 0.0), dtype=float))).sum() for k, g in zip(names, grads))
    hvps = torch.autograd.grad(dot, [t[k] for k in names])
    return loss.item(), {k: g.detach().numpy() for k, g in zip(names, grads)}, {k: h.numpy() for k, h in zip(names, hvps)}


@pytest.mark.parametrize("given", [("W1", "b1", "W2", "s"), ("W2",), ("s",)])
def test_the_three_match_double_backward_and_the_separate_calls(mod, given):
    rng = np.random.default_rng(3)
    arrays = {"X": rng.standard_normal((5, 3)), "T": rng.standard_normal((5, 2)), "W1": rng.standard_normal((3, 4)),
              "b1": rng.standard_normal((1, 4)), "W2": rng.standard_normal((4, 2)), "s": 1.3}
    shapes = {"W1": (3, 4), "b1": (1, 4), "W2": (4, 2)}
    directions = {k: (rng.standard_normal(shapes[k]) if k in shapes else 0.7) for k in given}
    loss, grads, hvp = mod.value_grad_and_hvp(directions, **arrays)
    want_loss, want_grads, want_hvp = _torch(arrays, directions)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert set(grads) == set(hvp) == set(want_grads)
    for k in want_grads:
        np.testing.assert_allclose(np.reshape(grads[k], np.shape(want_grads[k])), want_grads[k], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.reshape(hvp[k], np.shape(want_hvp[k])), want_hvp[k], rtol=1e-9, atol=1e-12)
    # the same numbers as the separate calls
    assert loss == mod.value_and_grad(**arrays)[0]
    separate = mod.hvp(directions, **arrays)
    for k in hvp:
        np.testing.assert_array_equal(hvp[k], separate[k])


def test_a_direction_for_an_input_is_refused(mod):
    with pytest.raises(ArgumentError, match="not differentiated"):
        mod.value_grad_and_hvp({"X": np.ones((2, 3))}, X=np.ones((2, 3)), T=np.ones((2, 2)), W1=np.ones((3, 4)),
                               b1=np.ones((1, 4)), W2=np.ones((4, 2)), s=1.0)
