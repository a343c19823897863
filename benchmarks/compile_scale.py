"""How long `sbp.compile` takes as models grow: 1,000, 10,000 and 100,000
parameters, and 1,000, 10,000 and 100,000 expression nodes.

    python benchmarks/compile_scale.py                      # every case, 600 s each at most
    python benchmarks/compile_scale.py --cases mlp,scalars --sizes 1000,10000 --timeout 300
    python benchmarks/compile_scale.py --save compile-scale-2026-12-06

The cases (each size N):

- `mlp`: parameters in matrices: X (64 x d) -> linear(h) -> tanh -> linear(1)
  -> MSE, with d*h + 2h + 1 close to N parameters.
- `scalars`: N separate scalar parameters p_k, loss sum_k tanh(p_k * x_k)
  (the issue's "many parameters": each its own leaf).
- `chain`: a long elementwise chain of one scalar input, e <- tanh(w e + x)
  repeated, with N distinct subexpressions in all (3 a link).
- `stack`: a deep stack of nn layers H <- tanh(linear(H, W_k, b_k)) on
  X (8 x 2), each layer's W_k 2 x 2 and b_k 1 x 2: N / 4 layers (about 4
  matrix nodes a layer).

Each case runs in a child process with a fresh cache folder (so the C is
built, not loaded), under `--timeout` seconds. Recorded: the declaration's
time, `sbp.compile`'s wall time (forward and value_and_grad, float64), its
stages as the "symbackprop" logger times them (lower, differentiate, emit,
C compile), its CPU seconds (Python, and the C compiler), the characters
of the C modules it generated, the distinct subexpressions
`pipeline.count_operations` counts, the child's peak memory, and how it ended: "ok", "refused" (the
ModelError's text, and how soon it came) or "timeout".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("mlp", "scalars", "chain", "stack")
SIZES = (1_000, 10_000, 100_000)


def _declare(case: str, size: int):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    if case == "mlp":
        d = 10 if size <= 1_000 else 100
        h = max(1, (size - 1) // (d + 2))
        X, T = sp.MatrixSymbol("X", 64, d), sp.MatrixSymbol("T", 64, 1)
        W1, b1, W2, b2 = (sp.MatrixSymbol("W1", d, h), sp.MatrixSymbol("b1", 1, h), sp.MatrixSymbol("W2", h, 1),
                          sp.MatrixSymbol("b2", 1, 1))
        out = nn.linear(nn.tanh(nn.linear(X, W1, b1)), W2, b2)
        return sbp.Model(f"scale_mlp_{size}", inputs=[X, T], params=[W1, b1, W2, b2], loss=nn.mse(out, T)), \
            d * h + 2 * h + 1
    if case == "scalars":
        ps, xs = sp.symbols(f"p0:{size}"), sp.symbols(f"x0:{size}")
        loss = sp.Add(*[sp.tanh(p * x) for p, x in zip(ps, xs)])
        return sbp.Model(f"scale_scalars_{size}", inputs=list(xs), params=list(ps), loss=loss), size
    if case == "chain":
        x, w = sp.symbols("x w")
        e = x
        for _ in range(size // 3):
            e = sp.tanh(w * e + x)
        return sbp.Model(f"scale_chain_{size}", inputs=[x], params=[w], loss=e), 1
    if case == "stack":
        X = sp.MatrixSymbol("X", 8, 2)
        H, params = X, []
        for k in range(size // 4):
            W, b = sp.MatrixSymbol(f"W{k}", 2, 2), sp.MatrixSymbol(f"b{k}", 1, 2)
            params += [W, b]
            H = nn.tanh(nn.linear(H, W, b))
        return sbp.Model(f"scale_stack_{size}", inputs=[X], params=params, loss=nn.sum_all(H)), 6 * (size // 4)
    raise SystemExit(f"unknown case {case!r}")


def child(case: str, size: int, cache: str) -> None:
    """One case, in this process: its record as JSON on the last line."""
    import logging
    import resource

    import symbackprop as sbp
    from symbackprop.pipeline import count_operations

    stages: dict[str, float] = {}

    class Stages(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            for name in ("lower", "differentiate", "emit", "C compile"):
                if text.startswith(name + " ") and ": " in text:
                    with contextlib.suppress(ValueError):
                        stages[name] = stages.get(name, 0.0) + float(text.split(": ", 1)[1].split(" s", 1)[0])

    logger = logging.getLogger("symbackprop")
    logger.setLevel(logging.INFO)
    logger.addHandler(Stages())
    record: dict = {"case": case, "size": size}
    start = time.perf_counter()
    model, params = _declare(case, size)
    record["declare_s"] = round(time.perf_counter() - start, 3)
    record["params"] = params
    record["subexpressions"] = count_operations([model.loss, *model.outputs.values()], 10**7)
    print(json.dumps(record), flush=True)  # what is known before compiling, should the compile time out
    start = time.perf_counter()
    try:
        sbp.compile(model, options=sbp.BuildOptions(cache_dir=Path(cache)))
        record["outcome"] = "ok"
    except sbp.ModelError as exc:
        record["outcome"] = "refused"
        record["message"] = str(exc)[:300]
    record["compile_s"] = round(time.perf_counter() - start, 3)
    record["stages_s"] = {k: round(v, 3) for k, v in stages.items()}
    record["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    record["cpu_s"] = {"python": round(mine.ru_utime + mine.ru_stime, 3),
                       "compiler": round(children.ru_utime + children.ru_stime, 3)}
    record["c_chars"] = sum(p.stat().st_size for p in Path(cache).glob("*/*.c") if not p.name.startswith("_sbp_"))
    print(json.dumps(record), flush=True)


def run_case(case: str, size: int, timeout: float, cache: Path) -> dict:
    folder = cache / f"{case}-{size}"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--child", case, str(size), str(folder)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        lines, tail = done.stdout, done.stderr
        outcome = None if done.returncode == 0 else f"crashed (exit {done.returncode})"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        lines = out.decode() if isinstance(out, bytes) else out
        tail, outcome = "", f"timeout after {timeout:.0f} s"
    records = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    record = records[-1] if records else {"case": case, "size": size}
    if outcome is not None:
        record["outcome"] = outcome
        if tail:
            record["stderr_tail"] = tail[-500:]
    record["wall_s"] = round(time.perf_counter() - start, 3)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one case may take")
    parser.add_argument("--save", help="write benchmarks/results/<name>.json")
    parser.add_argument("--cache", default=None, help="folder for the cases' fresh caches (default: a temporary one)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    import tempfile

    results = []
    with tempfile.TemporaryDirectory(prefix="sbp-scale-") as tmp:
        cache = Path(args.cache) if args.cache else Path(tmp)
        for case in args.cases.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                record = run_case(case, size, args.timeout, cache)
                results.append(record)
                print(json.dumps(record), flush=True)
                if args.save:  # after each case: a long run that is stopped keeps what it measured
                    _save(args.save, results, args)


_LABELS = {"mlp": "MLP, parameters in matrices", "scalars": "separate scalar parameters",
           "chain": "elementwise chain (subexpressions)", "stack": "deep stack of nn layers (nodes)"}


def _save(name: str, results: list[dict], args: argparse.Namespace) -> None:
    """The result file benchmarks/tables.py renders: a row a case, a column a
    size, each cell sbp.compile's seconds (to the refusal, where refused),
    and every record whole under "results"."""
    import subprocess

    out = HERE / "results" / f"{name}.json"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    sizes = sorted({r["size"] for r in results})
    rows = []
    for case in dict.fromkeys(r["case"] for r in results):
        mine = [r for r in results if r["case"] == case]
        row: dict = {"label": _LABELS.get(case, case),
                     "seconds": {str(r["size"]): r["compile_s"] for r in mine if r.get("compile_s") is not None}}
        refused = [f"{r['size']:,}" for r in mine if r["outcome"] == "refused"]
        timed_out = [f"{r['size']:,}" for r in mine if r["outcome"] == "timeout"]
        notes = ([f"at {', '.join(refused)}: a ModelError, the seconds until it came"] if refused else []) + \
            ([f"at {', '.join(timed_out)}: past the {args.timeout:.0f} s timeout"] if timed_out else [])
        if notes:
            row["note"] = "; ".join(notes)
        rows.append(row)
    out.write_text(json.dumps({
        "title": "Compile time by model size (sbp.compile: forward and value_and_grad, float64, a fresh cache)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load}",
        "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "command": f"python benchmarks/compile_scale.py --save {name}",
        "conditions": f"each case in a child process with a fresh cache folder, {args.timeout:.0f} s at most",
        "source": "benchmarks/compile_scale.py", "row_header": "case",
        "columns": [{"key": str(size), "label": f"{size:,}", "ratio": False} for size in sizes],
        "rows": rows, "timeout_s": args.timeout, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
