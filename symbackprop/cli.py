"""The `symbackprop` command.

    symbackprop demo [MODEL_FILE[:NAME]]     build, write, load, call and check a model
    symbackprop build [MODEL_FILE[:NAME] ...] [--out DIR] [--check] [--library]
    symbackprop graph MODEL_FILE[:NAME] [--format text|dot]   the backward graph
    symbackprop diff OLD NEW | --rev REV [--rev REV2] MODEL [--format text|markdown]   what changed in the math

With no model files, `build` takes every model in examples/ and writes to
generated/, the layout of this repository; `--check` regenerates into
memory and fails, printing a unified diff, where the files on disk differ
(and fails where it found no model to check); `--library` adds a CMake
project, a Makefile and a pkg-config file per model (docs/c_library.md).
What a model file must define is in docs/model_files.md; it is checked
before anything is written, and so are name collisions and the output
folder.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from symbackprop.declare.model import Model, leaf_name
from symbackprop.errors import ArgumentError, SymbackpropError
from symbackprop.log import on_stage
from symbackprop.progress import Progress, ProgressArg

DEFAULT_EXAMPLES = Path("examples")
DEFAULT_OUT = Path("generated")
DEMO_MODEL = DEFAULT_EXAMPLES / "mlp.py"
CONTRACT = "see docs/model_files.md"


@dataclass(frozen=True)
class Found:
    """A Model found in a model file, and where: `label` is FILE:VARIABLE."""

    model: Model
    module: ModuleType
    label: str


def _user_line(exc: BaseException, folder: Path) -> str:
    """', line N' of the innermost frame in the model file's folder, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).is_file() and Path(f.filename).resolve().parent == folder]  # not "<string>"
    return f" (line {frames[-1].lineno} of {Path(frames[-1].filename).name})" if frames else ""


def _import_failure(path: Path, exc: BaseException) -> SymbackpropError:
    where = _user_line(exc, path.resolve().parent)
    hint = ""
    if "Mix of Matrix and Scalar" in str(exc):
        hint = "; a 1x1 matrix m plus a scalar s is written sbp.as_scalar(m) + s or m + s * OneMatrix(1, 1)"
    if isinstance(exc, SymbackpropError):
        return SymbackpropError(f"{path}{where}: {exc}")
    return SymbackpropError(f"importing {path} failed{where}: {type(exc).__name__}: {exc}{hint}")


def load_file(path: Path) -> ModuleType:
    """Import a model file by path, as `python FILE` would run it: its folder
    is first on sys.path while it loads, so it may import its neighbours
    (which are forgotten afterwards, so that another folder's neighbour of
    the same name is not mistaken for them).

    Raises:
        SymbackpropError: no such file, not a Python file, or importing it
            raised (the message names the exception and the line).
    """
    if path.is_dir():
        raise SymbackpropError(f"{path} is a folder; name its model files (FOLDER/*.py)")
    if not path.is_file():
        raise SymbackpropError(f"no model file {path}")
    folder = path.resolve().parent
    name = "_symbackprop_model_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # e.g. a file not named *.py
        raise SymbackpropError(f"cannot import {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.path.insert(0, str(folder))
    sys.modules[name] = module  # as an import would: dataclasses and pickle look it up
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        raise _import_failure(path, exc) from None
    finally:
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
        _forget_neighbours(before, folder)
    return module


def _forget_neighbours(before: set[str], folder: Path) -> None:
    """Drop the modules first imported from `folder` itself (and their
    submodules); not those found elsewhere, even below it (a virtual
    environment or a source checkout inside the folder)."""
    new = set(sys.modules) - before
    local = {name for name in new if "." not in name and _lies_in(sys.modules[name], folder)}
    for name in new:
        if name.partition(".")[0] in local:
            del sys.modules[name]


def _lies_in(module: ModuleType, folder: Path) -> bool:
    """The module is folder/NAME.py or the package folder/NAME/."""
    source = getattr(module, "__file__", None)
    places = [Path(source).resolve().parent] if source else []
    places += [Path(p).resolve().parent for p in getattr(module, "__path__", ())]  # packages, namespace ones too
    return folder in places


def _split_spec(spec: str) -> tuple[Path, str]:
    """FILE[:NAME] into the file and the name ('' when none is given)."""
    if ":" in spec and not Path(spec).is_file():
        path, _, attr = spec.rpartition(":")
        return Path(path), attr
    return Path(spec), ""


def models_in(spec: str, required: bool = True) -> list[Found]:
    """The models named by FILE[:NAME]: NAME is a variable of the file or a
    Model's name; without it, every Model in the file (none is an error when
    `required`, as for a file named on the command line)."""
    path, attr = _split_spec(spec)
    module = load_file(path)
    found: list[Found] = []
    for variable, value in vars(module).items():
        if isinstance(value, Model) and all(value is not f.model for f in found):
            found.append(Found(value, module, f"{path}:{variable}"))
    if attr:
        return [_select(found, attr, path, module)]
    if not found and required:
        raise SymbackpropError(f"{path} defines no symbackprop.Model ({CONTRACT})")
    return found


def _select(found: list[Found], attr: str, path: Path, module: ModuleType) -> Found:
    variable = vars(module).get(attr)
    if isinstance(variable, Model):
        return Found(variable, module, f"{path}:{attr}")
    by_name = [f for f in found if f.model.name == attr]
    if len(by_name) == 1:
        return by_name[0]
    choices = ", ".join(f"{f.label.rpartition(':')[2]} (Model {f.model.name!r})" for f in found) or "none"
    if by_name:
        raise SymbackpropError(f"{path} has {len(by_name)} Models named {attr!r}; name one by its variable: {choices}")
    raise SymbackpropError(f"{path} has no Model named {attr!r} (as a variable or a Model's name); its Models: {choices}")


def default_specs() -> list[str]:
    return [str(p) for p in sorted(DEFAULT_EXAMPLES.glob("*.py")) if not p.name.startswith("_")]


@dataclass(frozen=True)
class Generated:
    """What one model writes: <folder>/<file name> -> text."""

    found: Found
    folder: str
    files: dict[str, str]


def generate_all(found: Iterable[Found], out: Path | None = None, progress: ProgressArg = False) -> list[Generated]:
    """Generate every model's files in memory; the same model found twice is
    written once, and two models whose names map to one C identifier (and so
    one folder) are an error naming both. `progress`: see symbackprop.progress."""
    from symbackprop.pipeline import generate

    result: dict[str, Generated] = {}
    found = list(found)
    bar = Progress(len(found), "model", progress)  # ends itself after the last model
    for item in found:
        stop = on_stage(lambda name: bar.note(stage=name))  # each model's stages beside the bar
        try:
            emitted, _ = generate(item.model, **training(item))
        finally:
            stop()
        bar.step(model=item.model.name)
        other = result.get(emitted.prefix)
        if other is not None:
            if _same_model(other.found.model, item.model):
                continue
            raise SymbackpropError(
                f"the models {other.found.model.name!r} ({other.found.label}) and {item.model.name!r} ({item.label}) "
                f"would both write {(out or Path()) / emitted.prefix}/ (their names map to the C identifier "
                f"{emitted.prefix}): rename one"
            )
        files = {f"{emitted.prefix}.c": emitted.source, f"{emitted.prefix}.h": emitted.header,
                 "derivation.md": emitted.derivation}
        result[emitted.prefix] = Generated(item, emitted.prefix, files)
    return list(result.values())


def training(found: Found) -> dict:
    """generate's arguments for a model file's module-level `optimizer`
    (docs/model_files.md): train_step and train_epoch beside the defaults."""
    from symbackprop.pipeline import DEFAULT_FUNCTIONS
    from symbackprop.run.optim import OPTIMIZERS

    optimizer = vars(found.module).get("optimizer")
    if optimizer is None:
        return {}
    path = found.label.rpartition(":")[0]
    if not isinstance(optimizer, OPTIMIZERS):
        what = f"the class {optimizer.__name__} (call it: {optimizer.__name__}(lr=...))" \
            if isinstance(optimizer, type) else f"a {type(optimizer).__name__}"
        raise SymbackpropError(f"{path}: `optimizer` asks build for train_step and train_epoch, and must be a "
                               f"symbackprop.SGD or symbackprop.Adam; it is {what} ({CONTRACT})")
    if not found.model.has_loss:
        raise SymbackpropError(f"{path}: `optimizer` asks build for train_step, and the model {found.model.name!r} "
                               f"({found.label}) has no loss to train")
    return {"functions": (*DEFAULT_FUNCTIONS, "train_step"), "optimizer": optimizer}


def _same_model(a: Model, b: Model) -> bool:
    """The same declaration (e.g. a model file imported by its neighbour)."""
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


def usable_out(out: Path, generated: Iterable[Generated] = ()) -> None:
    """Refuse an output folder that cannot take the files, before writing any."""
    if out.exists() and not out.is_dir():
        raise SymbackpropError(f"--out {out} is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SymbackpropError(f"cannot create the output folder {out}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SymbackpropError(f"the output folder {out} is not writable")
    for item in generated:
        folder = out / item.folder
        if folder.exists() and not folder.is_dir():
            raise SymbackpropError(f"{folder} is in the way of model {item.found.model.name!r}: it is not a folder")
        _check_owner(item, folder)


_NAMED = re.compile(r'of the model "(.*)"')


def _check_owner(item: Generated, folder: Path) -> None:
    """Refuse to overwrite another model's folder (written by an earlier run):
    the header's first line names the model it was generated from."""
    header = f"{item.folder}.h"
    try:
        with open(folder / header, encoding="utf-8", errors="replace") as handle:
            old = _NAMED.search(handle.readline())
    except OSError:
        return
    new = _NAMED.search(item.files[header].partition("\n")[0])
    if old and new and old.group(1) != new.group(1):
        raise SymbackpropError(
            f"{folder}/ holds the code of the model \"{old.group(1)}\"; the model {item.found.model.name!r} "
            f"({item.found.label}) maps to the same folder: rename it, or delete {folder}/ to replace it")


def write_atomic(path: Path, text: str) -> None:
    """Write whole or not at all: a temporary file beside it, then a rename
    (readers never see half a file; an interrupted build leaves the old one)."""
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",  # noqa: SIM115 (closed below, then renamed)
                                         delete=False, encoding="utf-8")
    try:
        with handle:
            handle.write(text)
        os.chmod(handle.name, 0o666 & ~_umask())
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_generated(generated: Iterable[Generated], out: Path) -> list[Path]:
    """Write each model's folder under `out`; an OSError is a SymbackpropError."""
    from symbackprop.emit.codegen import RUNTIME_HEADER, runtime_header

    written = []
    try:
        for item in generated:
            folder = out / item.folder
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in item.files.items():
                write_atomic(folder / name, text)
                written.append(folder / name)
        if written:  # the header every model's .c includes, once, at the top of out
            write_atomic(out / RUNTIME_HEADER, runtime_header())
            written.append(out / RUNTIME_HEADER)
    except OSError as exc:
        raise SymbackpropError(f"cannot write into {out}: {exc}") from None
    return written


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError as exc:
        raise SymbackpropError(f"cannot read {path}: {exc.strerror or exc}") from None


def check(generated: list[Generated], out: Path) -> list[str]:
    """Unified diffs between what is in `out` and what the models generate now."""
    from symbackprop.emit.codegen import RUNTIME_HEADER, runtime_header

    diffs = []
    shared = [(Path(), {RUNTIME_HEADER: runtime_header()})] if generated else []
    for folder, files in [(Path(item.folder), item.files) for item in generated] + shared:
        for name, text in files.items():
            on_disk = out / folder / name
            old = _read_or_empty(on_disk)
            if old != text:
                diffs.append("".join(difflib.unified_diff(
                    old.splitlines(keepends=True), text.splitlines(keepends=True),
                    fromfile=f"{on_disk} (on disk)", tofile=f"{on_disk} (generated now)")))
    return diffs


def cmd_build(args: argparse.Namespace) -> int:
    specs = args.models or default_specs()
    # scanning examples/, files that define no Model (training scripts) are skipped
    found = [item for spec in specs for item in models_in(spec, required=bool(args.models))]
    if not found:
        where = f"{DEFAULT_EXAMPLES}/ (run in the repository root, or name model files)"
        raise SymbackpropError(f"found no model in {where}: {'nothing was checked' if args.check else 'nothing to build'}")
    generated = [_with_library(g, args) for g in generate_all(found, args.out, args.progress)]
    if args.check:
        return _report_check(generated, args)
    usable_out(args.out, generated)
    for path in write_generated(generated, args.out):
        print(f"wrote {path}")
    return 0


def _with_library(item: Generated, args: argparse.Namespace) -> Generated:
    """Add the build files where asked (--library) or where a folder has them
    already, so that a later `build` keeps them current and `build --check`
    (the pre-commit hook) finds them stale."""
    from symbackprop.emit.library import CMAKE, library_files

    if not (args.library or (args.out / item.folder / CMAKE).is_file()):
        return item
    return Generated(item.found, item.folder, {**item.files, **library_files(item.folder)})


def _report_check(generated: list[Generated], args: argparse.Namespace) -> int:
    diffs = check(generated, args.out)
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        rerun = "symbackprop build" + "".join(f" {s}" for s in args.models) + f" --out {args.out}" + " --library" * args.library
        print(f"\n{len(diffs)} generated file(s) are stale; regenerate them with: {rerun}", file=sys.stderr)
        return 1
    print(f"generated code in {args.out} is up to date ({len(generated)} model(s))")
    return 0


def demo_inputs(found: Found) -> dict:
    """The demo's arrays from the file's sample_data(rng), checked against
    the model's inputs and params before anything is written."""
    sample = getattr(found.module, "sample_data", None)
    path = found.label.rpartition(":")[0]
    if not found.model.has_loss:
        raise SymbackpropError(f"demo checks a loss's gradient, and the model {found.model.name!r} ({found.label}) "
                               "has no loss; build and graph take it")
    if not callable(sample):
        raise SymbackpropError(
            f"demo needs {path} to define sample_data(rng) returning a dict of arrays for every input and "
            f"param of the model (build and graph need only a Model; {CONTRACT})")
    try:
        data = sample(np.random.default_rng(0))
    except Exception as exc:
        folder = Path(path).resolve().parent
        raise SymbackpropError(f"sample_data of {path} raised{_user_line(exc, folder)} "
                               f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, Mapping):
        raise SymbackpropError(f"sample_data of {path} must return a dict of arrays; got {type(data).__name__}")
    needed = [leaf_name(leaf) for leaf in (*found.model.inputs, *found.model.params)]
    missing = [name for name in needed if name not in data]
    unknown = [str(name) for name in data if name not in needed]
    if missing or unknown:
        raise SymbackpropError(f"sample_data of {path} must give every input and param of model "
                               f"{found.model.name!r} by name; missing {missing}, unknown {unknown}")
    return dict(data)


def _one_model(spec: str, command: str) -> Found:
    found = models_in(spec)
    if len(found) > 1:
        choices = ", ".join(item.label for item in found)
        raise SymbackpropError(f"{command} takes one model and {spec} defines {len(found)}: name one as FILE:NAME ({choices})")
    return found[0]


def cmd_demo(args: argparse.Namespace) -> int:
    from symbackprop.run.runtime import compile

    if args.model == str(DEMO_MODEL) and not DEMO_MODEL.is_file():
        raise SymbackpropError(f"no model file {DEMO_MODEL} (run in the repository root, or name a model file)")
    found = _one_model(args.model, "demo")
    model = found.model
    data = demo_inputs(found)
    generated = generate_all([found], args.out)
    start = time.perf_counter()
    mod = compile(model)
    seconds = time.perf_counter() - start
    try:  # the arrays are checked before anything is written
        outputs = mod.forward(**data)
    except ArgumentError as exc:
        raise SymbackpropError(f"sample_data of {found.label.rpartition(':')[0]} does not fit the model: {exc}") from None
    usable_out(args.out, generated)
    written = write_generated(generated, args.out)
    print(f"model {model.name!r}: wrote {', '.join(str(p) for p in written)}")
    print(f"compiled (or loaded from the cache) in {seconds:.2f} s")
    loss, _ = mod.value_and_grad(**data)
    print(f"loss = {loss:.10g}")
    for name, value in outputs.items():
        if name != "loss":
            print(f"output {name}: shape {np.shape(value)}")
    worst = mod.check_grads(raise_exception=False, **data).worst
    print(f"gradient check against central finite differences: max relative error {worst:.2e}")
    per_call = time_call(lambda: mod.value_and_grad(**data))
    print(f"value_and_grad: {per_call * 1e6:.2f} us per call (median)")
    return 0 if worst < 1e-6 else 1


def cmd_graph(args: argparse.Namespace) -> int:
    from symbackprop.emit.graph import graph_dot, graph_text
    from symbackprop.emit.picture import FORMATS, render_dot
    from symbackprop.pipeline import plan

    found = models_in(args.model)
    if args.format in FORMATS and len(found) > 1:  # one picture, one model
        names = ", ".join(item.label for item in found)
        raise SymbackpropError(f"--format {args.format} draws one model; {args.model} has several ({names}): name one")
    plans = [plan(item.model, functions=("value_and_grad",)) for item in found]
    if args.format in FORMATS:
        picture = render_dot(graph_dot(plans[0]), args.format)  # ToolMissing (status 2) without Graphviz
        data: str | bytes = picture.decode("utf-8") if args.format == "svg" else picture
    else:
        data = "".join(graph_dot(p) if args.format == "dot" else graph_text(p) + "\n" for p in plans)
    if args.output is not None:
        args.output.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        print(f"wrote {args.output}", file=sys.stderr)
    elif isinstance(data, bytes):  # a PNG
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
    else:
        sys.stdout.write(data)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from symbackprop.review.command import run_diff

    return run_diff(args.models, args.rev or [], args.format, lambda spec: _one_model(spec, "diff").model, _split_spec)


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
    build = sub.add_parser("build", help="write generated C, header and derivation for models",
                           epilog="exit status: 0 written (or up to date with --check), 1 stale files with --check, "
                                  "2 an error (printed to stderr)")
    build.add_argument("models", nargs="*", metavar="MODEL_FILE[:NAME]", help="default: every file in examples/")
    build.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: generated/)")
    build.add_argument("--check", action="store_true", help="fail with a diff where the files on disk are stale")
    build.add_argument("--library", action="store_true",
                       help="also write a CMakeLists.txt, a Makefile and a pkg-config file per model")
    build.add_argument("-v", "--verbose", action="store_true", help="log each stage and its duration to stderr")
    build.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="a progress bar over the models and the stages of each (tqdm, if installed); "
                            "default: when stderr is a terminal")
    build.set_defaults(run=cmd_build)
    graph = sub.add_parser("graph", help="print the backward graph (grad_fn style) as text, Graphviz DOT, SVG or PNG")
    graph.add_argument("model", metavar="MODEL_FILE[:NAME]")
    graph.add_argument("--format", choices=("text", "dot", "svg", "png"), default="text",
                       help="svg and png are drawn by Graphviz's dot program, which must be installed")
    graph.add_argument("-o", "--output", type=Path, metavar="FILE", help="write to FILE (default: stdout)")
    graph.set_defaults(run=cmd_graph)
    diff = sub.add_parser("diff", help="what changed in a model's math: equations, kept values, memory (docs/review.md)",
                          description="What changed in a model's math between two versions: equations, kept values, "
                                      "memory.",
                          epilog="exit status, as diff(1): 0 the same, 1 different, 2 an error (printed to stderr)")
    diff.add_argument("models", nargs="+", metavar="MODEL_FILE[:NAME]", help="OLD NEW, or one with --rev")
    diff.add_argument("--rev", action="append", metavar="REV", help="git revision of the old (then the new) version")
    diff.add_argument("--format", choices=("text", "markdown"), default="text")
    diff.set_defaults(run=cmd_diff)
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
        files, the demo's gradient check fails or ``diff`` finds a change; 2 when a SymbackpropError
        was raised (printed to stderr).

    Raises:
        SystemExit: the arguments are malformed, or --help was given (argparse).
    """
    args = parser().parse_args(argv)
    if getattr(args, "verbose", False):
        from symbackprop.log import enable

        enable()
    try:
        return int(args.run(args))
    except SymbackpropError as exc:
        print(f"symbackprop: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("symbackprop: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (symbackprop graph m.py | head): no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
