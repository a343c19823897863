"""Second order through a scan: the module's hvp and hessian (reverse over
forward: the vjp of the scan's tangent scan), against JAX's
jax.jvp(jax.grad(f)) over jax.lax.scan in float64 (1e-10 relative) and
central differences of the compiled gradient."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop import nn
from symbackprop.diff.hessian import route
from symbackprop.pipeline import plan

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

T = sp.Symbol("T", integer=True, positive=True)


pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py


# --- a tanh RNN: output and final state in the loss ---------------------------

H, D = 3, 2
W, Ux, b = sp.MatrixSymbol("W", H, H), sp.MatrixSymbol("Ux", D, H), sp.MatrixSymbol("b", 1, H)
Vo, h0 = sp.MatrixSymbol("Vo", H, 1), sp.MatrixSymbol("h0", 1, H)
RNN_PARAMS = ("W", "Ux", "b", "Vo", "h0")


def rnn_model(every=None, name="rnn2"):
    X, Z = sp.MatrixSymbol("X", T, D), sp.MatrixSymbol("Z", T, 1)
    h, x = sp.MatrixSymbol("h", 1, H), sp.MatrixSymbol("x", 1, D)
    new = (h * W + x * Ux + b).applyfunc(sp.tanh)
    Y = sbp.scan(new, new * Vo, h, x, h0, X, checkpoint_every=every)
    E = Y - Z
    loss = sp.OneMatrix(1, T) * sp.HadamardProduct(E, E) + sbp.final_state(Y) * sp.OneMatrix(H, 1)
    return sbp.Model(name, inputs=[X, Z], params=[W, Ux, b, Vo, h0], loss=loss)


def rnn_jax(p):
    def step(state, row):
        new = jnp.tanh(state @ p["W"] + row[None, :] @ p["Ux"] + p["b"])
        return new, (new @ p["Vo"])[0, 0]

    final, ys = jax.lax.scan(step, p["h0"], p["X"])
    return jnp.sum((ys - p["Z"][:, 0]) ** 2) + jnp.sum(final)


def rnn_data(rng, steps):
    return {"X": rng.standard_normal((steps, D)), "Z": rng.standard_normal((steps, 1)),
            "W": 0.6 * rng.standard_normal((H, H)), "Ux": rng.standard_normal((D, H)),
            "b": rng.standard_normal((1, H)), "Vo": rng.standard_normal((H, 1)), "h0": rng.standard_normal((1, H))}


def jax_hvp(loss, arrays, directions, params):
    fixed = {k: jnp.asarray(v) for k, v in arrays.items() if k not in params}
    primal = {k: jnp.asarray(arrays[k]) for k in params}
    tangent = {k: jnp.asarray(directions[k]) for k in params}
    _, out = jax.jit(lambda p, t: jax.jvp(jax.grad(lambda w: loss({**fixed, **w})), (p,), (t,)))(primal, tangent)
    return {k: np.asarray(v) for k, v in out.items()}


def check_hvp(mod, loss, arrays, params, rng, eps=1e-5):
    directions = {k: rng.standard_normal(np.shape(arrays[k])) for k in params}
    got_loss, grads, got = mod.value_grad_and_hvp(directions, **arrays)
    want = jax_hvp(loss, arrays, directions, params)
    assert got_loss == pytest.approx(float(loss({k: jnp.asarray(v) for k, v in arrays.items()})), rel=1e-12)
    moved = [{**arrays, **{k: arrays[k] + s * eps * directions[k] for k in params}} for s in (1, -1)]
    plus, minus = (mod.value_grad_and_hvp(directions, **m)[1] for m in moved)
    for name in params:
        assert relative_error(np.reshape(got[name], want[name].shape), want[name]) < 1e-10, name
        fd = (np.asarray(plus[name]) - np.asarray(minus[name])) / (2 * eps)
        assert relative_error(got[name], fd) < 1e-7, name
    return grads


@functools.cache
def rnn_hvp_module(every=None):
    """One compile per checkpointing choice, shared by the tests below."""
    return sbp.compile(rnn_model(every, f"rnn2_{every}"), functions=("hvp",))


@pytest.mark.parametrize("every", [None, 3])
def test_the_hvp_of_a_tanh_rnn_matches_jax_and_differences_of_the_gradient(every):
    mod = rnn_hvp_module(every)
    check_hvp(mod, rnn_jax, rnn_data(np.random.default_rng(1), 7), RNN_PARAMS, np.random.default_rng(2))


def test_the_hessian_of_a_tanh_rnn_matches_jax_hessian():
    mod = rnn_hvp_module()
    arrays = rnn_data(np.random.default_rng(3), 5)
    got = mod.hessian_matrix(**arrays)
    fixed = {k: jnp.asarray(v) for k, v in arrays.items() if k not in RNN_PARAMS}
    sizes = [arrays[k].size for k in RNN_PARAMS]
    ends = np.cumsum(sizes)

    def flat_loss(theta):
        parts = {k: theta[e - s:e].reshape(arrays[k].shape) for k, s, e in zip(RNN_PARAMS, sizes, ends)}
        return rnn_jax({**fixed, **parts})

    theta = jnp.concatenate([jnp.ravel(jnp.asarray(arrays[k])) for k in RNN_PARAMS])
    want = np.asarray(jax.jit(jax.hessian(flat_loss))(theta))
    assert got.shape == want.shape
    assert relative_error(got, want) < 1e-10
    assert relative_error(got, got.T) < 1e-12  # a Hessian: symmetric


# --- an LSTM: two states, a sequence and params captured -----------------------

LH, LD = 3, 2
LW = [sp.MatrixSymbol(f"W_{g}", LD, LH) for g in "ifgo"]
LU = [sp.MatrixSymbol(f"U_{g}", LH, LH) for g in "ifgo"]
LB = [sp.MatrixSymbol(f"b_{g}", 1, LH) for g in "ifgo"]
LV = sp.MatrixSymbol("v", LH, 1)
LSTM_PARAMS = tuple(m.name for m in (*LW, *LU, *LB, LV))


def lstm_model():
    X = sp.MatrixSymbol("X", T, LD)
    h, c, x = sp.MatrixSymbol("h", 1, LH), sp.MatrixSymbol("c", 1, LH), sp.MatrixSymbol("x", 1, LD)
    h_next, c_next = nn.lstm_cell(x, h, c, LW, LU, LB)
    zero = sp.ZeroMatrix(1, LH)
    Y = sbp.scan((h_next, c_next), h_next * LV, (h, c), x, (zero, zero), X)
    return sbp.Model("lstm2", inputs=[X], params=[*LW, *LU, *LB, LV],
                     loss=nn.sum_all(Y.applyfunc(sp.sin)))


def lstm_jax(p):
    def gate(k, row, h):
        g = "ifgo"[k]
        return row[None, :] @ p[f"W_{g}"] + h @ p[f"U_{g}"] + p[f"b_{g}"]

    def step(carry, row):
        h, c = carry
        i, f = jax.nn.sigmoid(gate(0, row, h)), jax.nn.sigmoid(gate(1, row, h))
        g, o = jnp.tanh(gate(2, row, h)), jax.nn.sigmoid(gate(3, row, h))
        c = f * c + i * g
        h = o * jnp.tanh(c)
        return (h, c), (h @ p["v"])[0, 0]

    zero = jnp.zeros((1, LH))
    _, ys = jax.lax.scan(step, (zero, zero), p["X"])
    return jnp.sum(jnp.sin(ys))


def test_the_hvp_of_an_lstm_matches_jax_and_differences_of_the_gradient():
    rng = np.random.default_rng(4)
    arrays = {"X": rng.standard_normal((6, LD))}
    arrays.update({k: 0.7 * rng.standard_normal(s.shape) for k, s in zip(LSTM_PARAMS, (*LW, *LU, *LB, LV))})
    mod = sbp.compile(lstm_model(), functions=("hvp",))
    check_hvp(mod, lstm_jax, arrays, LSTM_PARAMS, rng)


def test_the_route_is_reverse_over_forward_only_where_a_scan_is():
    with_scan = plan(rnn_model(name="rnn2_plan"), ("forward",)).lowered.loss
    assert route(with_scan) == "reverse_over_forward"
    n = sp.Symbol("n", integer=True, positive=True)
    A, w = sp.MatrixSymbol("A", n, 2), sp.MatrixSymbol("w", 2, 1)
    mlp = sbp.Model("no_scan", inputs=[A], params=[w], loss=nn.sum_all((A * w).applyfunc(sp.tanh)))
    assert route(plan(mlp, ("forward",)).lowered.loss) == "forward_over_reverse"


# --- sbp.grad of a scan inside the loss: the backward pass differentiated ------

P = sp.MatrixSymbol("P", T, D)  # the sequence the inner gradient is taken by


def penalty_model(every=None, name="rnn_penalty"):
    """A gradient penalty through an RNN: f a tanh RNN over P (outputs and
    final state); the loss holds d f / d P (a sequence's adjoint), d f / d h0
    (an init's) and d f / d W (a captured param's)."""
    h, x = sp.MatrixSymbol("h", 1, H), sp.MatrixSymbol("x", 1, D)
    new = (h * W + x * Ux + b).applyfunc(sp.tanh)
    Y = sbp.scan(new, new * Vo, h, x, h0, P, checkpoint_every=every)
    f = nn.sum_all(Y.applyfunc(sp.sin)) + sbp.final_state(Y) * sp.OneMatrix(H, 1)
    loss = (nn.sum_all(sbp.grad(f, P).applyfunc(lambda e: e**2)) + nn.sum_all(sbp.grad(f, h0).applyfunc(sp.cos))
            + nn.sum_all(sbp.grad(f, W).applyfunc(sp.sin)))
    return sbp.Model(name, inputs=[P], params=[W, Ux, b, Vo, h0], loss=loss)


def penalty_jax(p):
    def f(seq, start, w):
        def step(state, row):
            new = jnp.tanh(state @ w + row[None, :] @ p["Ux"] + p["b"])
            return new, (new @ p["Vo"])[0, 0]

        final, ys = jax.lax.scan(step, start, seq)
        return jnp.sum(jnp.sin(ys)) + jnp.sum(final)

    g_seq, g_start, g_w = jax.grad(f, argnums=(0, 1, 2))(p["P"], p["h0"], p["W"])
    return jnp.sum(g_seq**2) + jnp.sum(jnp.cos(g_start)) + jnp.sum(jnp.sin(g_w))


def penalty_data(rng, steps):
    data = rnn_data(rng, steps)
    return {"P": data.pop("X"), **{k: v for k, v in data.items() if k != "Z"}}


def test_a_gradient_penalty_through_an_rnn_matches_nested_jax_grad_and_differences():
    mod = sbp.compile(penalty_model())
    arrays = penalty_data(np.random.default_rng(6), 6)
    loss, grads = mod.value_and_grad(**arrays)
    values = {k: jnp.asarray(v) for k, v in arrays.items()}
    want_loss, want = jax.jit(jax.value_and_grad(lambda w: penalty_jax({**values, **w})))({k: values[k] for k in RNN_PARAMS})
    assert loss == pytest.approx(float(want_loss), rel=1e-12)
    for name in RNN_PARAMS:
        assert relative_error(np.reshape(grads[name], want[name].shape), np.asarray(want[name])) < 1e-10, name
        fd = central_differences(lambda d: mod.forward(**d)["loss"], arrays, name)
        assert relative_error(grads[name], fd) < 1e-6, name


def test_the_hvp_of_a_loss_that_holds_the_gradient_of_a_scan_matches_jax():
    """Third order: the tangent of the backward pass's generic scan, then
    its VJP."""
    mod = sbp.compile(penalty_model(name="rnn_penalty_hvp"), functions=("hvp",))
    check_hvp(mod, penalty_jax, penalty_data(np.random.default_rng(7), 5), RNN_PARAMS, np.random.default_rng(8))


def test_a_checkpointed_scan_is_refused_for_second_order_only():
    sbp.compile(rnn_model(2, "rnn_first_order_checkpointed"))  # first order: fine
    with pytest.raises(sbp.ModelError, match="drop checkpoint_every"):
        sbp.compile(penalty_model(2, "rnn_penalty_checkpointed"))


@pytest.mark.slow
def test_a_gradient_penalty_through_an_lstm_matches_nested_jax_grad():
    """Two states (h, c) side by side in each kept row; the penalty on the
    sequence's adjoint and on a captured gate weight's. (Slow: the default
    run checks the RNN's penalty above against JAX, and an LSTM's through
    docs/scan.md against central differences.)"""
    X = sp.MatrixSymbol("X", T, LD)
    f = lstm_model().loss  # a function of X
    loss = nn.sum_all(sbp.grad(f, X).applyfunc(lambda e: e**2)) + nn.sum_all(sbp.grad(f, LU[1]).applyfunc(sp.sin))
    mod = sbp.compile(sbp.Model("lstm_penalty", inputs=[X], params=[*LW, *LU, *LB, LV], loss=loss))

    def jax_loss(p):
        def f_of(seq, u_f):
            return lstm_jax({**p, "X": seq, "U_f": u_f})

        g_seq, g_u = jax.grad(f_of, argnums=(0, 1))(p["X"], p["U_f"])
        return jnp.sum(g_seq**2) + jnp.sum(jnp.sin(g_u))

    rng = np.random.default_rng(9)
    arrays = {"X": rng.standard_normal((5, LD))}
    arrays.update({k: 0.7 * rng.standard_normal(s.shape) for k, s in zip(LSTM_PARAMS, (*LW, *LU, *LB, LV))})
    loss_value, grads = mod.value_and_grad(**arrays)
    values = {k: jnp.asarray(v) for k, v in arrays.items()}
    want_loss, want = jax.value_and_grad(lambda w: jax_loss({**values, **w}))({k: values[k] for k in LSTM_PARAMS})
    assert loss_value == pytest.approx(float(want_loss), rel=1e-12)
    for name in LSTM_PARAMS:
        assert relative_error(np.reshape(grads[name], want[name].shape), np.asarray(want[name])) < 1e-10, name
    fd = central_differences(lambda d: mod.forward(**d)["loss"], arrays, "U_i")
    assert relative_error(grads["U_i"], fd) < 1e-6


def test_a_slope_penalty_with_one_column_rows_matches_nested_jax_grad():
    """Rows of one column: the backward pass reads the outputs' adjoints
    (1 x 1 rows) and its own backward pass computes the adjoints of its
    outputs (1 x 1 rows too), in placeholders kept apart."""
    seq, row = sp.MatrixSymbol("seq", T, 1), sp.MatrixSymbol("row", 1, 1)
    w_in = sp.MatrixSymbol("w_in", 1, H)
    h = sp.MatrixSymbol("h", 1, H)
    new = (h * W + row * w_in + b).applyfunc(sp.tanh)
    Y = sbp.scan(new, new * Vo, h, row, sp.ZeroMatrix(1, H), seq)
    slope = sbp.grad(nn.sum_all(Y.applyfunc(sp.sin)), seq)
    mod = sbp.compile(sbp.Model("rnn_slope", inputs=[seq], params=[W, w_in, b, Vo],
                                loss=nn.mean_all(slope.applyfunc(lambda s: (s - 1) ** 2))))

    def jax_loss(p):
        def f(s):
            def step(state, r):
                new = jnp.tanh(state @ p["W"] + r[None, :] @ p["w_in"] + p["b"])
                return new, (new @ p["Vo"])[0, 0]

            return jnp.sum(jnp.sin(jax.lax.scan(step, jnp.zeros((1, H)), s)[1]))

        return jnp.mean((jax.grad(f)(p["seq"]) - 1) ** 2)

    rng = np.random.default_rng(10)
    arrays = {"seq": rng.standard_normal((6, 1)), "W": 0.6 * rng.standard_normal((H, H)),
              "w_in": rng.standard_normal((1, H)), "b": rng.standard_normal((1, H)), "Vo": rng.standard_normal((H, 1))}
    _, grads = mod.value_and_grad(**arrays)
    values = {k: jnp.asarray(v) for k, v in arrays.items()}
    want = jax.jit(jax.grad(lambda w: jax_loss({**values, **w})))({k: values[k] for k in ("W", "w_in", "b", "Vo")})
    for name, value in want.items():
        assert relative_error(np.reshape(grads[name], value.shape), np.asarray(value)) < 1e-10, name
