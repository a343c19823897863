"""Compile generated C with cffi into a content-addressed cache, and load it.

cffi writes the extension's glue code (API mode, out of line); the C
compiler is run directly: the model's C starts compiling first (one
process, or one per translation unit where the model's C is split,
emit.cunits: the same file once per unit, -DSYMBACKPROP_UNIT=k), then cffi
writes the glue and it compiles beside them, at -O0 (GLUE_LEVEL: it
converts arguments; the hot path only passes through its packed entries,
which keep -O2), and the caller's Python (compile: the derivation) runs
while they do; then one command links them, with the BLAS only where an
object calls it (_linked). No distutils, no change of the
working folder or of the environment, so builds in several threads do not
disturb each other or the program. The commands and the compiler's output
go to a log file.

The cache key covers the C source, header, runtime header and cffi declarations, the whole
compiler command (compiler, flags, link options), what the compiler says
its version is, the Python ABI and symbackprop's version. A build happens
in a private temporary folder under a file lock and is moved into place
with one rename, so a half-finished build is never loaded and processes
building the same module at once leave one entry. `-march=native` is keyed
on the CPU it means here (cache_key.target_cpu), so a cache shared between
hosts never hands one host's vector code to another.

Nothing in the cache is trusted blindly (see cache_trust): folders and
files another user owns or others may write are refused, a library is
loaded only after its entry's manifest (sizes and SHA-256) checks out,
and a damaged entry is moved aside and rebuilt, with a logged warning.
Memos are JSON, never pickles: reading one runs no code. Built modules
export only their PyInit_ function (-fvisibility=hidden), so two modules
loaded with RTLD_GLOBAL cannot call each other's functions.

The compiler and its command lines are compiler.py, the packed entries
written into the glue packed.py, the memos of generated code memo.py.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from symbackprop._version import __version__
from symbackprop.base import trust as cache_trust
from symbackprop.base.cachedir import CACHE_ENV, cache_folder
from symbackprop.base.trust import ABSENT, entry_problem, secure_root, warn
from symbackprop.errors import BuildError
from symbackprop.log import event, stage
from symbackprop.toolchain.blas import (
    INSTALL,
    STUB_FOLDER,
    Blas,
    calls_blas,
    find_blas,
    prepare_blas,
    set_blas_threads,  # noqa: F401  (re-exported: older scripts import it here)
)
from symbackprop.toolchain.compiler import (
    EXT_SUFFIX,
    build_commands,
    compiler_command,
    libmvec_available,
    simd_flags,
    toolchain,
)
from symbackprop.toolchain.key import asks_for_host_cpu, digest, host_cpu
from symbackprop.toolchain.packed import packed_entries
from symbackprop.toolchain.threads import blas_beside_openmp

# Speed without changing results beyond rounding: no -ffast-math. -O3 and
# the host's vector units; contraction to FMA is allowed. On x86-64, loops
# use 512-bit vectors where the CPU has them (GCC prefers 256 by default):
# libmvec's 8-wide exp made log-sum-exp's gradient 1.3x and k-means' Newton
# direction 1.6x faster; without AVX-512 the flag changes nothing.
_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
DEFAULT_FLAGS = ("-O3", "-march=native", *(("-mprefer-vector-width=512",) if _X86_64 else ()),
                 "-ffp-contract=fast", "-fno-math-errno", "-std=c99")
# Replaces DEFAULT_FLAGS where BuildOptions is given no flags, in this process
# and the ones it starts: the test suite builds at -O1 with it (tests/conftest.py).
FLAGS_ENV = "SYMBACKPROP_CFLAGS"


def default_flags() -> tuple[str, ...]:
    """The flags of BuildOptions(): $SYMBACKPROP_CFLAGS split as a shell
    would (never run by one), else DEFAULT_FLAGS. The cache key holds the
    whole compiler command, so modules built under one are never loaded
    for the other."""
    text = os.environ.get(FLAGS_ENV, "").strip()
    if not text:
        return DEFAULT_FLAGS
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise BuildError(f"{FLAGS_ENV}={text!r} is not a list of compiler flags ({exc})") from exc


@dataclass(frozen=True)
class BuildOptions:
    """How to build: compiler flags, the cache folder, whether to use BLAS.

    Args:
        flags: the C compiler's flags (default: $SYMBACKPROP_CFLAGS, else
            DEFAULT_FLAGS).
        cache_dir: where built modules are kept (None: $SYMBACKPROP_CACHE_DIR,
            else the user cache folder).
        blas: large matrix products call a BLAS (toolchain.blas: MKL when the
            `mkl` wheel is installed and the CPU is not AMD, else OpenBLAS from scipy-openblas32;
            None: use one if there is one; True: require one, a BuildError
            where none is; False: plain C loops only).
        vector_math: elementwise loops call the SIMD variants of exp, tanh,
            ... from glibc's libmvec (GCC on x86_64 Linux; None: when
            available).
        openmp: split elementwise loops over many rows across threads
            (-fopenmp).
    """

    flags: tuple[str, ...] = field(default_factory=default_flags)
    cache_dir: Path | None = None  # default: $SYMBACKPROP_CACHE_DIR or the user cache
    blas: bool | None = None
    vector_math: bool | None = None  # glibc's libmvec SIMD math with GCC (None: when available)
    openmp: bool = False  # elementwise loops over many rows on several threads (-fopenmp)


def _blas_for(options: BuildOptions) -> Blas | None:
    if options.blas is False:
        return None
    blas = find_blas()
    if blas is None and options.blas:
        raise BuildError(f"BuildOptions(blas=True), but no BLAS is installed ({' or '.join(INSTALL.values())})")
    return blas


def _vector_math_args(options: BuildOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if options.vector_math is False:
        return (), ()
    available = libmvec_available(tuple(compiler_command()))
    if not available:
        if options.vector_math:
            raise BuildError("BuildOptions(vector_math=True) needs GCC on x86_64 Linux with glibc's libmvec")
        return (), ()
    return ("-DSYMBACKPROP_LIBMVEC",), ("-lmvec",)


def cache_root(options: BuildOptions | None = None) -> Path:
    """Where compiled modules are kept: BuildOptions.cache_dir, else
    $SYMBACKPROP_CACHE_DIR, else the user cache folder (base.cachedir)."""
    return cache_folder(options.cache_dir if options is not None else None)



def cache_key(prefix: str, source: str, header: str, cdef: str, flags: tuple[str, ...], libraries: tuple[str, ...] = ()) -> str:
    """The content address of a module: everything its binary depends on."""
    from symbackprop.emit.codegen import runtime_header  # the code generator: not for loading from the cache
    from symbackprop.emit.cunits import unit_count

    objects, link = build_commands("NAME", prefix, flags, Path("FOLDER"), libraries, unit_count(source))
    return digest("module", prefix, source, header, runtime_header(), cdef, *packed_entries(cdef),
                  *map(shlex.join, [*objects, link]), toolchain(link), EXT_SUFFIX, __version__)


def host_target(options: BuildOptions | None = None) -> str:
    """What a memo of generated code and its cache folder must also be keyed
    on, so that a cache shared between hosts never hands one host's entry
    to another CPU: where the flags ask for the host's CPU, its model and
    flags (/proc/cpuinfo: no compiler run on the memo's fast path)."""
    command = [*compiler_command(), *(options or BuildOptions()).flags]
    return host_cpu() if asks_for_host_cpu(command) else ""


def module_name(prefix: str, key: str) -> str:
    return f"_sbp_{prefix}_{key[:16]}"


def _compile_and_link_args(options: BuildOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Compiler flags and link arguments: the options' flags, then BLAS,
    vector math and simd directives (the BLAS's link arguments first:
    _linked may drop them)."""
    blas = _blas_for(options)
    vector_flags, vector_libraries = _vector_math_args(options)
    openmp = ("-fopenmp",) if options.openmp else ()
    simd = simd_flags(tuple(compiler_command()))
    flags = options.flags + (blas.compile_args if blas else ()) + vector_flags + simd + openmp
    libraries = (blas.link_args if blas else ()) + vector_libraries + openmp
    return flags, libraries




def _linked(libraries: tuple[str, ...], blas: tuple[str, ...], objects: list[Path]) -> tuple[str, ...]:
    """The link's libraries: without the BLAS's arguments (`blas`, their
    first ones) where no object refers to a cblas symbol. The linker reads
    every symbol of a library it is given (oneMKL's is 16 MB: 90 M
    instructions and 0.05-0.1 s of each link, the build's last step), and
    most models multiply no large matrices (the runtime header's product
    helpers, which call the BLAS, are static: compiled only where called,
    when optimizing)."""
    if not blas or libraries[:len(blas)] != blas:
        return libraries
    if any(calls_blas(path.read_bytes()) for path in objects):
        return libraries
    return libraries[len(blas):]


def warm_up(options: BuildOptions | None = None) -> threading.Thread:
    """Start, in a thread, what a build asks of this machine once per
    process: the compiler's version and the CPU it targets, the BLAS and
    libmvec found (compiler and linker processes; each answer is cached), and
    the imports of cffi and filelock. compile() starts it before it
    generates the C: these processes then wait beside the Python, not
    between it and the C compiler (0.1-0.3 s of a first cold compile, more
    where a second model's Python holds the interpreter: compile_all). A
    failure is left for the build, which raises it with its message."""

    def warm() -> None:
        with contextlib.suppress(Exception):  # (the build asks again, and says what is wrong)
            import cffi  # noqa: F401
            import filelock  # noqa: F401

            flags, _ = _compile_and_link_args(options or BuildOptions())
            toolchain([*compiler_command(), *flags])

    thread = threading.Thread(target=warm, name="symbackprop build warm-up", daemon=True)
    thread.start()
    return thread


def cache_entry(prefix: str, source: str, header: str, cdef: str, options: BuildOptions | None = None) -> Path:
    """The cache folder the module of this C has (or will have) under these options."""
    options = options or BuildOptions()
    return cache_root(options) / cache_key(prefix, source, header, cdef, *_compile_and_link_args(options))


def build(prefix: str, source: str, header: str, cdef: str, options: BuildOptions | None = None) -> tuple[ModuleType, Path]:
    """The compiled extension for this C, from the cache or freshly built.

    Returns the loaded cffi module and its cache folder.

    Raises:
        BuildError: the compiler is missing or failed (the message names
            the log file), or the cache folder cannot be written or is not
            this user's alone.
    """
    final = build_entry(prefix, source, header, cdef, options)
    return load_entry(final, prefix), final


def build_entry(prefix: str, source: str, header: str, cdef: str, options: BuildOptions | None = None,
                meanwhile: Callable[[], None] | None = None) -> Path:
    """build's first half: the cache folder of this C, complete (found, or
    compiled into it now), its module not loaded. It runs no Python of the
    module, so it may run in a thread while the caller goes on (compile_all
    generates the next model's C meanwhile); load_entry then loads it.
    `meanwhile`, where given, runs once in this call: while the C compiler
    runs where the module is compiled (its processes use other cores; a
    compile's derivation is written then), else before it returns.

    Raises:
        BuildError: as build.
    """
    options = options or BuildOptions()
    flags, libraries = _compile_and_link_args(options)
    blas = _blas_for(options)
    final = cache_entry(prefix, source, header, cdef, options)
    name = module_name(prefix, final.name)
    secure_root(final.parent)
    pending = [meanwhile] if meanwhile is not None else []

    def run_pending() -> None:
        while pending:
            pending.pop()()

    if entry_problem(final, _library(name)) is None:
        event("cache hit: %s", final)
    else:
        event("cache miss: %s", final)
        build_once(final, lambda folder: _complete(folder, name),
                   lambda staging: _compile_into(staging, final, name, prefix, source, header, cdef, flags, libraries,
                                                 run_pending, blas))
    run_pending()  # found in the cache (or made by another process meanwhile)
    return final


def load_entry(final: Path, prefix: str) -> ModuleType:
    """build's second half: the module of the cache folder build_entry gave.

    Raises:
        BuildError: the entry fails its check or does not load.
    """
    return load_checked(final, module_name(prefix, final.name))


def build_once(final: Path, complete: Callable[[Path], bool], fill: Callable[[Path], None]) -> None:
    """Make the cache folder `final` unless it is complete: under a file lock
    (another process may be making the same one), `fill` populates a private
    staging folder, which gets a manifest of its files and is then renamed
    into place, so a reader sees a whole entry or none. An entry that is
    there but not complete (damaged, unfinished, not this user's) is moved
    aside first.

    Raises:
        BuildError: the cache folder cannot be written or is not this
            user's alone (or what `fill` raises).
    """
    from filelock import FileLock  # imported here: loading from the cache takes no lock

    root = secure_root(final.parent)
    try:
        with FileLock(root / f"{final.name}.lock"):
            if complete(final):
                return
            _remove_stale_staging(root)
            staging = Path(tempfile.mkdtemp(prefix=f"tmp-{final.name}-", dir=root))
            try:
                fill(staging)
                cache_trust.write_manifest(staging)
                cache_trust.move_aside(final)  # not complete (a complete one is never replaced: we hold the lock)
                os.rename(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone once renamed
    except OSError as exc:
        raise BuildError(f"cannot write the module cache in {root} ({exc}); set {CACHE_ENV} to a writable folder") from exc


def _library(name: str) -> str:
    return f"{name}{EXT_SUFFIX}"


def _complete(folder: Path, name: str) -> bool:
    """Whether the entry holds the module, whole and trusted; a warning where
    it is there but damaged or not this user's alone (it will be rebuilt)."""
    return entry_ok(folder, _library(name))


def entry_ok(folder: Path, library: str) -> bool:
    """Whether the cache entry `folder` may be loaded (see
    cache_trust.entry_problem); a warning where it exists but may not."""
    problem = entry_problem(folder, library)
    if problem not in (None, ABSENT):
        warn("damaged or untrusted module cache entry %s, not loaded (it is rebuilt): %s", folder, problem)
    return problem is None


STALE_STAGING_SECONDS = 24 * 3600


def _remove_stale_staging(root: Path) -> None:
    """Private folders of builds that were killed a day ago or more: no build
    runs that long, so nothing still writes there."""
    cutoff = time.time() - STALE_STAGING_SECONDS
    for folder in root.glob("tmp-*"):
        _remove_if_older(folder, cutoff)


def _remove_if_older(folder: Path, cutoff: float) -> None:
    with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
        if folder.is_dir() and folder.stat().st_mtime < cutoff:
            shutil.rmtree(folder, ignore_errors=True)


def _compile_into(
    staging: Path, final: Path, name: str, prefix: str, source: str, header: str, cdef: str, flags: tuple[str, ...],
    libraries: tuple[str, ...], meanwhile: Callable[[], None] = lambda: None, blas: Blas | None = None
) -> None:
    """The module's files and library in `staging`: the model's objects
    start compiling first, then cffi writes the glue and it starts too,
    then `meanwhile` runs while they compile (Python on its own core:
    the glue's and meanwhile's time is not added before the compiler's);
    the link names the BLAS only where an object calls it (_linked),
    through its link stub where it has one (built then). The cache key
    holds the link command with it."""
    import cffi  # imported here: loading from the cache needs no cffi build machinery

    from symbackprop.emit.codegen import RUNTIME_HEADER, runtime_header
    from symbackprop.emit.cunits import unit_count

    with stage("C compile", prefix):
        (staging / f"{prefix}.c").write_text(source)
        (staging / f"{prefix}.h").write_text(header)
        (staging / RUNTIME_HEADER).write_text(runtime_header())  # what every module's .c includes
        units = unit_count(source)
        event("compiling %s: %d lines of C%s, cache key %s", prefix, len(source.splitlines()),
              f" in {units} units" if units > 1 else "", final.name[:12])
        objects, link = build_commands(name, prefix, flags, staging, libraries, units)
        glue, model = objects[0], objects[1:]
        link_args = blas.link_args if blas else ()
        linked: list[tuple[str, ...]] = []  # the link's libraries, once the objects are compiled

        def write_glue() -> None:
            ffi = cffi.FFI()
            declarations, definitions = packed_entries(cdef)
            ffi.cdef(cdef + declarations)
            # quiet: no "generating ..." line
            ffi.set_source(name, f'#include "{prefix}.h"\n' + definitions, compiler_verbose=0)
            ffi.emit_c_code(str(staging / f"{name}.c"))

        def stub_step() -> list[list[str]]:  # only where the link names the BLAS
            linked.append(_linked(libraries, link_args, [Path(command[-1]) for command in objects]))
            names_blas = bool(link_args) and linked[0][:len(link_args)] == link_args
            return _link_stub(staging, blas) if blas is not None and blas.stub and names_blas else []

        def link_step() -> list[list[str]]:
            kept = linked[0]
            return [link if kept == libraries else build_commands(name, prefix, flags, staging, kept, units)[1]]

        run_logged([objects, stub_step, link_step], staging / "build.log", final.parent, prefix,
                    started=[(model, write_glue), ([glue], meanwhile)])
        for command in objects:
            Path(command[-1]).unlink()  # in the library now
        if (staging / STUB_FOLDER).exists():  # a link-time stand-in: never loaded, not kept
            shutil.rmtree(staging / STUB_FOLDER)
            (staging / f"{STUB_FOLDER}.c").unlink()


def _link_stub(folder: Path, blas: Blas) -> list[list[str]]:
    """The command building `blas`'s link stub (Blas.stub) in `folder`,
    its source written there."""
    source = folder / f"{STUB_FOLDER}.c"
    source.write_text(blas.stub_source())
    (folder / STUB_FOLDER).mkdir()
    return [[*compiler_command(), "-shared", "-fPIC", f"-Wl,-soname,{blas.stub}", str(source),
             "-o", str(folder / STUB_FOLDER / str(blas.stub))]]


PROGRESS_SECONDS = 2.0  # while the compiler runs, a "still compiling" line this often


def run_logged(steps: list[list[list[str]] | Callable[[], list[list[str]]]], log: Path, keep_in: Path,
                subject: str = "", started: list[tuple[list[list[str]], Callable[[], None]]] | None = None) -> None:
    """Run the compiler: step after step, the commands of a step at once,
    their output in `log`, logging "still compiling <subject>: <s> s
    elapsed" every PROGRESS_SECONDS until they end; on a failure keep the
    log in `keep_in` and raise BuildError with the first error line.
    `started`, where given, says how the first step's commands start:
    (commands, then) pairs in order, `then` run once those commands run
    (the next ones' input written while these compile). A step given as a
    function is asked for its commands when the steps before it are done."""
    status: int | None = 0
    with open(log, "w") as handle:
        for k, step in enumerate(steps):
            commands = step() if callable(step) else step
            handle.write("".join(f"$ {shlex.join(command)}\n" for command in commands))
            handle.flush()
            status = _run_all(started if k == 0 and started is not None else [(commands, lambda: None)],
                              handle, log.parent, subject)
            if status != 0:
                break
    if status == 0:
        return
    kept = keep_in / f"failed-{log.parent.name}.log"
    shutil.copyfile(log, kept)
    lines = [line for line in log.read_text(errors="replace").splitlines() if not line.startswith("$ ")]
    first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "no output")
    what = f"exit status {status}" if status is not None else "it could not be started"
    raise BuildError(
        f"the C compiler {compiler_command()[0]!r} failed on the generated module ({what}): {first.strip()}; "
        f"the commands and the compiler's output are in {kept}"
    )


def _run_all(batches: list[tuple[list[list[str]], Callable[[], None]]], handle: Any, folder: Path,
             subject: str) -> int | None:
    """The first nonzero exit status of the commands run at once (0: all
    succeeded; None: one could not be started), their output to `handle`:
    each batch's commands started, then its callable run, in order."""
    processes: list[subprocess.Popen[bytes]] = []
    began = time.perf_counter()
    try:
        for commands, then in batches:
            try:
                processes.extend(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=folder)
                                 for command in commands)
            except OSError as exc:
                handle.write(f"{exc}\n")
                _stop(processes)
                return None
            then()
        for process in processes:
            while True:
                try:
                    process.wait(timeout=PROGRESS_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    event("still compiling %s: %.1f s elapsed", subject, time.perf_counter() - began)
    except BaseException:  # interrupted, or what ran meanwhile failed: leave no compiler running
        _stop(processes)
        raise
    return next((p.returncode for p in processes if p.returncode != 0), 0)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def _one_blas_pool(library: Path) -> None:
    """A module built with OpenMP and BLAS splits its large products across
    its OpenMP threads, one single-threaded BLAS call a block (matmul.c.j2):
    the BLAS's own threads are set to one, as OpenBLAS's spin-wait for
    work and for each other and starve OpenMP's (W11's step on a
    loaded 2-core machine, two threads: 5.4-9.8 s with both pools, 0.1-0.2 s
    with OpenMP's alone; docs/performance.md). set_blas_threads changes it
    again (sbp.set_num_threads leaves it at one). libgomp's wait policy is left as it is: with one pool its short
    spin between parallel loops is what makes them cheap (W11 at two
    threads 38 ms; 62 ms with OMP_WAIT_POLICY=passive, which stop 25 had
    made the default while OpenBLAS ran its own pool)."""
    data = library.read_bytes()
    if calls_blas(data):
        prepare_blas()
        if b"libgomp" in data:
            blas_beside_openmp()


def load_checked(folder: Path, name: str) -> ModuleType:
    """The module `name` of the cache entry `folder`, loaded only once the
    entry is checked (BuildError where it fails the check)."""
    if name in sys.modules:
        return sys.modules[name]
    path = folder / _library(name)
    problem = entry_problem(folder, path.name)
    if problem is not None:
        raise BuildError(f"not loading the compiled module {name} from {folder}: "
                         f"{'it is not there' if problem == ABSENT else problem}")
    _one_blas_pool(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BuildError(f"no compiled module {name} in {folder}")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # whole, but e.g. a library it links is missing on this host
        raise BuildError(f"cannot load the compiled module {path}: {exc}") from exc
    sys.modules[name] = module
    return module



def load_built(folder: Path, prefix: str, options: BuildOptions | None = None) -> ModuleType | None:
    """The extension module already built in a cache folder, if complete
    and trusted, and if the folder is an entry of the cache (a memo could
    name any folder)."""
    folder = Path(folder)
    if folder.parent != cache_root(options) or not re.fullmatch(r"[0-9a-f]{32}", folder.name):
        return None
    if not os.path.lexists(folder):
        return None  # removed since: a plain miss
    try:
        module = load_checked(folder, module_name(prefix, folder.name))  # checks the entry (once) before loading
    except BuildError as exc:  # the memo only saves time: generate and build instead
        warn("%s", exc)
        return None
    event("cache hit: %s", folder)
    return module
