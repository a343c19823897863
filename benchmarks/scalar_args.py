"""Scalar arguments on the call path: a Python float, a 0-d array, a (1, 1) array.

    taskset -c 1 python benchmarks/scalar_args.py --rounds 15 --save NAME

A model with two scalar parameters (tests/compiled/test_fastcall.py's:
`sum(x) * a + b**2`, x of 3 x 1) called by `mod.value_and_grad` with `a`
and `b` given as Python floats, as 0-d arrays of the module's dtype and as
(1, 1) arrays, and prepared (`pre()` and `pre.run()`). One process, one
thread; each round times every variant in turn (a sample of --inner
back-to-back calls, --calls samples, their median), and the ratios are
taken round by round against the Python floats' call.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import sympy as sp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import symbackprop as sbp  # noqa: E402
from benchmarks import tables  # noqa: E402
from benchmarks.interleave import _load, interleaved_summary  # noqa: E402


def variants(dtype: str) -> dict:
    """label -> a call of no arguments."""
    x = sp.MatrixSymbol("x", 3, 1)
    a, b = sp.symbols("a b")
    model = sbp.Model(f"bench_scalars_{dtype}", inputs=[x], params=[a, b],
                      loss=sbp.as_scalar(sp.OneMatrix(1, 3) * x) * a + b**2)
    mod = sbp.compile(model, dtype=dtype)
    xs = np.array([[1.0], [2.0], [4.0]], dtype=dtype)
    zero_d = {"a": np.array(0.5, dtype), "b": np.array(-3.0, dtype)}
    one_one = {"a": np.full((1, 1), 0.5, dtype), "b": np.full((1, 1), -3.0, dtype)}
    pre = mod.prepare(x=xs, **one_one)
    return {
        "floats": lambda: mod.value_and_grad(x=xs, a=0.5, b=-3.0),
        "0-d arrays": lambda: mod.value_and_grad(x=xs, **zero_d),
        "(1, 1) arrays": lambda: mod.value_and_grad(x=xs, **one_one),
        "prepared()": pre,
        "prepared.run()": pre.run,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float64,float32")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--inner", type=int, default=2000)
    p.add_argument("--conditions", default="")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    p.add_argument("--save", default=None, metavar="NAME")
    args = p.parse_args(argv)
    load = [_load()]
    rows, columns = [], []
    for dtype in args.dtype.split(","):
        calls = variants(dtype)
        for call in calls.values():
            for _ in range(100):
                call()
        summary = interleaved_summary(calls, dict.fromkeys(calls, args.inner), args.rounds, args.calls, args.clock)
        columns += [label for label in summary if label not in columns]
        print(f"{dtype}:")
        for label, (median, (ratio, low, high)) in summary.items():
            print(f"  {label:14} {median * 1e6:8.3f} us  ratio {ratio:.2f} ({low:.2f}-{high:.2f})", flush=True)
        rows.append({"label": f"sum(x) a + b^2, x 3x1, {dtype}",
                     "seconds": {label: median for label, (median, _) in summary.items()},
                     "ratios": {label: ratio for label, (_, ratio) in summary.items() if label != "floats"}})
    load.append(_load())
    if args.save:
        clock = "its CPU time" if args.clock == "cpu" else "wall clock"
        conditions = [f"one process, {clock}, {args.rounds} rounds of {args.calls} samples of each in turn, a sample "
                      f"{args.inner} back-to-back calls, median of the round medians, the ratio to the floats' "
                      "call the median of the per-round ratios and their range"]
        conditions += [f"load average {load[0]} at the start, {load[1]} at the end"] if all(load) else []
        if hasattr(os, "sched_getaffinity"):
            conditions.append(f"run on CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} of {os.cpu_count()}")
        conditions += [args.conditions] if args.conditions else []
        data = {"title": "Scalar arguments: value_and_grad with floats, 0-d and (1, 1) arrays, and prepared",
                **tables.provenance(),
                "command": "python benchmarks/scalar_args.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                "conditions": "; ".join(conditions), "source": "written by benchmarks/scalar_args.py --save",
                "row_header": "model", "baseline": "floats",
                "ratio_note": "in parentheses each column's time over the call with floats (above 1: slower)",
                "columns": [{"key": c, "label": c, "ratio": c != "floats"} for c in columns], "rows": rows}
        print(f"wrote {tables.save(args.save, data).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
