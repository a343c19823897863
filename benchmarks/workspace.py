"""Working memory of one value-and-gradient call: symbackprop beside numpy.

    python benchmarks/workspace.py --workload W3 --batch 128,1024,8192 --save NAME

symbackprop's is the module's own account (`mod.memory(n=...)`: the
workspace `value_and_grad` allocates, in bytes); numpy's is measured: the
peak of what `tracemalloc` sees numpy allocate during one call of the
`numpy_ref` peer's hand-written forward and backward pass (numpy reports
its array buffers to tracemalloc), the inputs and parameters allocated
before. Both are shown without the gradients a call returns (they are the
call's result, the same size in every library): numpy's peak minus the
gradients' bytes, symbackprop's workspace as it is (its gradients are
separate output arrays). Saved with `"unit": "bytes"` (benchmarks/tables.py
renders KiB and MiB), the ratio numpy's over symbackprop's.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tables, workloads  # noqa: E402


def numpy_peak(workload, dtype: str) -> tuple[int, int]:
    """(peak bytes numpy allocates in one call, bytes of the gradients it returns)."""
    from benchmarks.peers import numpy_ref

    inputs, params = workload.make_data(dtype)
    call = numpy_ref.setup(workload, dtype, inputs, params)[0].call
    call()  # warm-up
    tracemalloc.start()
    tracemalloc.reset_peak()
    _, grads = call()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, sum(g.nbytes for g in grads.values())


def symbackprop_workspace(workload, dtype: str, batches: list[int]) -> dict[int, int]:
    """value_and_grad's workspace in bytes at each batch size."""
    import symbackprop as sbp
    from benchmarks.peers import symbackprop as peer

    mod = sbp.compile(peer.build_model(workload), dtype=dtype)
    return {batch: int(mod.memory(n=batch)["value_and_grad"]) for batch in batches}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W3")
    p.add_argument("--batch", default="128,1024,8192", help="comma list of batch sizes (rows of X)")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--save", default=None, metavar="NAME")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    base = workloads.get(args.workload)[0]
    ours = symbackprop_workspace(base, args.dtype, batches)
    rows = []
    for batch in batches:
        peak, grads = numpy_peak(replace(base, batch=batch), args.dtype)
        size = 8 if args.dtype == "float64" else 4
        print(f"{args.workload} n={batch} {args.dtype}: symbackprop {ours[batch]} B ({ours[batch] / size / batch:.1f} n reals), "
              f"numpy peak {peak} B less gradients {grads} B = {peak - grads} B ({(peak - grads) / size / batch:.1f} n reals), "
              f"ratio {(peak - grads) / ours[batch]:.2f}", flush=True)
        rows.append({"label": f"{args.workload} batch {batch}, {args.dtype}",
                     "seconds": {"symbackprop": ours[batch], "numpy": peak - grads}})
    if args.save:
        data = {"title": f"{args.workload}: working memory of one value-and-gradient call", **tables.provenance(),
                "command": "python benchmarks/workspace.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                "conditions": "symbackprop: mod.memory(n=batch)['value_and_grad'], the workspace its call allocates; "
                              "numpy: the tracemalloc peak of one numpy_ref call less the gradients it returns",
                "source": "written by benchmarks/workspace.py --save", "row_header": "workload", "unit": "bytes",
                "baseline": "symbackprop",
                "columns": [{"key": "symbackprop", "label": "symbackprop", "ratio": False},
                            {"key": "numpy", "label": "numpy", "ratio": True}],
                "rows": rows}
        print(f"wrote {tables.save(args.save, data).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
