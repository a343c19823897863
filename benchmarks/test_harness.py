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
