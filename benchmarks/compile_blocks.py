"""How `sbp.compile` grows with repeated structure: N blocks of the same
shape, different weights. The goal is that N costs little past the first.

    python benchmarks/compile_blocks.py                               # every case
    python benchmarks/compile_blocks.py --cases transformer --sizes 1,2,4,12
    python benchmarks/compile_blocks.py --peer /work/main --repeats 3 --save compile-blocks-2026-12-07

The cases (each size N):

- `transformer`: examples/transformer_lm.py's model at d=16, 2 heads,
  context 8, N pre-norm blocks (attention and a gelu MLP, each with a
  layer norm); token ids bound at call time.
- `gru`: nn.gru_cell unrolled N steps (hidden 8, features 4, n rows),
  then nn.mse of the last state.
- `gru_scan`: the same cell as the step of one `sbp.scan(batch=B)`, its
  length bound at call time: what the unrolled GRU would cost were it
  recognized as a scan (the same C whatever N).
- `mlp`: N layers H <- tanh(linear(H, W_k, b_k)), width 16, then MSE.

Each case runs in a child process with a fresh cache folder (so the C is
built, not loaded), pinned to one CPU where `taskset` exists. Recorded:
declare and `sbp.compile` seconds (forward and value_and_grad, float64;
wall, and CPU: the child's own, "python_cpu_s", and its compilers',
"gcc_cpu_s"), the "symbackprop" logger's stages (lower, differentiate
with schedule, emit, C compile; wall, and the child's CPU up to each
stage's end since the one before) and the generated C's lines and
characters. On a loaded machine the CPU seconds are the measure. `--peer` runs the same cases with another checkout's
code (PYTHONPATH), interleaved case by case; the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("transformer", "gru", "gru_scan", "mlp")
SIZES = {"transformer": (1, 2, 4, 12), "gru": (10, 40, 100), "gru_scan": (10, 40, 100), "mlp": (10, 100)}
STAGES = ("lower", "differentiate", "emit", "C compile")


def transformer(blocks: int):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    context, d, heads, vocab = 8, 16, 2, 11
    m = sp.Symbol("m", integer=True, positive=True)
    ids, positions, targets = sbp.Index("ids", m), sbp.Index("positions", m), sbp.Index("targets", m)
    p = {"E": sp.MatrixSymbol("E", vocab, d), "P": sp.MatrixSymbol("P", context, d)}
    x = nn.add_positions(nn.embedding(p["E"], ids, context), p["P"], positions)
    for b in range(blocks):
        w = {k: sp.MatrixSymbol(f"{k}{b}", *shape) for k, shape in (
            ("ga", (1, d)), ("ba", (1, d)), ("Wq", (d, d)), ("Wk", (d, d)), ("Wv", (d, d)), ("Wo", (d, d)),
            ("gm", (1, d)), ("bm", (1, d)), ("Wup", (d, 4 * d)), ("cup", (1, 4 * d)), ("Wdown", (4 * d, d)),
            ("cdown", (1, d)))}
        p.update({str(s): s for s in w.values()})
        x = x + nn.self_attention(nn.layer_norm(x, w["ga"], w["ba"]), w["Wq"], w["Wk"], w["Wv"], w["Wo"], heads)
        up = nn.layer_norm(x, w["gm"], w["bm"]).map(lambda h, w=w: nn.gelu(nn.linear(h, w["Wup"], w["cup"])))
        x = x + up.map(lambda h, w=w: nn.linear(h, w["Wdown"], w["cdown"]))
    gf, bf, out = sp.MatrixSymbol("gf", 1, d), sp.MatrixSymbol("bf", 1, d), sp.MatrixSymbol("Wout", d, vocab)
    logits = nn.layer_norm(x, gf, bf).matrix * out
    return sbp.Model(f"blocks_transformer{blocks}", inputs=[ids, positions, targets],
                     params=[*p.values(), gf, bf, out],
                     loss=nn.softmax_cross_entropy(logits, nn.one_hot(targets, vocab)))


def _gru_weights(features: int, hidden: int):
    import sympy as sp

    return [[sp.MatrixSymbol(f"{kind}_{g}", *shape) for g in "rzn"]
            for kind, shape in (("W", (features, hidden)), ("U", (hidden, hidden)), ("b", (1, hidden)))]


def gru(steps: int):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    features, hidden = 4, 8
    n = sp.Symbol("n", integer=True, positive=True)
    xs = [sp.MatrixSymbol(f"x{t}", n, features) for t in range(steps)]
    target = sp.MatrixSymbol("T", n, hidden)
    W, U, b = _gru_weights(features, hidden)
    h = None
    for x in xs:
        h = nn.gru_cell(x, h, W, U, b)
    return sbp.Model(f"blocks_gru{steps}", inputs=[*xs, target], params=[*W, *U, *b], loss=nn.mse(h, target))


def gru_scan(steps: int):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    features, hidden = 4, 8
    B, rows = sp.symbols("B rows", integer=True, positive=True)  # rows = steps * B, bound at call time
    X = sp.MatrixSymbol("X", rows, features)
    target, h0 = sp.MatrixSymbol("T", B, hidden), sp.MatrixSymbol("h0", B, hidden)
    W, U, b = _gru_weights(features, hidden)
    h, x = sp.MatrixSymbol("h", B, hidden), sp.MatrixSymbol("x", B, features)
    last = sbp.scan(nn.gru_cell(x, h, W, U, b), None, h, x, h0, X, batch=B)
    return sbp.Model(f"blocks_gru_scan{steps}", inputs=[X, target, h0], params=[*W, *U, *b],
                     loss=nn.mse(last, target))


def mlp(layers: int):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    width = 16
    n = sp.Symbol("n", integer=True, positive=True)
    X, Y = sp.MatrixSymbol("X", n, width), sp.MatrixSymbol("Y", n, width)
    h, params = X, []
    for k in range(layers):
        W, b = sp.MatrixSymbol(f"W{k}", width, width), sp.MatrixSymbol(f"b{k}", 1, width)
        params += [W, b]
        h = nn.shallow(lambda h, W, b: nn.tanh(nn.linear(h, W, b)), h, W, b)
    return sbp.Model(f"blocks_mlp{layers}", inputs=[X, Y], params=params, loss=nn.shallow(nn.mse, h, Y))


BUILDERS = {"transformer": transformer, "gru": gru, "gru_scan": gru_scan, "mlp": mlp}


def child(case: str, size: int, cache: str) -> None:
    """One case, in this process: its record as JSON on the last line."""
    import logging

    import symbackprop as sbp

    stages: dict[str, float] = {}
    cpu_stages: dict[str, float] = {}  # this process's CPU seconds up to each stage's end, since the last
    c_size: dict[str, int] = {}
    mark = [0.0]

    class Stages(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            for name in STAGES:
                if text.startswith(name + " ") and ": " in text:
                    seconds = text.split(": ", 1)[1].split(" s", 1)[0]
                    stages[name] = stages.get(name, 0.0) + float(seconds)
                    now = time.process_time()
                    cpu_stages[name] = cpu_stages.get(name, 0.0) + now - mark[0]
                    mark[0] = now

    logging.getLogger("symbackprop").setLevel(logging.INFO)
    logging.getLogger("symbackprop").addHandler(Stages())
    record: dict = {"case": case, "size": size}
    start = time.perf_counter()
    model = BUILDERS[case](size)
    record["declare_s"] = round(time.perf_counter() - start, 3)
    start, cpu = time.perf_counter(), time.process_time()
    mark[0] = cpu
    sbp.compile(model, options=sbp.BuildOptions(cache_dir=Path(cache)))
    record["compile_s"] = round(time.perf_counter() - start, 3)
    record["python_cpu_s"] = round(time.process_time() - cpu, 3)
    record["gcc_cpu_s"] = round(_children_cpu(), 3)
    record["compile_cpu_s"] = round(record["python_cpu_s"] + record["gcc_cpu_s"], 3)
    record["stages_s"] = {k: round(v, 3) for k, v in stages.items()}
    record["stages_cpu_s"] = {k: round(v, 3) for k, v in cpu_stages.items()}
    for source in Path(cache).rglob("*.c"):
        text = source.read_text()
        c_size["lines"] = c_size.get("lines", 0) + text.count("\n")
        c_size["chars"] = c_size.get("chars", 0) + len(text)
    record["c"] = c_size
    print(json.dumps(record), flush=True)


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_case(case: str, size: int, code: Path, cache: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"{case}-{size}-", dir=cache))
    pin = ["taskset", "-c", "1"] if shutil.which("taskset") else []
    command = [*pin, sys.executable, __file__, "--child", case, str(size), str(folder)]
    env = {**os.environ, "PYTHONPATH": str(code), "SYMBACKPROP_CACHE_DIR": str(folder)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=code)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not records:
        return {"case": case, "size": size, "outcome": f"crashed (exit {done.returncode})",
                "stderr_tail": done.stderr[-800:]}
    return {**records[-1], "outcome": "ok"}


def _commit(code: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=code).stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sizes", help="sizes for every case chosen (default: each case's own)")
    parser.add_argument("--peer", help="another checkout to time beside this one, interleaved")
    parser.add_argument("--peer-commit", help="the peer's commit, where it is not a git checkout (a git archive)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--save", help="write benchmarks/results/<name>.json")
    parser.add_argument("--render", metavar="NAME", help="rewrite the table of benchmarks/results/NAME.json from its records")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    codes = {"this": HERE.parent}
    if args.peer:
        codes["peer"] = Path(args.peer).resolve()
    results = []
    with tempfile.TemporaryDirectory(prefix="sbp-blocks-") as tmp:
        for case in args.cases.split(","):
            sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES[case]
            for size in sizes:
                for repeat in range(args.repeats):
                    for label, code in codes.items():  # interleaved: this, peer, this, peer, ...
                        record = {**run_case(case, size, code, Path(tmp)), "code": label, "repeat": repeat}
                        results.append(record)
                        print(json.dumps(record), flush=True)
                if args.save:  # after each size: a long run that is stopped keeps what it measured
                    _save(args.save, results, codes, args)


def _median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get("outcome") == "ok"]
    return round(statistics.median(values), 3) if values else None


def _save(name: str, results: list[dict], codes: dict[str, Path], args: argparse.Namespace) -> None:
    """The result file benchmarks/tables.py renders (see _table), with
    where it was measured and every record whole under "results"."""
    out = HERE / "results" / f"{name}.json"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    commits = {label: (args.peer_commit if label == "peer" and args.peer_commit else _commit(code))
               for label, code in codes.items()}
    peer = f" --peer {args.peer}" + (f" --peer-commit {args.peer_commit}" if args.peer_commit else "") if args.peer else ""
    record = {
        "title": "Compile CPU of N repeated blocks (sbp.compile: forward and value_and_grad, float64, a fresh cache)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load}",
        "date": time.strftime("%Y-%m-%d"), **_commit_fields(commits),
        "command": f"python benchmarks/compile_blocks.py --cases {args.cases} --repeats {args.repeats}{peer} "
                   f"--save {name}",
        "conditions": "each run a child process pinned to CPU 1 (taskset -c 1) with a fresh cache folder; "
                      f"checkouts interleaved run by run; CPU seconds (the process's and its compilers'), "
                      f"medians of {args.repeats}",
        "source": "benchmarks/compile_blocks.py", "row_header": "case and N", "results": results}
    out.write_text(json.dumps({**record, **_table(results, commits)}, indent=1) + "\n")


def _commit_fields(commits: dict[str, str]) -> dict:
    """The commit as text (this one, and the peer's before it) and by checkout."""
    text = commits["this"] + (f" (the peer, before: {commits['peer']})" if "peer" in commits else "")
    return {"commit": text, "commits": commits}


def _table(results: list[dict], commits: dict[str, str]) -> dict:
    """A row a (case, size); a column each checkout's median CPU seconds
    (the peer's first, the baseline of this one's ratio) and of them its
    compilers'."""
    labels = sorted(commits, key=lambda label: label != "peer")  # the peer (before) first
    rows = []
    for case, size in dict.fromkeys((r["case"], r["size"]) for r in results):
        seconds = {}
        for label in labels:
            mine = [r for r in results if (r["case"], r["size"], r["code"]) == (case, size, label)]
            seconds[f"{label}_cpu"], seconds[f"{label}_gcc"] = _median(mine, "compile_cpu_s"), _median(mine, "gcc_cpu_s")
        rows.append({"label": f"{case} {size}", "seconds": seconds})
    columns = [{"key": f"{label}_{what}", "label": f"{commits[label]}: {heading}",
                "ratio": what == "cpu" and label == "this" and "peer" in commits}
               for label in labels for what, heading in (("cpu", "CPU"), ("gcc", "of it GCC"))]
    return {"baseline": "peer_cpu" if "peer" in commits else None, "columns": columns, "rows": rows,
            "ratio_note": "in parentheses this checkout's CPU over the peer's (below 1: it compiles faster)"}


def render(name: str) -> None:
    """Rewrite the table of a result file from its own records (after a
    change of _table), keeping where and when they were measured."""
    path = HERE / "results" / f"{name}.json"
    saved = json.loads(path.read_text())
    commits = saved.get("commits") or saved["commit"]  # (a first file held them under "commit")
    fields = {**_commit_fields(commits), **_table(saved["results"], commits)}
    path.write_text(json.dumps({**saved, **fields}, indent=1) + "\n")


if __name__ == "__main__":
    main()
