"""sbp.where: an elementwise select built as it stands. Values and gradients
against numpy and JAX's jnp.where (float64); a NaN in the branch not taken
(log and sqrt of a negative); the documented difference from JAX (the
branch not taken is not differentiated); bad input."""

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ModelError

N = 5
x = sp.MatrixSymbol("x", 1, N)
VALUES = np.array([[-2.0, -0.5, 0.25, 1.5, 3.0]])


def _select(chosen, other):
    return sbp.where([[sp.StrictGreaterThan(x[0, j], 0) for j in range(N)]],
                     sp.Matrix(1, N, lambda i, j: chosen(x[i, j])), sp.Matrix(1, N, lambda i, j: other(x[i, j])))


@pytest.fixture(scope="module")
def log_mod():
    sel = _select(lambda e: e**2 * sp.log(e), lambda e: -3 * e + e**3)
    return sbp.compile(sbp.Model("where_log", inputs=[], params=[x], loss=nn.sum_all(sel), outputs={"y": sel}))


def test_values_and_gradient_match_numpy_and_a_log_of_a_negative_does_not_leak(log_mod):
    out = log_mod.forward(x=VALUES)
    with np.errstate(invalid="ignore"):
        want = np.where(VALUES > 0, VALUES**2 * np.log(VALUES), -3 * VALUES + VALUES**3)
        want_grad = np.where(VALUES > 0, 2 * VALUES * np.log(VALUES) + VALUES, -3 + 3 * VALUES**2)
    assert np.isfinite(out["y"]).all()
    np.testing.assert_allclose(out["y"], want, rtol=1e-15)
    _, grads = log_mod.value_and_grad(x=VALUES)
    assert np.isfinite(grads["x"]).all()
    np.testing.assert_allclose(grads["x"], want_grad, rtol=1e-14)
    fd = central_differences(lambda d: log_mod.value_and_grad(**d)[0], {"x": VALUES}, "x")
    assert relative_error(grads["x"], fd) < 1e-8


def test_gradient_matches_jax_where(log_mod):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy

    def loss(v):  # log of |v| in the branch not taken: JAX evaluates both branches
        return jnp.sum(jnp.where(v > 0, v**2 * jnp.log(jnp.abs(v)), -3 * v + v**3))

    want = np.asarray(jax.grad(loss)(jnp.asarray(VALUES)))
    assert relative_error(log_mod.value_and_grad(x=VALUES)[1]["x"], want) < 1e-14


def test_the_branch_not_taken_is_not_differentiated_unlike_jax():
    """where(x > 0, sqrt(x), 0): derivative 0 at x < 0 (JAX's jnp.where
    gives NaN there: 0 * sqrt's NaN derivative), as documented."""
    sel = _select(sp.sqrt, lambda e: sp.Integer(0))
    mod = sbp.compile(sbp.Model("where_sqrt", inputs=[], params=[x], loss=nn.sum_all(sel)))
    _, grads = mod.value_and_grad(x=VALUES)
    want = np.where(VALUES > 0, 0.5 / np.sqrt(np.abs(VALUES)), 0.0)
    np.testing.assert_allclose(grads["x"], want, rtol=1e-15)
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    theirs = jax.grad(lambda v: jax.numpy.sum(jax.numpy.where(v > 0, jax.numpy.sqrt(v), 0.0)))(VALUES)
    assert np.isnan(np.asarray(theirs)[VALUES < 0]).all()


def test_nested_selects_are_one_piecewise_and_a_scalar_condition_selects_matrices():
    a, k = sp.Symbol("a"), sp.Symbol("k")
    nested = sbp.where(sp.Eq(k, 0, evaluate=False), a, sbp.where(sp.Lt(a, 1), 2 * a, 3))
    assert isinstance(nested, sp.Piecewise) and len(nested.args) == 3 and nested.args[-1].cond == sp.true
    assert nested.subs({k: 1, a: 0.5}) == 1.0 and nested.subs({k: 0, a: 0.5}) == 0.5
    m = sbp.where(sp.Lt(a, 0), sp.ones(2, 2), 0)
    assert m.shape == (2, 2) and m.subs(a, -1) == sp.ones(2, 2) and m.subs(a, 1) == sp.zeros(2, 2)
    assert sbp.where(True, a, 2) == a and sbp.where(sp.false, a, 2) == 2


def test_bad_input_names_what_is_wrong():
    a = sp.Symbol("a")
    with pytest.raises(ModelError, match="cond must be a condition"):
        sbp.where(a + 1, a, 0)
    with pytest.raises(ModelError, match="b is 1 x 3, the others 1 x 5"):
        sbp.where(sp.Lt(a, 0), x, sp.MatrixSymbol("y", 1, 3))
    with pytest.raises(ModelError, match="cond is 1 x 2, the others 1 x 5"):
        sbp.where([[sp.Lt(a, 0), sp.Lt(a, 1)]], x, 0)
    with pytest.raises(ModelError, match="a must be a SymPy expression or a number"):
        sbp.where(sp.Lt(a, 0), "one", 0)
