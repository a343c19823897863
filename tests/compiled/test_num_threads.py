"""sbp.set_num_threads / sbp.get_num_threads (the BLAS's and OpenMP's
threads of compiled modules) and the public sbp.BuildOptions."""

import subprocess
import sys
import textwrap

import pytest

import symbackprop as sbp
from symbackprop.toolchain import builder


def _run(code: str) -> str:
    """Run code in a fresh interpreter (the thread settings are the process's)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_build_options_is_public():
    assert sbp.BuildOptions is builder.BuildOptions
    assert "BuildOptions" in sbp.__all__ and {"set_num_threads", "get_num_threads"} <= set(sbp.__all__)
    assert sbp.BuildOptions(openmp=True).openmp


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_set_num_threads_refuses_what_is_not_a_count(bad):
    with pytest.raises(sbp.ArgumentError, match=r"set_num_threads takes a whole number of threads, at least 1"):
        sbp.set_num_threads(bad)


def test_set_then_get_and_the_blas_follows():
    out = _run("""
        import symbackprop as sbp
        from symbackprop.toolchain.blas import blas_threads
        from symbackprop.toolchain.threads import _libgomp
        for n in (1, 2, 1):
            sbp.set_num_threads(n)
            print(sbp.get_num_threads() if _libgomp() else n, blas_threads() or n)
    """)
    assert out.splitlines() == ["1 1", "2 2", "1 1"]


def test_an_openmp_module_with_blas_keeps_the_blas_at_one_thread():
    """Two pools would compete for the cores (builder._one_blas_pool)."""
    out = _run("""
        import numpy as np, sympy as sp
        import symbackprop as sbp
        from symbackprop.toolchain.blas import blas_threads
        from symbackprop.toolchain.threads import _libgomp
        if blas_threads() is None or _libgomp() is None:
            print("skip")
        else:
            A, B = sp.MatrixSymbol("A", 64, 64), sp.MatrixSymbol("B", 64, 64)
            model = sbp.Model("threads_omp_blas", inputs=[A], params=[B], outputs={"C": A * B})
            mod = sbp.compile(model, options=sbp.BuildOptions(openmp=True, blas=True))
            mod.forward(A=np.eye(64), B=np.eye(64))
            sbp.set_num_threads(2)
            print(sbp.get_num_threads(), blas_threads())
    """)
    if out == "skip":
        pytest.skip("no BLAS or no libgomp installed")
    assert out == "2 1"
