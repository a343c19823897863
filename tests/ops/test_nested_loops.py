"""Loops inside loops: a fixed point or a scan inside the step of a fixed
point or of a scan, the inner loop emitted inside the outer step (its
scratch in the step's scratch). Forward values against closed forms and
JAX (float64); gradients, for every pairing of the inner and outer loops'
derivative modes, against closed forms, JAX (nested lax.scan, or the
implicit function theorem solved by numpy over JAX's Jacobians) and
central differences, to 1e-10 relative."""

import functools

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

RTOL = 1e-10
MODES = ["implicit", "unrolled"]


pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py


# --- a fixed point inside a fixed point: y = sqrt(a + y) / 2, the sqrt by Newton ---

N = 3
a, x, y = sp.MatrixSymbol("a", 1, N), sp.MatrixSymbol("x", 1, N), sp.MatrixSymbol("y", 1, N)


def _nested_sqrt(inner_mode, outer_mode):
    c = sp.Matrix(1, N, lambda i, j: a[i, j] + y[i, j])
    root = sbp.fixed_point(sp.Matrix(1, N, lambda i, j: (x[i, j] + c[i, j] / x[i, j]) / 2), x,
                           sp.Matrix(1, N, lambda i, j: c[i, j] + 1), tol=1e-15, max_iter=80, diff=inner_mode)
    y_star = sbp.fixed_point(sp.Matrix(1, N, lambda i, j: root[i, j] / 2), y, sp.ZeroMatrix(1, N), tol=1e-15,
                             max_iter=200, diff=outer_mode)
    loss = nn.sum_all(y_star.applyfunc(lambda e: e**2))
    return sbp.Model(f"fp_in_fp_{inner_mode}_{outer_mode}", inputs=[], params=[a], loss=loss,
                     outputs={"y": y_star, "steps": sbp.iterations(y_star)})


@pytest.mark.parametrize("outer_mode", MODES)
@pytest.mark.parametrize("inner_mode", MODES)
def test_a_fixed_point_inside_a_fixed_point_matches_the_closed_form(inner_mode, outer_mode):
    mod = sbp.compile(_nested_sqrt(inner_mode, outer_mode), functions=("forward", "value_and_grad"))
    values = np.array([[1.0, 2.0, 5.0]])
    y_star = (1 + np.sqrt(1 + 16 * values)) / 8  # 4 y^2 - y - a = 0
    out = mod.forward(a=values)
    np.testing.assert_allclose(out["y"], y_star, rtol=1e-14)
    assert 5 < out["steps"][0, 0] < 200
    _, grads = mod.value_and_grad(a=values)
    want = 2 * y_star / np.sqrt(1 + 16 * values)  # d sum(y^2) / da, dy/da = 1 / (8y - 1)
    assert relative_error(grads["a"], want) < RTOL
    fd = central_differences(lambda d: float(mod.forward(**d)["loss"]), {"a": values}, "a")
    assert relative_error(grads["a"], fd) < 1e-7


# --- a fixed point inside a scan: h_{t+1} = sqrt(h_t + X_t) * b, the sqrt by Newton -----

T = sp.Symbol("T", integer=True, positive=True)
X, h, row, b, w = (sp.MatrixSymbol("X", T, N), sp.MatrixSymbol("h", 1, N), sp.MatrixSymbol("row", 1, N),
                   sp.MatrixSymbol("b", 1, N), sp.MatrixSymbol("w", 1, N))


def _fp_in_scan(inner_mode, every=None):
    c = sp.Matrix(1, N, lambda i, j: h[i, j] + row[i, j])
    root = sbp.fixed_point(sp.Matrix(1, N, lambda i, j: (x[i, j] + c[i, j] / x[i, j]) / 2), x,
                           sp.Matrix(1, N, lambda i, j: c[i, j] + 1), tol=1e-15, max_iter=80, diff=inner_mode)
    nxt = sp.Matrix(1, N, lambda i, j: root[i, j] * b[i, j])
    final = sbp.scan(nxt, None, h, row, sp.Matrix(1, N, lambda i, j: b[i, j] ** 2), X, checkpoint_every=every)
    loss = nn.sum_all(sp.HadamardProduct(w, final))
    return sbp.Model(f"fp_in_scan_{inner_mode}_{every}", inputs=[X, w], params=[b], loss=loss,
                     outputs={"final": final})


def _fp_in_scan_jax(Xv, wv, bv):
    final, _ = jax.lax.scan(lambda hh, r: (jnp.sqrt(hh + r) * bv, None), bv**2, Xv)
    return jnp.sum(wv * final)


@pytest.mark.parametrize("every", [None, 2])
@pytest.mark.parametrize("inner_mode", MODES)
def test_a_fixed_point_inside_a_scan_matches_jax(inner_mode, every):
    mod = sbp.compile(_fp_in_scan(inner_mode, every), functions=("forward", "value_and_grad"))
    rng = np.random.default_rng(1)
    data = {"X": rng.uniform(0.5, 2.0, (5, N)), "w": rng.standard_normal((1, N))}
    bv = rng.uniform(0.5, 1.5, (1, N))
    loss, grads = mod.value_and_grad(**data, b=bv)
    want_loss, want = jax.value_and_grad(_fp_in_scan_jax, argnums=(0, 2))(data["X"], data["w"], bv)
    assert abs(loss - want_loss) < RTOL * abs(want_loss)
    assert relative_error(grads["b"], np.asarray(want[1])) < RTOL
    fd = central_differences(lambda d: float(mod.forward(**d)["loss"]), {**data, "b": bv}, "b")
    assert relative_error(grads["b"], fd) < 1e-7


# --- a scan inside a scan: outer over the rows of X, inner over the rows of P ------

K = 3
P, z, p = sp.MatrixSymbol("P", K, N), sp.MatrixSymbol("z", 1, N), sp.MatrixSymbol("p", 1, N)


def _scan_in_scan(every=None):
    inner_step = sp.Matrix(1, N, lambda i, j: sp.tanh(z[i, j] * p[i, j] + row[i, j]))
    inner = sbp.scan(inner_step, None, z, p, h, P)
    final = sbp.scan(sp.Matrix(1, N, lambda i, j: inner[i, j] + h[i, j] / 2), None, h, row, sp.ZeroMatrix(1, N), X,
                     checkpoint_every=every)
    loss = nn.sum_all(sp.HadamardProduct(w, final))
    return sbp.Model(f"scan_in_scan_{every}", inputs=[X, w], params=[P], loss=loss, outputs={"final": final})


def _scan_in_scan_jax(Xv, wv, Pv):
    def outer(hh, r):
        zz, _ = jax.lax.scan(lambda zc, pr: (jnp.tanh(zc * pr + r), None), hh, Pv)
        return zz + hh / 2, None
    final, _ = jax.lax.scan(outer, jnp.zeros(N), Xv)
    return jnp.sum(wv * final)


@pytest.mark.parametrize("every", [None, 2])
def test_a_scan_inside_a_scan_matches_nested_lax_scan(every):
    mod = sbp.compile(_scan_in_scan(every), functions=("forward", "value_and_grad"))
    rng = np.random.default_rng(2)
    data = {"X": rng.standard_normal((6, N)), "w": rng.standard_normal((1, N))}
    Pv = rng.standard_normal((K, N))
    loss, grads = mod.value_and_grad(**data, P=Pv)
    want_loss, want = jax.value_and_grad(_scan_in_scan_jax, argnums=2)(data["X"], data["w"], Pv)
    assert abs(loss - want_loss) < RTOL * abs(want_loss)
    assert relative_error(grads["P"], np.asarray(want)) < RTOL
    fd = central_differences(lambda d: float(mod.forward(**d)["loss"]), {**data, "P": Pv}, "P")
    assert relative_error(grads["P"], fd) < 1e-7


# --- a scan inside a fixed point: y = tanh(inner(y)) / 2, inner a scan over P's rows --


def _scan_in_fp(outer_mode):
    inner = sbp.scan(sp.Matrix(1, N, lambda i, j: sp.sin(z[i, j]) * p[i, j] + y[i, j]), None, z, p, y, P)
    y_star = sbp.fixed_point(inner.applyfunc(sp.tanh) / 2, y, sp.ZeroMatrix(1, N), tol=1e-15, max_iter=300,
                             diff=outer_mode)
    return sbp.Model(f"scan_in_fp_{outer_mode}", inputs=[], params=[P], loss=nn.sum_all(y_star.applyfunc(sp.sin)),
                     outputs={"y": y_star})


def _scan_in_fp_step(yv, Pv):
    zz, _ = jax.lax.scan(lambda zc, pr: (jnp.sin(zc) * pr + yv, None), yv, Pv)
    return jnp.tanh(zz) / 2


@functools.cache
def _scan_in_fp_oracle():
    """P, JAX's fixed point y* and dL/dP by the implicit function theorem,
    the same for both modes: computed once. The fixed point: 300 steps of
    JAX's step in one fori_loop (compiled once, not once per step)."""
    Pv = np.random.default_rng(3).uniform(-0.5, 0.5, (K, N))  # float64: called in a test (the x64 fixture)
    yv = np.asarray(jax.lax.fori_loop(0, 300, lambda _, yc: _scan_in_fp_step(yc, Pv), jnp.zeros(N)))
    # implicit function theorem: dL/dP = g^T (I - df/dy)^{-1} df/dP at y*
    g = np.cos(yv)
    fy = np.asarray(jax.jacobian(_scan_in_fp_step, argnums=0)(yv, Pv))
    fp = np.asarray(jax.jacobian(_scan_in_fp_step, argnums=1)(yv, Pv))
    lam = np.linalg.solve((np.eye(N) - fy).T, g)
    return Pv, yv, np.einsum("i,ikn->kn", lam, fp)


@pytest.mark.parametrize("outer_mode", MODES)
def test_a_scan_inside_a_fixed_point_matches_the_implicit_function_theorem(outer_mode):
    mod = sbp.compile(_scan_in_fp(outer_mode), functions=("forward", "value_and_grad"))
    Pv, yv, want = _scan_in_fp_oracle()
    np.testing.assert_allclose(mod.forward(P=Pv)["y"][0], yv, rtol=1e-13, atol=1e-15)
    _, grads = mod.value_and_grad(P=Pv)
    assert relative_error(grads["P"], want) < RTOL


# --- second order: hvp through a loop inside a loop -----------------------------------


def _jax_hvp(loss, primal, tangent):
    return np.asarray(jax.jvp(jax.grad(loss), (jnp.asarray(primal),), (jnp.asarray(tangent),))[1])


def _check_hvp(mod, jax_loss, data, name, value, rng, eps=1e-5):
    """hvp against jax.jvp(jax.grad) and central differences of the gradient."""
    v = rng.standard_normal(value.shape)
    _, _, got = mod.value_grad_and_hvp({name: v}, **data, **{name: value})
    want = _jax_hvp(lambda q: jax_loss(q), value, v)
    assert relative_error(np.reshape(got[name], want.shape), want) < RTOL
    plus, minus = (mod.value_and_grad(**data, **{name: value + s * eps * v})[1][name] for s in (1, -1))
    assert relative_error(got[name], (plus - minus) / (2 * eps)) < 1e-7


@pytest.mark.parametrize("every", [None, 2])
def test_the_hvp_through_a_scan_inside_a_scan_matches_nested_lax_scan(every):
    mod = sbp.compile(_scan_in_scan(every), functions=("value_and_grad", "hvp"))
    rng = np.random.default_rng(4)
    data = {"X": rng.standard_normal((6, N)), "w": rng.standard_normal((1, N))}
    _check_hvp(mod, lambda q: _scan_in_scan_jax(data["X"], data["w"], q), data, "P", rng.standard_normal((K, N)), rng)


@pytest.mark.parametrize("inner_mode", MODES)
def test_the_hvp_through_a_fixed_point_inside_a_scan_matches_jax(inner_mode):
    mod = sbp.compile(_fp_in_scan(inner_mode), functions=("value_and_grad", "hvp"))
    rng = np.random.default_rng(5)
    data = {"X": rng.uniform(0.5, 2.0, (5, N)), "w": rng.standard_normal((1, N))}
    _check_hvp(mod, lambda q: _fp_in_scan_jax(data["X"], data["w"], q), data, "b", rng.uniform(0.5, 1.5, (1, N)), rng)


@pytest.mark.parametrize("outer_mode", MODES)
@pytest.mark.parametrize("inner_mode", MODES)
def test_the_hvp_through_a_fixed_point_inside_a_fixed_point_matches_the_closed_form(inner_mode, outer_mode):
    mod = sbp.compile(_nested_sqrt(inner_mode, outer_mode), functions=("value_and_grad", "hvp"))
    closed = lambda q: jnp.sum(((1 + jnp.sqrt(1 + 16 * q)) / 8) ** 2)  # noqa: E731
    _check_hvp(mod, closed, {}, "a", np.array([[1.0, 2.0, 5.0]]), np.random.default_rng(6))


@pytest.mark.parametrize("outer_mode", MODES)
def test_the_hvp_through_a_scan_inside_a_fixed_point_matches_jax(outer_mode):
    """JAX's oracle: 300 steps of the same iteration (a contraction: the
    derivatives of its iterates converge to those at the fixed point)."""
    mod = sbp.compile(_scan_in_fp(outer_mode), functions=("value_and_grad", "hvp"))

    def loss(q):
        return jnp.sum(jnp.sin(jax.lax.fori_loop(0, 300, lambda _, yv: _scan_in_fp_step(yv, q), jnp.zeros(N))))

    rng = np.random.default_rng(7)
    _check_hvp(mod, loss, {}, "P", rng.uniform(-0.5, 0.5, (K, N)), rng)
