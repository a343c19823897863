"""Peers timed in turn, round by round, each in a process of its own.

    python -m benchmarks.interleave --workload W11B --dtype float32 \\
        --peers symbackprop,torch_eager,torch_compile --threads 1 --rounds 9 --calls 5

run.py runs one peer after another, so a change in the machine's load
between them moves their ratios (this shared VM's times drift by 20%
within minutes). Here every peer's process is set up first (compiled,
warmed up) and then, round after round, each runs `--calls` calls in turn:
each round gives each peer a median, and the ratios are taken round by
round, so they compare calls made within seconds of each other. Printed:
per variant the median of its round medians, and each variant's ratio to
the first peer's first variant (its median over rounds, and the range).
Threads and pinning are run.py's (--threads CPUs, the pools' variables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serve(peer_name: str, workload_name: str, dtype: str) -> None:
    """(In the peer's process) set up, then answer each line `N` with every
    variant's N call times in seconds, as one JSON object."""
    import importlib

    from benchmarks import workloads
    from benchmarks.peers._common import bench_threads
    from benchmarks.worker import _limit_blas_threads

    peer = importlib.import_module(f"benchmarks.peers.{peer_name}")
    workload = workloads.get(workload_name)[0]
    inputs, params = workload.make_data(dtype)
    variants = peer.setup(workload, dtype, inputs, params)
    if not getattr(peer, "SETS_ITS_BLAS_THREADS", False):
        _limit_blas_threads(bench_threads())
    for variant in variants:
        for _ in range(2):
            variant.call()
    print(json.dumps({"ready": [v.label for v in variants]}), flush=True)
    for line in sys.stdin:
        calls = int(line)
        times: dict[str, list[float]] = {}
        for variant in variants:
            for _ in range(calls):
                t0 = time.perf_counter()
                variant.call()
                times.setdefault(variant.label, []).append(time.perf_counter() - t0)
        print(json.dumps(times), flush=True)


def _start(peer: str, args, tmp: str) -> subprocess.Popen:
    """A peer's process; `peer` may end in `:VAR=VALUE,...`, settings of its
    environment (`symbackprop:SYMBACKPROP_BLAS=openblas` beside plain
    `symbackprop`)."""
    from benchmarks.run import _pin_to_cpus, _worker_env

    peer, _, settings = peer.partition(":")
    env = _worker_env(argparse.Namespace(threads=args.threads, compile_timeout=600), tmp)
    env.update(item.split("=", 1) for item in settings.split(",") if item)
    command = [sys.executable, "-m", "benchmarks.interleave", "--serve", peer,
               "--workload", args.workload, "--dtype", args.dtype]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=_pin_to_cpus(args.threads))


def _reply(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"a peer process ended (status {process.wait()})")
    return json.loads(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--workload", required=True)
    p.add_argument("--dtype", default="float64")
    p.add_argument("--peers", default="symbackprop,torch_eager,torch_compile")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.workload, args.dtype)
        return 0
    with tempfile.TemporaryDirectory(prefix="sbp-interleave-") as tmp:
        processes: dict[str, subprocess.Popen] = {}
        try:
            for peer in args.peers.split(","):  # set up one at a time: compiles would disturb each other
                processes[peer] = _start(peer, args, tmp)
                _reply(processes[peer])
            rounds: list[dict[str, float]] = []
            for _ in range(args.rounds):
                medians: dict[str, float] = {}
                for peer, process in processes.items():
                    process.stdin.write(f"{args.calls}\n")
                    process.stdin.flush()
                    suffix = peer.partition(":")[2]
                    for label, times in _reply(process).items():
                        medians[f"{label}:{suffix}" if suffix else label] = statistics.median(times)
                rounds.append(medians)
        finally:
            for process in processes.values():
                process.stdin.close()
                process.wait(timeout=60)
    base = next(iter(rounds[0]))
    width = max(map(len, rounds[0]))
    print(f"{args.workload} {args.dtype}, {args.threads} thread(s), {args.rounds} rounds of {args.calls} calls; "
          f"ratio = variant's time / {base}'s, round by round")
    for label in rounds[0]:
        ratios = [r[label] / r[base] for r in rounds]
        print(f"  {label:{width}} {statistics.median(r[label] for r in rounds) * 1e3:9.2f} ms   "
              f"ratio {statistics.median(ratios):5.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
