"""sbp.stop_gradient: its value is its argument's, its derivative 0, in
reverse mode, forward mode (mod.jvp, sbp.jvp), a gradient taken inside the
model (sbp.grad) and the C (no derivative code for what it stops). Checked
against JAX's lax.stop_gradient in float64 (1e-10 relative), a closed form
and central differences."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop import nn
from symbackprop.pipeline import generate

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py

# --- a coupled saddle, GradBench's written the natural way ------------------
# f(q, p) = |q|^2 - |p|^2 + c q.p; the inner argmax over p by K steps of
# gradient ascent from the start s; R(q) = f(q, p*) with p* held fixed (the
# envelope theorem): dR/dq = 2q + c p*. One outer step q1 = s - eta dR/dq(s).

K, ETA_IN, ETA_OUT = 6, 0.3, 0.1
start = sp.MatrixSymbol("start", 1, 2)
c = sp.Symbol("c", real=True)


def f(q, p):
    return sbp.as_scalar(nn.sum_all(q.applyfunc(lambda v: v**2))) - sbp.as_scalar(
        nn.sum_all(p.applyfunc(lambda v: v**2))) + c * sbp.as_scalar(q * p.T)


def inner(q):
    p = start
    for _ in range(K):
        p = p + ETA_IN * sbp.grad(lambda v: f(q, v), p)  # d f / d p at p: p's own uses only
    return p


def saddle_model() -> sbp.Model:
    g = sbp.grad(f(start, sbp.stop_gradient(inner(start))), start)  # start is q and the inner loop's start
    q1 = start - ETA_OUT * g
    loss = f(q1, sbp.stop_gradient(inner(q1))) + sbp.as_scalar(nn.sum_all(g.applyfunc(lambda v: v**2)))
    return sbp.Model("saddle_stop", inputs=[start], params=[c], loss=loss, outputs={"g": g, "p": inner(start)})


def jax_f(q, p, c_):
    return jnp.sum(q**2) - jnp.sum(p**2) + c_ * jnp.dot(q, p)


def jax_inner(q, s, c_):
    p = s
    for _ in range(K):
        p = p + ETA_IN * jax.grad(lambda v: jax_f(q, v, c_))(p)
    return p


def jax_saddle(s, c_):
    sg = jax.lax.stop_gradient
    g = jax.grad(lambda q: jax_f(q, sg(jax_inner(q, q, c_)), c_))(s)
    q1 = s - ETA_OUT * g
    return jax_f(q1, sg(jax_inner(q1, s, c_)), c_) + jnp.sum(g**2), g


def test_a_saddle_with_the_inner_argmax_stopped_matches_jax():
    mod = sbp.compile(saddle_model())
    s, c_ = np.array([[0.7, -1.3]]), 0.8
    loss, grads = mod.value_and_grad(start=s, c=c_)
    (want_loss, want_g), want_dc = jax.value_and_grad(jax_saddle, argnums=1, has_aux=True)(jnp.asarray(s[0]), c_)
    assert loss == pytest.approx(float(want_loss), rel=1e-10)
    assert grads["c"] == pytest.approx(float(want_dc), rel=1e-10)
    out = mod.forward(start=s, c=c_)
    assert relative_error(out["g"][0], np.asarray(want_g)) < 1e-10
    assert relative_error(out["g"], 2 * s + c_ * out["p"]) < 1e-12  # the envelope theorem's closed form
    # the derivative of the loss's value differs: stop_gradient changed the gradient, not the value
    fd = central_differences(lambda d: mod.forward(**d)["loss"], {"start": s, "c": c_}, "c")
    assert abs(grads["c"] - float(fd)) > 1.0


def test_without_stop_gradient_the_inner_loop_is_differentiated_too():
    """The control: the same gradient without stop_gradient is the total
    derivative through p*(q), which differs (so the test above can fail)."""
    total = sbp.grad(f(start, inner(start)), start)
    mod = sbp.compile(sbp.Model("saddle_total", inputs=[start], params=[c], outputs={"g": total}),
                      functions=("forward",))
    s, c_ = np.array([[0.7, -1.3]]), 0.8
    want = jax.grad(lambda q: jax_f(q, jax_inner(q, q, c_), c_))(jnp.asarray(s[0]))
    got = mod.forward(start=s, c=c_)["g"][0]
    assert relative_error(got, np.asarray(want)) < 1e-10
    assert relative_error(got, np.asarray(jax_saddle(jnp.asarray(s[0]), c_)[1])) > 1e-4


# --- forward mode, and the C -------------------------------------------------

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
W, V = sp.MatrixSymbol("W", 3, 2), sp.MatrixSymbol("V", 3, 2)


def stopped_loss(stop=sbp.stop_gradient):
    return nn.sum_all(sp.HadamardProduct(nn.tanh(X * W), stop((X * V).applyfunc(sp.exp))))


def jax_stopped(v, stop=jax.lax.stop_gradient):
    return jnp.sum(jnp.tanh(v["X"] @ v["W"]) * stop(jnp.exp(v["X"] @ v["V"])))


ARRAYS = {"X": np.random.default_rng(0).standard_normal((5, 3)),
          "W": np.random.default_rng(1).standard_normal((3, 2)),
          "V": 0.5 * np.random.default_rng(2).standard_normal((3, 2))}


def test_reverse_and_forward_mode_and_the_hvp_see_no_dependence_through_it():
    mod = sbp.compile(sbp.Model("stopped", inputs=[X], params=[W, V], loss=stopped_loss()))
    values = {k: jnp.asarray(a) for k, a in ARRAYS.items()}
    loss, grads = mod.value_and_grad(**ARRAYS)
    want_loss, want = jax.value_and_grad(lambda p: jax_stopped({**values, **p}))({"W": values["W"], "V": values["V"]})
    assert loss == pytest.approx(float(want_loss), rel=1e-10)
    assert relative_error(grads["W"], np.asarray(want["W"])) < 1e-10
    assert not np.any(grads["V"])  # exactly 0
    direction = {"W": np.ones((3, 2)), "V": np.full((3, 2), 2.0)}
    _, tangent = jax.jvp(lambda p: jax_stopped({**values, **p}), ({"W": values["W"], "V": values["V"]},),
                         ({k: jnp.asarray(a) for k, a in direction.items()},))
    assert mod.jvp(direction, **ARRAYS)["loss"] == pytest.approx(float(tangent), rel=1e-10)
    only_v = mod.jvp({"V": direction["V"]}, **ARRAYS)["loss"]
    assert only_v == 0.0
    hv = mod.hvp({"V": direction["V"]}, **ARRAYS)
    assert not np.any(hv["V"]) and not np.any(hv["W"])


def test_sbp_jvp_inside_the_model_sees_none_either():
    """A directional derivative by V inside the loss: 0 through the stopped
    branch (as jax.jvp of lax.stop_gradient), so only W's term is left."""
    D = sp.MatrixSymbol("D", 3, 2)
    along_w = sbp.jvp(stopped_loss(), W, D)
    along_v = sbp.jvp(stopped_loss(), V, D)
    mod = sbp.compile(sbp.Model("stopped_jvp", inputs=[X, D], params=[W, V],
                                loss=sbp.as_scalar(along_w) ** 2 + sbp.as_scalar(along_v)))
    arrays = {**ARRAYS, "D": np.arange(6.0).reshape(3, 2) / 6}
    values = {k: jnp.asarray(a) for k, a in arrays.items()}

    def jax_loss(w):
        _, t = jax.jvp(lambda w_: jax_stopped({**values, "W": w_}), (w,), (values["D"],))
        return t**2

    loss, grads = mod.value_and_grad(**arrays)
    want_loss, want_w = jax.value_and_grad(jax_loss)(values["W"])
    assert loss == pytest.approx(float(want_loss), rel=1e-10)
    assert relative_error(grads["W"], np.asarray(want_w)) < 1e-10
    assert not np.any(grads["V"])


def test_the_c_has_no_derivative_code_for_the_stopped_branch():
    """With V's branch stopped, value_and_grad's C is the C of the model
    where V is an input (no gradient asked): the same products, functions
    and loops, but the loop nest that writes V's gradient as zeros."""

    def gradient_c(model):
        emitted, _ = generate(model)
        return emitted.source

    stopped = gradient_c(sbp.Model("sg_c", inputs=[X], params=[W, V], loss=stopped_loss()))
    as_input = gradient_c(sbp.Model("sg_c", inputs=[X, V], params=[W], loss=stopped_loss(lambda m: m)))
    for token in ("exp(", "tanh(", "_matmul(", "_loop("):
        assert stopped.count(token) == as_input.count(token) > 0, token
    assert "/* grad_V = 0 */" in stopped
    assert stopped.count("for (") == as_input.count("for (") + 2


def test_values_and_folding():
    a = sp.Symbol("a", real=True)
    assert sbp.stop_gradient(2) == 2 and sbp.stop_gradient(sbp.stop_gradient(a)) == sbp.stop_gradient(a)
    assert sp.diff(sbp.stop_gradient(a) * a, a) == sbp.stop_gradient(a)
    assert sbp.stop_gradient(sp.Matrix([[a, 1]])).shape == (1, 2)
    with pytest.raises(sbp.ModelError, match="stop_gradient takes"):
        sbp.stop_gradient("a")
