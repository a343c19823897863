"""A per-example map's sums keep one vector register's lanes of the real
type (RealType.lanes: eight doubles, sixteen floats), as the reductions
do: a small body's locals, a wide body's sums over whole groups of lanes
(its copies padded, the lanes in the workspace, the runtime's _lane_sums),
and a wide body's whole groups before its scalar tail. Float32 gradients
against numpy's float64 closed form at counts of examples below, at and
past one and several groups (the examples after the last whole group
included): a dropped tail or lanes the sums miss are off by far more than
float rounding. A float64 module compiled as float (<PREFIX>_REAL=float)
keeps its text's eight lanes, and the float helper it calls is told so."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, driver_source, input_arrays, parse_output, write_runtime_header
from test_memory_safety import SANITIZE, SANITIZER_ENV, _sanitizer_works
from test_wide_maps import M, _polyfit_model

import symbackprop as sbp
from symbackprop.emit.emitted import FLOAT32, FLOAT64
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions

FUNCTIONS = ("forward", "value_and_grad")
COUNTS = [1, 7, 8, 9, 15, 16, 17, 33, 1000]
DEGREE = 5  # a small body: its sum in lanes


def _small_model() -> sbp.Model:
    """Least squares of a degree-5 polynomial (examples/polynomial_fit.py):
    the coefficients' gradient, six sums over the examples, in lanes."""
    N = sp.Symbol("N", integer=True, positive=True)
    points, coeffs = sp.MatrixSymbol("ts", N, 2), sp.MatrixSymbol("x", 1, DEGREE + 1)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{DEGREE + 1}", real=True)
    squared = sbp.map_examples((s - sum(k[j] * t**j for j in range(DEGREE + 1))) ** 2,
                               [((t, s), points), (sp.Matrix(k), coeffs)])
    return sbp.Model("small_polyfit", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", squared, 0) / 2)


# name -> (model, terms, free coefficients); the wide ones' bodies are far over LANES_MAX_OPS
MODELS = {
    "small": (_small_model, DEGREE + 1, DEGREE + 1),
    "padded": (lambda: _polyfit_model(free=4), M, 4),  # 4 sums over copies padded to whole groups
    "padded_many": (_polyfit_model, M, M),  # 64 sums
    "tail": (lambda: _polyfit_model(residuals=True), M, M),  # whole groups, then a scalar tail
}


@pytest.fixture(scope="module")
def float32_modules():
    return {name: sbp.compile(make(), functions=FUNCTIONS, dtype="float32") for name, (make, _, _) in MODELS.items()}


@pytest.fixture(scope="module")
def float32_production(tmp_path_factory):
    """The same at the production flags (-O3 -march=native): GCC vectorizes
    the lanes' loops, a whole register of floats an operation."""
    options = BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path_factory.mktemp("production"))
    return {name: sbp.compile(make(), functions=FUNCTIONS, dtype="float32", options=options)
            for name, (make, _, _) in MODELS.items()}


def _closed_form(t: np.ndarray, s: np.ndarray, k: np.ndarray, terms: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(loss, gradient, residuals) in float64, term j's coefficient k[j % len(k)]."""
    V = t[:, None] ** np.arange(terms)[None, :]
    fold = np.zeros((terms, k.size))
    fold[np.arange(terms), np.arange(terms) % k.size] = 1
    r = s - V @ fold @ k
    return 0.5 * r @ r, -(fold.T @ V.T @ r), r


def test_each_kind_of_sum_keeps_the_real_types_lanes(float32_modules):
    """Sixteen float lanes (eight double ones) in the C of each kind of loop."""
    assert (FLOAT64.lanes, FLOAT32.lanes) == (8, 16)
    small64 = generate(_small_model(), functions=FUNCTIONS)[0].source
    assert "acc0[8] = {" in small64 and "k + 8 <= N" in small64
    small = float32_modules["small"].emitted.source
    assert "SYMBACKPROP_WIDE" not in small  # (a body under LANES_MAX_OPS)
    assert "acc0[16] = {" in small and "for (; k + 16 <= N; k += 16) {" in small and "l < 16;" in small
    for name in ("padded", "padded_many"):
        source = float32_modules[name].emitted.source
        assert "const int64_t rows16 = (N + 15) & ~(int64_t)15;" in source
        assert "for (int64_t i0 = 0; i0 < rows16; i0 += 16) {" in source
        assert "for (int64_t lane = 0; lane < 16; ++lane) {" in source
        assert re.search(r"_lane_sums\(lanes, 16, \d+, N - \(rows16 - 16\), term_sums\);", source)
        assert "rows8" not in source
    tail = float32_modules["tail"].emitted.source
    assert "(N & ~(int64_t)15)" in tail and "SYMBACKPROP_SCALAR_TAIL" in tail


@pytest.mark.parametrize("build", ["float32_modules", "float32_production"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", COUNTS)
def test_float32_sums_in_lanes_give_the_closed_form(build, name, n, request):
    """Loss and gradient (and each example's squared residual, where the
    loop keeps a scalar tail) in float32, against float64's closed form
    of the same float32 inputs."""
    module = request.getfixturevalue(build)[name]
    _, terms, free = MODELS[name]
    rng = np.random.default_rng(1000 + n)
    t = rng.uniform(-1, 1, n).astype(np.float32)
    s = rng.normal(size=n).astype(np.float32)
    k = (rng.normal(size=free) / np.arange(1, free + 1)).astype(np.float32)
    loss, grad, r = _closed_form(t.astype(np.float64), s.astype(np.float64), k.astype(np.float64), terms)
    V = np.abs(t.astype(np.float64))[:, None] ** np.arange(terms)[None, :]
    scale = V.T @ (np.abs(r) + np.abs(s)) + 1  # of each term's sum: its rounding's size
    fold = np.zeros((terms, free))
    fold[np.arange(terms), np.arange(terms) % free] = 1
    ts, row = np.stack([t, s], axis=1), k.reshape(1, -1)
    got_loss, grads = module.value_and_grad(ts=ts, x=row)
    assert grads["x"].dtype == np.float32
    assert float(np.ravel(got_loss)[0]) == pytest.approx(loss, rel=1e-4, abs=1e-5)
    assert np.all(np.abs(grads["x"].ravel() - grad) <= 1e-4 * (fold.T @ scale)), (grads["x"].ravel(), grad)
    forward = module.forward(ts=ts, x=row)
    assert float(np.ravel(forward["loss"])[0]) == pytest.approx(loss, rel=1e-4, abs=1e-5)
    if "squared" in forward:
        np.testing.assert_allclose(np.ravel(forward["squared"]), r * r, rtol=1e-3, atol=1e-5 * (1 + np.max(r * r)))


@pytest.mark.parametrize(("dtype", "real", "defines"), [
    ("float32", "float", []),
    ("float64", "float", ["-DWIDE_POLYFIT_4_REAL=float"]),  # a float64 module's eight lanes, in floats
    ("float64", "double", []),
])
def test_a_padded_loop_called_from_c_and_a_float64_module_compiled_as_float(dtype, real, defines, tmp_path):
    """The padded wide loop called from C (under AddressSanitizer where it
    runs: its copies' and lanes' rows past the last example stay inside
    the workspace), at each count of examples. The float64 module
    compiled as float keeps its text's eight lanes (rows8, into[8 + lane])
    and calls the float helper, through its alias, with that count."""
    emitted, _ = generate(_polyfit_model(free=4), dtype=dtype, functions=FUNCTIONS)
    lanes = (FLOAT32 if dtype == "float32" else FLOAT64).lanes
    assert f"_lane_sums(lanes, {lanes}, 4, N - (rows{lanes} - {lanes}), term_sums);" in emitted.source
    source = tmp_path / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    flags = [*STRICT_FLAGS, *(SANITIZE if _sanitizer_works(tmp_path) else ["-O1"]), *defines, f"-I{tmp_path}"]
    subprocess.run(["cc", *flags, "-c", str(source), "-o", str(tmp_path / "module.o")], check=True,
                   capture_output=True, text=True)
    numpy_real = np.float32 if real == "float" else np.float64
    rel = 1e-4 if real == "float" else 1e-10
    fold = np.zeros((M, 4))
    fold[np.arange(M), np.arange(M) % 4] = 1
    for n in COUNTS:
        dims = {"N": n}
        (tmp_path / "driver.c").write_text(driver_source([emitted.module], "value_and_grad", dims).replace("double", real))
        exe = tmp_path / f"driver_{n}"
        subprocess.run(["cc", *flags, str(tmp_path / "driver.c"), str(tmp_path / "module.o"), "-o", str(exe), "-lm"],
                       check=True, capture_output=True, text=True)
        ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env={**os.environ, **SANITIZER_ENV})
        assert ran.returncode == 0 and "Sanitizer" not in ran.stderr, ran.stderr[-4000:]
        printed = parse_output(ran.stdout)
        arrays = input_arrays(emitted.module, "value_and_grad", dims, {"ts": (n, 2), "x": (1, 4)})
        ts, k = (arrays[name].astype(numpy_real).astype(np.float64) for name in ("ts", "x"))  # as the C read them
        loss, grad, r = _closed_form(ts[:, 0], ts[:, 1], k.ravel(), M)
        scale = (np.abs(ts[:, :1]) ** np.arange(M)[None, :]).T @ (np.abs(r) + np.abs(ts[:, 1])) + 1
        assert printed[("wide_polyfit_4", "loss")] == pytest.approx([loss], rel=rel), n
        got = np.array(printed[("wide_polyfit_4", "grad_x")])
        assert np.all(np.abs(got - grad) <= rel * (fold.T @ scale)), (n, got, grad)


def test_a_dimension_named_as_the_float_loops_rows_is_renamed():
    """rows16, the float loop's examples in whole sixteens, as a user's
    dimension (as rows8: tests/compiled/test_wide_maps.py)."""
    N = sp.Symbol("rows16", integer=True, positive=True)
    points, coeffs = sp.MatrixSymbol("ts", N, 2), sp.MatrixSymbol("x", 1, 4)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols("k0:4", real=True)
    squared = sbp.map_examples((s - sum(k[j % 4] * t**j for j in range(M))) ** 2,
                               [((t, s), points), (sp.Matrix(k), coeffs)])
    model = sbp.Model("wide_rows16", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", squared, 0) / 2)
    module = sbp.compile(model, functions=FUNCTIONS, dtype="float32")
    source = module.emitted.source
    assert "const int64_t rows16 = (rows16_" in source  # the user's, renamed
    rng = np.random.default_rng(4)
    t_, s_ = rng.uniform(-1, 1, 21).astype(np.float32), rng.normal(size=21).astype(np.float32)
    k_ = rng.normal(size=4).astype(np.float32)
    loss, grad, _ = _closed_form(t_.astype(np.float64), s_.astype(np.float64), k_.astype(np.float64), M)
    got_loss, grads = module.value_and_grad(ts=np.stack([t_, s_], axis=1), x=k_.reshape(1, -1))
    assert float(np.ravel(got_loss)[0]) == pytest.approx(loss, rel=1e-4)
    np.testing.assert_allclose(grads["x"].ravel(), grad, rtol=1e-3, atol=1e-4 * np.abs(grad).max())
