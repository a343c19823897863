"""The `symbackprop` command.

    symbackprop demo [MODEL_FILE[:NAME]]     build, write, load, call and check a model
    symbackprop build [MODEL_FILE[:NAME] ...] [--out DIR] [--check]
    symbackprop graph MODEL_FILE[:NAME] [--format text|dot]   the backward graph

With no model files, `build` takes every model in examples/ and writes to
generated/, the layout of this repository; `--check` regenerates into a
temporary folder and fails, printing a unified diff, where the files on
disk differ.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import SymbackpropError
from .model import Model

DEFAULT_EXAMPLES = Path("examples")
DEFAULT_OUT = Path("generated")
DEMO_MODEL = DEFAULT_EXAMPLES / "mlp.py"


def load_file(path: Path) -> ModuleType:
    """Import a model file by path (without touching sys.path)."""
    if not path.is_file():
        raise SymbackpropError(f"no model file {path}")
    name = "_symbackprop_model_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # e.g. a file not named *.py
        raise SymbackpropError(f"cannot import {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def models_in(spec: str, required: bool = True) -> list[tuple[Model, ModuleType]]:
    """The models named by FILE[:NAME]: that attribute, or every Model in the
    file (none is an error when `required`, as for a file named on the command line)."""
    path, _, attr = spec.partition(":")
    module = load_file(Path(path))
    if attr:
        model = getattr(module, attr, None)
        if not isinstance(model, Model):
            raise SymbackpropError(f"{path} has no Model named {attr!r}")
        return [(model, module)]
    found = [(v, module) for v in vars(module).values() if isinstance(v, Model)]
    if not found and required:
        raise SymbackpropError(f"{path} defines no symbackprop.Model")
    return found


def default_specs() -> list[str]:
    return [str(p) for p in sorted(DEFAULT_EXAMPLES.glob("*.py")) if not p.name.startswith("_")]


def write_model(model: Model, out: Path) -> list[Path]:
    """Write <out>/<model name>/ with the C source, header and derivation."""
    from .compiler import generate

    emitted, _ = generate(model)
    folder = out / emitted.prefix
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        f"{emitted.prefix}.c": emitted.source,
        f"{emitted.prefix}.h": emitted.header,
        "derivation.md": emitted.derivation,
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    return [folder / name for name in files]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def check(models: Iterable[Model], out: Path) -> list[str]:
    """Unified diffs between what is in `out` and what the models generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        for model in models:
            write_model(model, fresh_root)
        fresh = _tree(fresh_root)
    diffs = []
    for rel, text in fresh.items():
        on_disk = out / rel
        old = on_disk.read_text() if on_disk.is_file() else ""
        if old != text:
            diffs.append("".join(difflib.unified_diff(
                old.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{on_disk} (on disk)", tofile=f"{on_disk} (generated now)")))
    return diffs


def cmd_build(args: argparse.Namespace) -> int:
    specs = args.models or default_specs()
    # scanning examples/, files that define no Model (training scripts) are skipped
    models = [model for spec in specs for model, _ in models_in(spec, required=bool(args.models))]
    if args.check:
        diffs = check(models, args.out)
        for diff in diffs:
            sys.stdout.write(diff)
        if diffs:
            rerun = "symbackprop build" + "".join(f" {s}" for s in args.models) + f" --out {args.out}"
            print(f"\n{len(diffs)} generated file(s) are stale; regenerate them with: {rerun}", file=sys.stderr)
            return 1
        print(f"generated code in {args.out} is up to date ({len(models)} model(s))")
        return 0
    for model in models:
        for path in write_model(model, args.out):
            print(f"wrote {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .runtime import compile

    model, module = models_in(args.model)[0]
    written = write_model(model, args.out)
    print(f"model {model.name!r}: wrote {', '.join(str(p) for p in written)}")
    start = time.perf_counter()
    mod = compile(model)
    print(f"compiled (or loaded from the cache) in {time.perf_counter() - start:.2f} s")
    data = module.sample_data(np.random.default_rng(0))
    outputs = mod.forward(**data)
    loss, grads = mod.value_and_grad(**data)
    print(f"loss = {loss:.10g}")
    for name, value in outputs.items():
        if name != "loss":
            print(f"output {name}: shape {np.shape(value)}")
    worst = gradient_check(lambda **a: mod.forward(**a)["loss"], data, grads)
    print(f"gradient check against central finite differences: max relative error {worst:.2e}")
    per_call = time_call(lambda: mod.value_and_grad(**data))
    print(f"value_and_grad: {per_call * 1e6:.2f} us per call (median)")
    return 0 if worst < 1e-6 else 1


def cmd_graph(args: argparse.Namespace) -> int:
    from .compiler import plan
    from .graph import graph_dot, graph_text

    for model, _ in models_in(args.model):
        the_plan = plan(model, functions=("value_and_grad",))
        sys.stdout.write(graph_dot(the_plan) if args.format == "dot" else graph_text(the_plan) + "\n")
    return 0


def gradient_check(loss_fn: Callable[..., float], data: dict, grads: dict, step: float = 1e-6) -> float:
    """Max over parameters of |analytic - central difference| / max|central|.
    Checks at most 20 entries per parameter, spread evenly."""
    worst = 0.0
    for name, grad in grads.items():
        base = np.asarray(data[name], dtype=float)
        grad = np.asarray(grad, dtype=float).reshape(base.shape)
        flat_indices = np.unique(np.linspace(0, base.size - 1, min(base.size, 20)).astype(int))
        numeric, analytic = [], []
        for flat in flat_indices:
            index = np.unravel_index(flat, base.shape)
            values = []
            for sign in (1, -1):
                shifted = base.copy()
                shifted[index] += sign * step
                values.append(loss_fn(**{**data, name: shifted}))
            numeric.append((values[0] - values[1]) / (2 * step))
            analytic.append(grad[index])
        numeric_a, analytic_a = np.array(numeric), np.array(analytic)
        scale = max(np.abs(numeric_a).max(), 1e-8)
        worst = max(worst, float(np.abs(numeric_a - analytic_a).max() / scale))
    return worst


def time_call(fn: Callable[[], object], repeats: int = 15, min_time: float = 0.02) -> float:
    """Median seconds per call over `repeats` batches of calls."""
    fn()
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - start >= min_time:
            break
        number *= 2
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return float(np.median(samples))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="symbackprop", description="SymPy model in, compiled C backprop out.")
    sub = top.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write generated C, header and derivation for models")
    build.add_argument("models", nargs="*", metavar="MODEL_FILE[:NAME]", help="default: every file in examples/")
    build.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: generated/)")
    build.add_argument("--check", action="store_true", help="fail with a diff where the files on disk are stale")
    build.add_argument("-v", "--verbose", action="store_true", help="log each stage and its duration to stderr")
    build.set_defaults(run=cmd_build)
    graph = sub.add_parser("graph", help="print the backward graph (grad_fn style) as text or Graphviz DOT")
    graph.add_argument("model", metavar="MODEL_FILE[:NAME]")
    graph.add_argument("--format", choices=("text", "dot"), default="text")
    graph.set_defaults(run=cmd_graph)
    demo = sub.add_parser("demo", help="build a model, call it on sample data, check and time it")
    demo.add_argument("model", nargs="?", default=str(DEMO_MODEL), metavar="MODEL_FILE[:NAME]")
    demo.add_argument("--out", type=Path, default=DEFAULT_OUT)
    demo.add_argument("-v", "--verbose", action="store_true", help="log each stage, the C compile and its progress")
    demo.set_defaults(run=cmd_demo)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """The ``symbackprop`` command: build, graph or demo.

    Args:
        argv: the arguments after the program name (None: sys.argv[1:]).

    Returns:
        The exit status: 0 on success; 1 when ``build --check`` finds stale
        files or the demo's gradient check fails; 2 when a SymbackpropError
        was raised (printed to stderr).

    Raises:
        SystemExit: the arguments are malformed, or --help was given (argparse).
    """
    args = parser().parse_args(argv)
    if getattr(args, "verbose", False):
        from .log import enable

        enable()
    try:
        return args.run(args)
    except SymbackpropError as exc:
        print(f"symbackprop: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
