"""Runs one peer over the requested workloads and dtypes (one process per peer).

Started by run.py as ``python -m benchmarks.worker --peer NAME ...``; writes
one JSON record per line to ``--out`` as soon as each result is known, so a
peer that is stopped for running too long keeps the results it had.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback

from benchmarks import measure, workloads
from benchmarks.peers import numpy_ref
from benchmarks.peers._common import Unsupported, bench_threads


def main(argv=None) -> None:
    args = _parse(argv)
    emit = _emitter(args.out)
    try:
        peer = importlib.import_module(f"benchmarks.peers.{args.peer}")
    except ImportError as exc:
        emit(peer=args.peer, status="not installed", reason=str(exc))
        return
    plan = measure.PLANS[args.plan]
    emit(peer=args.peer, status="init", seconds=_warm_up(peer, args.dtypes.split(",")[0]))
    for workload in workloads.get(args.workloads, args.batch):
        for dtype in args.dtypes.split(","):
            for record in run_one(peer, args.peer, workload, dtype, plan):
                emit(**record)


def run_one(peer, peer_name, workload, dtype, plan):
    """Records for every variant of ``peer`` on one workload and dtype."""
    base = {"peer": peer_name, "version": getattr(peer, "VERSION", None),
            "workload": workload.name, "dtype": dtype}
    inputs, params = workload.make_data(dtype)
    reference = numpy_ref.reference(workload, inputs, params)
    try:
        variants = peer.setup(workload, dtype, inputs, params)
    except Unsupported as exc:
        yield {**base, "variant": peer_name, "status": "unsupported", "reason": str(exc)}
        return
    except Exception:
        yield {**base, "variant": peer_name, "status": "error", "reason": _tail()}
        return
    if not getattr(peer, "SETS_ITS_BLAS_THREADS", False):
        _limit_blas_threads(bench_threads())  # after setup: it may load a BLAS
    for variant in variants:
        yield {**base, **_run_variant(peer, variant, workload, dtype, reference, plan)}


def _warm_up(peer, dtype) -> float | None:
    """Seconds to set up and call the peer once on the warm-up model."""
    inputs, params = workloads.WARMUP.make_data(dtype)
    t0 = time.perf_counter()
    try:
        for variant in peer.setup(workloads.WARMUP, dtype, inputs, params):
            variant.call()
    except Exception:
        return None  # the real workloads will report what is wrong
    return time.perf_counter() - t0


def _run_variant(peer, variant, workload, dtype, reference, plan) -> dict:
    record = {**variant.extra, "variant": variant.label, "notes": variant.notes,
              "compile_cold_s": variant.compile_cold_s,
              "compile_cached_s": variant.compile_cached_s}
    try:
        error = measure.max_rel_error(variant.call(), reference)
    except Exception:
        return {**record, "status": "error", "reason": _tail()}
    tolerance = measure.TOLERANCE[dtype]
    verified = getattr(peer, "VERIFY", True)
    record.update(max_rel_err=error if verified else None, tolerance=tolerance)
    if verified and not error <= tolerance:
        return {**record, "status": "failed verification",
                "reason": f"max relative error {error:.3g} > {tolerance:g}"}
    try:
        timing = measure.time_call(variant.call, plan)
    except Exception:
        return {**record, "status": "error", "reason": _tail()}
    gflops = workload.flops / timing["median_s"] / 1e9 if verified and workload.flops else None
    return {**record, **timing, "status": "ok", "gflops": gflops}


def _limit_blas_threads(n: int) -> None:
    """Limit every BLAS/OpenMP pool loaded so far (run.py also sets
    OPENBLAS/OMP/MKL_NUM_THREADS for the pools loaded later)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=n)


def _emitter(path: str):
    def emit(**record):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    return emit


def _tail(limit: int = 2000) -> str:
    return traceback.format_exc()[-limit:]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--peer", required=True)
    p.add_argument("--workloads", default=None)
    p.add_argument("--dtypes", default="float64,float32")
    p.add_argument("--plan", choices=sorted(measure.PLANS), default="full")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
