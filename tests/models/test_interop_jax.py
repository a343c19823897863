"""The JAX bridge: loss and gradients against JAX's own autodiff of the same
model written in jax.numpy, under jax.grad, jax.jit and jax.vmap."""

import numpy as np
import pytest
from conftest import load_example

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import symbackprop as sbp  # noqa: E402  (kept below the skip, as in test_interop_torch)

PARAMS = ("W1", "b1", "W2", "b2")


pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py


def jax_mlp(p, x, t):
    """examples/mlp.py in jax.numpy: the independent oracle."""
    y = jax.nn.sigmoid(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]
    return jnp.mean((y - t) ** 2), y


def test_grad_and_jit_equal_jax_autodiff(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(0), batch=6)
    params = {k: jnp.asarray(data[k]) for k in PARAMS}
    f = mlp_module.as_jax()

    def ours(p):
        return f(X=data["X"], T=data["T"], **p)

    def theirs(p):
        return jax_mlp(p, data["X"], data["T"])[0]

    for transform in (jax.value_and_grad, lambda fn: jax.jit(jax.value_and_grad(fn))):
        loss, grads = transform(ours)(params)
        expected_loss, expected = jax.value_and_grad(theirs)(params)
        assert loss.shape == () and loss.dtype == jnp.float64
        assert abs(float(loss) - float(expected_loss)) < 1e-12
        for name in PARAMS:
            np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(expected[name]), rtol=0, atol=1e-10)
    # a chain rule through the function: the cotangent scales the gradient
    scaled = jax.grad(lambda p: jnp.exp(ours(p)))(params)
    expected = jax.grad(lambda p: jnp.exp(theirs(p)))(params)
    np.testing.assert_allclose(np.asarray(scaled["W1"]), np.asarray(expected["W1"]), rtol=0, atol=1e-10)


def test_outputs_and_chosen_inputs(mlp_example):
    mod = sbp.compile(mlp_example.model, wrt=["W1", "X"])
    data = mlp_example.sample_data(np.random.default_rng(1), batch=5)
    f = mod.as_jax(outputs=["Y"])
    args = {k: jnp.asarray(v) for k, v in data.items()}

    def ours(w1, x):
        loss, outs = f(**{**args, "W1": w1, "X": x})
        return loss + jnp.sin(outs["Y"]).sum()

    def theirs(w1, x):
        loss, y = jax_mlp({**args, "W1": w1}, x, args["T"])
        return loss + jnp.sin(y).sum()

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(args["W1"], args["X"])
    expected = jax.grad(theirs, argnums=(0, 1))(args["W1"], args["X"])
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-10)
    # W2 is not differentiated by the module: a constant to JAX
    assert float(jnp.abs(jax.grad(lambda w2: f(**{**args, "W2": w2})[0])(args["W2"])).max()) == 0.0


def test_vmap_calls_per_example(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(2), batch=4)
    f = mlp_module.as_jax()
    params = {k: data[k] for k in PARAMS}
    xs = jnp.stack([jnp.asarray(data["X"]), 2.0 * jnp.asarray(data["X"])])
    got = jax.vmap(lambda x: f(X=x, T=data["T"], **params))(xs)
    expected = [float(jax_mlp(params, x, data["T"])[0]) for x in xs]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-12)


def test_wrong_arguments_are_named(mlp_module):
    with pytest.raises(sbp.ArgumentError, match="missing"):
        mlp_module.as_jax()(X=np.ones((2, 3)))
    with pytest.raises(sbp.ArgumentError, match="no output named"):
        mlp_module.as_jax(outputs=["Z"])


def test_index_inputs_stay_integers_under_grad_and_jit():
    """Bundle adjustment gathers cameras and points by int64 index arrays:
    they pass through as integers (their cotangent is JAX's float0)."""
    ba = load_example("bundle_adjustment")
    mod = sbp.compile(ba.model)
    data = ba.sample_data(np.random.default_rng(4))
    args = {k: jnp.asarray(v) for k, v in data.items()}
    fn = mod.as_jax()
    loss, grads = mod.value_and_grad(**data)
    assert float(fn(**args)) == pytest.approx(loss, rel=1e-14)
    grad = jax.jit(jax.grad(lambda cams, pts: fn(**{**args, "cams": cams, "pts": pts}), argnums=(0, 1)))
    cams, pts = grad(args["cams"], args["pts"])
    np.testing.assert_allclose(np.asarray(cams), grads["cams"], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(np.asarray(pts), grads["pts"], rtol=1e-13, atol=1e-15)
