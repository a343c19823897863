"""A map reading a shift of a map of its own loop joins that loop and
recomputes the shifted map at i - k (schedule/fusion.py, schedule/shifted.py):
an RK4 step whose stages each read the last one moved runs as one loop a
step (forward and reverse), and a plain chain of shifts both ways is one
loop. Each compared with JAX (float64, jax.lax.scan where there is a scan)
to 1e-10, with central differences, and at lengths shorter than how far
the loop reads (where its guarded head and tail parts meet)."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.schedule.fusion import MAX_REACH

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

n, s = sp.symbols("n s", integer=True, positive=True)
x = sp.MatrixSymbol("x", n, 1)
u = sp.MatrixSymbol("u", n, 1)
w = sp.MatrixSymbol("w", n, 1)
steps = sp.MatrixSymbol("steps", s, 1)
y, h_row = sp.MatrixSymbol("y", n, 1), sp.MatrixSymbol("h", 1, 1)
h = sbp.as_scalar(h_row)
RTOL = 1e-10


pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py


def _rel(got, want):
    return np.linalg.norm(np.ravel(got) - np.ravel(want)) / max(np.linalg.norm(np.ravel(want)), 1e-300)


def _moved(v, k, fill):
    """jnp: v moved k entries (k < 0: towards the start), `fill` where none moves in."""
    pad = jnp.full(min(abs(k), v.shape[0]), fill, dtype=v.dtype)
    if k > 0:
        return jnp.concatenate([pad, v[:-k]])[: v.shape[0]]
    return jnp.concatenate([v[-k:], pad])[-v.shape[0]:]


def rk4(f, y0, size):
    k1 = f(y0)
    k2 = f(y0 + size / 2 * k1)
    k3 = f(y0 + size / 2 * k2)
    k4 = f(y0 + size * k3)
    return y0 + size / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _f(v):
    """Arithmetic only, moved both ways with fills other than 0."""
    return sp.HadamardProduct(x, sbp.shift(v, 1, fill=1)) + sp.HadamardProduct(u, sbp.shift(v, -1, fill=0.5)) / 3


def _f_jax(xv, uv):
    return lambda v: xv * _moved(v, 1, 1.0) + uv * _moved(v, -1, 0.5) / 3


@pytest.fixture(scope="module")
def rk4_module():
    y_final = sbp.scan(rk4(_f, y, h), None, y, h_row, sp.ZeroMatrix(n, 1), steps)
    loss = nn.sum_all(sp.HadamardProduct(w, y_final))
    model = sbp.Model("rk4_fused", inputs=[steps, w, u], params=[x], loss=loss, outputs={"y": y_final})
    return sbp.compile(model)


def _rk4_case(size, count=5, seed=0):
    rng = np.random.default_rng(seed)
    xv, uv, wv = rng.uniform(0.2, 1.5, size), rng.uniform(-1, 1, size), rng.standard_normal(size)
    sizes = rng.uniform(0.1, 0.4, count)

    def solve(z):
        f = _f_jax(z, jnp.asarray(uv))
        return jax.lax.scan(lambda v, hv: (rk4(f, v, hv), None), jnp.zeros_like(z), jnp.asarray(sizes))[0]

    arrays = {"x": xv.reshape(-1, 1), "u": uv.reshape(-1, 1), "w": wv.reshape(-1, 1), "steps": sizes.reshape(-1, 1)}
    return arrays, solve, xv, wv


@pytest.mark.parametrize("size", [1, 2, 3, 5, 9, 40])
def test_rk4_step_fused_against_jax_scan(rk4_module, size):
    """Every length: shorter than the reach (head and tail parts meet), and longer."""
    arrays, solve, xv, wv = _rk4_case(size, seed=size)
    want_y = np.asarray(jax.jit(solve)(jnp.asarray(xv)))
    want_grad = np.asarray(jax.jit(jax.grad(lambda z: jnp.dot(jnp.asarray(wv), solve(z))))(jnp.asarray(xv)))
    assert _rel(rk4_module.forward(**arrays)["y"], want_y) < RTOL
    loss, grads = rk4_module.value_and_grad(**arrays)
    assert loss == pytest.approx(float(wv @ want_y), rel=RTOL)
    assert _rel(grads["x"], want_grad) < RTOL


def test_rk4_step_fused_central_differences(rk4_module):
    arrays, _, xv, _ = _rk4_case(12, seed=3)
    _, grads = rk4_module.value_and_grad(**arrays)
    direction = np.random.default_rng(7).standard_normal(xv.shape)
    eps = 1e-6
    plus = rk4_module.forward(**{**arrays, "x": (xv + eps * direction).reshape(-1, 1)})["loss"]
    minus = rk4_module.forward(**{**arrays, "x": (xv - eps * direction).reshape(-1, 1)})["loss"]
    assert float(np.ravel(grads["x"]) @ direction) == pytest.approx((plus - minus) / (2 * eps), rel=1e-8)


def _step_loops(source: str, function: str, steps: str = "_t < s; ++") -> int:
    """The loops over the n entries inside the loop over the steps of `function`
    (`steps`: how that loop starts; its own state copies, t1_i, not counted)."""
    # the function's definition, or, in a module compiled as units (emit/cunits.py),
    # the first of its parts whose body holds the loop over the steps
    bodies = [source[m.end():source.index("\n}\n", m.end())]
              for m in re.finditer(rf"\brk4_fused_{function}(_part\d+)?\(\n", source)]
    body = next(b for b in bodies if steps in b)
    body = body[body.index(steps):]
    body = body[:body.index("_swap = ")]
    return len(re.findall(r"for \(int64_t i = ", body))


def test_rk4_step_is_one_loop(rk4_module):
    """The four stages (each reading the last moved) are recomputed at i - k in
    the step's one loop, in three parts (a guarded head and tail, the middle
    read straight): no loop a stage, no stage stored."""
    assert _step_loops(rk4_module.source, "forward") == 3
    assert _step_loops(rk4_module.source, "value_and_grad") == 3  # the forward scan keeping its states
    assert _step_loops(rk4_module.source, "value_and_grad", "_t >= 0; --") == 3  # the reverse sweep
    # y_next reads y 4 entries back and 4 ahead (k4 reads k3 moved, ... k1 reads y moved)
    assert "[i - 4]" in rk4_module.source and "[i + 4]" in rk4_module.source


# --- a plain chain, no scan --------------------------------------------------


def _chain(v, moves):
    """v, then for each (k, fill): v <- shift(x*v + 1, k, fill) * u + v.

    SymPy's `+` calls doit() on both sides all the way down, and v appears
    twice a step, so the walk doubles each step (beyond_reach: 3 CPU s);
    doit(deep=False) of parts already canonical builds the same expression
    (equal srepr; test_the_chain_is_what_plus_builds) in linear time."""
    for k, fill in moves:
        inner = sp.MatAdd(sp.HadamardProduct(x, v).doit(deep=False), sp.OneMatrix(n, 1)).doit(deep=False)
        v = sp.MatAdd(sp.HadamardProduct(sbp.shift(inner, k, fill=fill), u).doit(deep=False), v).doit(deep=False)
    return v


def _chain_jax(z, uv, moves):
    v = z
    for k, fill in moves:
        v = _moved(z * v + 1, k, fill) * uv + v
    return v


def _chain_by_plus(v, moves):
    for k, fill in moves:
        v = sp.HadamardProduct(sbp.shift(sp.HadamardProduct(x, v) + sp.OneMatrix(n, 1), k, fill=fill), u) + v
    return v


def test_the_chain_is_what_plus_builds():
    moves = [(1, 0.5), (-2, 2.0), (1, 0.0), (-1, 1.0), (2, 0.25)]
    assert sp.srepr(_chain(x, moves)) == sp.srepr(_chain_by_plus(x, moves))


CHAINS = {
    "both_ways": [(1, 0.5), (-2, 2.0), (1, 0.0), (-1, 1.0)],
    # farther than MAX_REACH in all: a stored value breaks the chain (the loop reads no farther)
    "beyond_reach": [(1, 0.25)] * (MAX_REACH + 3),
}


@pytest.mark.parametrize("case", sorted(CHAINS))
def test_shift_chain_against_jax_and_central_differences(case):
    moves = CHAINS[case]
    loss = nn.sum_all(sp.HadamardProduct(w, _chain(x, moves)))
    mod = sbp.compile(sbp.Model(f"shift_chain_{case}", inputs=[w, u], params=[x], loss=loss))
    for size in (2, 7, 30):
        rng = np.random.default_rng(size)
        xv, uv, wv = rng.uniform(-0.9, 0.9, size), rng.uniform(-0.9, 0.9, size), rng.standard_normal(size)

        def total(z, wv=wv, uv=uv):
            return jnp.dot(jnp.asarray(wv), _chain_jax(z, jnp.asarray(uv), moves))

        arrays = {"x": xv.reshape(-1, 1), "u": uv.reshape(-1, 1), "w": wv.reshape(-1, 1)}
        loss_value, grads = mod.value_and_grad(**arrays)
        want_loss, want_grad = jax.jit(jax.value_and_grad(total))(jnp.asarray(xv))
        assert loss_value == pytest.approx(float(want_loss), rel=RTOL)
        assert _rel(grads["x"], np.asarray(want_grad)) < RTOL
        direction = rng.standard_normal(size)
        eps = 1e-6
        plus = mod.forward(**{**arrays, "x": (xv + eps * direction).reshape(-1, 1)})["loss"]
        minus = mod.forward(**{**arrays, "x": (xv - eps * direction).reshape(-1, 1)})["loss"]
        assert float(np.ravel(grads["x"]) @ direction) == pytest.approx((plus - minus) / (2 * eps), rel=1e-7)
    reads = [int(k) for k in re.findall(r"\[i [-+] (\d+)\]", mod.source)]
    assert reads and max(reads) <= MAX_REACH


@pytest.mark.parametrize("case", ["function_call", "long_arithmetic"])
def test_costly_values_are_stored_not_recomputed(case):
    """A shifted value that calls a function, or of more than MAX_RECOMPUTED
    operations, is stored by a loop of its own and read moved (x is never
    read at i - 1); the result still matches JAX."""
    if case == "function_call":
        inner = sp.HadamardProduct(x, u).applyfunc(sp.sin)
        inner_jax = lambda z, uv: jnp.sin(z * uv)  # noqa: E731
    else:  # sum_k u x^k / k: arithmetic, but long
        # one MatAdd (the same expression as adding the terms one by one, which doit()s the sum each time)
        inner = sp.MatAdd(*(sp.HadamardProduct(u, sp.HadamardPower(x, k)) / k for k in range(2, 60))).doit()
        inner_jax = lambda z, uv: sum(uv * z**k / k for k in range(2, 60))  # noqa: E731
    loss = nn.sum_all(sp.HadamardProduct(w, sbp.shift(inner, 1, fill=2) + x))
    mod = sbp.compile(sbp.Model(f"shift_costly_{case}", inputs=[w, u], params=[x], loss=loss))
    assert "[i - 1]" in mod.source and not re.search(r"(?<!\w)x\[i - 1\]", mod.source)
    rng = np.random.default_rng(4)
    xv, uv, wv = rng.uniform(-0.9, 0.9, 11), rng.uniform(-0.9, 0.9, 11), rng.standard_normal(11)

    def total(z):
        return jnp.dot(jnp.asarray(wv), _moved(inner_jax(z, jnp.asarray(uv)), 1, 2.0) + z)

    loss_value, grads = mod.value_and_grad(x=xv.reshape(-1, 1), u=uv.reshape(-1, 1), w=wv.reshape(-1, 1))
    want_loss, want_grad = jax.jit(jax.value_and_grad(total))(jnp.asarray(xv))
    assert loss_value == pytest.approx(float(want_loss), rel=RTOL)
    assert _rel(grads["x"], np.asarray(want_grad)) < RTOL
