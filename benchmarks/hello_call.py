"""GradBench's `hello` (the square of a scalar and its derivative): the cost of one call.

    taskset -c 1 python benchmarks/hello_call.py --against /work/main --rounds 15 --save NAME

The model `x**2` (x a scalar param) called by `mod.forward` and
`mod.value_and_grad` with x given as a Python float, a 0-d array and a
(1, 1) array, and prepared (`pre()`, `pre.run()`), beside floors: a bare
cffi call of an empty C function, a Python function returning `x * x`, and
CasADi's Function of x -> (x^2, 2x) called with a float (its own Python
call path), where casadi imports. Each checkout named (this one, and
--against's) runs in a process of its own (PYTHONPATH set to it); round
after round each process times every variant in turn (a sample: --inner
back-to-back calls, the process's CPU time; --calls samples, their
median), so before and after are measured within seconds of each other.
Per variant and checkout: the median of the round medians; the ratio of
this checkout's to --against's is taken round by round.
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


def variants(folder: str) -> dict:
    """label -> a call of no arguments (in the worker's process)."""
    import numpy as np
    import sympy as sp

    import symbackprop as sbp

    x = sp.Symbol("x")
    mod = sbp.compile(sbp.Model("bench_hello", params=[x], loss=x**2))
    zero_d, one_one = np.array(3.0), np.full((1, 1), 3.0)
    pre = mod.prepare(x=one_one)
    calls = {
        "forward, float": lambda: mod.forward(x=3.0),
        "forward, 0-d": lambda: mod.forward(x=zero_d),
        "forward, (1, 1)": lambda: mod.forward(x=one_one),
        "value_and_grad, float": lambda: mod.value_and_grad(x=3.0),
        "value_and_grad, 0-d": lambda: mod.value_and_grad(x=zero_d),
        "value_and_grad, (1, 1)": lambda: mod.value_and_grad(x=one_one),
        "prepared()": pre,
        "prepared.run()": pre.run,
        "floor: bare cffi call": _empty_c_function(folder),
        "floor: Python x * x": lambda: _square(3.0),
    }
    try:
        import casadi as ca
    except ImportError:
        return calls
    s = ca.SX.sym("x")
    both = ca.Function("hello", [s], [s * s, ca.jacobian(s * s, s)])
    calls["CasADi Function(float)"] = lambda: both(3.0)
    return calls


def _square(x: float) -> float:
    return x * x


def _empty_c_function(folder: str):
    from cffi import FFI

    ffi = FFI()
    ffi.cdef("int empty(void);")
    ffi.set_source("_hello_empty", "int empty(void) { return 0; }")
    ffi.compile(tmpdir=folder)
    sys.path.insert(0, folder)
    from _hello_empty import lib  # type: ignore[import-not-found]

    return lib.empty


def serve(inner: int, calls: int) -> None:
    """(In a worker) set up, then answer each line with one sample of every variant: {label: seconds a call}."""
    with tempfile.TemporaryDirectory() as folder:
        timed = variants(folder)
        for call in timed.values():
            for _ in range(1000):
                call()
        import symbackprop

        print(json.dumps({"labels": list(timed), "module": symbackprop.__file__}), flush=True)
        for _ in sys.stdin:
            out = {}
            for label, call in timed.items():
                samples = []
                for _ in range(calls):
                    start = time.process_time()
                    for _ in range(inner):
                        call()
                    samples.append((time.process_time() - start) / inner)
                out[label] = statistics.median(samples)
            print(json.dumps(out), flush=True)


def _worker(checkout: str, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=checkout)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--inner", str(args.inner),
           "--calls", str(args.calls)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def measure(checkouts: dict[str, str], args) -> tuple[list[str], dict[str, list[dict[str, float]]]]:
    """The variants' labels, and per checkout its rounds ({label: seconds})."""
    workers = {name: _worker(path, args) for name, path in checkouts.items()}
    hello = {name: json.loads(w.stdout.readline()) for name, w in workers.items()}
    for name, answer in hello.items():  # each worker imports its own checkout's symbackprop
        assert answer["module"].startswith(checkouts[name]), (name, answer["module"])
    labels = hello["after"]["labels"]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in workers}
    for _ in range(args.rounds):
        for name, w in workers.items():
            w.stdin.write("\n")
            w.stdin.flush()
            rounds[name].append(json.loads(w.stdout.readline()))
    for w in workers.values():
        w.stdin.close()
        w.wait()
    return labels, rounds


def _commit(folder: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default=None, help="another checkout to time beside this one (before)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--inner", type=int, default=2000)
    p.add_argument("--conditions", default="")
    p.add_argument("--save", default=None, metavar="NAME")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.inner, args.calls)
        return 0
    checkouts = {"after": str(ROOT)}
    if args.against:
        checkouts = {"before": str(Path(args.against).resolve()), **checkouts}
    load = [_load()]
    labels, rounds = measure(checkouts, args)
    load.append(_load())
    rows = []
    for label in labels:
        seconds = {name: statistics.median(r[label] for r in rounds[name]) for name in checkouts}
        row = {"label": label, "seconds": seconds}
        if "before" in checkouts:
            ratios = [a[label] / b[label] for a, b in zip(rounds["after"], rounds["before"])]
            row["ratios"] = {"after": [statistics.median(ratios), min(ratios), max(ratios)]}
        rows.append(row)
        shown = "  ".join(f"{name} {s * 1e9:8.0f} ns" for name, s in seconds.items())
        ratio = f"  ratio {row['ratios']['after'][0]:.2f}" if "ratios" in row else ""
        print(f"{label:26} {shown}{ratio}", flush=True)
    if args.save:
        _save(args, argv, checkouts, rows, load)
    return 0


def _save(args, argv, checkouts: dict, rows: list, load: list) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import tables

    conditions = [f"one process per checkout, its CPU time, {args.rounds} rounds, each timing every variant in "
                  f"turn in each process ({args.calls} samples of {args.inner} back-to-back calls, their median), "
                  "median of the round medians, the ratio after/before the median of the per-round ratios and "
                  "their range"]
    conditions += [f"load average {load[0]:.2f} at the start, {load[1]:.2f} at the end"] if all(load) else []
    if hasattr(os, "sched_getaffinity"):
        conditions.append(f"run on CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} of {os.cpu_count()}")
    conditions += [f"before: {checkouts['before']} at commit {_commit(checkouts['before'])}"] if "before" in checkouts else []
    conditions += [args.conditions] if args.conditions else []
    columns = [{"key": name, "label": f"{name} ({'--against' if name == 'before' else 'this commit'})",
                "ratio": name == "after"} for name in checkouts]
    data = {"title": "GradBench hello (x^2 and its derivative): the time of one call", **tables.provenance(),
            "command": "python benchmarks/hello_call.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "conditions": "; ".join(conditions), "source": "written by benchmarks/hello_call.py --save",
            "row_header": "call", "baseline": "before" if "before" in checkouts else None,
            "ratio_note": "in parentheses after's time over before's, round by round (below 1: faster now)",
            "columns": columns, "rows": rows}
    print(f"wrote {tables.save(args.save, data).relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
