"""scan(..., reverse=True): the steps run from the last rows to the first
(a bidirectional RNN's backward direction), the outputs in the sequence's
order. Against JAX's lax.scan(reverse=True) in float64: outputs, final
state, the loss's gradient (params and inputs, batched over B sequences)
and its hvp (second order: the backward pass of a reversed scan runs
forwards)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import sympy as sp
from oracles import relative_error

import symbackprop as sbp
from symbackprop import nn

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py

N, B, T = sp.symbols("N B T", integer=True, positive=True)
D, H = 2, 3
W, Ux, b, Vo = (sp.MatrixSymbol("W", H, H), sp.MatrixSymbol("Ux", D, H), sp.MatrixSymbol("b", 1, H),
                sp.MatrixSymbol("Vo", H, 1))
PARAMS = ("W", "Ux", "b", "Vo")


def _step(h, x):
    return (h * W + nn.linear(x, Ux, b)).applyfunc(sp.tanh)


@functools.cache
def batched():
    """A tanh RNN over B sequences, time-major rows, run backwards; the loss
    reads every output and the final state."""
    X, Z, h0 = sp.MatrixSymbol("X", N, D), sp.MatrixSymbol("Z", N, 1), sp.MatrixSymbol("h0", B, H)
    h, x = sp.MatrixSymbol("h", B, H), sp.MatrixSymbol("x", B, D)
    new = _step(h, x)
    Y = sbp.scan(new, new * Vo, h, x, h0, X, batch=B, reverse=True)
    E = Y - Z
    loss = nn.sum_all(sp.HadamardProduct(E, E)) + nn.sum_all(sbp.final_state(Y).applyfunc(sp.sin))
    model = sbp.Model("scan_reversed_batched", inputs=[X, Z, h0], params=[W, Ux, b, Vo], loss=loss,
                      outputs={"Y": Y, "final": sbp.final_state(Y)}, grad_inputs=[X, h0])
    return sbp.compile(model)


def batched_jax(p, batch, steps):
    def step(state, rows):
        new = jnp.tanh(state @ p["W"] + rows @ p["Ux"] + p["b"])
        return new, new @ p["Vo"]

    final, ys = jax.lax.scan(step, p["h0"], p["X"].reshape(steps, batch, D), reverse=True)
    ys = ys.reshape(steps * batch, 1)
    return jnp.sum((ys - p["Z"]) ** 2) + jnp.sum(jnp.sin(final)), (ys, final)


def data(rng, rows, batch):
    return {"X": rng.standard_normal((rows, D)), "Z": rng.standard_normal((rows, 1)),
            "h0": rng.standard_normal((batch, H)), "W": 0.6 * rng.standard_normal((H, H)),
            "Ux": rng.standard_normal((D, H)), "b": rng.standard_normal((1, H)), "Vo": rng.standard_normal((H, 1))}


@pytest.mark.parametrize(("batch", "steps"), [(1, 1), (3, 5), (2, 1), (1, 4)])
def test_a_reversed_batched_scan_matches_jax(batch, steps):
    mod = batched()
    arrays = data(np.random.default_rng(batch * 10 + steps), batch * steps, batch)
    loss, grads = mod.value_and_grad(**arrays)
    outputs = mod.forward(**arrays)
    p = {k: jnp.asarray(v) for k, v in arrays.items()}
    (want, (ys, final)), want_grads = jax.value_and_grad(
        lambda q: batched_jax({**p, **q}, batch, steps), has_aux=True)({k: p[k] for k in (*PARAMS, "X", "h0")})
    assert loss == pytest.approx(float(want), rel=1e-12)
    assert relative_error(outputs["Y"], np.asarray(ys)) < 1e-12
    assert relative_error(outputs["final"], np.asarray(final)) < 1e-12
    for name, grad in want_grads.items():
        assert relative_error(grads[name], np.asarray(grad)) < 1e-10, name


def test_the_first_step_reads_the_last_rows():
    """Two steps of one sequence, W = 0: the final state is read from row 0
    alone and the output of row 1 from row 1 alone (the first step)."""
    mod = batched()
    arrays = {**data(np.random.default_rng(0), 2, 1), "W": np.zeros((H, H))}
    out = mod.forward(**arrays)
    rows = np.tanh(arrays["X"] @ arrays["Ux"] + arrays["b"])
    np.testing.assert_allclose(out["final"], rows[:1], rtol=1e-14)
    np.testing.assert_allclose(out["Y"], rows @ arrays["Vo"], rtol=1e-14)


def rnn_jax(p):
    def step(state, row):
        new = jnp.tanh(state @ p["W"] + row[None, :] @ p["Ux"] + p["b"])
        return new, (new @ p["Vo"])[0, 0]

    final, ys = jax.lax.scan(step, jnp.zeros((1, H)), p["X"], reverse=True)
    return jnp.sum(jnp.sin(ys * jnp.arange(1, len(ys) + 1))) + jnp.sum(final ** 2)


def test_the_hvp_of_a_reversed_scan_matches_jax():
    X = sp.MatrixSymbol("X", T, D)
    h, x = sp.MatrixSymbol("h", 1, H), sp.MatrixSymbol("x", 1, D)
    new = _step(h, x)
    Y = sbp.scan(new, new * Vo, h, x, sp.ZeroMatrix(1, H), X, reverse=True)
    weights = sp.MatrixSymbol("weights", T, 1)  # 1 .. T: the rows' order shows in the loss
    loss = nn.sum_all(sp.HadamardProduct(Y, weights).applyfunc(sp.sin)) + nn.sum_all(
        sbp.final_state(Y).applyfunc(lambda v: v**2))
    mod = sbp.compile(sbp.Model("scan_reversed_hvp", inputs=[X, weights], params=[W, Ux, b, Vo], loss=loss),
                      functions=("hvp",))
    rng = np.random.default_rng(4)
    arrays = {k: v for k, v in data(rng, 6, 1).items() if k not in ("Z", "h0")}
    arrays["weights"] = np.arange(1.0, 7.0).reshape(6, 1)
    directions = {k: rng.standard_normal(arrays[k].shape) for k in PARAMS}
    loss_value, _, got = mod.value_grad_and_hvp(directions, **arrays)
    p = {k: jnp.asarray(v) for k, v in arrays.items() if k != "weights"}
    assert loss_value == pytest.approx(float(rnn_jax(p)), rel=1e-12)
    fixed = {"X": p["X"]}
    _, want = jax.jvp(jax.grad(lambda w: rnn_jax({**fixed, **w})), ({k: p[k] for k in PARAMS},),
                      ({k: jnp.asarray(directions[k]) for k in PARAMS},))
    for name in PARAMS:
        assert relative_error(np.reshape(got[name], want[name].shape), np.asarray(want[name])) < 1e-10, name


def test_reverse_is_refused_with_checkpoints_and_must_be_a_bool():
    h, x, X = sp.MatrixSymbol("h", 1, H), sp.MatrixSymbol("x", 1, D), sp.MatrixSymbol("X", T, D)
    new = _step(h, x)
    with pytest.raises(sbp.ModelError, match="checkpoint_every is not supported with reverse=True"):
        sbp.scan(new, new * Vo, h, x, sp.ZeroMatrix(1, H), X, checkpoint_every=2, reverse=True)
    with pytest.raises(sbp.ModelError, match="reverse must be True or False"):
        sbp.scan(new, new * Vo, h, x, sp.ZeroMatrix(1, H), X, reverse=1)
