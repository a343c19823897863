"""The implicit adjoint solved directly ((I - J^T) lambda = g by LU, for
states of at most DIRECT_ENTRIES entries): against JAX's custom_root, the
adjoint loop, closed forms and central differences (float64, 1e-10); an
entry frozen at x* (its step the identity: a stop branch) held fixed, as
GradBench's saddle needs."""

import re

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate

H = 3
W, a = sp.MatrixSymbol("W", H, H), sp.MatrixSymbol("a", H, 1)
z, c = sp.MatrixSymbol("z", H, 1), sp.MatrixSymbol("c", 1, 1)


def frozen_model(name: str):
    """z <- tanh(W z + c a), c <- c (frozen at its init 2): loss sum(z*) + 3 c."""
    step = ((W * z + a * c[0, 0]).applyfunc(sp.tanh), sp.Matrix([[c[0, 0]]]))
    z_star, c_star = sbp.fixed_point(step, (z, c), (sp.ZeroMatrix(H, 1), sp.Matrix([[2]])), tol=1e-15, max_iter=300)
    return sbp.Model(name, inputs=[], params=[W, a], loss=nn.sum_all(z_star) + 3 * c_star)


def data():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((H, H))
    return {"W": 0.6 * w / np.linalg.norm(w, 2), "a": rng.standard_normal((H, 1)) / 2}


def jax_custom_root_grad(d):
    """JAX's custom_root over z (c held at 2: the frozen entry is a constant)."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy

    def z_star(w, av):
        def f(zz):
            return jnp.tanh(w @ zz + 2 * av[:, 0]) - zz

        def solve(f, z0):
            return jax.lax.fori_loop(0, 300, lambda _, zz: zz + f(zz), z0)

        def tangent_solve(g, y):
            return jnp.linalg.solve(jax.jacobian(g)(y), y)

        return jax.lax.custom_root(f, jnp.zeros(H), solve, tangent_solve)

    grads = jax.grad(lambda w, av: jnp.sum(z_star(w, av)) + 6.0, argnums=(0, 1))(d["W"], d["a"])
    return {"W": np.asarray(grads[0]), "a": np.asarray(grads[1])}


@pytest.fixture(scope="module")
def frozen_mod():
    return sbp.compile(frozen_model("frozen_direct"))


def test_a_frozen_entry_is_held_fixed_and_the_rest_matches_custom_root(frozen_mod):
    d = data()
    _, grads = frozen_mod.value_and_grad(**d)
    want = jax_custom_root_grad(d)
    for name in ("W", "a"):
        assert relative_error(grads[name], want[name]) < 1e-10, name
        fd = central_differences(lambda v: frozen_mod.value_and_grad(**v)[0], d, name)
        assert relative_error(grads[name], fd) < 1e-8, name


def test_the_direct_adjoint_has_no_loop_and_agrees_with_the_adjoint_loop(frozen_mod, monkeypatch):
    def loops():
        return len(re.findall(r"while \(", generate(frozen_model("frozen_c"), "float64")[0].source))

    direct_loops = loops()
    monkeypatch.setattr("symbackprop.loops.implicit.DIRECT_ENTRIES", 0)
    assert loops() == direct_loops + 1  # the adjoint's loop, gone with the direct solve
    looped = sbp.compile(frozen_model("frozen_looped"))
    d = data()
    _, by_loop = looped.value_and_grad(**d)
    _, direct = frozen_mod.value_and_grad(**d)
    for name in ("W", "a"):  # the loop's lambda_c grows each step, but reaches no param
        assert relative_error(direct[name], by_loop[name]) < 1e-12, name


def test_saddles_nested_gradient_through_a_stopped_argmax():
    """GradBench saddle: R(q) = f(q, argmax_p f(q, p)), the argmax a fixed
    point whose last step is the stop branch (every entry frozen): dR/dq =
    2q (closed form), JAX's jacfwd through the while loop, central
    differences."""
    from benchmarks.gradbench import saddle

    mod = sbp.compile(saddle.build_models(saddle.DEFAULT)["grad"], functions=("value_and_grad",))
    s = np.array([[1.0, 1.0]])
    for q in (s, np.array([[0.3, -2.0]])):
        _, grads = mod.value_and_grad(start=s, q=q)
        np.testing.assert_allclose(grads["q"], 2 * q, rtol=1e-12)
        fd = central_differences(lambda v: mod.value_and_grad(start=s, **v)[0], {"q": q}, "q")
        assert relative_error(grads["q"], fd) < 1e-8
    pytest.importorskip("jax")
    _, r_grad = saddle._jax_parts()
    assert relative_error(grads["q"][0], np.asarray(r_grad(q[0], s[0]))) < 1e-10


def test_a_loop_that_does_not_read_the_step_state_runs_once_outside():
    """y <- (y + sqrt(a)) / 2 with sqrt(a) by Newton: the inner loop reads
    only a, so it is lowered before the outer loop (not nested in its C);
    y* = sqrt(a), dy*/da = 1 / (2 sqrt(a))."""
    n = 3
    av, r, y = sp.MatrixSymbol("av", 1, n), sp.MatrixSymbol("r", 1, n), sp.MatrixSymbol("y", 1, n)
    root = sbp.fixed_point(sp.Matrix(1, n, lambda i, j: (r[i, j] + av[i, j] / r[i, j]) / 2), r, av, tol=1e-15,
                           max_iter=80)
    y_star = sbp.fixed_point((y + root) / 2, y, sp.ZeroMatrix(1, n), tol=1e-15, max_iter=200)
    model = sbp.Model("hoisted_inner", inputs=[], params=[av], loss=nn.sum_all(y_star), outputs={"y": y_star})
    source = generate(model, "float64")[0].source
    indents = {len(line) - len(line.lstrip()) for line in source.splitlines() if line.lstrip().startswith("while (")}
    assert len(indents) == 1, indents  # every loop at the function's top level
    values = np.array([[2.0, 9.0, 0.5]])
    mod = sbp.compile(model)
    np.testing.assert_allclose(mod.forward(av=values)["y"], np.sqrt(values), rtol=1e-14)
    np.testing.assert_allclose(mod.value_and_grad(av=values)[1]["av"], 0.5 / np.sqrt(values), rtol=1e-12)
