"""Cold compile of GradBench ports, stage by stage, wall and CPU time.

    python -m benchmarks.gradbench.coldcompile [--evals gmm,llsq,det@ell=7] [--repeat 3] [--json out.json]
                                               [--code /other/checkout,.] [--used-cache]

An eval is at its default size, or at the size after `@` (`det@ell=9`, `gmm@d=2/K=5/N=10`).
Each sample is a fresh process with an empty SYMBACKPROP_CACHE_DIR (cold),
then one more process on the same folder (cached); with --code, the
samples of each checkout's symbackprop alternate (a before/after table on
a machine whose load changes; a checkout without the call hot path's
extension built in place compiles it in every cold sample, and the table
says so). With --used-cache, each sample's folder has
first compiled another model (lse at n=16): the call hot path's extension
and the templates' compiled code are there, as in any cache used before,
and only the model is cold. Stage times come from the
"symbackprop" logger (summed over models and functions); CPU time is
resource.getrusage of the process and its children (the C compiler), which
a loaded machine disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_EVALS = ("lse", "kmeans", "llsq", "ba", "gmm", "lstm")
FIRST_MODEL = "lse@n=16"  # what --used-cache compiles into each folder first
_STAGE = re.compile(r"^(lower|differentiate|emit|C compile) .*?: ([0-9.]+) s")


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def probe(name: str) -> None:
    """(In the subprocess) compile eval `name` at its default size; print JSON."""
    import importlib
    import logging

    sys.path.append(str(ROOT))  # after PYTHONPATH: symbackprop from the checkout being measured
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    t0, c0 = time.perf_counter(), _cpu()
    import symbackprop as sbp
    from benchmarks.gradbench._common import build_models

    try:
        from benchmarks.gradbench._common import sbp_compile_models
    except ImportError:  # a checkout from before per-model functions

        def sbp_compile_models(E, models):
            return {k: sbp.compile(m, functions=E.SBP_FUNCTIONS) for k, m in models.items()}

    logging.getLogger("symbackprop").addHandler(Keep())
    logging.getLogger("symbackprop").setLevel(logging.INFO)
    module, _, size = name.partition("@")
    E = importlib.import_module(f"benchmarks.gradbench.{module}")
    models = build_models(E, _size(size) if size else E.DEFAULT)
    t1, c1 = time.perf_counter(), _cpu()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    sbp_compile_models(E, models)
    t2, c2 = time.perf_counter(), _cpu()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    stages: dict[str, float] = {}
    for line in lines:
        match = _STAGE.match(line)
        if match:
            stages[match.group(1)] = stages.get(match.group(1), 0.0) + float(match.group(2))
    cc_cpu = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    try:  # without it, an empty cache compiles the call hot path beside the model (C compile, cc_cpu)
        from symbackprop.run import fastcall
        installed = fastcall.installed() is not None
    except (ImportError, AttributeError):  # a checkout from before it was built at install
        installed = False
    print(json.dumps({"declare": t1 - t0, "compile": t2 - t1, "compile_cpu": c2 - c1, "cc_cpu": cc_cpu,
                      "import_cpu": c1 - c0, "fastcall_installed": installed, **stages}))


def _size(text: str) -> dict:
    """`ell=9/n=3` as {"ell": 9, "n": 3}."""
    return {key: int(value) for key, value in (part.split("=") for part in text.split("/"))}


def sample(name: str, cache: str, code: Path = ROOT) -> dict:
    env = dict(os.environ, SYMBACKPROP_CACHE_DIR=cache, PYTHONPATH=str(code))
    out = subprocess.run([sys.executable, __file__, "--probe", name],
                         cwd=code, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name} in {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--evals", default=",".join(DEFAULT_EVALS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--code", default=None, help="comma list of checkouts whose symbackprop to time, alternately")
    p.add_argument("--used-cache", action="store_true", help=f"compile {FIRST_MODEL} into each cache folder first")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        probe(args.probe)
        return 0
    codes = [Path(c).resolve() for c in args.code.split(",")] if args.code else [ROOT]
    results: dict = {}
    # import_cpu: `import symbackprop` and the model's declaration (the compiler's stages are imported
    # on first use, inside compile, since the package's lazy names)
    keys = ("import_cpu", "compile", "compile_cpu", "lower", "differentiate", "emit", "C compile", "cc_cpu")
    print(f"{'eval':8} {'code':24} " + " ".join(f"{k:>13}" for k in (*keys, "cached", "cached_cpu")))
    for name in args.evals.split(","):
        runs: dict = {code: [] for code in codes}
        cached: dict = {code: [] for code in codes}
        for _ in range(args.repeat):
            for code in codes:
                with tempfile.TemporaryDirectory(prefix="sbp-cold-") as cache:
                    if args.used_cache:
                        sample(FIRST_MODEL, cache, code)
                    runs[code].append(sample(name, cache, code))
                    cached[code].append(sample(name, cache, code))
        for code in codes:
            med = {k: statistics.median(r.get(k, 0.0) for r in runs[code]) for k in keys}
            med["cached"] = statistics.median(r["compile"] for r in cached[code])
            med["cached_cpu"] = statistics.median(r["compile_cpu"] for r in cached[code])
            results.setdefault(name, {})[str(code)] = {"median": med, "runs": runs[code], "cached": cached[code]}
            print(f"{name:8} {str(code)[-24:]:24} " + " ".join(f"{med[k]:13.3f}" for k in (*keys, "cached", "cached_cpu")),
                  flush=True)
            if not all(r.get("fastcall_installed", True) for r in runs[code]):
                print(f"  note: {code} has no installed call hot path: each cold sample compiled it too "
                      "(build it in place: python setup.py build_ext --inplace)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
