"""How long a compiled module's forward-mode functions take to build on
first use, against `sbp.compile` (issue 41): the first `mod.jvp`,
`mod.hvp` and `mod.jacobian` of a fresh module, each built from nothing.

    python benchmarks/forward_build.py                          # every case
    python benchmarks/forward_build.py --cases hand16,mlp10 --profile hvp
    python benchmarks/forward_build.py --save forward-build-2026-12-07 --label after

The cases:

- `hand16`: a hand-tracking-like model: an explicit chain of 16 bones of
  4x4 transforms (a rotation about z, one about x, a translation along x;
  the pose is 1 x 48), each bone's transform shared by every point of a
  map over 50 skinned points (rest position and one weight per bone);
  the loss is the squared misfit, the per-point misfit an output.
- `mlp10`: 10 layers of tanh(linear) 16 wide on X (32 x 4), MSE to T.
- `gmm`, `bundle_adjustment`: examples/ (GradBench's GMM and BA).

Each case runs in a child process with a fresh cache folder (so the C is
built, not loaded) pinned to one CPU (`taskset -c 1` where it exists).
Recorded: `sbp.compile`'s seconds, then each first call's seconds
(jvp, hvp, jacobian of the first output), each split into the "symbackprop"
logger's stages (lower, differentiate, emit, C compile), its CPU seconds
(Python and the C compiler) and the characters of the C it generated. `--profile KIND` prints the cProfile of that build.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("hand16", "mlp10", "gmm", "bundle_adjustment")
KINDS = ("compile", "jvp", "hvp", "jacobian")
STAGES = ("lower", "differentiate", "emit", "C compile")


def hand_model(bones: int = 16, points: int = 50):
    """The hand-like model and its data (see the module's docstring)."""
    import numpy as np
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    n = sp.Symbol("N", integer=True, positive=True)
    pose = sp.MatrixSymbol("pose", 1, 3 * bones)
    rest, targets = sp.MatrixSymbol("rest", n, 3 + bones), sp.MatrixSymbol("targets", n, 3)
    chain, placed = sp.eye(4), []
    for k in range(bones):
        a, b, c = pose[0, 3 * k], pose[0, 3 * k + 1], pose[0, 3 * k + 2]
        rz = sp.Matrix([[sp.cos(a), -sp.sin(a), 0, 0], [sp.sin(a), sp.cos(a), 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
        rx = sp.Matrix([[1, 0, 0, 0], [0, sp.cos(b), -sp.sin(b), 0], [0, sp.sin(b), sp.cos(b), 0], [0, 0, 0, 1]])
        chain = chain * rz * rx * sp.Matrix([[1, 0, 0, c], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
        placed.extend(chain[:3, :])
    shared = sp.Matrix(sp.symbols(f"m0:{12 * bones}", real=True))
    point = sp.Matrix(sp.symbols(f"p0:{3 + bones}", real=True))
    target = sp.Matrix(sp.symbols("q0:3", real=True))
    moved = sp.zeros(3, 1)
    for k in range(bones):
        transform = sp.Matrix(3, 4, list(shared[12 * k: 12 * k + 12]))
        moved += point[3 + k] * (transform[:, :3] * point[:3, :] + transform[:, 3])
    misfit = sbp.map_examples((moved - target).dot(moved - target),
                              [(shared, sp.ImmutableMatrix([placed])), (point, rest), (target, targets)])
    model = sbp.Model(f"hand{bones}", inputs=[rest, targets], params=[pose], loss=nn.sum_all(misfit),
                      outputs={"misfit": misfit})
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(bones), points)
    data = {"pose": 0.3 * rng.standard_normal((1, 3 * bones)),
            "rest": np.column_stack([rng.standard_normal((points, 3)), weights]),
            "targets": rng.standard_normal((points, 3))}
    return model, data


def mlp_model(layers: int = 10, width: int = 16):
    import numpy as np
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    x, t = sp.MatrixSymbol("X", 32, 4), sp.MatrixSymbol("T", 32, 1)
    rng = np.random.default_rng(0)
    h, params, data = x, [], {"X": rng.standard_normal((32, 4)), "T": rng.standard_normal((32, 1))}
    for k in range(layers):
        fan_in, fan_out = int(h.shape[1]), (1 if k == layers - 1 else width)
        w, b = sp.MatrixSymbol(f"W{k}", fan_in, fan_out), sp.MatrixSymbol(f"b{k}", 1, fan_out)
        params += [w, b]
        data[str(w)], data[str(b)] = rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in), np.zeros((1, fan_out))
        h = nn.linear(h, w, b) if k == layers - 1 else nn.tanh(nn.linear(h, w, b))
    return sbp.Model(f"mlp{layers}", inputs=[x, t], params=params, loss=nn.mse(h, t), outputs={"Y": h}), data


def example_model(name: str):
    import importlib

    import numpy as np

    sys.path.insert(0, str(HERE.parent / "examples"))
    module = importlib.import_module(name)
    return module.model, module.sample_data(np.random.default_rng(0))


def declare(case: str):
    if case.startswith("hand"):
        return hand_model(int(case[4:] or 16))
    if case.startswith("mlp"):
        return mlp_model(int(case[3:] or 10))
    return example_model(case)


class Stages(logging.Handler):
    """Adds up the seconds of the "symbackprop" logger's stage lines."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for name in STAGES:
            if text.startswith(name + " ") and ": " in text:
                with contextlib.suppress(ValueError):
                    seconds = float(text.split(": ", 1)[1].split(" s", 1)[0])
                    self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        taken, self.seconds = {k: round(v, 3) for k, v in self.seconds.items()}, {}
        return taken


def _first_call(mod, kind: str, data: dict) -> None:
    import numpy as np

    differentiated = [str(p) for p in mod.model.params]
    direction = {differentiated[0]: np.ones_like(np.asarray(data[differentiated[0]], dtype=float))}
    if kind == "jvp":
        mod.jvp(direction, **data)
    elif kind == "hvp":
        mod.hvp(direction, **data)
    else:
        mod.jacobian(next(iter(mod.model.outputs)), **data)


def _cpu() -> dict[str, float]:
    """CPU seconds so far of this process (Python, its threads) and of its
    finished children (the C compiler): on a loaded machine, wall time
    counts the other processes' turns too."""
    import resource

    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"python": mine.ru_utime + mine.ru_stime, "compiler": children.ru_utime + children.ru_stime}


def c_chars(cache: str) -> int:
    """Characters of the generated C modules in the cache so far (the
    cffi glue not counted): what the C compiler reads besides the headers."""
    return sum(path.stat().st_size for path in Path(cache).glob("*/*.c") if not path.name.startswith("_sbp_"))


def child(case: str, cache: str, profile: str | None) -> None:
    """One case, in this process: its record as JSON on the last line."""
    import cProfile
    import pstats

    import symbackprop as sbp

    stages = Stages()
    logger = logging.getLogger("symbackprop")
    logger.setLevel(logging.INFO)
    logger.addHandler(stages)
    model, data = declare(case)
    record: dict = {"case": case, "seconds": {}, "cpu_s": {}, "stages_s": {}, "c_chars": {}}
    kinds = [k for k in KINDS if k != "jacobian" or model.outputs]
    mod = None
    for kind in kinds:
        profiler = cProfile.Profile() if kind == profile else None
        start, cpu = time.perf_counter(), _cpu()
        with profiler or contextlib.nullcontext():
            if kind == "compile":
                mod = sbp.compile(model, options=sbp.BuildOptions(cache_dir=Path(cache)))
            else:
                _first_call(mod, kind, data)
        record["seconds"][kind] = round(time.perf_counter() - start, 3)
        record["cpu_s"][kind] = {k: round(after - before, 3) for (k, after), before in zip(_cpu().items(), cpu.values())}
        record["stages_s"][kind] = stages.take()
        record["c_chars"][kind] = c_chars(cache) - sum(record["c_chars"].values())
        if profiler is not None:
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(60)
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    print(json.dumps(record), flush=True)


def run_case(case: str, timeout: float, profile: str | None) -> dict:
    pin = ["taskset", "-c", "1"] if shutil.which("taskset") else []
    with tempfile.TemporaryDirectory(prefix="sbp-forward-") as cache:
        command = [*pin, sys.executable, __file__, "--child", case, cache]
        if profile:
            command += ["--profile", profile]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "SYMBACKPROP_CACHE_DIR": cache})
        except subprocess.TimeoutExpired:
            return {"case": case, "outcome": f"timeout after {timeout:.0f} s"}
    if profile:
        sys.stderr.write(done.stderr)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not records:
        return {"case": case, "outcome": f"crashed (exit {done.returncode})", "stderr_tail": done.stderr[-800:]}
    return {**records[-1], "outcome": "ok"}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def summarize(case: str, runs: list[dict]) -> dict:
    """The median CPU seconds (Python and compiler) and wall seconds of each
    build over the runs, each build's CPU over sbp.compile's, and every run whole."""
    ok = [r for r in runs if r.get("outcome") == "ok"]
    kinds = [k for k in KINDS if ok and k in ok[0]["seconds"]]
    cpu = {k: round(_median([sum(r["cpu_s"][k].values()) for r in ok]), 3) for k in kinds}
    chars = {k: ok[0]["c_chars"][k] for k in kinds} if ok and "c_chars" in ok[0] else {}
    return {"case": case, "cpu_s": cpu, "wall_s": {k: round(_median([r["seconds"][k] for r in ok]), 3) for k in kinds},
            "c_chars": chars,
            "ratio_to_compile": {k: round(cpu[k] / cpu["compile"], 2) for k in kinds if k != "compile"},
            "runs": runs}


def save(name: str, label: str, rows: list[dict], args: argparse.Namespace) -> None:
    """Adds this run's rows, under `label` (as "before" on main and "after"
    on a branch), to benchmarks/results/<name>.json."""
    out = HERE / "results" / f"{name}.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    runs = {**previous.get("runs", {}), label: rows}
    commits = {**previous.get("commits", {}), label: subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()}
    columns = [{"key": f"{lab}:{kind}", "label": f"{kind} ({lab})", "ratio": False}
               for lab in runs for kind in KINDS]
    table = []
    for case in dict.fromkeys(r["case"] for rows_ in runs.values() for r in rows_):
        cells = {f"{lab}:{kind}": r["cpu_s"][kind] for lab, rows_ in runs.items()
                 for r in rows_ if r["case"] == case for kind in r["cpu_s"]}
        table.append({"label": case, "seconds": cells})
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    out.write_text(json.dumps({
        "title": "First build of the forward-mode functions against sbp.compile (fresh cache, float64)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load}",
        "date": time.strftime("%Y-%m-%d"), "commit": ", ".join(f"{lab} {c}" for lab, c in commits.items()),
        "command": f"python benchmarks/forward_build.py --repeat {args.repeat} --save {name} --label LABEL",
        "conditions": "each case and repeat in a child process with a fresh cache folder, taskset -c 1; "
                      "the median of the repeats; CPU seconds of the process and of the C compiler "
                      "(wall time on the shared 2-core machine counts other processes' turns)",
        "source": "benchmarks/forward_build.py", "row_header": "model", "baseline": None,
        "columns": columns, "rows": table, "runs": runs, "commits": commits}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeat", type=int, default=1, help="child processes per case (the median is kept)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one case may take")
    parser.add_argument("--profile", choices=KINDS, help="print the cProfile of this build")
    parser.add_argument("--save", help="add the rows to benchmarks/results/<name>.json")
    parser.add_argument("--label", default="after", help="the rows' label in the saved file")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.profile)
        return
    rows = []
    for case in args.cases.split(","):
        row = summarize(case, [run_case(case, args.timeout, args.profile) for _ in range(args.repeat)])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        for run in row["runs"]:
            print(json.dumps({k: run.get(k) for k in ("cpu_s", "stages_s", "outcome", "stderr_tail") if k in run}),
                  flush=True)
    if args.save:
        save(args.save, args.label, rows, args)


if __name__ == "__main__":
    main()
