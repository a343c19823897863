"""Loops inside a scan's step, and shifts along a symbolic dimension
(sbp.shift): an RK4 integrator whose step holds four stages and a
recurrence along the state vector (y'_i = x_i y_{i-1}, GradBench's ode),
a step holding a running sum, and the shift on its own; each compiled and
compared with JAX (jax.lax.scan, float64) and finite differences."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ModelError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

n, s = sp.symbols("n s", integer=True, positive=True)
x = sp.MatrixSymbol("x", n, 1)
w = sp.MatrixSymbol("w", n, 1)
steps = sp.MatrixSymbol("steps", s, 1)
y, h_row = sp.MatrixSymbol("y", n, 1), sp.MatrixSymbol("h", 1, 1)
h = sbp.as_scalar(h_row)
RTOL = 1e-10


pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py


def rk4(f, y0, size):
    """The four stages of one RK4 step, written out (a fixed count)."""
    k1 = f(y0)
    k2 = f(y0 + size / 2 * k1)
    k3 = f(y0 + size / 2 * k2)
    k4 = f(y0 + size * k3)
    return y0 + size / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _chain(v):  # f_0 = x_0, f_i = x_i v_{i-1}, with a nonlinearity to exercise every stage's rule
    return sp.HadamardProduct(x, sbp.shift(v, 1, fill=1)) - v.applyfunc(sp.sin) / 4


def _chain_jax(xv):
    return lambda v: xv * jnp.concatenate([jnp.ones(1), v[:-1]]) - jnp.sin(v) / 4


def _model(name, f, with_cumsum=False):
    y_final = sbp.scan(rk4(f, y, h), None, y, h_row, sp.ZeroMatrix(n, 1), steps)
    loss = nn.sum_all(sp.HadamardProduct(w, y_final))
    return sbp.Model(name, inputs=[steps, w], params=[x], loss=loss, outputs={"y": y_final})


def _jax_solve(f_of_x, sizes):
    def solve(xv):
        f = f_of_x(xv)
        return jax.lax.scan(lambda v, hv: (rk4(f, v, hv), None), jnp.zeros_like(xv), jnp.asarray(sizes))[0]
    return solve


def _data(size=9, count=7, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.uniform(0.1, 0.4, count)  # unequal steps: the step size is read from the sequence
    return rng.uniform(0.2, 1.5, size), sizes, rng.standard_normal(size)


def _rel(got, want):
    return np.linalg.norm(np.ravel(got) - np.ravel(want)) / np.linalg.norm(np.ravel(want))


CASES = {
    "chain": (_chain, _chain_jax),
    # a running sum inside the step: f = x * cumsum(v) reversed, i.e. f_i = x_i sum_{j >= i} v_j
    "cumsum": (lambda v: sp.HadamardProduct(x, sbp.cumsum(v, 0, reverse=True)) + x,
               lambda xv: (lambda v: xv * jnp.cumsum(v[::-1])[::-1] + xv)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rk4_scan_against_jax_and_finite_differences(case):
    f, f_jax = CASES[case]
    mod = sbp.compile(_model(f"rk4_{case}", f))
    xv, sizes, wv = _data()
    solve = _jax_solve(f_jax, sizes)
    want_y = np.asarray(jax.jit(solve)(jnp.asarray(xv)))
    want_grad = np.asarray(jax.jit(jax.grad(lambda z: jnp.dot(jnp.asarray(wv), solve(z))))(jnp.asarray(xv)))
    arrays = {"x": xv.reshape(-1, 1), "steps": sizes.reshape(-1, 1), "w": wv.reshape(-1, 1)}
    loss, grads = mod.value_and_grad(**arrays)
    assert _rel(mod.forward(**arrays)["y"], want_y) < RTOL
    assert loss == pytest.approx(float(wv @ want_y), rel=RTOL)
    assert _rel(grads["x"], want_grad) < RTOL
    # forward mode: the tangent scan, against jax.jvp
    direction = np.random.default_rng(5).standard_normal(xv.shape)
    _, want_tangent = jax.jit(lambda z, t: jax.jvp(lambda v: jnp.dot(jnp.asarray(wv), solve(v)), (z,), (t,)))(
        jnp.asarray(xv), jnp.asarray(direction))
    got = mod.jvp(tangents={"x": direction.reshape(-1, 1)}, **arrays)["loss"]
    assert float(np.ravel(got)[0]) == pytest.approx(float(want_tangent), rel=RTOL)
    # central differences along the same direction
    eps = 1e-6
    plus = mod.forward(**{**arrays, "x": (xv + eps * direction).reshape(-1, 1)})["loss"]
    minus = mod.forward(**{**arrays, "x": (xv - eps * direction).reshape(-1, 1)})["loss"]
    assert float(np.ravel(grads["x"]) @ direction) == pytest.approx((plus - minus) / (2 * eps), rel=1e-7)


def test_the_length_is_bound_at_call_time():
    """One module, any n and any number of steps: the C holds loops, not copies of the step."""
    mod = sbp.compile(_model("rk4_lengths", _chain))
    for size, count in ((1, 1), (3, 20), (40, 2)):
        xv, sizes, wv = _data(size, count, seed=size)
        solve = _jax_solve(_chain_jax, sizes)
        got = mod.forward(x=xv.reshape(-1, 1), steps=sizes.reshape(-1, 1), w=wv.reshape(-1, 1))["y"]
        assert _rel(got, np.asarray(solve(jnp.asarray(xv)))) < RTOL
    # a loop over the steps; inside, loops over the n entries that read y_{i-1} in place
    # (the shift is not copied: schedule/shifted.py) and, in the backward pass, g_{i+1}
    assert "< s; ++" in mod.source and "for (int64_t i = 1; i < n; ++i)" in mod.source
    assert "[i - 1]" in mod.source and "[i + 1]" in mod.source and "_shift(" not in mod.source


M = sp.MatrixSymbol("M", n, s)


@pytest.mark.parametrize(("k", "axis", "fill", "transposed"),
                         [(1, 0, 1.5, False), (-2, 0, 0, True), (2, 1, -0.5, False), (-1, 1, 0, True), (7, 0, 2, False)])
def test_shift_against_numpy_and_finite_differences(k, axis, fill, transposed):
    """Value and gradient of sum(sin(shift(A) * A)) with A = M or M^T; k = 7
    moves every entry out (the result is all fill)."""
    A = M.T if transposed else M
    loss = nn.sum_all(sp.HadamardProduct(sbp.shift(A, k, axis, fill), A).applyfunc(sp.sin))
    mod = sbp.compile(sbp.Model(f"shift_{k + 9}_{axis}_{int(transposed)}", params=[M], loss=loss))

    def numpy_loss(m):
        a = m.T if transposed else m
        return np.sin(_moved_np(a, k, axis, fill) * a).sum()

    m = np.random.default_rng(2).uniform(-1, 1, (5, 4))
    value, grads = mod.value_and_grad(M=m)
    assert value == pytest.approx(numpy_loss(m), rel=1e-13)
    fd = np.zeros_like(m)
    for index in np.ndindex(m.shape):
        step = np.zeros_like(m)
        step[index] = 1e-6
        fd[index] = (numpy_loss(m + step) - numpy_loss(m - step)) / 2e-6
    np.testing.assert_allclose(grads["M"], fd, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(("args", "message"), [((M, 1.5, 0), "whole number"), ((M, 1, 2), "axis"),
                                               ((M, 1, 0, sp.Symbol("a")), "fill"), ((3, 1, 0), "matrix")])
def test_shift_refuses_bad_arguments(args, message):
    with pytest.raises(ModelError, match=message):
        sbp.shift(*args)


def _moved_np(a, k, axis, fill):
    out = np.full_like(a, float(fill))
    length = a.shape[axis]
    if abs(k) < length:
        src = np.take(a, range(length - k) if k > 0 else range(-k, length), axis=axis)
        index = [slice(None)] * 2
        index[axis] = slice(k, length) if k > 0 else slice(0, length + k)
        out[tuple(index)] = src
    return out


def test_shifts_read_inside_vector_loops_at_every_length():
    """Shifts of a column and of a row read in place by the loops that use
    them (moved both ways in one loop, so it splits in three parts), at
    lengths shorter than the moves too; value and gradient against numpy
    and finite differences."""
    v, r = sp.MatrixSymbol("v", n, 1), sp.MatrixSymbol("r", 1, n)
    col = sp.HadamardProduct(sbp.shift(v, 2, fill=0.5), sbp.shift(v, -1, fill=-2), v).applyfunc(sp.sin)
    row = sp.HadamardProduct(sbp.shift(r, -3, 1, fill=0.25), r).applyfunc(sp.cos)
    mod = sbp.compile(sbp.Model("shift_vectors", params=[v, r], loss=nn.sum_all(col) + nn.sum_all(row)))
    assert "? " in mod.source and "_shift(" not in mod.source  # guarded parts, no copies

    def numpy_loss(a, b):
        return (np.sin(_moved_np(a, 2, 0, 0.5) * _moved_np(a, -1, 0, -2) * a).sum()
                + np.cos(_moved_np(b, -3, 1, 0.25) * b).sum())

    rng = np.random.default_rng(8)
    for length in (1, 2, 3, 4, 7):
        a, b = rng.uniform(-1, 1, (length, 1)), rng.uniform(-1, 1, (1, length))
        value, grads = mod.value_and_grad(v=a, r=b)
        assert value == pytest.approx(numpy_loss(a, b), rel=1e-13)
        for name, arr in (("v", a), ("r", b)):
            fd = np.zeros_like(arr)
            for index in np.ndindex(arr.shape):
                step = np.zeros_like(arr)
                step[index] = 1e-6
                up = numpy_loss(a + step, b) if name == "v" else numpy_loss(a, b + step)
                down = numpy_loss(a - step, b) if name == "v" else numpy_loss(a, b - step)
                fd[index] = (up - down) / 2e-6
            np.testing.assert_allclose(grads[name], fd, rtol=1e-7, atol=1e-9, err_msg=f"{name}, length {length}")
