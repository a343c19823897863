"""Checks of the benchmark harness itself: ``pytest benchmarks``.

The numpy reference is checked against central finite differences, and the
worker's verify-then-time logic against fake peers.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from benchmarks import measure, worker, workloads
from benchmarks.peers import numpy_ref
from benchmarks.peers._common import Unsupported, Variant

SMALL = [w for w in workloads.get() if w.name in ("W1", "W2", "W4")]


def _finite_difference(workload, inputs, params, name, eps=1e-6):
    grad = np.zeros_like(params[name])
    for idx in np.ndindex(grad.shape):
        plus = {k: v.copy() for k, v in params.items()}
        minus = {k: v.copy() for k, v in params.items()}
        plus[name][idx] += eps
        minus[name][idx] -= eps
        grad[idx] = (numpy_ref.value_and_grad(workload, inputs, plus)[0]
                     - numpy_ref.value_and_grad(workload, inputs, minus)[0]) / (2 * eps)
    return grad


@pytest.mark.parametrize("workload", SMALL + [workloads.WARMUP], ids=lambda w: w.name)
def test_numpy_ref_matches_finite_differences(workload):
    inputs, params = workload.make_data("float64")
    _, grads = numpy_ref.value_and_grad(workload, inputs, params)
    for name in workload.param_names[:4]:  # the last layers and the first ones
        fd = _finite_difference(workload, inputs, params, name)
        assert np.linalg.norm(grads[name] - fd) <= 1e-6 * max(np.linalg.norm(fd), 1e-12)


def test_softmax_ce_gradient_on_a_small_batch():
    w = workloads.Workload("ce", "", batch=5, sizes=(4, 6, 3), activation="tanh",
                           loss="softmax_ce")
    inputs, params = w.make_data("float64")
    _, grads = numpy_ref.value_and_grad(w, inputs, params)
    for name in w.param_names:
        fd = _finite_difference(w, inputs, params, name)
        assert np.allclose(grads[name], fd, atol=1e-8)


def test_data_is_deterministic_and_typed():
    w = workloads.WORKLOADS["W3"]
    a_in, a_par = w.make_data("float32")
    b_in, _ = w.make_data("float32")
    for k in a_in:
        assert a_in[k].dtype == np.float32 and a_in[k].flags.c_contiguous
        assert np.array_equal(a_in[k], b_in[k])
    assert set(a_par) == set(w.param_names)
    assert a_in["T"].sum(axis=1).tolist() == [1.0] * w.batch


def _fake_peer(variants=None, error=None):
    def setup(workload, dtype, inputs, params):
        if error:
            raise error
        return variants(workload, inputs, params)

    return types.SimpleNamespace(setup=setup)


def _run(peer):
    plan = measure.TimingPlan(warmup_s=0.0, sample_s=1e-4, samples=3, budget_s=0.1,
                              min_samples=1)
    return list(worker.run_one(peer, "fake", workloads.WORKLOADS["W1"], "float64", plan))


def test_wrong_gradients_are_reported_and_not_timed():
    def variants(w, inputs, params):
        loss, grads = numpy_ref.value_and_grad(w, inputs, params)
        wrong = {k: 1.01 * g for k, g in grads.items()}
        return [Variant("fake", lambda: (loss, wrong))]

    [record] = _run(_fake_peer(variants))
    assert record["status"] == "failed verification"
    assert "median_s" not in record


def test_right_gradients_are_timed():
    def variants(w, inputs, params):
        return [Variant("fake", lambda: numpy_ref.value_and_grad(w, inputs, params))]

    [record] = _run(_fake_peer(variants))
    assert record["status"] == "ok" and record["max_rel_err"] == 0.0
    assert 0 < record["min_s"] <= record["median_s"] <= record["max_s"]


def test_unsupported_and_broken_peers_are_reported():
    [unsupported] = _run(_fake_peer(error=Unsupported("no such layer")))
    assert unsupported["status"] == "unsupported" and unsupported["reason"] == "no such layer"
    [broken] = _run(_fake_peer(error=ValueError("boom")))
    assert broken["status"] == "error" and "boom" in broken["reason"]


# --------------------------------------------------------------------------
# The example workloads (W5-W10): numpy references on small data

SMALL_EXAMPLES = {
    "W5": dict(points=30, components=4),
    "W6": dict(cameras=3, points=7, observations=25),
    "W6J": dict(cameras=3, points=7, observations=25),
    "W7": dict(count=50),
    "W8": dict(length=40),
    "W9": dict(repeats=1),
    "W10": dict(batch=3),
}


def _small(name):
    return workloads.WORKLOADS[name].resized(**SMALL_EXAMPLES[name])


@pytest.mark.parametrize("name", ["W5", "W6", "W7", "W8", "W9", "W10"])
def test_example_gradients_match_directional_differences(name, eps=1e-6):
    w = _small(name)
    inputs, params = w.make_data("float64")
    _, grads = numpy_ref.value_and_grad(w, inputs, params)
    assert set(grads) == set(w.param_names)
    rng = np.random.default_rng(1)
    for pname in w.param_names:
        d = rng.standard_normal(params[pname].shape)
        loss = lambda s: numpy_ref.value_and_grad(w, inputs, {**params, pname: params[pname] + s * d})[0]
        fd = (loss(eps) - loss(-eps)) / (2 * eps)
        assert abs(fd - np.sum(grads[pname] * d)) <= 1e-6 * np.linalg.norm(grads[pname]) * np.linalg.norm(d) + 1e-9


def test_bundle_adjustment_jacobian_matches_directional_differences(eps=1e-6):
    from benchmarks.peers import _numpy_examples

    w = _small("W6J")
    inputs, params = w.make_data("float64")
    loss, out = numpy_ref.value_and_grad(w, inputs, params)
    c, X, wt, u = _numpy_examples._gathered(inputs, params)
    n = len(u)
    d = np.random.default_rng(1).standard_normal((n, 15))  # one direction per observation
    res = lambda s: _numpy_examples.ba_vjp(c + s * d[:, :11], X + s * d[:, 11:14],
                                           wt + s * d[:, 14:], u, [])[0]
    fd = (res(eps) - res(-eps)) / (2 * eps)
    jd = np.einsum("nrk,nk->nr", out["jacobian"].reshape(n, 2, 15), d)
    assert np.linalg.norm(jd - fd) <= 1e-6 * np.linalg.norm(fd)
    assert np.allclose(out["residual"], res(0.0), rtol=0, atol=0)
    assert loss == numpy_ref.value_and_grad(_small("W6"), inputs, params)[0]


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem + "_for_benchmarks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["W5", "W6", "W7", "W8"])
def test_example_losses_match_the_test_suites_numpy_oracles(name):
    oracles = _load(workloads.EXAMPLES.parent / "tests" / "oracles.py")
    w = _small(name)
    inputs, params = w.make_data("float64")
    loss, _ = numpy_ref.value_and_grad(w, inputs, params)
    assert loss == pytest.approx(oracles.NUMPY_LOSSES[w.example]({**inputs, **params}), rel=1e-12)


def test_example_data_is_the_examples_own_sample_data():
    """make_data draws what the example's sample_data (or, for the LSTM,
    text_data and init_params) would, under the names the model declares."""
    pytest.importorskip("symbackprop")
    from benchmarks.peers.symbackprop import load_example

    for name in ["W5", "W6", "W7", "W8", "W9", "W10"]:
        w = _small(name)
        ex = load_example(w.example)
        inputs, params = w.make_data("float64")
        assert [s.name for s in ex.model.inputs] == list(w.input_names)
        assert [s.name for s in ex.model.params] == list(w.param_names)
        rng = np.random.default_rng(0)
        if name == "W9":
            expected = {**ex.text_data(ex.TEXT * dict(w.size)["repeats"]), **ex.init_params(rng)}
        else:
            expected = ex.sample_data(rng, **dict(w.size))
        assert set(expected) == {*inputs, *params}
        for key, value in {**inputs, **params}.items():
            assert value.dtype == expected[key].dtype and np.array_equal(value, expected[key]), (name, key)


def test_combine_takes_the_median_over_runs():
    from benchmarks import combine

    def run(sbp, prep, peer):
        rec = lambda v, s: {"workload": "W7", "dtype": "float64", "variant": v, "status": "ok",
                            "median_s": s}
        return [rec("symbackprop", sbp), rec("symbackprop.prepared", prep), rec("jax_jit", peer),
                {"workload": "W7", "dtype": "float64", "variant": "torch_compile",
                 "status": "unsupported"}]

    rows = combine.combine([run(2.0, 2.0, 1.0), run(9.0, 2.0, 3.0), run(2.0, 2.0, 2.0)])
    by = {r["variant"]: r for r in rows}
    assert by["jax_jit"]["median_s"] == 2.0 and by["jax_jit"]["ratio"] == 1.0
    assert by["symbackprop"]["median_s"] == 2.0 and by["symbackprop"]["runs"] == 3
    assert "torch_compile" not in by
    assert "jax_jit" in combine.format_rows(rows)


def test_transformer_and_batched_lstm_data_are_the_examples():
    """W11's arrays are transformer_lm.py's windows() of its text and its
    init_params(rng); W12's are lstm_lm_batched.py's first windows, time-major
    as its epoch_data lays out a minibatch, and its init_params(rng, 64)."""
    pytest.importorskip("symbackprop")
    from benchmarks.peers.symbackprop import load_example

    tf = load_example("transformer_lm")
    inputs, params = workloads.WORKLOADS["W11"].resized(sequences=3).make_data("float64")
    assert [s.name for s in tf.model.params] == list(params)
    data = tf.windows(tf.encode(tf.TEXT))
    for key in ("ids", "positions", "targets"):
        assert np.array_equal(inputs[key], data[key][:3 * tf.CONTEXT]), key
    for key, value in tf.init_params(np.random.default_rng(0)).items():
        assert np.array_equal(params[key], value), key

    lstm = load_example("lstm_lm_batched")
    inputs, params = workloads.WORKLOADS["W12"].resized(batch=5).make_data("float64")
    wins = lstm.windows(lstm.TEXT * 2)[:5]  # the example's windows; the batch the workload's
    steps = wins.T  # (WINDOW + 1, 5): time-major, as epoch_data orders a minibatch
    eye = np.eye(lstm.VOCAB)
    assert np.array_equal(inputs["X"], eye[steps[:-1].reshape(-1)])
    assert np.array_equal(inputs["Y"], eye[steps[1:].reshape(-1)])
    for key, value in lstm.init_params(np.random.default_rng(0), workloads.LSTM_BATCHED_HIDDEN).items():
        assert np.array_equal(params[key], value), key
