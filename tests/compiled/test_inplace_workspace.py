"""An elementwise loop of the backward pass writes its result over an input
that nothing reads after it (schedule/inplace.py): the workspace shrinks,
the results do not change (checked against a hand-written numpy backward
pass and against the same module built without it), and no loop touches
two names for one memory (test_shared_maps.py checks that invariant on
the examples' plans)."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import pipeline
from symbackprop.declare import nn
from symbackprop.schedule import scheduler
from symbackprop.toolchain.builder import BuildOptions

n = sp.Symbol("n", integer=True, positive=True)
SIZES = (7, 5, 3)


def _model():
    X, T = sp.MatrixSymbol("X", n, SIZES[0]), sp.MatrixSymbol("T", n, SIZES[2])
    W1, b1 = sp.MatrixSymbol("W1", SIZES[0], SIZES[1]), sp.MatrixSymbol("b1", 1, SIZES[1])
    W2, b2 = sp.MatrixSymbol("W2", SIZES[1], SIZES[2]), sp.MatrixSymbol("b2", 1, SIZES[2])
    z = nn.linear(nn.tanh(nn.linear(X, W1, b1)), W2, b2)
    return sbp.Model("inplace_mlp", inputs=[X, T], params=[W1, b1, W2, b2], loss=nn.softmax_cross_entropy(z, T))


def _data(rows: int = 9) -> dict:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, SIZES[2], rows)
    return {"X": rng.standard_normal((rows, SIZES[0])), "T": np.eye(SIZES[2])[labels],
            "W1": rng.standard_normal((SIZES[0], SIZES[1])) / 3, "b1": rng.standard_normal((1, SIZES[1])),
            "W2": rng.standard_normal((SIZES[1], SIZES[2])) / 2, "b2": rng.standard_normal((1, SIZES[2]))}


def _numpy(d: dict) -> tuple[float, dict]:
    """The loss and gradients by hand: mean over rows of logsumexp(z) - t.z."""
    h = np.tanh(d["X"] @ d["W1"] + d["b1"])
    z = h @ d["W2"] + d["b2"]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    rows = len(z)
    loss = np.mean(np.log(e.sum(axis=1)) + z.max(axis=1) - (d["T"] * z).sum(axis=1))
    gz = (p - d["T"]) / rows
    gh = gz @ d["W2"].T * (1 - h**2)
    return loss, {"W1": d["X"].T @ gh, "b1": gh.sum(0, keepdims=True), "W2": h.T @ gz, "b2": gz.sum(0, keepdims=True)}


def _work(model) -> sp.Expr:
    return next(fn.schedule.work_size for fn in pipeline.plan(model).functions if fn.kind == "value_and_grad")


def test_the_backward_pass_writes_over_a_dead_adjoint(monkeypatch):
    model = _model()
    source = pipeline.generate(model, derivation=False)[0].source
    code = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    # a loop storing into the array it reads at the same entry: grad_t[...] = ...grad_t[...]...
    assert re.search(r"(\w+)\[(\w[^\]]*)\] = [^;]*\b\1\[\2\]", code), code
    with_it = _work(model)
    monkeypatch.setattr(scheduler, "over_dead_inputs", lambda sched, stored: {})
    without = _work(model)
    saved = sp.expand(without - with_it)
    assert saved.subs(n, 1) > 0 and sp.degree(saved, n) == 1, (with_it, without)  # n x hidden reals saved


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_results_are_those_of_the_numpy_backward_pass_and_of_the_build_without_it(tmp_path, monkeypatch, dtype):
    d = _data()
    mod = sbp.compile(_model(), dtype=dtype, options=BuildOptions(cache_dir=tmp_path / "with"))
    cast = {k: v.astype(dtype) for k, v in d.items()}
    loss, grads = mod.value_and_grad(**cast)
    expected_loss, expected = _numpy(d)
    rtol = 1e-12 if dtype == "float64" else 2e-5
    assert loss == pytest.approx(expected_loss, rel=rtol)
    for k, g in expected.items():
        np.testing.assert_allclose(grads[k], g, rtol=rtol * 10, atol=rtol)
    monkeypatch.setattr(scheduler, "over_dead_inputs", lambda sched, stored: {})
    plain = sbp.compile(_model(), dtype=dtype, options=BuildOptions(cache_dir=tmp_path / "without"))
    assert mod.source != plain.source
    loss_plain, grads_plain = plain.value_and_grad(**cast)
    assert loss == loss_plain
    for k in expected:
        np.testing.assert_array_equal(grads[k], grads_plain[k])
