"""Combine several ``run.py --json`` files: per workload, dtype and variant,
the median over the runs of each run's median, and its ratio to
symbackprop's (the plain ``value_and_grad`` variant, combined the same way).

    python benchmarks/combine.py run1.json run2.json run3.json

On a noisy machine one run's medians can be off by tens of percent (a
burst of other work during one variant's samples); the median over runs
is what the READMEs quote.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run import BASELINE, _align, _t  # noqa: E402


def combine(runs: list[list[dict]]) -> list[dict]:
    """One row per (workload, dtype, variant) that was ``ok`` in some run."""
    groups: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            if r.get("status") == "ok":
                groups.setdefault((r["workload"], r["dtype"], r["variant"]), []).append(r)
    base = {(workload, dtype): statistics.median(r["median_s"] for r in rs)
            for (workload, dtype, variant), rs in groups.items() if variant == BASELINE}
    rows = []
    for (workload, dtype, variant), rs in groups.items():
        medians = [r["median_s"] for r in rs]
        median = statistics.median(medians)
        colds = [r["compile_cold_s"] for r in rs if r.get("compile_cold_s") is not None]
        b = base.get((workload, dtype))
        rows.append({
            "workload": workload, "dtype": dtype, "variant": variant, "runs": len(rs),
            "median_s": median, "run_medians_s": medians,
            "ratio": median / b if b else None,
            "compile_cold_s": statistics.median(colds) if colds else None,
            "c_lines": rs[-1].get("c_lines"),
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    key = lambda r: (r["workload"], r["dtype"] != "float64", r["variant"])
    table = [("workload", "dtype", "variant", "runs", "median of medians", f"/{BASELINE}",
              "run medians", "compile cold (median)", "C lines")]
    for r in sorted(rows, key=key):
        table.append((r["workload"], r["dtype"], r["variant"], r["runs"], _t(r["median_s"]),
                      f"{r['ratio']:.2f}" if r["ratio"] else "",
                      " ".join(_t(m) for m in r["run_medians_s"]),
                      _t(r["compile_cold_s"]), r["c_lines"] or ""))
    return "\n".join(_align(table))


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = [json.loads(Path(p).read_text())["results"] for p in paths]
    print(format_rows(combine(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
