"""Side-by-side benchmark: symbackprop against its peers.

    python benchmarks/run.py [--quick] [--workloads W1,W3] [--dtype float64,float32]
                             [--peers numpy_ref,symbackprop] [--threads 1]
                             [--json out.json] [--save NAME]

Each peer runs in subprocesses of its own, one after another, one for
each workload and dtype. Per workload and dtype a peer's gradients are checked against numpy_ref first; only peers
that pass are timed. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tables, workloads  # noqa: E402
from benchmarks.peers import PEERS  # noqa: E402

BASELINE = "symbackprop"


def main(argv=None) -> int:
    args = _parse(argv)
    records = []
    for peer in args.peers:
        print(f"[{time.strftime('%H:%M:%S')}] {peer} ...", file=sys.stderr, flush=True)
        records += run_peer(peer, args)
    print(format_table(records, args.workloads))
    if args.json:
        report = {"meta": _meta(args), "results": records}
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    if args.save:
        path = tables.save(args.save, results_file(records, args, argv))
        print(f"\nwrote {path.relative_to(ROOT)}: render it with <!-- table:{args.save} --> and benchmarks/tables.py")
    return 0


# --------------------------------------------------------------------------
# Running one peer


def run_peer(peer: str, args) -> list[dict]:
    """Run ``peer`` on every selected workload and dtype, each pair in a
    worker subprocess of its own (a process that has compiled one shape
    runs another slower: torch.compile's second shape in one process took
    about twice a fresh process's time); its records, plus one per missing
    workload/dtype where a worker died or ran out of time."""
    records: list[dict] = []
    for workload in args.workloads:
        for dtype in args.dtype:
            records += _run_shape(peer, workload, dtype, args)
            if any(r["status"] == "not installed" for r in records):
                return records  # the first worker said so: the others would too
    return records


def _run_shape(peer: str, workload, dtype: str, args) -> list[dict]:
    """One worker subprocess: ``peer`` on one workload and dtype."""
    with tempfile.TemporaryDirectory(prefix=f"sbp_bench_{peer}_") as tmp:
        out = Path(tmp) / "records.jsonl"
        cmd = [sys.executable, "-m", "benchmarks.worker", "--peer", peer,
               "--workloads", workload.name, "--dtypes", dtype,
               "--plan", "quick" if args.quick else "full",
               "--out", str(out)] + (["--batch", str(args.batch)] if args.batch else [])
        pin = None if args.no_pin else _pin_to_cpus(args.threads)
        status, detail = _run_worker(cmd, _worker_env(args, tmp), args.timeout, pin)
        records = _read_records(out)
    if status != "done":
        records += _missing(peer, records, [workload], [dtype], status, detail)
    return records


def _run_worker(cmd, env, timeout, preexec_fn):
    """('done' | 'timeout' | 'error', detail); the worker's process group is
    killed on timeout (it may have started compilers of its own)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=preexec_fn)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", f"peer subprocess exceeded {timeout:.0f} s"
    if proc.returncode != 0:
        return "error", f"worker exited {proc.returncode}: {output[-1500:]}"
    return "done", ""


def _pin_to_cpus(threads: int):
    """A preexec_fn confining the worker, and every thread any library starts
    in it, to ``threads`` CPUs (None when that is all of them): thread-count
    settings do not reach every pool (XLA's, for one)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if threads >= len(cpus):
        return None
    return lambda: os.sched_setaffinity(0, cpus[:threads])


def _worker_env(args, tmp: str) -> dict:
    threads = str(args.threads)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "SBP_BENCH_THREADS"):
        env[var] = threads
    env["SBP_BENCH_CACHE"] = str(Path(tmp) / "cache")  # fresh: first compile is cold
    env["SBP_BENCH_COMPILE_TIMEOUT"] = str(args.compile_timeout)
    env["SYMBACKPROP_CACHE_DIR"] = str(Path(tmp) / "symbackprop")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "torchinductor")
    env["JAX_PLATFORMS"] = "cpu"
    if args.threads == 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_cpu_multi_thread_eigen=false").strip()
    return env


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _missing(peer, records, selected, dtypes, status, detail) -> list[dict]:
    if any(r["status"] == "not installed" for r in records):
        return []
    seen = {(r.get("workload"), r.get("dtype")) for r in records}
    return [{"peer": peer, "variant": peer, "workload": w.name, "dtype": d,
             "status": status, "reason": detail}
            for w in selected for d in dtypes if (w.name, d) not in seen]


# --------------------------------------------------------------------------
# Reporting

COLUMNS = ("workload", "dtype", "peer", "status", "median", "min", "max",
           f"/{BASELINE}", f"/{BASELINE}.prep", "GFLOP/s", "compile cold", "cached",
           "max rel err")


def format_table(records: list[dict], selected) -> str:
    """A plain-text table of every record, then the reasons and notes."""
    order = {w.name: i for i, w in enumerate(selected)}
    present = sorted((r for r in records if r["status"] not in ("not installed", "init")),
                     key=lambda r: (order.get(r["workload"], 99), r["dtype"] != "float64"))
    lines = _align([COLUMNS] + [_row(r, records) for r in present])
    lines += [f"{r['peer']}: not installed ({r.get('reason', '')})"
              for r in records if r["status"] == "not installed"]
    first_init: dict[str, dict] = {}  # a peer's first worker's (each worker warms up)
    for r in records:
        if r["status"] == "init":
            first_init.setdefault(r["peer"], r)
    warmups = [f"{r['peer']} {_t(r['seconds'])}" for r in first_init.values() if r.get("seconds") is not None]
    if warmups:
        lines += ["", "one-off warm-up per peer process (not in the compile columns): "
                  + ", ".join(warmups)]
    notes = _notes(present)
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)


def _notes(records) -> list[str]:
    """Each distinct reason or note once, with the rows it applies to."""
    where: dict[tuple, list] = {}
    for r in records:
        for text in ([r["reason"]] if r.get("reason") else []) + r.get("notes", []):
            last_line = text.strip().splitlines()[-1] if text.strip() else text
            rows = where.setdefault((r["peer"], last_line), [])
            tag = f"{r['workload']}/{r['dtype']}"
            if tag not in rows:
                rows.append(tag)
    return [f"{peer} [{' '.join(rows)}]: {text}" for (peer, text), rows in where.items()]


def _row(r: dict, records: list[dict]) -> tuple:
    ok = r["status"] == "ok"
    base = _baseline_medians(records, r["workload"], r["dtype"])
    ratio = lambda b: f"{r['median_s'] / b:.2f}" if ok and b else ""
    gflops = f"{r['gflops']:.2f}" if ok and r.get("gflops") and r["workload"] == "W3" else ""
    err = r.get("max_rel_err")
    return (r["workload"], r["dtype"], r["variant"], r["status"],
            _t(r.get("median_s")), _t(r.get("min_s")), _t(r.get("max_s")),
            ratio(base.get(BASELINE)), ratio(base.get(f"{BASELINE}.prepared")), gflops,
            _t(r.get("compile_cold_s")), _t(r.get("compile_cached_s")),
            f"{err:.1e}" if err is not None else "")


def _baseline_medians(records, workload, dtype) -> dict:
    return {r["variant"]: r["median_s"] for r in records
            if r["peer"] == BASELINE and r["status"] == "ok"
            and r["workload"] == workload and r["dtype"] == dtype}


_t = tables.format_seconds


def results_file(records: list[dict], args, argv=None) -> dict:
    """The run as a result file of benchmarks/results/ (its fields: benchmarks/tables.py):
    a row per workload and dtype, a column per peer variant, the medians of the peers that passed."""
    meta = _meta(args)
    variants = list(dict.fromkeys(r["variant"] for r in records if r["status"] == "ok"))
    rows = {}
    for r in records:
        if r["status"] == "ok":
            row = rows.setdefault((r["workload"], r["dtype"]), {"label": f"{r['workload']} {r['dtype']}", "seconds": {}})
            row["seconds"][r["variant"]] = r["median_s"]
    return {
        "title": "benchmarks/run.py, time per call", **tables.provenance(),
        "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "conditions": f"{args.threads} thread(s) a peer, {meta['plan']} plan, medians",
        "source": "written by benchmarks/run.py --save", "meta": meta, "row_header": "workload",
        "baseline": BASELINE if BASELINE in variants else None,
        "columns": [{"key": v, "label": v, "ratio": v != BASELINE} for v in variants],
        "rows": list(rows.values()),
    }


def _align(rows) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
    return [fmt(rows[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows[1:]]


def _meta(args) -> dict:
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "batch": args.batch,
        "pinned": not args.no_pin,
        "plan": "quick" if args.quick else "full",
        "workloads": {w.name: {"description": w.description, "flops": w.flops}
                      for w in args.workloads},
        "dtypes": args.dtype,
    }


def _parse(argv):
    p = argparse.ArgumentParser(description="symbackprop side-by-side benchmark")
    p.add_argument("--quick", action="store_true", help="fewer, shorter samples")
    p.add_argument("--workloads", default=None, help="comma-separated, e.g. W1,W3")
    p.add_argument("--dtype", default="float64,float32", help="float64,float32")
    p.add_argument("--peers", default=None, help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--threads", type=int, default=1, help="BLAS/intra-op threads per peer")
    p.add_argument("--batch", type=int, default=None,
                   help="rows of the batch MLPs' X (W1, W3, W4) instead of their own")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin each peer process to --threads CPUs")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per peer subprocess (default 1800, 600 with --quick)")
    p.add_argument("--compile-timeout", type=float, default=300.0,
                   help="seconds one C compile may take")
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--save", default=None, metavar="NAME",
                   help="write the medians to benchmarks/results/NAME.json, which benchmarks/tables.py renders")
    args = p.parse_args(argv)
    args.peers = [s.strip() for s in args.peers.split(",")] if args.peers else list(PEERS)
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        p.error(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    try:
        args.workloads = workloads.get(args.workloads, args.batch)
    except KeyError as exc:
        p.error(exc.args[0])
    args.dtype = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not args.dtype or set(args.dtype) - set(workloads.DTYPES):
        p.error(f"--dtype must be a comma list of {', '.join(workloads.DTYPES)}")
    if args.timeout is None:
        args.timeout = 600.0 if args.quick else 1800.0
    return args


if __name__ == "__main__":
    sys.exit(main())
