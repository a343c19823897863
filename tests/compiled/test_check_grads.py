"""mod.check_grads: passes on the compiled gradients of several models at
the dtype's default tolerance, and fails (raises) by default when the
gradient it is given is wrong, NaN or inf, or the differences are."""

import math

import numpy as np
import pytest
import sympy as sp
from conftest import load_example

import symbackprop as sbp
from symbackprop import nn
from symbackprop.run.gradcheck import check_gradient, default_tolerance, enforce


def _layer_norm_mlp():
    n = sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 6), sp.MatrixSymbol("T", n, 3)
    W1, b1 = sp.MatrixSymbol("W1", 6, 16), sp.MatrixSymbol("b1", 1, 16)
    g, beta = sp.MatrixSymbol("g", 1, 16), sp.MatrixSymbol("beta", 1, 16)
    W2, b2 = sp.MatrixSymbol("W2", 16, 3), sp.MatrixSymbol("b2", 1, 3)
    H = nn.layer_norm(nn.tanh(nn.linear(X, W1, b1)), g, beta)
    model = sbp.Model("check_layer_norm_mlp", inputs=[X, T], params=[W1, b1, g, beta, W2, b2],
                      loss=nn.mse(nn.linear(H, W2, b2), T))
    rng = np.random.default_rng(3)
    shapes = {"X": (12, 6), "T": (12, 3), "W1": (6, 16), "b1": (1, 16), "g": (1, 16), "beta": (1, 16),
              "W2": (16, 3), "b2": (1, 3)}
    return model, {k: rng.standard_normal(s) for k, s in shapes.items()}


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
        "layer_norm_mlp": _layer_norm_mlp(),
    }


MODELS = _models()


def _cast(data, dtype):
    return {k: np.asarray(v, dtype=dtype) if isinstance(v, np.ndarray) else v for k, v in data.items()}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_correct_gradients_pass_by_default(name, dtype):
    model, data = MODELS[name]
    mod = sbp.compile(model, dtype=dtype)
    data = _cast(data, dtype)
    for seed in range(3):
        report = mod.check_grads(directions=3, seed=seed, **data)  # the dtype's tolerance: raises if off
    _, grads = mod.value_and_grad(**data)
    assert set(report.arguments) == set(grads)
    if dtype == "float64":
        assert report.worst < 1e-8
    else:  # within the float32 loss's own rounding over the step: a relative error says little where a
        # direction is nearly orthogonal to the gradient (<grad, v> = -0.0014 against 0.4-7 for the rest)
        assert all(a.abs_error <= a.noise for a in report.arguments.values()), report
    assert all(a.analytic != 0 for a in report.arguments.values())  # the directions moved the loss
    assert "relative error" in str(report)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_readme_call_passes_on_correct_float64_gradients(name):
    model, data = MODELS[name]
    mod = sbp.compile(model)
    for seed in range(4):
        mod.check_grads(rtol=1e-6, seed=seed, **data)  # README: mod.check_grads(rtol=1e-6, **arrays)
        mod.check_grads(rtol=1e-8, atol=1e-12, seed=seed, **data)  # and far tighter


def _wrapped(monkeypatch, mod, change):
    """mod.value_and_grad with `change` applied to its gradients."""
    right = mod.value_and_grad

    def changed(**arrays):
        loss, grads = right(**arrays)
        return loss, change(dict(grads))

    monkeypatch.setattr(mod, "value_and_grad", changed)


@pytest.mark.parametrize("name, argument", [("mlp", "b1"), ("mlp", "W2"), ("layer_norm_mlp", "g"),
                                            ("scalar", "y"), ("cross_entropy", "Z")])
def test_a_wrong_gradient_fails_by_default(monkeypatch, name, argument):
    model, data = MODELS[name]
    mod = sbp.compile(model)
    mod.check_grads(**data)
    _wrapped(monkeypatch, mod, lambda g: {**g, argument: g[argument] * 1.001})  # one argument 0.1% off
    with pytest.raises(sbp.GradientCheckError, match=rf"{argument}: <grad, v> = .* but the central difference") as e:
        mod.check_grads(**data)
    others = [k for k in data if k != argument and k in mod.value_and_grad(**data)[1]]
    assert not any(f"{k}: <grad" in str(e.value) for k in others)
    with pytest.raises(AssertionError):  # as jax's check_grads and torch's gradcheck signal it
        mod.check_grads(rtol=1e-6, **data)
    report = mod.check_grads(raise_exception=False, **data)  # a report only
    assert report.arguments[argument].rel_error > 1e-4
    assert all(report.arguments[k].rel_error < 1e-8 for k in others)


@pytest.mark.parametrize("name", ["mlp", "layer_norm_mlp"])
def test_a_wrong_float32_gradient_fails_by_default(monkeypatch, name):
    model, data = MODELS[name]
    mod = sbp.compile(model, dtype="float32")
    data = _cast(data, "float32")
    mod.check_grads(**data)
    _wrapped(monkeypatch, mod, lambda g: {**g, "b2": g["b2"] * 1.02})
    with pytest.raises(sbp.GradientCheckError, match="b2: "):
        mod.check_grads(**data)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_non_finite_gradient_fails_whatever_the_tolerance(monkeypatch, bad, dtype):
    model, data = MODELS["mlp"]
    mod = sbp.compile(model, dtype=dtype)
    data = _cast(data, dtype)

    def planted(g):
        w = np.array(g["W1"])
        w.flat[3] = bad
        return {**g, "W1": w}

    _wrapped(monkeypatch, mod, planted)
    with pytest.raises(sbp.GradientCheckError, match=r"W1: .*not finite"):
        mod.check_grads(rtol=1e-6, **data)
    with pytest.raises(sbp.GradientCheckError, match="W1: "):
        mod.check_grads(rtol=1e9, atol=1e9, **data)
    report = mod.check_grads(raise_exception=False, **data)
    assert report.arguments["W1"].rel_error == math.inf and report.worst == math.inf
    assert not report.arguments["W1"].finite


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_difference_fails(monkeypatch, bad):
    model, data = MODELS["mlp"]
    mod = sbp.compile(model)
    right = mod.forward
    point = np.array(data["b2"])

    def forward(**arrays):  # the loss is NaN or inf off the point, along b2 only
        out = dict(right(**arrays))
        if not np.array_equal(arrays["b2"], point):
            out["loss"] = bad
        return out

    monkeypatch.setattr(mod, "forward", forward)
    with pytest.raises(sbp.GradientCheckError, match=r"b2: .*not finite") as e:
        mod.check_grads(rtol=1e-6, **data)
    assert "W1: " not in str(e.value)


def _numpy_check(loss, grad, x, dtype, **tolerance):
    report = check_gradient(lambda a: loss(np.asarray(a["x"], dtype=np.float64)), {"x": grad(x)}, {"x": x},
                            np.dtype(dtype), directions=4)
    enforce(report, *default_tolerance(np.dtype(dtype), tolerance.get("rtol"), tolerance.get("atol")))
    return report


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_error_model_against_closed_forms(dtype):
    """sum(sin(x) * exp(x/3)) against its derivative: passes; 1% off: fails,
    also with a large x (the step grows with it)."""
    loss = lambda x: float(np.sum(np.sin(x) * np.exp(x / 3)))  # noqa: E731
    grad = lambda x: np.cos(x) * np.exp(x / 3) + np.sin(x) * np.exp(x / 3) / 3  # noqa: E731
    for scale in (1.0, 30.0):
        x = (np.random.default_rng(0).standard_normal(20) * scale).astype(dtype)
        assert _numpy_check(loss, grad, x, dtype).worst < (1e-9 if dtype == "float64" else 1e-3)
        with pytest.raises(sbp.GradientCheckError):
            _numpy_check(loss, lambda x: grad(x) * 1.01, x, dtype)
