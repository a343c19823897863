"""Closed-form checks: the hand-worked ReLU network, weight decay, powers,
and every supported elementwise function against sympy.diff."""

import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from oracles import relative_error

import symbackprop as sbp
from symbackprop.declare import nn


def test_relu_network_worked_example():
    example = load_example("relu_net")
    mod = sbp.compile(example.model)
    loss, grads = mod.value_and_grad(**example.sample_data())
    assert loss == 2.0
    np.testing.assert_array_equal(grads["W2"], [[0.0, -4.0]])
    np.testing.assert_array_equal(grads["W1"], [[0.0, 0.0], [2.0, 4.0]])
    assert mod.forward(**example.sample_data())["y"].tolist() == [[-2.0]]


def test_weight_decay_sums_both_paths():
    """J = L + lambda/2 (|W1|^2 + |W2|^2): dJ/dW = dL/dW + lambda W."""
    example = load_example("mlp")
    lam = sp.Symbol("lam")
    W1, W2 = example.W1, example.W2
    decayed = example.model.loss + lam / 2 * nn.l2_penalty(W1, W2)
    model = sbp.Model("mlp_decay", inputs=list(example.model.inputs) + [lam],
                      params=example.model.params, loss=decayed)
    plain = sbp.compile(example.model)
    mod = sbp.compile(model)
    data = example.sample_data(np.random.default_rng(5))
    loss_plain, grads_plain = plain.value_and_grad(**data)
    loss, grads = mod.value_and_grad(**data, lam=0.3)
    penalty = 0.15 * (np.sum(data["W1"] ** 2) + np.sum(data["W2"] ** 2))
    assert loss == pytest.approx(loss_plain + penalty, rel=1e-13)
    for name in ("W1", "W2"):
        np.testing.assert_allclose(grads[name], grads_plain[name] + 0.3 * data[name], rtol=1e-12, atol=1e-14)
    for name in ("b1", "b2"):
        np.testing.assert_allclose(grads[name], grads_plain[name], rtol=1e-12, atol=1e-14)


def test_cube():
    x = sp.Symbol("x")
    mod = sbp.compile(sbp.Model("cube", params=[x], loss=x**3))
    for value in (-1.5, 0.0, 2.0):
        loss, grads = mod.value_and_grad(x=value)
        assert loss == pytest.approx(value**3)
        assert grads["x"] == pytest.approx(3 * value**2)


V = sp.Symbol("v", real=True)
# (name, scalar function of v, points: including where a branch changes)
ELEMENTWISE = [
    ("exp", sp.exp(V), [-1.0, 0.0, 2.0]),
    ("log", sp.log(V), [0.5, 1.0, 3.0]),
    ("sin", sp.sin(V), [-1.0, 0.0, 2.0]),
    ("cos", sp.cos(V), [-1.0, 0.0, 2.0]),
    ("tanh", sp.tanh(V), [-3.0, 0.0, 0.7]),
    ("sqrt", sp.sqrt(V), [0.25, 1.0, 4.0]),
    ("power", V**5 - 3 * V**-2, [-2.0, 0.5, 1.5]),
    ("rational_power", V ** sp.Rational(3, 2), [0.5, 2.0]),
    ("abs", sp.Abs(V), [-2.0, 0.0, 3.0]),
    ("relu", sp.Max(V, 0), [-1.0, 0.0, 2.0]),
    ("piecewise", sp.Piecewise((V**2, V < 1), (2 * V - 1, True)), [0.0, 1.0, 3.0]),
    ("sigmoid", nn.sigmoid(V), [-4.0, 0.0, 4.0]),
    ("softplus", nn.softplus(V), [-4.0, 0.0, 4.0]),
]

# Values chosen at the kinks, where the derivative jumps: relu'(0) = 0 (as
# PyTorch), |v|'(0) = sign(0) = 0; a Piecewise takes the branch whose
# condition holds at the point (here v < 1 is false at 1: the slope is 2).
AT_KINKS = {("relu", 0.0): 0.0, ("abs", 0.0): 0.0, ("piecewise", 1.0): 2.0}


@pytest.mark.parametrize("name,body,points", ELEMENTWISE, ids=[e[0] for e in ELEMENTWISE])
def test_elementwise_gradient(name, body, points):
    """Elementwise on a 1x3 matrix, summed: compared with sympy.diff."""
    X = sp.MatrixSymbol("X", 1, len(points))
    model = sbp.Model(f"fn_{name}", params=[X], loss=nn.sum_all(X.applyfunc(sp.Lambda(V, body))))
    mod = sbp.compile(model)
    values = np.array([points])
    loss, grads = mod.value_and_grad(X=values)
    expected_loss = sum(float(body.subs(V, p)) for p in points)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    derivative = sp.diff(body, V)
    for k, p in enumerate(points):
        expected = AT_KINKS.get((name, p))
        if expected is None:
            expected = float(derivative.subs(V, p))
        assert grads["X"][0, k] == pytest.approx(expected, rel=1e-12, abs=1e-14), (name, p)


def test_symbolic_dimension_is_bound_per_call():
    example = load_example("mlp")
    mod = sbp.compile(example.model)
    for batch in (1, 3, 17):
        data = example.sample_data(np.random.default_rng(batch), batch=batch)
        out = mod.forward(**data)
        assert out["Y"].shape == (batch, 2)


def test_gradient_with_respect_to_chosen_inputs():
    example = load_example("mlp")
    model = sbp.Model("mlp_adv", inputs=example.model.inputs, params=example.model.params,
                      loss=example.model.loss, grad_inputs=[example.X])
    mod = sbp.compile(model)
    data = example.sample_data(np.random.default_rng(7))
    _, grads = mod.value_and_grad(**data)
    from oracles import central_differences, mlp_loss
    assert relative_error(grads["X"], central_differences(mlp_loss, data, "X")) < 1e-6


def test_explicit_matrix_of_scalars():
    a, b, c = sp.symbols("a b c")
    W = sp.MatrixSymbol("W", 2, 2)
    v = sp.Matrix([[a * b, sp.sin(c)]])  # 1x2 explicit matrix
    loss = nn.sum_all(sp.HadamardPower(v * W, 2))
    mod = sbp.compile(sbp.Model("explicit", inputs=[a], params=[b, c, W], loss=loss))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 2))
    values = {"a": 0.7, "b": -1.2, "c": 0.4, "W": w}
    ws = sp.symbols("w0:4")
    full = (sp.Matrix([[a * b, sp.sin(c)]]) * sp.Matrix(2, 2, ws)).applyfunc(lambda e: e**2)
    total = sum(full)
    subs = {a: 0.7, b: -1.2, c: 0.4, **{ws[k]: w.flat[k] for k in range(4)}}
    loss_value, grads = mod.value_and_grad(**values)
    assert loss_value == pytest.approx(float(total.subs(subs)), rel=1e-12)
    assert grads["b"] == pytest.approx(float(sp.diff(total, b).subs(subs)), rel=1e-12)
    assert grads["c"] == pytest.approx(float(sp.diff(total, c).subs(subs)), rel=1e-12)
    expected_w = np.array([float(sp.diff(total, ws[k]).subs(subs)) for k in range(4)]).reshape(2, 2)
    np.testing.assert_allclose(grads["W"], expected_w, rtol=1e-12)


def test_documented_tie_of_max():
    """README: at a tie of Max(a, b) neither argument gets the gradient."""
    a, b = sp.symbols("a b")
    mod = sbp.compile(sbp.Model("tie", params=[a, b], loss=sp.Max(a, b)))
    assert mod.value_and_grad(a=1.0, b=1.0) == (1.0, {"a": 0.0, "b": 0.0})
    assert mod.value_and_grad(a=2.0, b=1.0) == (2.0, {"a": 1.0, "b": 0.0})


def test_explicit_matrix_of_constants():
    """X @ [[0], [1], [0]] selects X's middle column (a pack of constants)."""
    X = sp.MatrixSymbol("X", 4, 3)
    mod = sbp.compile(sbp.Model("constants", params=[X], loss=nn.sum_all(X * sp.Matrix([[0], [1], [0]]))))
    x = np.arange(12.0).reshape(4, 3)
    loss, grads = mod.value_and_grad(X=x)
    assert loss == x[:, 1].sum()
    np.testing.assert_array_equal(grads["X"], np.tile([0.0, 1.0, 0.0], (4, 1)))
