"""symbackprop.fixed_point: a loop that stops on a condition, differentiated
by the implicit function theorem or through the steps that ran. Against
closed forms (Newton's sqrt), numpy's linear solve of the implicit
function theorem, JAX in float64 (a while loop, and the same steps
unrolled), central differences; the C's bounds (max_iter, NaN); training;
declaration errors."""

import re
import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, write_runtime_header
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate
from symbackprop.run.optim import SGD

# --- Newton's method for sqrt: x <- (x + a/x) / 2 ------------------------------

N = 4
a, x = sp.MatrixSymbol("a", 1, N), sp.MatrixSymbol("x", 1, N)
NEWTON = sp.Matrix(1, N, lambda i, j: (x[i, j] + a[i, j] / x[i, j]) / 2)


def sqrt_model(mode: str, tol: float = 1e-14, max_iter: int = 60):
    root = sbp.fixed_point(NEWTON, x, a, tol=tol, max_iter=max_iter, diff=mode)
    return sbp.Model(f"newton_sqrt_{mode}", inputs=[], params=[a], loss=nn.sum_all(root),
                     outputs={"root": root, "steps": sbp.iterations(root)})


@pytest.mark.parametrize("mode", ["implicit", "unrolled"])
def test_newton_sqrt_and_its_derivative_match_the_closed_form(mode):
    mod = sbp.compile(sqrt_model(mode))
    values = np.array([[2.0, 9.0, 0.5, 1e4]])
    out = mod.forward(a=values)
    np.testing.assert_allclose(out["root"], np.sqrt(values), rtol=1e-15)
    assert 3 <= out["steps"][0, 0] < 60  # stopped on the tolerance, not the bound
    loss, grads = mod.value_and_grad(a=values)
    assert loss == pytest.approx(np.sqrt(values).sum(), rel=1e-14)
    np.testing.assert_allclose(grads["a"], 0.5 / np.sqrt(values), rtol=1e-12)  # d sqrt(a) / da


@pytest.mark.parametrize("mode", ["implicit", "unrolled"])
def test_a_scalar_state_solves_x_equals_c_cos_x(mode):
    """x* = c cos x*: dx*/dc = cos x* / (1 + c sin x*) (implicit
    differentiation by hand); x* by scipy's root bracketing."""
    brentq = pytest.importorskip("scipy.optimize").brentq
    s, c = sp.Symbol("s"), sp.Symbol("c")
    root = sbp.fixed_point(c * sp.cos(s), s, 0, tol=1e-15, max_iter=500, diff=mode)
    mod = sbp.compile(sbp.Model(f"cos_fixed_point_{mode}", inputs=[], params=[c], loss=root))
    loss, grads = mod.value_and_grad(c=0.7)
    want = brentq(lambda v: v - 0.7 * np.cos(v), 0, 1, xtol=1e-16)
    assert loss == pytest.approx(want, rel=1e-14)
    assert grads["c"] == pytest.approx(np.cos(want) / (1 + 0.7 * np.sin(want)), rel=1e-12)


def test_the_count_is_bounded_by_max_iter_and_a_nan_stops_the_loop():
    mod = sbp.compile(sqrt_model("unrolled", max_iter=25))
    # sqrt(-2) by Newton never converges (a chaotic orbit from -2): the loop runs max_iter steps, no more
    out = mod.forward(a=np.array([[-2.0, 4.0, 4.0, 4.0]]))
    assert out["steps"][0, 0] == 25 and np.isfinite(out["root"]).all()
    # 0/0 is NaN on the first step: the change is NaN, and the loop stops there
    stopped = mod.forward(a=np.array([[0.0, 4.0, 4.0, 4.0]]))
    assert stopped["steps"][0, 0] == 1 and np.isnan(stopped["root"][0, 0])
    assert np.isfinite(stopped["root"][0, 1:]).all()


@pytest.mark.parametrize("direct", [True, False])
def test_the_c_bounds_the_loop_and_tests_for_nan(direct, monkeypatch):
    if not direct:  # the adjoint by its loop, as for a state of over DIRECT_ENTRIES entries
        monkeypatch.setattr("symbackprop.loops.implicit.DIRECT_ENTRIES", 0)
    source = generate(sqrt_model("implicit", max_iter=37), "float64")[0].source
    conditions = re.findall(r"while \((.*?)\) \{", source)
    # forward's loop, and value_and_grad's forward and adjoint loops (none: a 1 x 4 state's adjoint
    # is solved directly): each bounded by max_iter
    assert len(conditions) == (2 if direct else 3) and all(re.fullmatch(r"\w+ < 37", c) for c in conditions), conditions
    assert "!= " in source and "break; /* converged, or NaN */" in source


# --- a deep-equilibrium layer: z = tanh(W z + U u + b) -------------------------

H, D = 5, 3
W, U, bias = sp.MatrixSymbol("W", H, H), sp.MatrixSymbol("U", H, D), sp.MatrixSymbol("bias", H, 1)
u, v = sp.MatrixSymbol("u", D, 1), sp.MatrixSymbol("v", H, 1)
z = sp.MatrixSymbol("z", H, 1)


def deq_model(mode: str, tol: float = 1e-14, max_iter: int = 200, name: str = "deq"):
    z_star = sbp.fixed_point((W * z + U * u + bias).applyfunc(sp.tanh), z, sp.ZeroMatrix(H, 1), tol=tol,
                             max_iter=max_iter, diff=mode)
    loss = v.T * z_star + nn.sum_all(z_star.applyfunc(lambda e: e**2)) / 2
    return sbp.Model(f"{name}_{mode}", inputs=[u], params=[W, U, bias, v], loss=loss,
                     outputs={"z": z_star, "steps": sbp.iterations(z_star)})


def deq_data(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((H, H))
    return {"W": 0.5 * w / np.linalg.norm(w, 2), "U": rng.standard_normal((H, D)) / 2,
            "bias": rng.standard_normal((H, 1)) / 4, "v": rng.standard_normal((H, 1)), "u": rng.standard_normal((D, 1))}


def deq_numpy_implicit(d: dict) -> tuple[float, dict]:
    """The fixed point by many iterations, and the implicit function theorem's
    gradient by numpy's linear solve: (I - J^T) lambda = dloss/dz."""
    zz = np.zeros((H, 1))
    for _ in range(400):
        zz = np.tanh(d["W"] @ zz + d["U"] @ d["u"] + d["bias"])
    loss = (d["v"].T @ zz).item() + (zz**2).sum() / 2
    s = 1 - zz**2  # tanh' at the fixed point
    lam = np.linalg.solve(np.eye(H) - (s * d["W"]).T, d["v"] + zz)
    delta = s * lam
    return loss, {"W": delta @ zz.T, "U": delta @ d["u"].T, "bias": delta, "v": zz, "u": d["U"].T @ delta}


@pytest.fixture(scope="module")
def deq_modules():
    return {mode: sbp.compile(deq_model(mode), functions=("forward", "value_and_grad", "jvp")) for mode in
            ("implicit", "unrolled")}


@pytest.mark.parametrize("mode", ["implicit", "unrolled"])
def test_deq_gradient_matches_the_implicit_function_theorem_solved_by_numpy(deq_modules, mode):
    d = deq_data()
    loss, grads = deq_modules[mode].value_and_grad(**d)
    want_loss, want = deq_numpy_implicit(d)
    assert loss == pytest.approx(want_loss, rel=1e-13)
    for name in ("W", "U", "bias", "v"):
        assert relative_error(grads[name], want[name]) < 1e-10, name


def test_deq_gradient_matches_central_differences(deq_modules):
    d = deq_data(1)
    mod = deq_modules["implicit"]
    _, grads = mod.value_and_grad(**d)

    def loss(values):
        return float(mod.forward(**values)["loss"])

    for name in ("W", "bias"):
        assert relative_error(grads[name], central_differences(loss, d, name)) < 1e-7, name


def test_deq_jvp_matches_central_differences(deq_modules):
    d = deq_data(2)
    rng = np.random.default_rng(3)
    tangents = {k: rng.standard_normal(d[k].shape) for k in ("W", "U", "bias", "v")}
    eps = 1e-6
    plus = {**d, **{k: d[k] + eps * t for k, t in tangents.items()}}
    minus = {**d, **{k: d[k] - eps * t for k, t in tangents.items()}}
    for mode, mod in deq_modules.items():
        out = mod.jvp(tangents, **d)
        fd = (mod.forward(**plus)["loss"] - mod.forward(**minus)["loss"]) / (2 * eps)
        assert float(out["loss"]) == pytest.approx(float(fd), rel=1e-7), mode


@pytest.fixture
def jax64():
    jax = pytest.importorskip("jax")
    saved = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield jax
    jax.config.update("jax_enable_x64", saved)


def _jax_loss(jax, steps: int | None, tol: float = 1e-14):
    """The DEQ's loss in JAX: `steps` iterations unrolled (fori_loop), or a
    while loop to `tol` differentiated by jax.lax.custom_root (implicit)."""
    jnp = jax.numpy

    def loss(p, inp):
        def f(zz):
            return jnp.tanh(p["W"] @ zz + p["U"] @ inp + p["bias"])

        if steps is not None:
            zz = jax.lax.fori_loop(0, steps, lambda _, zz: f(zz), jnp.zeros((H, 1)))
        else:
            def solve(g, z0):
                def cond(c):
                    return (c[1] < 200) & (jnp.max(jnp.abs(c[2])) > tol)

                def body(c):
                    new = c[0] - g(c[0])  # g(z) = z - f(z): new = f(z)
                    return new, c[1] + 1, new - c[0]

                return jax.lax.while_loop(cond, body, (z0, 0, jnp.ones_like(z0)))[0]

            def tangent_solve(g, y):
                return jnp.linalg.solve(jax.jacobian(g)(y)[:, 0, :, 0], y)

            zz = jax.lax.custom_root(lambda zz: zz - f(zz), jnp.zeros((H, 1)), solve, tangent_solve)
        return (p["v"].T @ zz)[0, 0] + (zz**2).sum() / 2

    return loss


def test_deq_implicit_matches_jax_custom_root_and_unrolled_matches_jax_fori_loop(deq_modules, jax64):
    jax = jax64
    d = deq_data(4)
    params = {k: d[k] for k in ("W", "U", "bias", "v")}
    want_loss, want = jax.value_and_grad(_jax_loss(jax, None))(params, d["u"])
    loss, grads = deq_modules["implicit"].value_and_grad(**d)
    assert loss == pytest.approx(float(want_loss), rel=1e-13)
    for name in params:
        assert relative_error(grads[name], np.asarray(want[name])) < 1e-10, name
    # unrolled: the derivative of exactly the steps the C ran
    steps = int(deq_modules["unrolled"].forward(**d)["steps"][0, 0])
    want_loss, want = jax.value_and_grad(_jax_loss(jax, steps))(params, d["u"])
    loss, grads = deq_modules["unrolled"].value_and_grad(**d)
    assert loss == pytest.approx(float(want_loss), rel=1e-13)
    for name in params:
        assert relative_error(grads[name], np.asarray(want[name])) < 1e-10, name


def test_deq_hvp_through_the_implicit_derivative_matches_jax(jax64):
    """The implicit VJP is itself a fixed-point loop and one step's VJP, so
    forward-over-reverse (hvp) runs through it; the unrolled one goes reverse
    over forward (the vjp of the loss's tangent), against JAX unrolled to
    the same number of steps."""
    jax = jax64
    d = deq_data(8)
    params = {k: d[k] for k in ("W", "U", "bias", "v")}
    rng = np.random.default_rng(9)
    directions = {k: rng.standard_normal(p.shape) for k, p in params.items()}
    mod = sbp.compile(deq_model("implicit", name="deq_hvp"), functions=("hvp",))
    got = mod.hvp(directions, **d)
    loss = _jax_loss(jax, None)
    _, want = jax.jvp(jax.grad(lambda p: loss(p, d["u"])), (params,), (directions,))
    for name in params:
        assert relative_error(got[name], np.asarray(want[name])) < 1e-10, name
    unrolled = sbp.compile(deq_model("unrolled", name="deq_hvp_unrolled"), functions=("forward", "hvp"))
    steps = int(unrolled.forward(**d)["steps"][0, 0])
    loss = _jax_loss(jax, steps)
    _, want = jax.jvp(jax.grad(lambda p: loss(p, d["u"])), (params,), (directions,))
    got = unrolled.hvp(directions, **d)
    for name in params:
        assert relative_error(got[name], np.asarray(want[name])) < 1e-10, name


def test_unrolled_is_exact_for_the_computed_function_when_the_loop_stops_early(jax64):
    """At a loose tol the loop stops far from the fixed point: the unrolled
    derivative is that of the steps run (JAX unrolled to the same count),
    and the implicit one is off by about the distance to the fixed point."""
    jax = jax64
    d = deq_data(5)
    params = {k: d[k] for k in ("W", "U", "bias", "v")}
    mod = sbp.compile(deq_model("unrolled", tol=1e-3, name="deq_loose"))
    steps = int(mod.forward(**d)["steps"][0, 0])
    assert 2 <= steps < 20
    _, grads = mod.value_and_grad(**d)
    _, want = jax.value_and_grad(_jax_loss(jax, steps))(params, d["u"])
    for name in params:
        assert relative_error(grads[name], np.asarray(want[name])) < 1e-12, name


def test_a_deq_loss_trains(deq_modules):
    d = deq_data(6)
    target = np.random.default_rng(7).uniform(-0.5, 0.5, (H, 1))
    z_star = sbp.fixed_point((W * z + U * u + bias).applyfunc(sp.tanh), z, sp.ZeroMatrix(H, 1), tol=1e-12,
                             max_iter=100)
    t = sp.MatrixSymbol("t", H, 1)
    model = sbp.Model("deq_train", inputs=[u, t], params=[W, U, bias], loss=nn.mse(z_star, t))
    lr = 0.5
    mod = sbp.compile(model, optimizer=SGD(lr=lr), functions=("forward", "value_and_grad", "train_step"))
    params = {k: d[k].copy() for k in ("W", "U", "bias")}
    first, grads = mod.value_and_grad(u=d["u"], t=target, **params)
    expected = {k: params[k] - lr * grads[k] for k in params}
    losses = [mod.train_step(u=d["u"], t=target, **params) for _ in range(20)]
    assert losses[0] == pytest.approx(first, rel=1e-14)
    assert losses[-1] < 0.5 * losses[0]
    # one step is params - lr * grad (checked from a fresh copy)
    fresh = {k: d[k].copy() for k in ("W", "U", "bias")}
    mod.train_step(u=d["u"], t=target, **fresh)
    for k in fresh:
        np.testing.assert_allclose(fresh[k], expected[k], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_c_compiles_without_warnings(tmp_path, dtype):
    emitted, _ = generate(deq_model("unrolled", name=f"deq_strict_{dtype}"), dtype,
                          functions=("forward", "value_and_grad", "jvp"))
    emitted_implicit, _ = generate(deq_model("implicit", name=f"deq_strict_i_{dtype}"), dtype,
                                   functions=("forward", "value_and_grad", "jvp", "hvp"))
    write_runtime_header(tmp_path)
    for e in (emitted, emitted_implicit):
        source = tmp_path / f"{e.prefix}.c"
        source.write_text(e.source)
        (tmp_path / f"{e.prefix}.h").write_text(e.header)
        result = subprocess.run(["cc", *STRICT_FLAGS, "-c", str(source), "-o", str(tmp_path / f"{e.prefix}.o")],
                                capture_output=True, text=True)
        assert result.returncode == 0 and result.stderr == "", result.stderr


# --- declaration errors -----------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"diff": "adjoint"}, "diff must be one of"),
    ({"max_iter": 0}, "max_iter must be a positive integer"),
    ({"max_iter": 2.5}, "max_iter must be a positive integer"),
    ({"tol": -1.0}, "tol must be a finite number >= 0"),
    ({"tol": float("nan")}, "tol must be a finite number >= 0"),
    ({"tol": "small"}, "tol must be a number"),
])
def test_bad_arguments_are_model_errors(kwargs, message):
    with pytest.raises(sbp.ModelError, match=message):
        sbp.fixed_point(NEWTON, x, a, **kwargs)


def test_bad_declarations_are_model_errors():
    with pytest.raises(sbp.ModelError, match="has shape"):
        sbp.fixed_point(NEWTON.T, x, a)
    with pytest.raises(sbp.ModelError, match="must be MatrixSymbols or Symbols"):
        sbp.fixed_point(NEWTON, a * 2, a)
    with pytest.raises(sbp.ModelError, match="iterations needs the result"):
        sbp.iterations(a)
    root = sbp.fixed_point(NEWTON, a, a)  # the state is a param too
    with pytest.raises(sbp.ModelError, match="cannot also be an input or param"):
        generate(sbp.Model("fp_bad", inputs=[], params=[a], loss=nn.sum_all(root)), "float64")
    q = sp.MatrixSymbol("q", 1, N)
    stray = sbp.fixed_point(NEWTON + q, x, a)
    with pytest.raises(sbp.ModelError, match="in the step of a fixed point"):
        generate(sbp.Model("fp_stray", inputs=[], params=[a], loss=nn.sum_all(stray)), "float64")


def test_a_gradient_penalty_through_an_unrolled_fixed_point_is_refused_by_name():
    """sbp.grad of an unrolled loop, differentiated again, would read kept
    states past the steps that ran: refused, naming the mode that works."""
    z_star = sbp.fixed_point((W * z + U * u + bias).applyfunc(sp.tanh), z, sp.ZeroMatrix(H, 1), tol=1e-14,
                             max_iter=50, diff="unrolled")
    penalty = nn.sum_all(sbp.grad(nn.sum_all(z_star), u).applyfunc(lambda e: e**2))
    model = sbp.Model("deq_penalty", inputs=[u], params=[W, U, bias, v], loss=penalty)
    with pytest.raises(sbp.ModelError, match='diff="implicit"'):
        generate(model, "float64", functions=("value_and_grad",))
