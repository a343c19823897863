"""Peers timed in turn, round by round, each in a process of its own.

    python -m benchmarks.interleave --workload W11B --dtype float32 \\
        --peers symbackprop,torch_eager,torch_compile --threads 1 --rounds 9 --calls 5
    python -m benchmarks.interleave --workload W8 --dtype float64,float32 \\
        --sizes length=1000,100000 --peers symbackprop,numpy_ref,jax_jit --save NAME

run.py runs one peer after another, so a change in the machine's load
between them moves their ratios (this shared VM's times drift by 20%
within minutes). Here every peer's process is set up first (compiled,
warmed up) and then, round after round, each runs `--calls` calls in turn:
each round gives each peer a median, and the ratios are taken round by
round, so they compare calls made within seconds of each other. Printed:
per variant the median of its round medians, and each variant's ratio to
the first peer's first variant (its median over rounds, and the range).
Threads and pinning are run.py's (--threads CPUs, the pools' variables).

`--dtype` and `--sizes` (an example workload's data size, `KEY=N,N,...`:
`length` for W8) may list several: each dtype and size is a session of its
own, fresh processes. `--inner N` times N back-to-back calls as one call
(for calls of a microsecond, where the clock's own cost would count);
`--inner 0`, as many as take 2 ms, each variant counted once after its warm-up.
`--clock cpu` times each peer process's CPU time (all its threads) instead
of the wall clock: on a machine loaded by other work, the wall clock
measures the share of the CPU a process got as much as its own work.
`--save NAME` writes every session as a row of benchmarks/results/NAME.json
(benchmarks/tables.py), the median of the round medians in seconds and the
round-by-round ratios to the first peer's first variant.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _workload(name: str, size: str | None):
    """Workload ``name``, resized to ``size`` (``KEY=N``) when given."""
    from benchmarks import workloads

    workload = workloads.get(name)[0]
    if size:
        key, _, value = size.partition("=")
        workload = workload.resized(**{key: int(value)})
    return workload


def serve(peer_name: str, workload_name: str, dtype: str, size: str | None = None, inner: int = 1,
          clock: str = "wall") -> None:
    """(In the peer's process) set up, then answer each line `N` with every
    variant's N call times in seconds, as one JSON object."""
    import importlib

    from benchmarks.peers._common import bench_threads
    from benchmarks.worker import _limit_blas_threads

    peer = importlib.import_module(f"benchmarks.peers.{peer_name}")
    workload = _workload(workload_name, size)
    inputs, params = workload.make_data(dtype)
    variants = peer.setup(workload, dtype, inputs, params)
    if not getattr(peer, "SETS_ITS_BLAS_THREADS", False):
        _limit_blas_threads(bench_threads())
    for variant in variants:
        for _ in range(2):
            variant.call()
    calls = {variant.label: variant.call for variant in variants}
    repeats = sample_repeats(calls, inner)
    print(json.dumps({"ready": list(calls)}), flush=True)
    for line in sys.stdin:
        print(json.dumps(sample_times(calls, repeats, int(line), clock)), flush=True)


def sample_repeats(calls: dict, inner: int) -> dict[str, int]:
    """Back-to-back calls a timed sample of each takes: `inner`, or with 0
    as many as make a sample of about 2 ms."""
    repeats = {}
    for label, call in calls.items():
        t0 = time.perf_counter()
        call()
        repeats[label] = inner or max(1, min(100_000, int(2e-3 / max(time.perf_counter() - t0, 1e-9))))
    return repeats


def sample_times(calls: dict, repeats: dict[str, int], count: int, clock: str = "wall") -> dict[str, list[float]]:
    """Each call's `count` samples in turn, a sample's time over its
    repeats back-to-back calls (clock "cpu": the process's CPU time)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {}
    for label, call in calls.items():
        repeat = repeats[label]
        for _ in range(count):
            t0 = now()
            for _ in range(repeat):
                call()
            times.setdefault(label, []).append((now() - t0) / repeat)
    return times


def _start(peer: str, args, workload: str, dtype: str, size: str | None, tmp: str) -> subprocess.Popen:
    """A peer's process; `peer` may end in `:VAR=VALUE,...`, settings of its
    environment (`symbackprop:SYMBACKPROP_BLAS=openblas` beside plain
    `symbackprop`). `SBP_CWD=FOLDER` starts it in FOLDER, whose packages
    come first on its path: a folder with links to this benchmarks/ and an
    older checkout's symbackprop/ and templates/ times that commit's code
    beside this one's."""
    from benchmarks.run import _pin_to_cpus, _worker_env

    peer, _, settings = peer.partition(":")
    env = _worker_env(argparse.Namespace(threads=args.threads, compile_timeout=600), tmp)
    env.update(item.split("=", 1) for item in settings.split(",") if item)
    cwd = env.pop("SBP_CWD", str(ROOT))
    command = [sys.executable, "-m", "benchmarks.interleave", "--serve", peer,
               "--workload", workload, "--dtype", dtype, "--inner", str(args.inner), "--clock", args.clock]
    command += ["--sizes", size] if size else []
    return subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=_pin_to_cpus(args.threads))


def _reply(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"a peer process ended (status {process.wait()})")
    return json.loads(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--workload", required=True, help="one, or a comma list: a session each")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--peers", default="symbackprop,torch_eager,torch_compile")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--inner", type=int, default=1, help="back-to-back calls timed as one (0: as many as take 2 ms)")
    p.add_argument("--sizes", default=None, help="KEY=N,N,...: the example workload's data sizes")
    p.add_argument("--save", default=None, metavar="NAME", help="write benchmarks/results/NAME.json")
    p.add_argument("--conditions", default="", help="added to the saved file's conditions (the load, ...)")
    p.add_argument("--title", default=None, help="the saved table's title")
    p.add_argument("--baseline", default=None, help="the variant ratios divide by (default: the first)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: each peer process's CPU time (all its threads), not the wall clock")
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.workload, args.dtype, args.sizes, args.inner, args.clock)
        return 0
    sizes: list[str | None] = [None]
    if args.sizes:
        key, _, values = args.sizes.partition("=")
        sizes = [f"{key}={value}" for value in values.split(",")]
    sessions = []
    args.load = [_load()]
    for workload in args.workload.split(","):
        for dtype in args.dtype.split(","):
            for size in sizes:
                rounds = _session(args, workload, dtype, size)
                sessions.append((workload, dtype, size, rounds))
                _print(args, workload, dtype, size, rounds)
    args.load.append(_load())
    if args.save:
        from benchmarks import tables

        path = tables.save(args.save, results_file(args, sessions, argv))
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


def _session(args, workload: str, dtype: str, size: str | None) -> list[dict[str, float]]:
    """Every peer set up, then the rounds: each round's median of each variant."""
    with tempfile.TemporaryDirectory(prefix="sbp-interleave-") as tmp:
        processes: dict[str, subprocess.Popen] = {}
        try:
            for peer in args.peers.split(","):  # set up one at a time: compiles would disturb each other
                processes[peer] = _start(peer, args, workload, dtype, size, tmp)
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
    return rounds


def _load() -> str:
    """The machine's 1-minute load average now (Linux), else empty."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return ""


def interleaved_summary(calls: dict, repeats: dict[str, int], rounds: int, count: int,
                        clock: str = "cpu") -> dict[str, tuple[float, list[float]]]:
    """`rounds` rounds of sample_times (each call's median a round), then
    _summary of them: for the benchmarks that run their peers in-process."""
    medians = [{label: statistics.median(t) for label, t in sample_times(calls, repeats, count, clock).items()}
               for _ in range(rounds)]
    return _summary(medians)


def _summary(rounds: list[dict[str, float]], base: str | None = None) -> dict[str, tuple[float, list[float]]]:
    """Each variant's median of its round medians and its ratio to ``base``'s
    (default: the first variant's), round by round: [median, min, max]."""
    base = base or next(iter(rounds[0]))
    out = {}
    for label in rounds[0]:
        ratios = [r[label] / r[base] for r in rounds]
        out[label] = (statistics.median(r[label] for r in rounds),
                      [statistics.median(ratios), min(ratios), max(ratios)])
    return out


def _print(args, workload: str, dtype: str, size: str | None, rounds: list[dict[str, float]]) -> None:
    base = args.baseline or next(iter(rounds[0]))
    width = max(map(len, rounds[0]))
    print(f"{workload}{' ' + size if size else ''} {dtype}, {args.threads} thread(s), {args.rounds} rounds "
          f"of {args.calls} x {args.inner or 'about 2 ms of'} calls; ratio = variant's time / {base}'s, "
          "round by round", flush=True)
    for label, (median, (ratio, low, high)) in _summary(rounds, args.baseline).items():
        print(f"  {label:{width}} {median * 1e6:12.3f} us   ratio {ratio:5.2f} ({low:.2f}-{high:.2f})", flush=True)


LABELS = {  # the saved table's column headings
    "symbackprop": "symbackprop", "symbackprop.prepared": "prepared, run()",
    "symbackprop.prepared()": "prepared, pre()", "numpy_ref": "numpy", "jax_jit": "JAX jit",
    "torch_eager": "PyTorch eager", "torch_compile": "torch.compile", "casadi_c": "CasADi C",
    "casadi_c.prepared": "CasADi C prepared", "bare_cffi": "bare cffi call", "bare_cffi.prepared": "bare cffi prepared",
}


def results_file(args, sessions, argv=None) -> dict:
    """The sessions as a result file of benchmarks/results/: a row per dtype and size,
    a column per variant, the ratios measured round by round."""
    from benchmarks import tables

    columns: list[str] = []
    rows = []
    for workload, dtype, size, rounds in sessions:
        summary = _summary(rounds, args.baseline)
        columns += [label for label in summary if label not in columns]
        base = args.baseline or next(iter(summary))
        rows.append({"label": " ".join(filter(None, [workload, size, dtype])),
                     "seconds": {label: median for label, (median, _) in summary.items()},
                     "ratios": {label: ratio for label, (_, ratio) in summary.items() if label != base}})
    command = "python -m benchmarks.interleave " + shlex.join(sys.argv[1:] if argv is None else argv)
    conditions = [f"{args.threads} thread(s) a peer, each peer in its own process, "
                  f"{'its CPU time (all its threads)' if args.clock == 'cpu' else 'wall clock'}, {args.rounds} rounds of "
                  f"{args.calls} samples of each in turn, a sample {args.inner or 'about 2 ms of'} back-to-back "
                  "calls, median of the round medians, the ratio the median of the per-round ratios and their range"]
    if all(args.load):
        conditions.append(f"load average {args.load[0]} at the start, {args.load[1]} at the end")
    if hasattr(os, "sched_getaffinity"):
        conditions.append(f"run on CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} of {os.cpu_count()}")
    conditions += [args.conditions] if args.conditions else []
    return {
        "title": args.title or f"{args.workload}, time per call, interleaved", **tables.provenance(),
        "command": command,
        "conditions": "; ".join(conditions),
        "source": "written by benchmarks/interleave.py --save", "row_header": "workload",
        "baseline": args.baseline or columns[0],
        **({"ratio_note": f"in parentheses each column's time over {LABELS.get(args.baseline, args.baseline)}'s "
                          "(above 1: slower than it)"} if args.baseline else {}),
        "columns": [{"key": c, "label": LABELS.get(c, c), "ratio": c != (args.baseline or columns[0])} for c in columns],
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
