"""Compile a model and call it on numpy arrays: `compile` generates the C
(or finds it in the memo of earlier compiles), builds it (or loads it from
the cache) and wraps it in a CompiledModule (run/module.py).

Calls go through one binder (binding.py): see run/function.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.abi import ModuleSpec
from symbackprop.declare.model import Model
from symbackprop.emit.emitted import REAL_TYPES, Emitted
from symbackprop.errors import ModelError
from symbackprop.log import slow_work
from symbackprop.plan import DEFAULT_FUNCTIONS
from symbackprop.run import fastcall
from symbackprop.run.module import CompiledModule
from symbackprop.toolchain.builder import (
    BuildOptions,
    build_entry,
    find_blas,
    load_built,
    load_entry,
    warm_up,
)
from symbackprop.toolchain.memo import package_digest, read_memo, write_memo

if TYPE_CHECKING:  # only for annotations
    from symbackprop.run.optim import SGD, Adam

K = TypeVar("K")


def compile(
    model: Model,
    dtype: str = "float64",
    options: BuildOptions | None = None,
    wrt: Sequence[str] | None = None,
    functions: Sequence[str] = DEFAULT_FUNCTIONS,
    optimizer: SGD | Adam | None = None,
) -> CompiledModule:
    """Generate, build (or load from the cache) and wrap the model.

    Args:
        model: the Model to compile.
        dtype: "float64" (default) or "float32".
        options: compiler flags, cache folder, BLAS (see BuildOptions).
        wrt: names to differentiate with respect to: params, inputs, or named
            outputs (the gradient of an intermediate); default: the model's
            params and grad_inputs. Nothing else is differentiated.
        functions: C functions to build now; others ("vjp", "jvp", "hvp",
            "train_step") are built on first use.
        optimizer: for train_step: a symbackprop.SGD or symbackprop.Adam.

    Returns:
        The CompiledModule.

    Raises:
        ModelError: the model cannot be compiled (names the subexpression),
            or dtype is not one of the two.
        BuildError: the C compiler is missing or failed (names the log).
    """
    with slow_work(f"compiling {model.name!r} ({', '.join(functions)}, {dtype})"):
        return _start(model, dtype, options, wrt, functions, optimizer, None)()


def compile_all(
    models: Mapping[K, Model],
    functions: Sequence[str] | Mapping[K, Sequence[str]] = DEFAULT_FUNCTIONS,
    dtype: str = "float64",
    options: BuildOptions | None = None,
) -> dict[K, CompiledModule]:
    """Several models compiled, each as `compile` would: the same modules,
    from the same C. Each model's C is generated in turn, and its C
    compiler runs beside (in a thread, which waits on its processes) while
    the next model's C is generated; then all are loaded. For a program
    that compiles a few models at its start (a primal and its Jacobian),
    the C compiler of one overlaps the Python of the next.

    Args:
        models: the Models, by any key.
        functions: the C functions to build for every model, or a mapping
            from each model's key to its functions (as compile's `functions`).
        dtype: as compile's.
        options: as compile's.

    Returns:
        The CompiledModules, by the models' keys (in their order).

    Raises:
        ModelError: as compile's; the C compilers
            already started are waited for first.
        BuildError: as compile's.
    """
    finishes: dict[K, Callable[[], CompiledModule]] = {}
    names = ", ".join(repr(m.name) for m in models.values())
    with slow_work(f"compiling {names}"), ThreadPoolExecutor(thread_name_prefix="symbackprop build") as pool:
        try:
            for key, model in models.items():
                wanted = functions[key] if isinstance(functions, Mapping) else functions
                finishes[key] = _start(model, dtype, options, None, wanted, None, pool)
        finally:  # each started build ends (and is loaded) before this returns or raises
            outcomes = {key: _outcome(finish) for key, finish in finishes.items()}
    failure = next((error for _, error in outcomes.values() if error is not None), None)
    if failure is not None:
        raise failure
    return {key: module for key, (module, _) in outcomes.items() if module is not None}


def _outcome(finish: Callable[[], CompiledModule]) -> tuple[CompiledModule | None, BaseException | None]:
    """finish()'s module, or the exception it raised."""
    try:
        return finish(), None
    except BaseException as exc:  # raised by compile_all once every build has ended
        return None, exc


def _start(model: Model, dtype: str, options: BuildOptions | None, wrt: Sequence[str] | None,
           functions: Sequence[str], optimizer: SGD | Adam | None,
           beside: Executor | None) -> Callable[[], CompiledModule]:
    """compile's work up to its module: a call that finishes it. Where the
    module is to be built, `beside` builds it in one of its threads (the
    call waits for it), else the call builds it."""
    if dtype not in REAL_TYPES:
        raise ModelError(f"dtype must be one of {sorted(REAL_TYPES)}; got {dtype!r}")
    key = model_fingerprint(model, dtype, tuple(functions), None if wrt is None else tuple(wrt), optimizer, options)
    found = _from_memo(read_memo(key, options))
    if found is not None:
        emitted, spec, folder = found
        module = load_built(folder, emitted.prefix, options)
        if module is not None:
            cached = CompiledModule(model, emitted, spec, module.lib, module.ffi, folder, dtype, options, optimizer, None)
            return lambda: cached
    # imported here: a module loaded from the cache imports no compiler
    from symbackprop.pipeline import derivation_text, generate
    from symbackprop.run.plan_spec import module_spec

    fastcall.build_beside()  # an empty cache: the call hot path compiles beside this model
    warm_up(options)  # the compiler's and the BLAS's probes, beside this model's Python
    emitted, plan = generate(model, dtype, functions=functions, wrt=wrt, optimizer=optimizer, derivation=False)
    spec = module_spec(plan, model, dtype, emitted.prefix)
    derived: list[str] = []  # the derivation, written while the C compiles (build_entry's meanwhile)

    def derive() -> None:
        if not derived:
            derived.append(derivation_text(plan, model.name, dtype))

    started = threading.Event()  # the build's C compiler processes are running (or it ended)

    def derive_beside() -> None:  # build_entry's meanwhile: its compiler processes have started
        started.set()
        derive()

    texts = (emitted.prefix, emitted.source, emitted.header, emitted.cdef, options, derive_beside)
    entry = beside.submit(build_entry, *texts) if beside is not None else None
    if entry is not None:
        # The caller's next Python (compile_all: the next model's C) waits until the C compiler
        # runs: the build's own Python (its cache key, files, cffi's glue) does many small reads
        # and writes, each waiting up to the interpreter's switch interval for a thread that
        # computes: beside the next model's generate, the C compiler started 0.2-0.3 s later.
        entry.add_done_callback(lambda _: started.set())
        started.wait()

    def finish() -> CompiledModule:
        folder = entry.result() if entry is not None else build_entry(*texts)
        derive()  # (build_entry ran it, while compiling or on a cache hit; else here)
        whole = replace(emitted, derivation=derived[0])
        module = load_entry(folder, whole.prefix)
        write_memo(key, _memo(whole, spec, folder), options)
        return CompiledModule(model, whole, spec, module.lib, module.ffi, folder, dtype, options, optimizer, plan)

    return finish


_EMITTED_TEXTS = ("prefix", "source", "header", "cdef", "derivation")


def _memo(emitted: Emitted, spec: ModuleSpec, folder: Path) -> dict:
    """What compile() stores in the memo: JSON-able texts, the ABI spec and the folder."""
    return {"emitted": {name: getattr(emitted, name) for name in _EMITTED_TEXTS}, "spec": spec.to_json(),
            "folder": str(folder)}


def _from_memo(memo: Any) -> tuple[Emitted, ModuleSpec, Path] | None:
    """What _memo stored, checked; None (a miss) for anything else."""
    try:
        texts, folder = memo["emitted"], memo["folder"]
        if type(texts) is not dict or set(texts) != set(_EMITTED_TEXTS) or type(folder) is not str:
            return None
        if not all(type(texts[name]) is str for name in _EMITTED_TEXTS):
            return None
        spec = ModuleSpec.from_json(memo["spec"])
        if spec.prefix != texts["prefix"]:
            return None
        # the C model (CModule) is not kept: nothing reads it after rendering
        return Emitted(**texts, module=None), spec, Path(folder)
    except (ValueError, KeyError, TypeError):
        return None


_BASIC_ARGS = sp.Basic.args  # the property that returns _args (a class may define its own)


class _ExpressionDigest:
    """A hash of the structure of expressions that visits each subexpression
    object once (srepr and preorder_traversal walk every path of a shared
    DAG, which is exponential for an unrolled recurrent model). Each distinct
    subexpression is one line of a listing, its type and the line numbers of
    its arguments, or a leaf's text; `value` hashes the listing once. Dummy
    symbols are numbered in the order they are met. An entry of a matrix at
    constant indices is one line: its matrix's line number and the indices."""

    def __init__(self) -> None:
        # id -> (the object, kept so that its id stays unique; its line's number, as text)
        self.line: dict[int, tuple[Any, str]] = {}
        self.lines: list[str] = []
        self.dummies: dict[sp.Dummy, int] = {}
        self.heads: dict[type, tuple[str, bool] | None] = {}  # (the head of its line, its args is Basic's), or a leaf

    def __call__(self, root: Any) -> int:
        """The line number of root in the listing, walked with an explicit
        stack (no recursion per level: a model 1,000 layers deep is 1,000s
        of levels). Most of a cached compile of a large scalar model (det
        by minors at ell=9: 5,114 lines, ~15-20 ms), so each object costs
        as little as it can: its type's head and its args read once per
        type, its arguments already listed never pushed."""
        line, lines, heads = self.line, self.lines, self.heads
        stack: list[Any] = [root, None]  # by twos: an object, then its args once its arguments are listed (None before)
        while stack:
            args = stack.pop()
            expr = stack.pop()
            if id(expr) in line:
                continue
            if args is None:
                kind = type(expr)
                if kind not in heads:
                    heads[kind] = ((kind.__name__ + "(", kind.args is _BASIC_ARGS)
                                   if issubclass(kind, sp.Basic) and not issubclass(kind, sp.Dummy) else None)
                head = heads[kind]
                if kind is MatrixElement and self._plain_entry(expr):
                    text = self._entry(expr)  # one line, its matrix listed (once) first
                    line[id(expr)] = (expr, str(len(lines)))
                    lines.append(text)
                    continue
                if head is not None:
                    # SymPy's args is a property, some of them computed: read once (Basic's is _args)
                    args = expr._args if head[1] else expr.args
                    if args:  # its arguments first, left to right (the order dummies are numbered in)
                        stack += [expr, args]
                        for arg in reversed(args):
                            if id(arg) not in line:
                                stack += [arg, None]
                        continue
                text = "=" + self._leaf(expr)
            else:
                text = heads[type(expr)][0] + ",".join([line[id(a)][1] for a in args]) + ")"  # type: ignore[index]
            line[id(expr)] = (expr, str(len(lines)))
            lines.append(text)
        return int(line[id(root)][1])

    def _plain_entry(self, expr: MatrixElement) -> bool:
        """Whether expr is an entry at constant indices of a matrix symbol
        or of a matrix listed already (so that listing its matrix is one
        short walk, never a recursion down a deep model)."""
        matrix, i, j = expr._args
        return i.is_Integer and j.is_Integer and (type(matrix) is sp.MatrixSymbol or id(matrix) in self.line)

    def _entry(self, expr: MatrixElement) -> str:
        """The line of a _plain_entry: its matrix's line number and the
        indices. A model reads entries as new objects each time (det by
        minors at ell=9: 2,304 of A's), which were each walked with their
        three arguments."""
        matrix, i, j = expr._args
        number = self.line[id(matrix)][1] if id(matrix) in self.line else str(self(matrix))
        return f"MatrixElement[{number}]({int(i)},{int(j)})"

    def _leaf(self, expr: Any) -> str:
        if isinstance(expr, sp.Dummy):
            return f"Dummy{self.dummies.setdefault(expr, len(self.dummies))}{sorted(expr.assumptions0.items())}"
        if isinstance(expr, sp.Symbol):  # srepr's text, without its printer's cost
            return f"{type(expr).__name__}({expr.name!r}{sorted(expr.assumptions0.items())})"
        return sp.srepr(expr) if isinstance(expr, sp.Basic) else repr(expr)

    def value(self, *roots: int) -> str:
        """The digest of the listing so far and of the roots' line numbers."""
        from symbackprop.toolchain.key import digest

        return digest("expressions", repr(self.lines), "|", *map(str, roots))  # a list's repr: one hash update, not one a line


def model_fingerprint(model: Model, *settings: Any) -> str:
    """A hash of everything generation depends on: the model's expressions
    (SymPy's srepr, with Lambda's dummy variables numbered in order), the
    settings, the compiler flags (also where the settings name none:
    $SYMBACKPROP_CFLAGS may change them), whether BLAS is installed, the CPU where the flags ask for
    the host's (the memo names a cache entry built for it), and
    symbackprop's own code."""
    from symbackprop.toolchain.builder import host_target
    from symbackprop.toolchain.key import digest as key_digest

    options = next((s for s in settings if isinstance(s, BuildOptions)), None)
    expressions = [model.loss, *model.outputs.values(), *model.names.values()]
    digest = _ExpressionDigest()
    parts = [
        model.name,
        str(model.has_loss),
        *(sp.srepr(leaf) for leaf in (*model.inputs, "|", *model.params, "|", *model.grad_inputs)),
        *model.outputs,
        "|",
        *model.names,
        digest.value(*(digest(sp.sympify(expr)) for expr in expressions)),
        repr(settings),
        repr((options or BuildOptions()).flags),  # the memo names a cache entry built with them
        getattr(find_blas(), "name", "no BLAS"),
        host_target(options),
        package_digest(),
    ]
    return key_digest("model", *parts)


__all__ = ["compile", "compile_all", "model_fingerprint"]
