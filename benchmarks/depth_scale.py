"""How long declaring and compiling take as models grow deep: a tanh MLP of
10, 100 and 1,000 layers, a residual chain of as many steps and a GRU
unrolled 10 to 1,000 steps, on two
versions of symbackprop's code (before and after a change), interleaved.

    taskset -c 1 python benchmarks/depth_scale.py --before /work/main --save depth-scale-2026-12-07
    git archive BEFORE | tar -x -C /tmp/before    # a fixed tree, while main moves
    taskset -c 1 python benchmarks/depth_scale.py --before /tmp/before --before-commit BEFORE ...
    python benchmarks/depth_scale.py --cases gru --sizes 10,300 --timeout 120

The cases (each size N):

- `mlp`: X (16 x 8) -> N times H <- nn.tanh(nn.linear(H, W_k, b_k)), W_k
  8 x 8, b_k 1 x 8 -> nn.mse against T.
- `residual`: the same, each layer added to its input: H <- H +
  nn.tanh(nn.linear(H, W_k, b_k)).
- `gru`: nn.gru_cell of hidden 8 on X (16 x 8) unrolled N steps from the
  zero state (the same weights each step) -> nn.mse against T.

Each case runs in a child process with a fresh cache folder (so the C is
built, not loaded) and its version's code first on PYTHONPATH, under
`--timeout` seconds; for each case the versions alternate, so both see the
same load. Recorded: the declaration's seconds (the model and its loss:
wall and CPU), `sbp.compile`'s (forward and value_and_grad, float64: wall,
and CPU including the C compiler's), its stages as the "symbackprop"
logger times them, and how it ended: "ok", "refused" (a ModelError),
"error" (any other exception, e.g. a RecursionError, with its text) or
"timeout". Pin it to one CPU (taskset -c 1): the children inherit it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("mlp", "residual", "gru")
SIZES = {"mlp": (10, 100, 1_000), "residual": (10, 100, 300, 1_000), "gru": (10, 40, 100, 300, 1_000)}
BATCH, WIDTH = 16, 8
LABELS = {"mlp": "tanh MLP, width 8, {n:,} layers", "residual": "residual tanh chain, width 8, {n:,} steps",
          "gru": "GRU, hidden 8, {n:,} steps"}


def declare(case: str, size: int):
    """The model of a case, declared with symbackprop's public API only (it runs on either version)."""
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    X, T = sp.MatrixSymbol("X", BATCH, WIDTH), sp.MatrixSymbol("T", BATCH, WIDTH)
    if case in ("mlp", "residual"):
        h, params = X, []
        for k in range(size):
            W, b = sp.MatrixSymbol(f"W{k}", WIDTH, WIDTH), sp.MatrixSymbol(f"b{k}", 1, WIDTH)
            params += [W, b]
            layer = nn.tanh(nn.linear(h, W, b))
            h = h + layer if case == "residual" else layer
    elif case == "gru":
        weights = [[sp.MatrixSymbol(f"{kind}{gate}", *shape) for gate in "rzh"]
                   for kind, shape in (("W", (WIDTH, WIDTH)), ("U", (WIDTH, WIDTH)), ("b", (1, WIDTH)))]
        params = [s for group in weights for s in group]
        h = None
        for _ in range(size):
            h = nn.gru_cell(X, h, *weights)
    else:
        raise SystemExit(f"unknown case {case!r}")
    return sbp.Model(f"depth_{case}_{size}", inputs=[X, T], params=params, loss=nn.mse(h, T))


def _stage_times() -> dict[str, float]:
    """Seconds of each stage, as the "symbackprop" logger reports them (filled as it logs)."""
    import logging

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
    return stages


def _cpu() -> float:
    """CPU seconds of this process and the children it waited for (the C compiler)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _ended(record: dict, exc: BaseException) -> None:
    import symbackprop as sbp

    record["outcome"] = "refused" if isinstance(exc, sbp.ModelError) else "error"
    record["message"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def child(case: str, size: int, cache: str) -> None:
    """One case, in this process: its record as JSON on the last line."""
    import symbackprop as sbp

    stages = _stage_times()
    record: dict = {"case": case, "size": size}
    wall, cpu = time.perf_counter(), _cpu()
    try:
        model = declare(case, size)
    except Exception as exc:  # a RecursionError is what is measured
        _ended(record, exc)
        print(json.dumps(record), flush=True)
        return
    record["declare_s"], record["declare_cpu_s"] = round(time.perf_counter() - wall, 3), round(_cpu() - cpu, 3)
    print(json.dumps(record), flush=True)  # what is known before compiling, should the compile time out
    wall, cpu = time.perf_counter(), _cpu()
    try:
        sbp.compile(model, options=sbp.BuildOptions(cache_dir=Path(cache)))
        record["outcome"] = "ok"
    except Exception as exc:  # recorded: the outcome is what is measured
        _ended(record, exc)
    record["compile_s"], record["compile_cpu_s"] = round(time.perf_counter() - wall, 3), round(_cpu() - cpu, 3)
    record["stages_s"] = {k: round(v, 3) for k, v in stages.items()}
    record["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(record), flush=True)


def run_case(case: str, size: int, code: Path, timeout: float, cache: Path) -> dict:
    """One case in a child process on `code`'s symbackprop, a fresh cache folder."""
    folder = Path(tempfile.mkdtemp(prefix=f"{case}-{size}-", dir=cache))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [sys.executable, __file__, "--child", case, str(size), str(folder)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        lines, outcome = done.stdout, None if done.returncode == 0 else f"crashed (exit {done.returncode})"
        tail = done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        lines, tail, outcome = out.decode() if isinstance(out, bytes) else out, "", "timeout"
    records = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    record = records[-1] if records else {"case": case, "size": size}
    if outcome is not None:
        record["outcome"] = outcome
        if tail:
            record["stderr_tail"] = tail[-500:]
    record["wall_s"] = round(time.perf_counter() - start, 3)
    return record


def _commit(code: Path, given: str | None) -> str:
    """`given` (a tree exported with git archive has no history), else the tree's HEAD."""
    if given:
        return given
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=code)
    return found.stdout.strip() or "unknown"


def results_file(results: list[dict], versions: dict[str, Path], args: argparse.Namespace, argv: list[str]) -> dict:
    """The result file benchmarks/tables.py renders: a row a case and size, a
    column a version's declaration and compile CPU seconds; every record
    whole under "results"."""
    rows = []
    for case, size in dict.fromkeys((r["case"], r["size"]) for r in results):
        mine = {r["version"]: r for r in results if (r["case"], r["size"]) == (case, size)}
        seconds = {f"{stage}_{v}": mine[v][f"{stage}_cpu_s"] for v in mine for stage in ("declare", "compile")
                   if mine[v].get(f"{stage}_cpu_s") is not None and (stage == "declare" or mine[v]["outcome"] == "ok")}
        notes = [f"{v}: {r['outcome']}" + (f" ({r['message'][:120]})" if r.get("message") else "")
                 for v, r in mine.items() if r.get("outcome") != "ok"]
        row: dict = {"label": LABELS[case].format(n=size), "seconds": seconds}
        if notes:
            row["note"] = "; ".join(notes)
        rows.append(row)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    columns = [{"key": f"{stage}_{v}", "label": f"{stage} ({v})", "ratio": False}
               for stage in ("declare", "compile") for v in versions]
    return {
        "title": "Declaring and compiling deep models (CPU seconds; sbp.compile: forward and value_and_grad, "
                 "float64, a fresh cache)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load}",
        "date": time.strftime("%Y-%m-%d"),
        "commit": ", ".join(f"{v} {_commit(code, getattr(args, f'{v}_commit'))}" for v, code in versions.items()),
        "command": "python benchmarks/depth_scale.py " + " ".join(argv),
        "conditions": (f"each case in a child process with a fresh cache folder, {args.timeout:.0f} s at most, "
                       f"the versions alternating case by case; CPU affinity {sorted(os.sched_getaffinity(0))}; "
                       "compile's CPU includes the C compiler's"),
        "source": "benchmarks/depth_scale.py", "row_header": "model",
        "baseline": None, "columns": columns, "rows": rows,
        "versions": {v: str(code) for v, code in versions.items()}, "timeout_s": args.timeout, "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sizes", help="the sizes of every case (default: each case's own)")
    parser.add_argument("--before", help="the code root to compare with (e.g. a checkout of main)")
    parser.add_argument("--before-commit", help="the before tree's commit, where it is no git checkout")
    parser.add_argument("--after-commit", help="this tree's commit, where it is no git checkout")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one case may take")
    parser.add_argument("--save", help="write benchmarks/results/<name>.json")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    versions = {"before": Path(args.before).resolve()} if args.before else {}
    versions["after"] = HERE.parent
    results = []
    with tempfile.TemporaryDirectory(prefix="sbp-depth-") as cache:
        for case in args.cases.split(","):
            sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES[case]
            for size in sizes:
                for version, code in versions.items():
                    record = {"version": version, **run_case(case, size, code, args.timeout, Path(cache))}
                    results.append(record)
                    print(json.dumps(record), flush=True)
                    if args.save:  # after each case: a long run that is stopped keeps what it measured
                        out = HERE / "results" / f"{args.save}.json"
                        out.write_text(json.dumps(results_file(results, versions, args, argv), indent=1) + "\n")


if __name__ == "__main__":
    main()
