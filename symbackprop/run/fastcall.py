"""The C hot path of ordinary calls (`_fastcall.c`), built on first use.

cffi makes a pointer from a numpy array in about 0.2 us; a call of a
generated function with a dozen arrays spends more than that on checks,
allocation and pointers than on its arithmetic. `Caller` does the checks,
the allocation of the outputs and the call in C, through a packed entry
point that every module has beside each function (see
toolchain.packed.packed_entries). It declines (returns None) whatever it does not
expect, and the Python path then converts or explains; a caller given a
fallback (Function.answer's) calls it there itself, and returns the
outputs shaped as the module's method returns them, so that an ordinary
call is one C call.

The extension is built with the package where it is installed (setup.py:
`symbackprop.run.symbackprop_fastcall`), and used where it imports and was
built from this _fastcall.c. Else it is compiled once per Python, numpy
and compiler into the module cache; if that fails too (no numpy headers,
say) calls simply take the Python path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import sysconfig
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from symbackprop.base.trust import entry_problem
from symbackprop.errors import BuildError
from symbackprop.log import event
from symbackprop.toolchain.builder import (
    BuildOptions,
    build_once,
    cache_root,
    entry_ok,
    load_checked,
    run_logged,
)
from symbackprop.toolchain.compiler import EXT_SUFFIX, compiler_command, link_options, toolchain
from symbackprop.toolchain.key import digest

SOURCE = Path(__file__).with_name("_fastcall.c")
NAME = "symbackprop_fastcall"
FLAGS = ("-O2", "-std=c11", "-pthread")
DISABLE_ENV = "SYMBACKPROP_NO_FASTCALL"  # set to 1: every call takes the Python path
FROM_CACHE_ENV = "SYMBACKPROP_FASTCALL_FROM_CACHE"  # set to 1: the cache's copy even where one is installed
INSTALLED = "symbackprop.run.symbackprop_fastcall"  # built with the package (setup.py)


def _command(folder: Path) -> list[str]:
    paths = sysconfig.get_paths()
    includes = dict.fromkeys([paths["include"], paths["platinclude"], np.get_include()])
    return [*compiler_command(), *FLAGS, *link_options(), *[f"-I{path}" for path in includes],
            str(folder / SOURCE.name), "-o", str(folder / f"{NAME}{EXT_SUFFIX}")]


@lru_cache(maxsize=1)
def extension() -> ModuleType | None:
    """The compiled extension, or None where it cannot be built or is disabled:
    the one installed with the package, else the module cache's."""
    if os.environ.get(DISABLE_ENV):
        return None
    module = installed()
    if module is not None:
        return module
    try:
        source, final, built = _entry()
        try:
            return load_checked(final, NAME)  # checks the entry, then loads it
        except BuildError:
            _build(source, final, built)  # (a damaged entry: with a warning)
            return load_checked(final, NAME)
    except (OSError, BuildError, ImportError) as exc:
        event("no C hot path for calls (%s): calls take the Python path", exc)
        return None


def source_digest() -> str:
    """The SHA-256 of _fastcall.c, which the installed extension carries
    (setup.py compiles it in as SOURCE_DIGEST)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


@lru_cache(maxsize=1)
def installed() -> ModuleType | None:
    """The extension built with the package, where it imports and was built
    from this _fastcall.c (an editable install keeps the copy it built
    when the source changes after); else None."""
    if os.environ.get(FROM_CACHE_ENV):
        return None
    try:
        module = importlib.import_module(INSTALLED)
    except ModuleNotFoundError:  # not built (an install without a compiler, a source tree)
        return None
    except (ImportError, OSError) as exc:  # built for another numpy or Python, say
        event("the installed C hot path does not load (%s): using the module cache's", exc)
        return None
    if getattr(module, "SOURCE_DIGEST", None) != source_digest():
        event("the installed C hot path was built from another _fastcall.c: using the module cache's")
        return None
    return module


def _entry() -> tuple[str, Path, Path]:
    """The extension's source, its cache folder and its library there."""
    source = SOURCE.read_text()
    command = _command(Path("FOLDER"))
    # keyed on the compiler's files, not its `--version` (a process: most of a cached compile's time)
    key = digest("fastcall", source, " ".join(command), toolchain(command, local=True), np.__version__, EXT_SUFFIX,
                 length=24)
    final = cache_root(BuildOptions()) / f"fastcall-{key}"
    return source, final, final / f"{NAME}{EXT_SUFFIX}"


def _build(source: str, final: Path, built: Path) -> None:
    build_once(final, lambda folder: entry_ok(folder, built.name), lambda staging: _compile(source, staging, final))


def build_beside() -> threading.Thread | None:
    """Start building the extension in a thread where its cache entry is
    missing (an empty cache), so that it compiles beside the first model's
    C, on another core, not after it; extension() then waits for it (the
    entry's file lock). The thread, or None where nothing is to be built."""
    if os.environ.get(DISABLE_ENV) or extension.cache_info().currsize or installed() is not None:
        return None
    try:
        source, final, built = _entry()
        if entry_problem(final, built.name) is None:
            return None
    except (OSError, BuildError):
        return None  # extension() says why, when a call first asks

    def build() -> None:
        with contextlib.suppress(OSError, BuildError):  # extension() tries again, and says why
            _build(source, final, built)

    thread = threading.Thread(target=build, name="symbackprop fastcall build")
    thread.start()
    return thread


def _compile(source: str, staging: Path, final: Path) -> None:
    (staging / SOURCE.name).write_text(source)
    run_logged([[_command(staging)]], staging / "build.log", final.parent, "the call hot path")


# The most arrays (inputs and outputs) the extension's Caller takes
# (_fastcall.c): a function with more is called through cffi, as where
# there is no extension (a deep stack of 5,000 parameter matrices was a
# ValueError when the module loaded).
MAX_ARGUMENTS = 4096


def caller(lib: Any, ffi: Any, c_name: str, n_dims: int, itemsize: int,
           inputs: list[tuple[int, int, int, bool]], outputs: list[tuple[int, int, int, bool]],
           names: tuple[str, ...] = (), layout: Any = None, fallback: Any = None) -> Any | None:
    """A C caller of one generated function, or None (no extension, a
    module built without packed entry points, or over MAX_ARGUMENTS arrays).

    Args:
        lib, ffi: the module's cffi library and FFI.
        c_name: the generated function's C name.
        n_dims: how many symbolic dimensions it takes.
        itemsize: the bytes of one element of its real type.
        inputs: (rows, cols, numpy type number, a scalar) per input, in C
            order; a size > 0 is fixed, -(k + 1) is dimension k.
        outputs: (rows, cols, numpy type number, returned as a float) per output.
        names: the inputs' names in C order (then the caller also takes
            the dict of keyword arguments).
        layout: how to return the outputs (Function.layout; needs names),
            or None: a list in C order.
        fallback: called with the arguments, its result returned, where
            the caller declines or the C function's status is nonzero.

    Returns:
        A callable taking the list of inputs in C order (or the dict of them
        by name) and returning the outputs (see layout), or (without a
        fallback) None to decline or an int status of the C function.
    """
    module = extension()
    if module is None or not hasattr(lib, f"{c_name}__packed") or len(inputs) + len(outputs) > MAX_ARGUMENTS:
        return None
    entry = int(ffi.cast("uintptr_t", ffi.addressof(lib, f"{c_name}__packed")))
    work_len = int(ffi.cast("uintptr_t", ffi.addressof(lib, f"{c_name}_work_len__packed")))
    # interned: keyword arguments' keys are
    named = (tuple(sys.intern(name) for name in names), layout, fallback) if names else ()
    return module.Caller(entry, work_len, n_dims, itemsize, tuple(inputs), tuple(outputs), *named)


def sweeper(lib: Any, ffi: Any, c_name: str) -> Any | None:
    """The generated function run once per one-hot seed in one C call
    (_fastcall.c's sweep), or None (no extension, or a module built
    without packed entry points).

    Returns:
        A callable (dims, arrays, seed_slots, work, slots, rows) -> the first
        nonzero status of the generated function, or 0: dims a tuple of
        ints, arrays the list of inputs then outputs, seed_slots a tuple of
        indices into arrays (the seeds run through each one's entries in
        turn), work the workspace's address, slots a tuple of indices into
        arrays, rows a tuple of arrays, one per slot, of one row per seed
        (see _fastcall.c).
    """
    module = extension()
    if module is None or not hasattr(lib, f"{c_name}__packed") or not hasattr(module, "sweep"):
        return None
    entry = int(ffi.cast("uintptr_t", ffi.addressof(lib, f"{c_name}__packed")))
    return lambda *args: int(module.sweep(entry, *args))
