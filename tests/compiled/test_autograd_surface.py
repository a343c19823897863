"""VJP with seeds, chosen gradients, JVP, HVP, Hessians and Jacobians,
checked against finite differences and sympy."""

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, mlp_loss, relative_error, sigmoid

import symbackprop as sbp
from symbackprop.declare import nn


def mlp_outputs(d):
    hidden = sigmoid(d["X"] @ d["W1"] + d["b1"])
    return hidden @ d["W2"] + d["b2"]


def test_vjp_with_a_seed(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(0), batch=4)
    seed = np.random.default_rng(1).standard_normal((4, 2))
    grads = mlp_module.vjp("Y", seed, **data)
    for name in ("W1", "b1", "W2", "b2"):
        expected = central_differences(lambda d: float(np.sum(seed * mlp_outputs(d))), data, name)
        assert relative_error(grads[name], expected) < 1e-6, name


def test_vjp_of_a_non_scalar_output_needs_a_seed(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(0), batch=4)
    with pytest.raises(sbp.ArgumentError, match="needs a seed because the output is not a scalar"):
        mlp_module.vjp("Y", **data)
    with pytest.raises(sbp.ArgumentError, match=r"\(4, 2\).*\(2, 4\)"):
        mlp_module.vjp("Y", np.ones((2, 4)), **data)


def test_gradients_of_chosen_inputs_and_intermediates(mlp_example):
    mod = sbp.compile(mlp_example.model, wrt=["W1", "X", "Y"])
    data = mlp_example.sample_data(np.random.default_rng(2), batch=3)
    _, grads = mod.value_and_grad(**data)
    assert set(grads) == {"W1", "X", "Y"}
    assert relative_error(grads["X"], central_differences(mlp_loss, data, "X")) < 1e-6
    y = mlp_outputs(data)
    np.testing.assert_allclose(grads["Y"], 2 * (y - data["T"]) / y.size, rtol=1e-12)


def test_nothing_that_was_not_asked_for_is_computed(mlp_example):
    mod = sbp.compile(mlp_example.model, wrt=["W2"])
    computing = mod.source.split("/* --- what the functions take")[0]  # not the self-description after it
    body = computing.split("_value_and_grad(")[-1]
    assert "grad_W2" in body
    assert "grad_W1" not in body and "grad_b1" not in body
    assert "X^T" not in body and "W2^T" not in body  # no backward product into the first layer


def test_jvp_is_a_directional_derivative(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(3), batch=5)
    rng = np.random.default_rng(4)
    tangents = {"W1": rng.standard_normal((3, 4)), "b2": rng.standard_normal((1, 2))}
    out = mlp_module.jvp(tangents, **data)
    step = 1e-6
    plus = {**data, **{k: data[k] + step * v for k, v in tangents.items()}}
    minus = {**data, **{k: data[k] - step * v for k, v in tangents.items()}}
    assert out["loss"] == pytest.approx((mlp_loss(plus) - mlp_loss(minus)) / (2 * step), rel=1e-6)
    expected_y = (mlp_outputs(plus) - mlp_outputs(minus)) / (2 * step)
    assert relative_error(out["Y"], expected_y) < 1e-6


def test_hvp_matches_finite_differences_of_the_gradient(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(5), batch=5)
    rng = np.random.default_rng(6)
    direction = {k: rng.standard_normal(np.shape(data[k])) for k in ("W1", "b1", "W2", "b2")}
    hv = mlp_module.hvp(direction, **data)
    step = 1e-5
    plus = {**data, **{k: data[k] + step * v for k, v in direction.items()}}
    minus = {**data, **{k: data[k] - step * v for k, v in direction.items()}}
    g_plus, g_minus = mlp_module.value_and_grad(**plus)[1], mlp_module.value_and_grad(**minus)[1]
    for k in direction:
        assert relative_error(hv[k], (g_plus[k] - g_minus[k]) / (2 * step)) < 1e-6, k


def test_scalar_hessian_matches_sympy():
    x, y = sp.symbols("x y")
    f = x**3 * y + sp.sin(x * y) + sp.exp(y) / x
    mod = sbp.compile(sbp.Model("hess", params=[x, y], loss=f))
    point = {x: 0.7, y: -0.4}
    expected = np.array(sp.hessian(f, (x, y)).subs(point).evalf(), dtype=float)
    np.testing.assert_allclose(mod.hessian_matrix(x=0.7, y=-0.4), expected, rtol=1e-12)
    blocks = mod.hessian(x=0.7, y=-0.4)
    assert isinstance(blocks["x"]["y"], float)
    np.testing.assert_allclose([[blocks[a][b] for b in "xy"] for a in "xy"], expected, rtol=1e-12)


def test_hessian_blocks_are_keyed_by_argument(mlp_example, mlp_module):
    """H[a][b] of shape a.shape + b.shape: against finite differences of the gradient."""
    data = mlp_example.sample_data(np.random.default_rng(5), batch=3)
    blocks = mlp_module.hessian(**data)
    keys = ["W1", "b1", "W2", "b2"]
    assert list(blocks) == keys and all(list(row) == keys for row in blocks.values())
    step = 1e-5
    for b in keys:
        for index in np.ndindex(data[b].shape):
            plus, minus = {**data, b: data[b].copy()}, {**data, b: data[b].copy()}
            plus[b][index] += step
            minus[b][index] -= step
            g_plus, g_minus = mlp_module.value_and_grad(**plus)[1], mlp_module.value_and_grad(**minus)[1]
            for a in keys:
                assert blocks[a][b].shape == data[a].shape + data[b].shape
                column = blocks[a][b][(Ellipsis, *index)]
                assert relative_error(column, (g_plus[a] - g_minus[a]) / (2 * step)) < 1e-6, (a, b, index)
    flat = mlp_module.hessian_matrix(**data)
    np.testing.assert_array_equal(flat[:12, 12:16], blocks["W1"]["b1"].reshape(12, 4))


def test_jacobian_of_a_small_vector_valued_output():
    W = sp.MatrixSymbol("W", 2, 3)
    x = sp.MatrixSymbol("x", 3, 1)
    h = nn.tanh(W * x)
    model = sbp.Model("vec", inputs=[x], params=[W], loss=nn.sum_all(h), outputs={"h": h})
    mod = sbp.compile(model)
    rng = np.random.default_rng(7)
    data = {"W": rng.standard_normal((2, 3)), "x": rng.standard_normal((3, 1))}
    jac = mod.jacobian("h", **data)["W"]
    assert jac.shape == (2, 1, 2, 3)
    z = data["W"] @ data["x"]
    for i in range(2):
        expected = np.zeros((2, 3))
        expected[i, :] = (1 - np.tanh(z[i, 0]) ** 2) * data["x"][:, 0]
        np.testing.assert_allclose(jac[i, 0], expected, rtol=1e-12, atol=1e-15)


def test_prepared_call_writes_into_its_arrays(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(8), batch=6)
    call = mlp_module.prepare(**data)
    loss, grads = call()  # what value_and_grad returns, in the call's own arrays
    expected_loss, expected = mlp_module.value_and_grad(**data)
    assert loss == expected_loss and set(grads) == set(expected)
    for k, v in expected.items():
        np.testing.assert_array_equal(call.grads[k], v)
        assert grads[k] is call.grads[k]
    doubled = {**data, "W1": data["W1"] * 2}
    call.inputs["W1"][:] *= 2  # refill in place (the caller's own array): the next call sees it
    assert call.run() == pytest.approx(mlp_module.value_and_grad(**doubled)[0], rel=1e-15)


@pytest.mark.parametrize("kind", ["forward", "value_and_grad", "jvp", "hvp"])
def test_a_prepared_call_returns_the_same_objects_updated_in_place(mlp_example, mlp_module, kind):
    """Nothing is allocated per call but the scalars: the dicts and arrays
    of one call are those of the next, holding the next call's values."""
    rng = np.random.default_rng(10)
    data = mlp_example.sample_data(rng, batch=5)
    extra = {arg: rng.standard_normal(data[key].shape) for arg, _, key in mlp_module.function(kind).spec.extra_roles}
    call = mlp_module.prepare(kind, **data, **extra)
    first = call()
    containers = [first] if isinstance(first, dict) else [part for part in first if isinstance(part, dict)]
    arrays = {id(v) for c in containers for v in c.values() if isinstance(v, np.ndarray)}
    assert containers and arrays
    call.inputs["W1"][:] *= -0.5  # a new point: the same objects now hold its results
    second = call()
    assert type(second) is type(first)
    parts = [second] if isinstance(second, dict) else [part for part in second if isinstance(part, dict)]
    assert all(a is b for a, b in zip(parts, containers))
    assert {id(v) for c in parts for v in c.values() if isinstance(v, np.ndarray)} == arrays
    unprepared = mlp_module.function(kind).call({**{k: v.copy() for k, v in call.inputs.items()}})
    assert len(unprepared) == len(call.results)
    for (name, mine), theirs in zip(call.results.items(), unprepared):
        np.testing.assert_array_equal(np.asarray(mine).reshape(np.shape(theirs)), theirs, err_msg=name)


@pytest.mark.parametrize("kind", ["forward", "value_and_grad", "jvp", "hvp"])
def test_a_prepared_call_returns_what_the_method_returns(mlp_example, mlp_module, kind):
    data = mlp_example.sample_data(np.random.default_rng(9), batch=5)
    direction = {"W1": np.ones((3, 4))}
    methods = {
        "forward": lambda: mlp_module.forward(**data),
        "value_and_grad": lambda: mlp_module.value_and_grad(**data),
        "jvp": lambda: mlp_module.jvp(direction, **data),
        "hvp": lambda: mlp_module.value_grad_and_hvp(direction, **data),
    }
    extra = {arg: direction.get(key, np.zeros_like(data[key])) for arg, _, key in mlp_module.function(kind).spec.extra_roles}
    got, want = mlp_module.prepare(kind, **data, **extra)(), methods[kind]()

    def same(a, b):
        if isinstance(b, tuple):
            return type(a) is tuple and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(b, dict):
            return type(a) is dict and set(a) == set(b) and all(same(a[k], b[k]) for k in b)
        return type(a) is type(b) and np.array_equal(a, b)

    assert same(got, want), (got, want)
