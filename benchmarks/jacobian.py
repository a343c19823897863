"""mod.jacobian: one C sweep (of the vjp kernel over the output's entries,
or of the jvp's over the parameters' where they are fewer: 26 here, so
from n = 16 on) against one Python vjp call per output entry, as before;
beside it each sweep forced (reverse: the vjp's; forward: the jvp's), to
show where the choice should switch.

    taskset -c 1 python benchmarks/jacobian.py --batches 4,8,32,256 --rounds 15 --inner 10 --save NAME

examples/mlp.py's MLP (3 -> 4 -> 2, the Jacobian of its output Y, n x 2,
with respect to W1, b1, W2, b2) at a few batch sizes n. One process, one
thread; each round times both variants in turn (--calls samples of
--inner back-to-back calls, their median), and the ratios are taken round
by round against the per-entry loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import symbackprop as sbp  # noqa: E402
from benchmarks import tables  # noqa: E402
from benchmarks.interleave import _load, interleaved_summary  # noqa: E402
from symbackprop.base.abi import concrete  # noqa: E402

BEFORE = "vjp per entry"
AFTER = "jacobian (C sweep)"
REVERSE, FORWARD = "reverse sweep", "forward sweep"


def _mlp():
    spec = importlib.util.spec_from_file_location("example_mlp", ROOT / "examples" / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_entry(mod, output: str, data: dict) -> dict:
    """The Jacobian as mod.jacobian made it before (its code at cef2ef5): one vjp per output entry."""
    found = next(shape for name, shape, _ in mod.spec.outputs if name == output)
    shape = concrete(found, mod.function("forward").binder.dims_from(data))
    rows: dict[str, list] = {}
    for index in np.ndindex(*shape):
        seed = np.zeros(shape, dtype=mod.dtype)
        seed[index] = 1.0
        for key, grad in mod.vjp(output, seed, **data).items():
            rows.setdefault(key, []).append(np.asarray(grad, dtype=mod.dtype))
    return {k: np.array(v).reshape(*shape, *np.shape(v[0])) for k, v in rows.items()}


def variants(mod, batch: int) -> dict:
    data = _mlp().sample_data(np.random.default_rng(0), batch=batch)
    bound = mod.function("forward").binder.dims_from(data)
    shape = concrete(next(shape for name, shape, _ in mod.spec.outputs if name == "Y"), bound)
    calls = {BEFORE: lambda: per_entry(mod, "Y", data), AFTER: lambda: mod.jacobian("Y", **data),
             REVERSE: lambda: mod._jacobian_reverse("Y", shape, data),
             FORWARD: lambda: mod._jacobian_forward("Y", shape, bound, data)}
    before = calls[BEFORE]()
    for call in (calls[AFTER], calls[REVERSE], calls[FORWARD]):
        after = call()
        for name in before:  # the same Jacobian (to rounding: forward mode sums in another order), or this means nothing
            np.testing.assert_allclose(after[name], before[name], rtol=1e-12, atol=1e-14)
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="4,32,256")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--inner", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu", help="cpu: the process's CPU time")
    p.add_argument("--conditions", default="")
    p.add_argument("--save", default=None, metavar="NAME")
    args = p.parse_args(argv)
    load = [_load()]
    mod = sbp.compile(_mlp().model)
    rows = []
    for batch in map(int, args.batches.split(",")):
        calls = variants(mod, batch)
        summary = interleaved_summary(calls, dict.fromkeys(calls, args.inner), args.rounds, args.calls, args.clock)
        print(f"n = {batch} ({2 * batch} output entries):")
        for label, (median, (ratio, low, high)) in summary.items():
            print(f"  {label:22} {median * 1e6:10.1f} us  ratio {ratio:.3f} ({low:.3f}-{high:.3f})", flush=True)
        rows.append({"label": f"MLP 3-4-2, Y of {batch} x 2, float64",
                     "seconds": {label: median for label, (median, _) in summary.items()},
                     "ratios": {label: summary[label][1] for label in (AFTER, REVERSE, FORWARD)}})
    load.append(_load())
    if args.save:
        clock = "its CPU time" if args.clock == "cpu" else "wall clock"
        conditions = [f"one process, one thread, {clock}, {args.rounds} rounds of {args.calls} samples of each in "
                      f"turn, a sample {args.inner} back-to-back calls, median of the round medians, the ratio the "
                      "median of the per-round ratios"]
        conditions += [f"load average {load[0]} at the start, {load[1]} at the end"] if all(load) else []
        if hasattr(os, "sched_getaffinity"):
            conditions.append(f"run on CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} of {os.cpu_count()}")
        conditions += [args.conditions] if args.conditions else []
        data = {"title": "mod.jacobian: one C call against one vjp call per output entry",
                **tables.provenance(),
                "command": "python benchmarks/jacobian.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                "conditions": "; ".join(conditions), "source": "written by benchmarks/jacobian.py --save",
                "row_header": "model", "baseline": BEFORE,
                "ratio_note": "in parentheses the time over the per-entry loop's (below 1: faster)",
                "columns": [{"key": BEFORE, "label": BEFORE, "ratio": False},
                            *({"key": label, "label": label, "ratio": True} for label in (AFTER, REVERSE, FORWARD))],
                "rows": rows}
        print(f"wrote {tables.save(args.save, data).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
