"""The generated C and the runtime header compile without a warning under
GCC's optimizing builds (-O3 -Wall -Wextra, as CMake's Release build adds
-O3): some warnings (-Waggressive-loop-optimizations) appear only once
the optimizer inlines the runtime's helpers with known sizes. The checked-in
examples, with and without OpenMP and BLAS, and a float32 module."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from c_driver import write_runtime_header
from conftest import ROOT, load_example

from symbackprop.pipeline import generate

FLAGS = ["-std=c99", "-O3", "-Wall", "-Wextra", "-Wpedantic"]
VARIANTS = {
    "plain": [],
    "openmp_blas": ["-fopenmp", "-DSYMBACKPROP_CBLAS"],
    # the causal scores on gemmt, as symbackprop's own builds link it (without: gemm)
    "openmp_blas_gemmt": ["-fopenmp", "-DSYMBACKPROP_CBLAS", "-DSYMBACKPROP_CBLAS_DGEMMT=cblas_dgemmt",
                          "-DSYMBACKPROP_CBLAS_SGEMMT=cblas_sgemmt"],
    "simd": ["-fopenmp-simd", "-DSYMBACKPROP_OPENMP_SIMD"],
}


def _warnings(source: Path, include: Path, extra: list[str]) -> str:
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs gcc on PATH (the warnings are GCC's)")
    done = subprocess.run([compiler, *FLAGS, *extra, f"-I{include}", "-c", str(source), "-o", "/dev/null"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


# where each warned: mnist_mlp's sums inlined (-Waggressive-loop-optimizations),
# transformer_lm's attention workspace unused with BLAS (-Wunused-variable)
CASES = [("mnist_mlp", v) for v in sorted(VARIANTS)] + [("mlp", "plain"), ("transformer_lm", "openmp_blas"),
                                                         ("transformer_lm", "openmp_blas_gemmt")]


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_checked_in_examples_compile_without_warnings(example, variant):
    source = ROOT / "generated" / example / f"{example}.c"
    assert _warnings(source, ROOT / "generated", VARIANTS[variant]) == ""


def test_a_float32_module_compiles_without_warnings(tmp_path):
    """float32's reductions (16 lanes in log-sum-exp), sums over 128 rows."""
    emitted, _ = generate(load_example("mnist_mlp").model, "float32")
    write_runtime_header(tmp_path)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    source = tmp_path / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    assert _warnings(source, tmp_path, []) == ""
