"""Helpers shared by the peers: the peer interface, a generic MLP loss for
autodiff frameworks, and building/calling C code through cffi."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

C_TYPES = {"float64": "double", "float32": "float"}
DEFAULT_CFLAGS = ("-O3", "-march=native")


class Unsupported(Exception):
    """The peer cannot run this workload/dtype; the message says why."""


@dataclass
class Variant:
    """One timed way of calling a peer.

    ``call`` takes no arguments (the arrays are bound when the variant is set
    up) and returns ``(loss, {param_name: grad})``; anything ``np.asarray``
    accepts is fine for the values.
    """

    label: str
    call: Callable[[], tuple]
    compile_cold_s: float | None = None
    compile_cached_s: float | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # more fields for the JSON record


def bench_threads() -> int:
    """Threads a peer may use (set by run.py --threads)."""
    return int(os.environ.get("SBP_BENCH_THREADS", "1"))


def compile_timeout() -> float:
    """Seconds a C compile may take (set by run.py --compile-timeout)."""
    return float(os.environ.get("SBP_BENCH_COMPILE_TIMEOUT", "300"))


def cache_root() -> Path:
    """Per-run compile cache (fresh for every worker: first build is cold)."""
    root = os.environ.get("SBP_BENCH_CACHE")
    path = Path(root) if root else Path(tempfile.gettempdir()) / "sbp_bench_cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def timed(fn: Callable, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``."""
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t0


# --------------------------------------------------------------------------
# A generic MLP loss, written once for every array library with operators.


@dataclass(frozen=True)
class Ops:
    """The few library functions the generic loss needs."""

    activations: dict  # name -> elementwise function
    logsumexp_rows: Callable  # (n, k) -> (n,)
    sum_rows: Callable  # (n, k) -> (n,)


def mlp_loss(workload, ops: Ops, inputs: dict, params: dict):
    """The workload's scalar loss, using only ``@``, ``+``, ``-``, ``*`` and ``ops``."""
    x_name, t_name = workload.input_names
    act = ops.activations[workload.activation]
    a = inputs[x_name]
    for k in range(1, workload.n_layers + 1):
        w = params[f"W{k}"]
        z = a @ w if workload.layout == "rows" else w @ a
        if workload.has_bias:
            z = z + params[f"b{k}"]
        a = act(z) if k < workload.n_layers else z
    target = inputs[t_name]
    if workload.loss == "mse":
        return ((a - target) * (a - target)).mean()
    if workload.loss == "half_sse":
        return 0.5 * ((a - target) * (a - target)).sum()
    if workload.loss == "softmax_ce":
        return (ops.logsumexp_rows(a) - ops.sum_rows(target * a)).mean()
    raise Unsupported(f"loss {workload.loss!r}")


# --------------------------------------------------------------------------
# C through cffi.

_BUILD_SCRIPT = """
import json, sys, cffi
spec = json.load(open(sys.argv[1]))
ffi = cffi.FFI()
ffi.cdef(spec["cdef"])
ffi.set_source(spec["name"], spec["source"], extra_compile_args=spec["cflags"])
ffi.compile(tmpdir=spec["dir"], verbose=False)
"""


@dataclass
class CModule:
    ffi: object
    lib: object
    seconds: float
    cached: bool


def build_cffi(name: str, cdef: str, source: str, *, cflags=DEFAULT_CFLAGS,
               timeout: float | None = None) -> CModule:
    """Compile ``source`` as a cffi API-mode extension and load it.

    The build runs in a child process (so it can be stopped after
    ``timeout`` seconds) into a directory keyed by a hash of everything that
    goes into it; a second build of the same thing only loads the library
    (the "cached" compile time).
    """
    key = hashlib.sha256(json.dumps([cdef, source, list(cflags)]).encode()).hexdigest()[:16]
    modname = f"{name}_{key}"
    build_dir = cache_root() / modname
    t0 = time.perf_counter()
    library = _find_library(build_dir, modname)
    cached = library is not None
    if not cached:
        _compile_in_child(build_dir, modname, cdef, source, list(cflags),
                          timeout or compile_timeout())
        library = _find_library(build_dir, modname)
        if library is None:
            raise RuntimeError(f"cffi build of {modname} produced no library")
    module = _load_extension(modname, library)
    return CModule(module.ffi, module.lib, time.perf_counter() - t0, cached)


def _find_library(build_dir: Path, modname: str) -> Path | None:
    found = sorted(build_dir.glob(f"{modname}*.so")) if build_dir.is_dir() else []
    return found[0] if found else None


def _compile_in_child(build_dir, modname, cdef, source, cflags, timeout):
    build_dir.mkdir(parents=True, exist_ok=True)
    spec_file = build_dir / "build_spec.json"
    spec = {"name": modname, "cdef": cdef, "source": source, "cflags": cflags,
            "dir": str(build_dir)}
    spec_file.write_text(json.dumps(spec))
    try:
        proc = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, str(spec_file)],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise Unsupported(f"C compile exceeded the {timeout:.0f} s compile timeout") from None
    if proc.returncode != 0:
        raise RuntimeError(f"cffi build failed:\n{proc.stderr[-3000:]}")


def _load_extension(modname: str, path: Path):
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def c_signature(func: str, ctype: str, n_in: int, n_out: int) -> str:
    """``int func(const T* a0, ..., T* r0, ...)``: one pointer per array."""
    args = [f"const {ctype}* a{i}" for i in range(n_in)]
    args += [f"{ctype}* r{i}" for i in range(n_out)]
    return f"int {func}({', '.join(args)})"


class CffiCall:
    """Calls ``int func(in arrays..., loss, grads...)`` with numpy arrays.

    ``in_names`` orders the input and parameter arrays, ``grad_shapes``
    orders the gradients; the loss is a one-element output written first.
    """

    def __init__(self, module: CModule, func: str, dtype: str, in_names, grad_shapes: dict):
        self.ffi, self.func = module.ffi, getattr(module.lib, func)
        self.ctype = C_TYPES[dtype] + "[]"
        self.dtype, self.in_names, self.grad_shapes = dtype, tuple(in_names), dict(grad_shapes)

    def _outputs(self):
        loss = np.empty(1, self.dtype)
        grads = {k: np.empty(s, self.dtype) for k, s in self.grad_shapes.items()}
        return loss, grads

    def _pointers(self, arrays: dict, loss, grads) -> list:
        buf = self.ffi.from_buffer
        ptrs = [buf(self.ctype, arrays[k]) for k in self.in_names]
        ptrs.append(buf(self.ctype, loss, require_writable=True))
        ptrs += [buf(self.ctype, g, require_writable=True) for g in grads.values()]
        return ptrs

    def __call__(self, arrays: dict):
        """Bind every array and allocate fresh outputs on each call."""
        loss, grads = self._outputs()
        self._check(self.func(*self._pointers(arrays, loss, grads)))
        return float(loss[0]), grads

    def prepare(self, arrays: dict) -> Callable[[], tuple]:
        """Bind the arrays and outputs once; the returned call only calls C."""
        loss, grads = self._outputs()
        ptrs, func, check = self._pointers(arrays, loss, grads), self.func, self._check

        def call():
            check(func(*ptrs))
            return float(loss[0]), grads

        return call

    @staticmethod
    def _check(status):
        if status:
            raise RuntimeError(f"C function returned {status}")


def cffi_variants(label: str, caller: CffiCall, arrays: dict, module: CModule,
                  cached: CModule | None = None, notes=()) -> list[Variant]:
    """The per-call and the prepared variant of a cffi-called function."""
    times = {"compile_cold_s": module.seconds,
             "compile_cached_s": cached.seconds if cached else None}
    return [
        Variant(label, lambda: caller(arrays), notes=list(notes), **times),
        Variant(f"{label}.prepared", caller.prepare(arrays), notes=list(notes), **times),
    ]
