"""GradBench ports: validate, then time symbackprop against JAX and PyTorch.

    python benchmarks/gradbench/run.py [--evals lse,gmm] [--small] [--quick]
                                       [--peers symbackprop,jax,torch,torch_compile,manual]
                                       [--compile-timeout 60] [--scaling] [--json out.json] [--save NAME]
                                       [--sizes "simple n=100,complicated n=1000"] [--clock cpu]

Per eval (at its default size, or its smallest with --small): symbackprop's
cold and cached compile time, each in a fresh process (cold: an empty
SYMBACKPROP_CACHE_DIR; cached: the same folder again), capped at
--compile-timeout; then every peer's primal and derivative are checked against
the numpy reference (the derivative against JAX's where the eval has no numpy
derivative) and, for symbackprop, against finite differences where the eval
defines them; the peers that pass are timed, interleaved (one sample of each
call in turn, repeated), one thread, pinned to one CPU (--no-pin: not);
compiles (symbackprop's probe, JAX's jit, torch.compile) run on every CPU
the process had, as a user's would. --sizes names sizes of the eval's SIZES
by their labels, in place of its default. --scaling times each eval at its 3-4
SCALING sizes and prints the slope of log(time) against log(work).
"""

from __future__ import annotations

import os
import sys

# one thread for every library, before any of them is imported
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import tables  # noqa: E402
from benchmarks.gradbench import EVALS  # noqa: E402
from benchmarks.gradbench._common import (  # noqa: E402
    Unsupported,
    build_models,
    max_rel_error,
    sbp_compile,
    sbp_compile_models,
    to_numpy,
)
from benchmarks.measure import PLANS, TOLERANCE, _calibrate, _sample, _warm_up  # noqa: E402
from benchmarks.run import _align, _t  # noqa: E402

PEERS = ("symbackprop", "jax", "torch", "torch_compile", "manual")
TOL = TOLERANCE["float64"]


def load(name: str):
    return importlib.import_module(f"benchmarks.gradbench.{name}")


# --------------------------------------------------------------------------
# symbackprop: compile (in a probe process, for cold/cached times and a cap)


def probe(name: str, size: dict) -> None:
    """(In a subprocess) compile and print the seconds as JSON."""
    E = load(name)
    t0 = time.perf_counter()
    models = build_models(E, size)
    t1 = time.perf_counter()
    sbp_compile_models(E, models)
    t2 = time.perf_counter()
    print(json.dumps({"declare_s": t1 - t0, "compile_s": t2 - t1}))


# The CPUs this process had before main pinned it to one. Calls are timed
# pinned; compiles are not: symbackprop's C compiler runs a large module's
# units on every CPU, and a peer's compiler may use threads too (pinned, the
# probe compiled saddle's four units one after another: 2.19 s, against
# 1.05 s).
_ALL_CPUS: set[int] | None = None


@contextlib.contextmanager
def every_cpu():
    """While compiling: this process (and what it starts) on every CPU it had before it was pinned."""
    if _ALL_CPUS is None:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def compile_probe(name: str, size: dict, cache: str, timeout: float) -> dict:
    env = dict(os.environ, SYMBACKPROP_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks.gradbench.run", "--probe", name, "--size", json.dumps(size)]
    try:
        with every_cpu():  # (the probe process inherits this process's CPUs)
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                                 start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"compile did not finish in {timeout:.0f} s"}
    if out.returncode != 0:
        return {"status": "error", "reason": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return {"status": "ok", **json.loads(out.stdout.strip().splitlines()[-1])}


# --------------------------------------------------------------------------
# Peers, validation, timing


def peer_calls(E, peer: str, data: dict, mod) -> tuple:
    """(primal, derivative, {compile seconds}) for one peer."""
    if peer == "symbackprop":
        p, d = E.sbp_calls(mod, data)
        return p, d, {}
    if peer == "jax":
        return E.jax_calls(data)
    if peer in ("torch", "torch_compile"):
        return E.torch_calls(data, peer == "torch_compile")
    if peer == "manual":  # GradBench's hand-written C++, where GB_MANUAL_DIR has it (manual.py)
        from benchmarks.gradbench import manual

        return (*manual.calls(E.NAME, data), {})
    raise ValueError(peer)


def validate(E, peer: str, primal, derivative, data: dict, ref: tuple, jax_deriv) -> dict:
    """Relative errors of a peer's outputs; 'ok' when every one is below TOL."""
    ref_p, ref_d = ref
    errors = {"primal": max_rel_error(to_numpy(primal()), ref_p)}
    got_d = to_numpy(derivative())
    if ref_d is not None:
        errors["derivative"] = max_rel_error(got_d, ref_d)
    elif jax_deriv is not None and peer != "jax":
        errors["derivative_vs_jax"] = max_rel_error(got_d, jax_deriv)
    if peer == "symbackprop" and hasattr(E, "fd_error"):
        errors["finite_differences"] = E.fd_error(data, got_d)
    fd_tol = 1e-5
    ok = all((v < fd_tol if k == "finite_differences" else v < TOL) for k, v in errors.items())
    return {"errors": errors, "ok": ok}


def time_interleaved(calls: dict, plan, clock: str = "wall") -> dict:
    """Median, min and max seconds per call of each no-argument call,
    sampling them in turn (one sample each, repeated) so that machine noise
    falls on all of them alike (clock "cpu": the process's CPU time, for a
    loaded machine). Reuses benchmarks/measure.py's helpers."""
    inner = {}
    for key, call in calls.items():
        _warm_up(call, plan.warmup_s)
        inner[key] = _calibrate(call, plan.sample_s)
    sample = _sample if clock == "wall" else _cpu_sample
    samples: dict = {key: [] for key in calls}
    start = time.perf_counter()
    for _ in range(plan.samples):
        for key, call in calls.items():
            samples[key].append(sample(call, inner[key]) / inner[key] / 1e9)
        if time.perf_counter() - start > plan.budget_s * len(calls) and len(samples[key]) >= plan.min_samples:
            break
    return {key: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "samples": len(v)}
            for key, v in samples.items()}


def _cpu_sample(call, inner: int) -> int:
    """measure._sample's nanoseconds, of this process's CPU time."""
    t0 = time.process_time_ns()
    for _ in range(inner):
        call()
    return time.process_time_ns() - t0


def run_eval(name: str, size: dict, args, cache_root: Path) -> dict:
    E = load(name)
    rec: dict = {"eval": name, "size": size, "label": E.label(size), "primal": E.PRIMAL,
                 "derivative": E.DERIVATIVE, "peers": {}}
    print(f"[{time.strftime('%H:%M:%S')}] {name} {E.label(size)}", file=sys.stderr, flush=True)
    data = E.generate(size)
    ref = E.reference(data)
    mod = None
    if "symbackprop" in args.peers:
        cache = str(cache_root / f"{name}_{E.label(size)}".replace(",", "_").replace("=", "").replace(" ", "_"))
        cold = compile_probe(name, size, cache, args.compile_timeout)
        cached = compile_probe(name, size, cache, args.compile_timeout) if cold["status"] == "ok" else None
        rec["sbp_compile"] = {"cold": cold, "cached": cached}
        if cold["status"] == "ok":
            os.environ["SYMBACKPROP_CACHE_DIR"] = cache
            with every_cpu():
                mod = sbp_compile(E, size)
    calls, jax_deriv = {}, None
    for peer in [p for p in ("jax", *args.peers) if p in args.peers or p == "jax"]:
        if peer in calls or (peer == "jax" and "jax" in rec["peers"]):
            continue
        entry: dict = {}
        rec["peers"][peer] = entry
        if peer == "symbackprop" and mod is None:
            entry.update(status="compile " + rec["sbp_compile"]["cold"]["status"],
                         reason=str(rec["sbp_compile"]["cold"].get("reason", "")))
            continue
        try:
            with every_cpu():  # (a peer compiles here: JAX's jit, torch.compile)
                p, d, seconds = peer_calls(E, peer, data, mod)
        except Unsupported as exc:
            entry.update(status="unsupported", reason=str(exc))
            continue
        except Exception as exc:  # a peer's failure is reported, the others still run
            entry.update(status="error", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            if args.verbose:
                traceback.print_exc()
            continue
        entry["compile_s"] = seconds
        if peer == "jax" and ref[1] is None:
            jax_deriv = to_numpy(d())
        try:
            check = validate(E, peer, p, d, data, ref, jax_deriv)
        except Exception as exc:
            entry.update(status="error", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            continue
        entry.update(check)
        entry["status"] = "ok" if check["ok"] else "failed verification"
        if check["ok"] and peer in args.peers:
            calls[(peer, "primal")] = p
            calls[(peer, "derivative")] = d
    if "jax" not in args.peers:
        rec["peers"].pop("jax", None)
    if not args.no_timing and calls:
        times = time_interleaved(calls, PLANS[args.plan], args.clock)
        for (peer, fn), t in times.items():
            rec["peers"][peer][fn] = t
    return rec


# --------------------------------------------------------------------------
# Reporting


def format_tables(records: list) -> str:
    rows = [("eval", "size", "function", "peer", "status", "median", "min", "/symbackprop", "max rel err", "fd err")]
    notes = []
    for r in records:
        base = r["peers"].get("symbackprop", {})
        for fn in ("primal", "derivative"):
            for peer, e in r["peers"].items():
                t = e.get(fn)
                b = base.get(fn)
                ratio = f"{t['median_s'] / b['median_s']:.2f}" if t and b else ""
                errs = e.get("errors", {})
                err = errs.get("primal") if fn == "primal" else errs.get("derivative", errs.get("derivative_vs_jax"))
                fd = errs.get("finite_differences") if fn == "derivative" else None
                rows.append((r["eval"], r["label"], f"{fn} ({r[fn]})", peer, e.get("status", ""),
                             _t(t and t["median_s"]), _t(t and t["min_s"]), ratio,
                             f"{err:.1e}" if err is not None else "", f"{fd:.1e}" if fd is not None else ""))
        for peer, e in r["peers"].items():
            if e.get("reason"):
                notes.append(f"{r['eval']} {r['label']} {peer}: {e['reason']}")
    lines = _align(rows)
    lines += ["", "ratio: peer median / symbackprop median on the same call (above 1: symbackprop is faster)",
              "max rel err: against the numpy reference (derivatives: against JAX's where the eval has no numpy",
              "derivative; blank for JAX itself there); fd err: symbackprop's derivative against central differences"]
    comp = [("eval", "size", "symbackprop cold", "cached", "jax primal+derivative", "torch.compile first calls")]
    for r in records:
        c = r.get("sbp_compile") or {}
        cold, cached = c.get("cold") or {}, c.get("cached") or {}
        show = lambda d: _t(d["compile_s"]) if d.get("status") == "ok" else d.get("status", "")  # noqa: E731
        jx = r["peers"].get("jax", {}).get("compile_s") or {}
        tc = r["peers"].get("torch_compile", {}).get("compile_s") or {}
        comp.append((r["eval"], r["label"], show(cold), show(cached), _t(sum(jx.values())) if jx else "",
                     _t(sum(tc.values())) if tc else ""))
    lines += ["", "compile time (symbackprop: sbp.compile in a fresh process; cold: empty cache folder; every CPU):"]
    lines += _align(comp)
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)


def scaling(names, args, cache_root: Path) -> list:
    out = []
    for name in names:
        E = load(name)
        points = []
        for size in E.SCALING:
            rec = run_eval(name, size, args, cache_root)
            points.append(rec)
        fit = {}
        for peer in args.peers:
            for fn in ("primal", "derivative"):
                xs = [np.log(E.work(r["size"])) for r in points if r["peers"].get(peer, {}).get(fn)]
                ys = [np.log(r["peers"][peer][fn]["median_s"]) for r in points if r["peers"].get(peer, {}).get(fn)]
                if len(xs) >= 2:
                    fit[f"{peer} {fn}"] = float(np.polyfit(xs, ys, 1)[0])
        out.append({"eval": name, "points": points, "slopes": fit})
    return out


def format_scaling(results: list) -> str:
    rows = [("eval", "size", "work", "peer", "primal", "derivative")]
    slopes = []
    for s in results:
        E = load(s["eval"])
        for r in s["points"]:
            for peer, e in r["peers"].items():
                rows.append((s["eval"], r["label"], f"{E.work(r['size']):.3g}", peer,
                             _t(e.get("primal", {}).get("median_s")) or e.get("status", ""),
                             _t(e.get("derivative", {}).get("median_s"))))
        slopes.append(f"  {s['eval']}: " + ", ".join(f"{k} {v:.2f}" for k, v in s["slopes"].items()))
    return "\n".join(_align(rows) + ["", "slope of log(time) vs log(work) (1: cost grows as the work):"] + slopes)


def main(argv=None) -> int:
    args = parse(argv)
    if args.probe:
        probe(args.probe, json.loads(args.size))
        return 0
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        global _ALL_CPUS
        _ALL_CPUS = os.sched_getaffinity(0)
        os.sched_setaffinity(0, sorted(_ALL_CPUS)[:1])
    with tempfile.TemporaryDirectory(prefix="sbp_gradbench_") as tmp:
        cache_root = Path(tmp)
        report: dict = {"meta": meta(args)}
        if args.scaling:
            report["scaling"] = scaling(args.evals, args, cache_root)
            print(format_scaling(report["scaling"]))
        else:
            records = [run_eval(name, size, args, cache_root)
                       for name in args.evals for size in chosen_sizes(load(name), args)]
            report["results"] = records
            print(format_tables(records))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"\nwrote {args.json}")
    if args.save:  # (with --scaling, a row per eval and size)
        records = report.get("results") or [r for s in report["scaling"] for r in s["points"]]
        path = tables.save(args.save, results_file(records, args, argv))
        print(f"\nwrote {path.relative_to(ROOT)}: render it with <!-- table:{args.save} --> and benchmarks/tables.py")
    return 0


def chosen_sizes(E, args) -> list:
    """The sizes --sizes names (by label, among the eval's SIZES), else its smallest or default."""
    if not args.sizes:
        return [E.SMALL if args.small else E.DEFAULT]
    by_label = {E.label(size): size for size in E.SIZES}
    names = size_labels(args.sizes, by_label)
    unknown = [name for name in names if name not in by_label]
    if unknown:
        raise SystemExit(f"{E.NAME} has no size {unknown}; its sizes: {sorted(by_label)}")
    return [by_label[name] for name in names]


def size_labels(parts: list, known) -> list:
    """The labels in --sizes' comma list, whose labels hold commas of their
    own ("k=10,n=1000,d=8"): its parts joined until they make a known label."""
    names, pending = [], []
    for part in parts:
        pending.append(part)
        if ",".join(pending) in known:
            names.append(",".join(pending))
            pending = []
    return names + ([",".join(pending)] if pending else [])


def results_file(records: list, args, argv=None) -> dict:
    """The run as a result file of benchmarks/results/ (fields: benchmarks/tables.py): a row per
    eval, each peer's primal and derivative as columns, the medians of peers that passed."""
    rows = []
    for r in records:
        seconds, fastest = {}, {}
        for peer, entry in r["peers"].items():
            for fn, key in (("primal", f"{peer}.primal"), ("derivative", peer)):
                if entry.get("status") == "ok" and entry.get(fn):
                    seconds[key], fastest[key] = entry[fn]["median_s"], entry[fn]["min_s"]
        rows.append({"label": f"{r['eval']} {r['label']}, {r['derivative']}", "seconds": seconds, "fastest": fastest})
    peers = [p for p in args.peers if any(p in row["seconds"] for row in rows)]
    columns = primal_columns(peers, rows)
    columns += [{"key": p, "label": f"{p} derivative", "ratio": p != "symbackprop"} for p in peers]
    return {"title": "GradBench's evals, time per call", **tables.provenance(),
            "command": " ".join(["python benchmarks/gradbench/run.py", *(sys.argv[1:] if argv is None else argv)]),
            "conditions": f"every peer's results checked first; calls timed interleaved, {args.plan} plan, "
                          f"{'CPU time' if getattr(args, 'clock', 'wall') == 'cpu' else 'wall clock'}, "
                          f"{'pinned to one CPU' if not args.no_pin else 'not pinned'}, medians",
            "source": _source(peers), "meta": meta(args), "row_header": "eval",
            "baseline": "symbackprop" if "symbackprop" in peers else None, "columns": columns, "rows": rows}


def primal_columns(peers: list, rows: list) -> list:
    """A column for each peer's primal that some row has, symbackprop's first (no ratio: the
    ratios are to symbackprop's derivative)."""
    keys = [f"{p}.primal" for p in sorted(peers, key=lambda p: p != "symbackprop")]
    return [{"key": k, "label": f"{k.split('.')[0]} primal", "ratio": False} for k in keys
            if any(k in row["seconds"] for row in rows)]


def _source(peers: list) -> str:
    source = "written by benchmarks/gradbench/run.py --save"
    if "manual" in peers:
        from benchmarks.gradbench import manual

        source += "; " + manual.SOURCE
    return source


def meta(args) -> dict:
    versions = {}
    for mod in ("numpy", "jax", "torch", "sympy"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except Exception:
            versions[mod] = None
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "pinned": not args.no_pin,
            "plan": args.plan, "clock": getattr(args, "clock", "wall"), "small": args.small, "versions": versions}


def parse(argv):
    p = argparse.ArgumentParser(description="GradBench ports: symbackprop vs JAX and PyTorch")
    p.add_argument("--evals", default=",".join(EVALS), help=f"comma list of {','.join(EVALS)}")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {','.join(PEERS)}")
    p.add_argument("--small", action="store_true", help="each eval's smallest size instead of its default")
    p.add_argument("--quick", action="store_true", help="fewer, shorter timing samples")
    p.add_argument("--scaling", action="store_true", help="cost versus size: each eval at its SCALING sizes")
    p.add_argument("--sizes", default=None, help="comma list of size labels (as the tables print them)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    p.add_argument("--compile-timeout", type=float, default=60.0, help="seconds a symbackprop compile may take")
    p.add_argument("--no-timing", action="store_true", help="validate only")
    p.add_argument("--no-pin", action="store_true", help="do not pin this process to one CPU")
    p.add_argument("--verbose", action="store_true", help="print peers' tracebacks")
    p.add_argument("--json", default=None, help="write every result to this file")
    p.add_argument("--save", default=None, metavar="NAME",
                   help="write the medians to benchmarks/results/NAME.json, which benchmarks/tables.py renders")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.evals = [e.strip() for e in args.evals.split(",") if e.strip()]
    args.peers = [e.strip() for e in args.peers.split(",") if e.strip()]
    args.sizes = [e.strip() for e in args.sizes.split(",") if e.strip()] if args.sizes else None
    if set(args.evals) - set(EVALS) or set(args.peers) - set(PEERS):
        p.error(f"evals must be among {EVALS}; peers among {PEERS}")
    args.plan = "quick" if args.quick else "full"
    return args


if __name__ == "__main__":
    sys.exit(main())
