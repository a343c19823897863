"""Which BLAS the large matrix products call, how to link it, its threads.

Two are known, both from wheels, found without importing them:
- Intel's oneMKL (the `mkl` wheel, `pip install symbackprop[mkl]`), the
  library PyTorch's CPU wheel multiplies with: on the transformer's
  product shapes, one thread, OpenBLAS took 0.88-1.69 of its time (median
  1.35; docs/performance.md, 2026-12-01). It runs on its GNU OpenMP threading layer,
  so its threads are libgomp's, the pool of a module's own parallel loops.
- OpenBLAS from `scipy-openblas32` (a dependency: always there), symbols
  prefixed `scipy_`.

$SYMBACKPROP_BLAS ("mkl" or "openblas") chooses one; by default the first
installed of preference()'s order: mkl, then openblas, but openblas first
on AMD CPUs, where oneMKL runs its generic code path (libmkl_def; a
Zen 4 VM with AVX-512, one thread, interleaved in one process: OpenBLAS
0.3.34's training steps took 0.90-0.95 of oneMKL 2026.2's time on the
GPT-style decoder, 0.93-0.94 on the MNIST MLP, 0.78-0.85 on LeNet-5;
benchmarks/real_sizes.py). The cache key holds the link command, so a
module built against one is never loaded for the other.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from symbackprop.errors import BuildError

BLAS_ENV = "SYMBACKPROP_BLAS"
# Where a module's build folder holds the link stub of a BLAS (Blas.stub),
# relative to that folder (the link runs there; the cache key holds the link).
# Not an identifier: no model's C files (prefix.c, prefix.h) can take it.
STUB_FOLDER = "blas-stub"


@dataclass(frozen=True)
class Blas:
    """A cblas to link: its name, compile and link arguments, the library
    whose thread count set_blas_threads changes, and that function's name."""

    name: str
    compile_args: tuple[str, ...]
    link_args: tuple[str, ...]
    library: Path
    set_threads: str
    get_threads: str
    # A library linked through a stub of this file name and soname: its
    # cblas entry points, empty, built before the link that names it, so that
    # the linker reads them and not the library's every symbol (oneMKL's
    # libmkl_rt: 65,000, 0.12-0.15 s of each link); the module records the
    # soname, and at run time loads the real library, through the rpath.
    stub: str | None = None
    symbols: tuple[str, ...] = ()  # the cblas entry points a module may call

    def stub_source(self) -> str:
        """The stub's C: each entry point, doing nothing (never run)."""
        return "".join(f"void {name}(void) {{}}\n" for name in self.symbols)


# What the runtime header calls; gemmt (one triangle of a product: the
# attention's causal scores) only where its name is defined, as both
# libraries here export it and a cblas of its own may not.
CBLAS_CALLED = ("dgemm", "sgemm", "dtrmm", "strmm", "dtrsm", "strsm", "dgemmt", "sgemmt")
# The LAPACK routines it calls (Fortran names: a trailing underscore), which
# both libraries export beside their cblas: the LU factorization of det,
# logdet and solve, a triangle's inverse for A^-T, and cholesky's factorization
# (templates/linalg.c.j2).
LAPACK_CALLED = ("dgetrf", "sgetrf", "dtrtri", "strtri", "dpotrf", "spotrf")
# What an object file that calls the BLAS (or its LAPACK) names: the cblas
# entry points' prefix, and the LAPACK routines' names.
SYMBOL_MARKS = (b"cblas_", *(name.encode() + b"_" for name in LAPACK_CALLED))


def _cblas_names(prefix: str) -> tuple[str, ...]:
    """The compile flags that turn the BLAS (and LAPACK) calls on, each
    entry point under the library's name for it (OpenBLAS's scipy_cblas_dgemm,
    scipy_dgetrf_)."""
    return ("-DSYMBACKPROP_CBLAS", "-DSYMBACKPROP_LAPACK",
            *(f"-DSYMBACKPROP_CBLAS_{name.upper()}={prefix}cblas_{name}" for name in CBLAS_CALLED),
            *(f"-DSYMBACKPROP_LAPACK_{name.upper()}={prefix}{name}_" for name in LAPACK_CALLED))


def calls_blas(data: bytes) -> bool:
    """Whether an object file or library (its bytes) calls the BLAS or its LAPACK."""
    return any(mark in data for mark in SYMBOL_MARKS)


def _mkl() -> Blas | None:
    """The `mkl` wheel's single dynamic library (in the environment's lib
    folder; the wheel ships no unversioned .so link, so it is linked by its
    file name). Its threading layer is chosen at run time (prepare_blas)."""
    folder = Path(sys.prefix) / "lib"  # where the wheel puts it, in a venv too
    files = sorted(folder.glob("libmkl_rt.so.*"))
    if not files:
        return None
    return Blas(
        name="mkl",
        compile_args=_cblas_names(""),
        link_args=(f"-L{STUB_FOLDER}", f"-l:{files[-1].name}", f"-Wl,-rpath,{folder}"),
        library=files[-1],
        set_threads="MKL_Set_Num_Threads",
        get_threads="MKL_Get_Max_Threads",
        stub=files[-1].name,
        symbols=tuple(f"cblas_{name}" for name in CBLAS_CALLED) + tuple(f"{name}_" for name in LAPACK_CALLED),
    )


def _openblas() -> Blas | None:
    """The scipy-openblas32 wheel's OpenBLAS (its import costs ~50 ms)."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib"
    library = folder / "libscipy_openblas.so"
    if not library.is_file():
        return None
    return Blas(
        name="openblas",
        compile_args=_cblas_names("scipy_"),
        link_args=(f"-L{folder}", "-lscipy_openblas", f"-Wl,-rpath,{folder}"),
        library=library,
        set_threads="scipy_openblas_set_num_threads",
        get_threads="scipy_openblas_get_num_threads",
    )


FINDERS = {"mkl": _mkl, "openblas": _openblas}
INSTALL = {"mkl": "pip install mkl", "openblas": "pip install scipy-openblas32"}


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it ("GenuineIntel", "AuthenticAMD"; "" where unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.partition(":")[2].strip()
    return ""


def preference() -> tuple[str, ...]:
    """The order find_blas tries the BLASes in: oneMKL first, but on AMD
    CPUs, where it runs its generic code path, OpenBLAS first."""
    return ("openblas", "mkl") if cpu_vendor() == "AuthenticAMD" else ("mkl", "openblas")


@cache
def find_blas() -> Blas | None:
    """The BLAS modules link: $SYMBACKPROP_BLAS's choice, else the first
    installed in preference()'s order; None if none is."""
    wanted = os.environ.get(BLAS_ENV, "").strip().lower()
    if not wanted:
        return next((blas for blas in (FINDERS[name]() for name in preference()) if blas is not None), None)
    if wanted not in FINDERS:
        raise BuildError(f"{BLAS_ENV}={wanted!r}: expected one of {', '.join(FINDERS)}")
    blas = FINDERS[wanted]()
    if blas is None:
        raise BuildError(f"{BLAS_ENV}={wanted}, but it is not installed ({INSTALL[wanted]})")
    return blas


MKL_THREADING_GNU = 3  # mkl_service.h's MKL_THREADING_LAYER values: INTEL 0, SEQUENTIAL 1, PGI 2, GNU 3


@cache
def _library(blas: Blas) -> ctypes.CDLL:
    """The BLAS library, ready for its first call: MKL's threads are put
    on libgomp (MKL_THREADING_GNU), the OpenMP of GCC's modules, unless the
    user chose a layer with $MKL_THREADING_LAYER (Intel's default, libiomp5,
    would be a second thread pool beside a module's own)."""
    library = ctypes.CDLL(str(blas.library))
    if blas.name == "mkl" and not os.environ.get("MKL_THREADING_LAYER"):
        library.MKL_Set_Threading_Layer(ctypes.c_int(MKL_THREADING_GNU))
    return library


def prepare_blas() -> None:
    """Before a module that calls BLAS is loaded (toolchain.builder.load_checked)."""
    blas = find_blas()
    if blas is not None:
        _library(blas)


def set_blas_threads(count: int) -> None:
    """How many threads BLAS calls of compiled modules use (default: one
    per core). Does nothing when modules are built without BLAS."""
    blas = find_blas()
    if blas is not None:
        getattr(_library(blas), blas.set_threads)(ctypes.c_int(int(count)))


def blas_threads() -> int | None:
    """How many threads BLAS calls use now (None without BLAS)."""
    blas = find_blas()
    return None if blas is None else int(getattr(_library(blas), blas.get_threads)())
