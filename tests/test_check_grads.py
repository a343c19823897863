"""mod.check_grads: passes on the compiled gradients of several models, and
fails (reports, then raises) when the gradient it is given is wrong."""

import numpy as np
import pytest
import sympy as sp
from conftest import load_example

import symbackprop as sbp
from symbackprop import nn


def _models():
    mlp = load_example("mlp")
    x, y = sp.symbols("x y")
    scalar = sbp.Model("check_scalar", params=[x, y], loss=x**3 * y + sp.sin(x * y) + sp.exp(y) / x)
    Z, T = sp.MatrixSymbol("Z", 4, 3), sp.MatrixSymbol("T", 4, 3)
    ce = sbp.Model("check_ce", inputs=[T], params=[Z], loss=nn.softmax_cross_entropy(nn.gelu(Z), T))
    rng = np.random.default_rng(1)
    return {
        "mlp": (mlp.model, mlp.sample_data(rng, batch=5)),
        "scalar": (scalar, {"x": 0.7, "y": -0.4}),
        "cross_entropy": (ce, {"Z": rng.standard_normal((4, 3)), "T": rng.dirichlet(np.ones(3), size=4)}),
    }


MODELS = _models()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_correct_gradients_pass(name, dtype):
    model, data = MODELS[name]
    mod = sbp.compile(model, dtype=dtype)
    data = {k: np.asarray(v, dtype=dtype) if isinstance(v, np.ndarray) else v for k, v in data.items()}
    tolerance = 1e-7 if dtype == "float64" else 2e-2
    report = mod.check_grads(rtol=tolerance, atol=tolerance, directions=3, **data)
    _, grads = mod.value_and_grad(**data)
    assert set(report.arguments) == set(grads)
    assert report.worst < tolerance
    assert all(a.analytic != 0 for a in report.arguments.values())  # the directions moved the loss
    assert "relative error" in str(report)


def test_a_wrong_gradient_is_caught(monkeypatch):
    model, data = MODELS["mlp"]
    mod = sbp.compile(model)
    assert mod.check_grads(rtol=1e-7, **data).worst < 1e-7
    right = mod.value_and_grad

    def perturbed(**arrays):
        loss, grads = right(**arrays)
        wrong = dict(grads)
        wrong["b1"] = grads["b1"] * 1.001  # one argument 0.1% off
        return loss, wrong

    monkeypatch.setattr(mod, "value_and_grad", perturbed)
    report = mod.check_grads(**data)  # no tolerance: a report only
    assert report.arguments["b1"].rel_error > 1e-4
    assert report.arguments["W1"].rel_error < 1e-7
    with pytest.raises(sbp.GradientCheckError, match=r"b1: <grad, v> = .* but the central difference is") as caught:
        mod.check_grads(rtol=1e-6, **data)
    assert "W1" not in str(caught.value)
    with pytest.raises(AssertionError):  # as jax's check_grads and torch's gradcheck signal it
        mod.check_grads(atol=1e-9, **data)
