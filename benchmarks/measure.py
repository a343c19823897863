"""Gradient verification and call timing."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import numpy as np

TOLERANCE = {"float64": 1e-6, "float32": 1e-3}


def max_rel_error(result, reference) -> float:
    """Largest relative error over the loss and every gradient (2-norm-wise).

    ``result`` and ``reference`` are ``(loss, {name: grad})``; a gradient
    missing from ``result`` counts as an infinite error.
    """
    loss, grads = result
    ref_loss, ref_grads = reference
    errors = [_rel(np.asarray(float(loss)), np.asarray(ref_loss))]
    for name, ref in ref_grads.items():
        if name not in grads:
            return float("inf")
        got = np.asarray(grads[name], dtype=np.float64)
        if got.shape != ref.shape:
            return float("inf")
        errors.append(_rel(got, ref))
    return max(errors)


def _rel(got, ref) -> float:
    scale = max(float(np.linalg.norm(ref)), np.finfo(np.float64).tiny)
    err = float(np.linalg.norm(np.asarray(got, dtype=np.float64) - ref)) / scale
    return err if np.isfinite(err) else float("inf")


@dataclass(frozen=True)
class TimingPlan:
    warmup_s: float  # minimum warm-up time
    sample_s: float  # minimum duration of one timed sample (sets inner loop)
    samples: int  # samples wanted
    budget_s: float  # stop sampling after this long (keeping >= min_samples)
    min_samples: int = 5


PLANS = {
    "full": TimingPlan(warmup_s=0.3, sample_s=0.005, samples=41, budget_s=4.0),
    "quick": TimingPlan(warmup_s=0.05, sample_s=0.001, samples=11, budget_s=0.5,
                        min_samples=3),
}


def time_call(call, plan: TimingPlan) -> dict:
    """Per-call seconds (median, min, max over samples) of a no-arg ``call``.

    Each sample times ``inner`` back-to-back calls with ``perf_counter_ns``,
    ``inner`` chosen so that a sample lasts at least ``plan.sample_s``;
    garbage collection is off while sampling.
    """
    _warm_up(call, plan.warmup_s)
    inner = _calibrate(call, plan.sample_s)
    per_call, start = [], time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(per_call) < plan.samples:
            per_call.append(_sample(call, inner) / inner / 1e9)
            elapsed = time.perf_counter() - start
            if elapsed > plan.budget_s and len(per_call) >= plan.min_samples:
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "median_s": statistics.median(per_call),
        "min_s": min(per_call),
        "max_s": max(per_call),
        "samples": len(per_call),
        "inner": inner,
    }


def _warm_up(call, seconds: float) -> None:
    end = time.perf_counter() + seconds
    for i in range(1_000_000):
        call()
        if i >= 2 and time.perf_counter() > end:
            return


def _calibrate(call, sample_s: float) -> int:
    inner = 1
    while True:
        ns = _sample(call, inner)
        if ns >= sample_s * 1e9 or inner >= 1 << 20:
            return inner
        # aim a little past the target, at most 10x per step
        inner = max(inner + 1, min(inner * 10, int(inner * 1.2 * sample_s * 1e9 / max(ns, 1))))


def _sample(call, inner: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(inner):
        call()
    return time.perf_counter_ns() - t0
