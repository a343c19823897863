"""Compile generated C with cffi into a content-addressed cache, and load it.

The cache key covers the C source, the cffi declarations, the compiler
flags, the compiler's identity, the Python ABI and symbackprop's version.
A build happens in a private temporary folder under a file lock and is
moved into place with one rename, so a half-finished build is never loaded
and processes building the same module at once leave one entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator

from ._version import __version__
from .errors import BuildError

CACHE_ENV = "SYMBACKPROP_CACHE_DIR"
# Speed without changing results beyond rounding: no -ffast-math. -O3 and
# the host's vector units; contraction to FMA is allowed.
DEFAULT_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-std=c99")


@dataclass(frozen=True)
class BuildOptions:
    flags: tuple[str, ...] = DEFAULT_FLAGS
    cache_dir: Path | None = None  # default: $SYMBACKPROP_CACHE_DIR or the user cache


def cache_root(options: BuildOptions | None = None) -> Path:
    """Where compiled modules are kept: $SYMBACKPROP_CACHE_DIR, else
    $XDG_CACHE_HOME/symbackprop, else ~/.cache/symbackprop."""
    if options is not None and options.cache_dir is not None:
        return Path(options.cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "symbackprop"


@lru_cache(maxsize=None)
def compiler_identity() -> str:
    """The C compiler command and what it says its version is."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    cc = os.environ.get("CC", cc)
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"no working C compiler: running {cc!r} failed ({exc}); install gcc or clang, or set CC") from exc
    return f"{cc}\n{out.stdout.strip()}"


def cache_key(prefix: str, source: str, header: str, cdef: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for part in (prefix, source, header, cdef, " ".join(flags), compiler_identity(),
                 sysconfig.get_config_var("EXT_SUFFIX") or "", __version__):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def module_name(prefix: str, key: str) -> str:
    return f"_sbp_{prefix}_{key[:16]}"


def build(prefix: str, source: str, header: str, cdef: str, options: BuildOptions | None = None) -> tuple[ModuleType, Path]:
    """The compiled extension for this C, from the cache or freshly built.

    Returns the loaded cffi module and its cache folder.

    Raises:
        BuildError: the compiler is missing or failed; the message names
            the log file.
    """
    options = options or BuildOptions()
    key = cache_key(prefix, source, header, cdef, options.flags)
    root = cache_root(options)
    final = root / key
    name = module_name(prefix, key)
    if not _complete(final, name):
        with _locked(root / f"{key}.lock"):
            if not _complete(final, name):
                _compile_into(final, name, prefix, source, header, cdef, options.flags)
    return _load(final, name), final


def _complete(folder: Path, name: str) -> bool:
    return _library(folder, name) is not None


def _library(folder: Path, name: str) -> Path | None:
    if not folder.is_dir():
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def _compile_into(final: Path, name: str, prefix: str, source: str, header: str, cdef: str, flags: tuple[str, ...]) -> None:
    import cffi  # imported here: loading from the cache needs no cffi build machinery

    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"tmp-{final.name}-", dir=final.parent))
    log = staging / "build.log"
    try:
        (staging / f"{prefix}.c").write_text(source)
        (staging / f"{prefix}.h").write_text(header)
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        ffi.set_source(
            name,
            f'#include "{prefix}.h"',
            sources=[str(staging / f"{prefix}.c")],
            include_dirs=[str(staging)],
            extra_compile_args=list(flags),
            libraries=["m"],
        )
        _run_logged(ffi, staging, log)
        for leftover in staging.glob("*.o"):
            leftover.unlink()
        try:
            os.rename(staging, final)
        except OSError:
            if not _complete(final, name):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone once renamed


def _run_logged(ffi, staging: Path, log: Path) -> None:
    """Run cffi's compile with the compiler's output sent to the log file."""
    saved = os.dup(1), os.dup(2)
    try:
        with open(log, "w") as handle:
            os.dup2(handle.fileno(), 1)
            os.dup2(handle.fileno(), 2)
            try:
                ffi.compile(tmpdir=str(staging), verbose=True)
            except Exception as exc:
                sys.stdout.flush()
                failure = exc
            else:
                failure = None
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    if failure is not None:
        kept = staging.parent / f"failed-{staging.name}.log"
        shutil.copyfile(log, kept)
        raise BuildError(f"the C compiler failed on the generated module ({type(failure).__name__}: "
                         f"{failure}); the compiler's output is in {kept}") from failure


def _load(folder: Path, name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    path = _library(folder, name)
    if path is None:
        raise BuildError(f"no compiled module {name} in {folder}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
