"""The public thread setting of compiled modules (`sbp.set_num_threads`,
`sbp.get_num_threads`), as torch.set_num_threads: one number for both
thread pools the generated code may use, the BLAS's (toolchain.blas) and
OpenMP's (libgomp, for modules built with BuildOptions(openmp=True)).

A module built with both splits its products across its OpenMP threads,
each block one single-threaded BLAS call (builder._one_blas_pool): once
such a module is loaded, the BLAS keeps one thread and the number given
goes to OpenMP alone, so that two pools never compete for the cores.

OpenMP's count is a setting of the calling thread (omp_set_num_threads):
calls from other Python threads keep $OMP_NUM_THREADS (or one per core).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

from symbackprop.errors import ArgumentError
from symbackprop.toolchain.blas import blas_threads, set_blas_threads

_shared = {"openmp_blas": False}  # a module built with OpenMP and BLAS was loaded


@cache
def _libgomp() -> ctypes.CDLL | None:
    """GCC's OpenMP runtime (the one a module built with -fopenmp loads:
    the same library by its soname), or None where it is not installed."""
    for name in ("libgomp.so.1", ctypes.util.find_library("gomp")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


def blas_beside_openmp() -> None:
    """A module built with OpenMP and BLAS is being loaded: the BLAS keeps
    one thread from now on (its blocks run on OpenMP's threads)."""
    _shared["openmp_blas"] = True
    set_blas_threads(1)


def set_num_threads(count: int) -> None:
    """How many threads compiled modules use (the BLAS's products and the
    OpenMP loops; see the module's docstring). As torch.set_num_threads.

    Args:
        count: a whole number, at least 1.

    Raises:
        ArgumentError: count is not a whole number >= 1.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ArgumentError(f"set_num_threads takes a whole number of threads, at least 1; got {count!r}")
    set_blas_threads(1 if _shared["openmp_blas"] else count)
    gomp = _libgomp()
    if gomp is not None:
        gomp.omp_set_num_threads(ctypes.c_int(count))


def get_num_threads() -> int:
    """How many threads compiled modules use now: OpenMP's count where its
    runtime is installed, else the BLAS's, else 1."""
    gomp = _libgomp()
    if gomp is not None:
        return int(gomp.omp_get_max_threads())
    return blas_threads() or 1


__all__ = ["blas_beside_openmp", "get_num_threads", "set_num_threads"]
