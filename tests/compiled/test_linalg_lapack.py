"""det, logdet and solve above and below the size from which the runtime
header calls LAPACK's getrf and the BLAS's trsm (emit.codegen.LAPACK_MIN_SIZE,
templates/linalg.c.j2), cholesky and triangular_solve about theirs (potrf and
trsm from CHOLESKY_LAPACK_MIN_SIZE), and in C built without a BLAS (the loops alone):
values and gradients against numpy's closed forms and JAX float64 at
n = 3, 17, 64, 130, ill-conditioned and singular matrices, and a counter
compiled in (-DSYMBACKPROP_LAPACK_COUNT) that says which path ran.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.emit.codegen import CHOLESKY_LAPACK_MIN_SIZE, LAPACK_MIN_SIZE, runtime_header
from symbackprop.toolchain.blas import BLAS_ENV, FINDERS, find_blas
from symbackprop.toolchain.builder import default_flags

n, k = sp.symbols("n k", integer=True, positive=True)
A = sp.MatrixSymbol("A", n, n)
B = sp.MatrixSymbol("B", n, k)
SIZES = (3, 17, 64, 130)  # below and above LAPACK_MIN_SIZE
COUNT = "-DSYMBACKPROP_LAPACK_COUNT"


def _model(name: str) -> sbp.Model:
    """det / 3 + logdet + sum(sin(solve(A, B))): each op's gradient in one."""
    solved = sbp.solve(A, B)
    loss = sbp.det(A) / 3 + sbp.logdet(A) + sbp.as_scalar(nn.sum_all(solved.applyfunc(sp.sin)))
    outputs = {"d": sbp.det(A) * sp.OneMatrix(1, 1), "ld": sbp.logdet(A) * sp.OneMatrix(1, 1), "X": solved}
    return sbp.Model(name, params=[A, B], loss=loss, outputs=outputs)


@pytest.fixture(scope="module")
def counted():
    """Built with the default flags (a BLAS, and its LAPACK, where installed) and the counter."""
    return sbp.compile(_model("lapack_counted"), options=sbp.BuildOptions(flags=(*default_flags(), COUNT)))


@pytest.fixture(scope="module")
def loops():
    """Built without a BLAS: the runtime header's loops at every size."""
    return sbp.compile(_model("lapack_loops"), options=sbp.BuildOptions(flags=(*default_flags(), COUNT), blas=False))


def _draw(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A well-conditioned A (its det of order 1 at every size) and B (size x 2)."""
    rng = np.random.default_rng(seed + size)
    a = np.eye(size) + 0.4 * rng.standard_normal((size, size)) / np.sqrt(size)
    return a, rng.standard_normal((size, 2))


def _expected(a: np.ndarray, b: np.ndarray) -> tuple[float, dict]:
    """The loss and its gradients in closed form (numpy's LAPACK)."""
    d, (_, ld) = np.linalg.det(a), np.linalg.slogdet(a)
    x = np.linalg.solve(a, b)
    grad_b = np.linalg.solve(a.T, np.cos(x))
    inv_t = np.linalg.inv(a).T
    grad_a = d / 3 * inv_t + inv_t - grad_b @ x.T
    return d / 3 + ld + np.sin(x).sum(), {"A": grad_a, "B": grad_b}


def _lapack_calls(mod: sbp.CompiledModule) -> int | None:
    """The counter of the module's library (None: compiled without LAPACK)."""
    prefix = f"_sbp_{mod.model.name}_"
    paths = {m.__file__ for name, m in list(sys.modules.items())
             if name.startswith(prefix) and getattr(m, "__file__", None)}
    assert paths, f"no loaded library of {mod.model.name}"
    counts = [_counter(ctypes.CDLL(path)) for path in paths]
    found = [count for count in counts if count is not None]
    return sum(found) if found else None


def _counter(library: ctypes.CDLL) -> int | None:
    try:
        return ctypes.c_longlong.in_dll(library, "symbackprop_lapack_calls").value
    except ValueError:  # the symbol is absent
        return None


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("which", ["counted", "loops"])
def test_values_and_gradients_match_numpy(which, size, request):
    mod = request.getfixturevalue(which)
    a, b = _draw(size)
    loss, grads = mod.value_and_grad(A=a, B=b)
    expected, expected_grads = _expected(a, b)
    np.testing.assert_allclose(loss, expected, rtol=1e-11)
    for name in ("A", "B"):
        np.testing.assert_allclose(grads[name], expected_grads[name], rtol=1e-9, atol=1e-11 * abs(expected_grads[name]).max(),
                                   err_msg=name)
    out = mod.forward(A=a, B=b)
    np.testing.assert_allclose(out["X"], np.linalg.solve(a, b), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["d"][0, 0], np.linalg.det(a), rtol=1e-11)


@pytest.mark.parametrize("size", SIZES)
def test_gradients_match_jax(counted, size):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy

    def loss(a, b):
        return jnp.linalg.det(a) / 3 + jnp.linalg.slogdet(a)[1] + jnp.sin(jnp.linalg.solve(a, b)).sum()

    a, b = _draw(size, seed=1)
    value, (grad_a, grad_b) = jax.value_and_grad(loss, argnums=(0, 1))(a, b)
    got, grads = counted.value_and_grad(A=a, B=b)
    np.testing.assert_allclose(got, float(value), rtol=1e-11)
    np.testing.assert_allclose(grads["A"], np.asarray(grad_a), rtol=1e-9, atol=1e-11 * float(abs(grad_a).max()))
    np.testing.assert_allclose(grads["B"], np.asarray(grad_b), rtol=1e-9, atol=1e-11 * float(abs(grad_b).max()))


@pytest.mark.parametrize("size", (17, 130))
@pytest.mark.parametrize("which", ["counted", "loops"])
def test_ill_conditioned_matches_numpy_within_its_condition(which, size, request):
    """cond(A) = 1e10: solve's relative error is bounded by about cond * eps, as numpy's."""
    mod = request.getfixturevalue(which)
    rng = np.random.default_rng(size)
    q1, _ = np.linalg.qr(rng.standard_normal((size, size)))
    q2, _ = np.linalg.qr(rng.standard_normal((size, size)))
    a = q1 @ np.diag(np.logspace(0, -10, size)) @ q2
    b = a @ rng.standard_normal((size, 2))  # an exact solution of order 1
    out = mod.forward(A=a, B=b)
    x = np.linalg.solve(a, b)
    assert np.abs(out["X"] - x).max() <= 1e-3 * np.abs(x).max()
    np.testing.assert_allclose(out["ld"][0, 0], np.linalg.slogdet(a)[1], rtol=1e-9)
    _, grads = mod.value_and_grad(A=a, B=b)
    assert np.all(np.isfinite(grads["A"])) and np.all(np.isfinite(grads["B"]))


@pytest.mark.parametrize("size", (3, 17, 130))
@pytest.mark.parametrize("which", ["counted", "loops"])
def test_singular_gives_the_documented_values(which, size, request):
    """A zero row: det 0, logdet -inf, solve and the gradients not finite
    (docs/linalg.md), by LAPACK's path and the loops alike; a NaN entry: NaN."""
    mod = request.getfixturevalue(which)
    a, b = _draw(size)
    a[size // 2] = 0
    out = mod.forward(A=a, B=b)
    assert out["d"][0, 0] == 0 and out["ld"][0, 0] == -np.inf
    assert not np.all(np.isfinite(out["X"]))
    _, grads = mod.value_and_grad(A=a, B=b)
    assert not np.all(np.isfinite(grads["A"])) and not np.all(np.isfinite(grads["B"]))
    a, _ = _draw(size)
    a[size - 1, 0] = np.nan
    out = mod.forward(A=a, B=b)
    assert np.isnan(out["d"][0, 0]) and np.isnan(out["ld"][0, 0]) and np.isnan(out["X"]).any()


def test_lapack_runs_from_its_size_up_and_not_below(counted):
    if find_blas() is None:
        pytest.skip("no BLAS installed: modules are built without LAPACK")
    counted.value_and_grad(A=_draw(1)[0], B=_draw(1)[1])  # the library is loaded
    before = _lapack_calls(counted)
    assert before is not None, "built with a BLAS, but without the LAPACK path"
    a, b = _draw(LAPACK_MIN_SIZE - 1)
    counted.value_and_grad(A=a, B=b)
    assert _lapack_calls(counted) == before  # below the size: the loops
    a, b = _draw(LAPACK_MIN_SIZE)
    counted.value_and_grad(A=a, B=b)
    # one getrf (the forward's factors, kept for the gradient), then trsm for
    # solve(A, B), for A^-T B-bar and for A^-T (det's and logdet's gradient)
    assert _lapack_calls(counted) == before + 4


def test_without_a_blas_there_is_no_lapack_path(loops):
    loops.value_and_grad(A=_draw(130)[0], B=_draw(130)[1])
    assert _lapack_calls(loops) is None


def test_the_header_names_getrf_under_its_flag():
    header = runtime_header()
    assert "#ifdef SYMBACKPROP_LAPACK" in header
    assert "dgetrf_" in header and "sgetrf_" in header and "trsm" in header
    assert "dpotrf_" in header and "spotrf_" in header


def test_float32_above_the_size():
    mod = sbp.compile(_model("lapack_f32"), dtype="float32")
    a, b = _draw(64)
    loss, grads = mod.value_and_grad(A=a.astype(np.float32), B=b.astype(np.float32))
    expected, expected_grads = _expected(a, b)
    np.testing.assert_allclose(loss, expected, rtol=1e-4)
    np.testing.assert_allclose(grads["A"], expected_grads["A"], rtol=1e-3, atol=1e-4 * abs(expected_grads["A"]).max())


# In a child process (the BLAS is chosen once per process): det, logdet and
# solve above the size, float64 and float32, through that BLAS's LAPACK.
CHILD = textwrap.dedent("""
    import json
    import numpy as np, sympy as sp
    import symbackprop as sbp
    from symbackprop import nn
    from symbackprop.toolchain.blas import find_blas

    n = sp.Symbol("n", integer=True, positive=True)
    A, B = sp.MatrixSymbol("A", n, n), sp.MatrixSymbol("B", n, 2)
    loss = sbp.logdet(A) + sbp.det(A) + sbp.as_scalar(nn.sum_all(sbp.solve(A, B)))
    rng = np.random.default_rng(5)
    a = np.eye(100) + 0.4 * rng.standard_normal((100, 100)) / 10
    b = rng.standard_normal((100, 2))
    inv_t = np.linalg.inv(a).T
    grad_b = np.linalg.solve(a.T, np.ones((100, 2)))
    expected = inv_t + np.linalg.det(a) * inv_t - grad_b @ np.linalg.solve(a, b).T
    errors = {}
    for dtype in ("float64", "float32"):
        mod = sbp.compile(sbp.Model("lapack_choice", params=[A, B], loss=loss), dtype=dtype)
        _, grads = mod.value_and_grad(A=a.astype(dtype), B=b.astype(dtype))
        errors[dtype] = float(np.abs(grads["A"] - expected).max() / np.abs(expected).max())
    low = sbp.cholesky(A)
    solved = sbp.triangular_solve(low, B, lower=True)
    chol = sbp.Model("chol_choice", params=[A, B], loss=sbp.as_scalar(nn.sum_all(solved)), outputs={"L": low, "X": solved})
    s = (a + a.T) / 2
    for dtype in ("float64", "float32"):
        out = sbp.compile(chol, dtype=dtype).forward(A=a.astype(dtype), B=b.astype(dtype))
        errors["chol_" + dtype] = float(max(np.abs(out["L"] - np.linalg.cholesky(s)).max(),
                                            np.abs(out["X"] - np.linalg.solve(np.linalg.cholesky(s), b)).max()))
    print(json.dumps({"name": find_blas().name, "errors": errors}))
""")


@pytest.mark.parametrize("name", sorted(FINDERS))
def test_each_installed_blas_links_its_lapack(name, tmp_path):
    """oneMKL through its link stub (dgetrf_, dpotrf_), OpenBLAS under its prefix (scipy_dgetrf_)."""
    if FINDERS[name]() is None:
        pytest.skip(f"{name} is not installed")
    env = dict(os.environ, **{BLAS_ENV: name, "SYMBACKPROP_CACHE_DIR": str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["name"] == name, result
    assert result["errors"]["float64"] < 1e-11 and result["errors"]["float32"] < 1e-3, result
    assert result["errors"]["chol_float64"] < 1e-12 and result["errors"]["chol_float32"] < 1e-4, result
    libraries = list(tmp_path.rglob("_sbp_lapack_choice_*.so"))
    assert libraries and all(b"getrf_" in path.read_bytes() for path in libraries), libraries
    libraries = list(tmp_path.rglob("_sbp_chol_choice_*.so"))
    assert libraries and all(b"potrf_" in path.read_bytes() for path in libraries), libraries


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("defines", [[], ["-DSYMBACKPROP_CBLAS", "-DSYMBACKPROP_LAPACK"],
                                     ["-DSYMBACKPROP_CBLAS", "-DSYMBACKPROP_LAPACK", COUNT]])
def test_the_c_compiles_without_warnings_with_and_without_lapack(dtype, defines, tmp_path):
    """gcc -O3 -Wall -Wextra -Wpedantic (as test_c_warnings) on det, logdet and solve's C."""
    import shutil

    from c_driver import write_runtime_header

    from symbackprop.pipeline import generate

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc on PATH (the warnings are GCC's)")
    emitted, _ = generate(_model("lapack_warnings"), dtype)
    write_runtime_header(tmp_path)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    source = tmp_path / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    done = subprocess.run(["gcc", "-std=c99", "-O3", "-Wall", "-Wextra", "-Wpedantic", *defines, f"-I{tmp_path}",
                           "-c", str(source), "-o", str(tmp_path / "out.o")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    named = (tmp_path / "out.o").read_bytes()
    assert (b"dgetrf_" in named or b"sgetrf_" in named) == ("-DSYMBACKPROP_LAPACK" in defines)


# --- cholesky and triangular_solve: potrf and trsm from CHOLESKY_LAPACK_MIN_SIZE up ---

U = sp.MatrixSymbol("U", n, n)


def _cholesky_model(name: str) -> sbp.Model:
    """sum(sin(L^-1 B)) + sum(cos(triu(U)^-1 B)), L = cholesky(A): the
    gradients of cholesky and of both triangles' solves in one."""
    lower = sbp.triangular_solve(sbp.cholesky(A), B, lower=True)
    upper = sbp.triangular_solve(U, B, lower=False)
    loss = sbp.as_scalar(nn.sum_all(lower.applyfunc(sp.sin)) + nn.sum_all(upper.applyfunc(sp.cos)))
    return sbp.Model(name, params=[A, U, B], loss=loss, outputs={"L": sbp.cholesky(A), "X": lower, "V": upper})


@pytest.fixture(scope="module")
def chol_counted():
    return sbp.compile(_cholesky_model("chol_counted"), options=sbp.BuildOptions(flags=(*default_flags(), COUNT)))


@pytest.fixture(scope="module")
def chol_loops():
    return sbp.compile(_cholesky_model("chol_loops"), options=sbp.BuildOptions(flags=(*default_flags(), COUNT), blas=False))


def _draw_spd(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A symmetric positive definite A (not exactly symmetric: its
    symmetric part is factored), an upper U of diagonal about 1, B size x 3."""
    rng = np.random.default_rng(seed + 7 * size)
    x = rng.standard_normal((size, size))
    a = x @ x.T / size + np.eye(size) + 1e-3 * rng.standard_normal((size, size))
    u = np.eye(size) + 0.3 * rng.standard_normal((size, size)) / np.sqrt(size)
    return a, u, rng.standard_normal((size, 3))


def _jax_cholesky_loss():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp, solve_triangular = jax.numpy, jax.scipy.linalg.solve_triangular

    def loss(a, u, b):
        low = jnp.linalg.cholesky((a + a.T) / 2)
        return (jnp.sin(solve_triangular(low, b, lower=True)).sum()
                + jnp.cos(solve_triangular(jnp.triu(u), b, lower=False)).sum())

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("which", ["chol_counted", "chol_loops"])
def test_cholesky_and_triangular_solve_match_numpy_and_jax(which, size, request):
    mod = request.getfixturevalue(which)
    a, u, b = _draw_spd(size)
    out = mod.forward(A=a, U=u, B=b)
    low = np.linalg.cholesky((a + a.T) / 2)
    np.testing.assert_allclose(out["L"], low, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(out["X"], np.linalg.solve(low, b), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["V"], np.linalg.solve(np.triu(u), b), rtol=1e-10, atol=1e-12)
    value, expected = _jax_cholesky_loss()(a, u, b)
    loss, grads = mod.value_and_grad(A=a, U=u, B=b)
    np.testing.assert_allclose(loss, float(value), rtol=1e-11)
    for name, grad in zip("AUB", expected):
        grad = np.asarray(grad)
        np.testing.assert_allclose(grads[name], grad, rtol=1e-9, atol=1e-11 * abs(grad).max(), err_msg=name)


@pytest.mark.parametrize("size", (17, CHOLESKY_LAPACK_MIN_SIZE, 130))
def test_not_positive_definite_gives_the_documented_nan_on_both_paths(chol_counted, chol_loops, size):
    """A negative pivot at column j: L's columns before j are the factor's,
    NaN from j on, zeros above the diagonal (docs/linalg.md), by potrf's
    path and the loops alike; a NaN entry gives NaN there too."""
    a, u, b = _draw_spd(size)
    j = size // 2
    a[j, :], a[:, j] = 0.0, 0.0
    a[j, j] = -1.0
    got = [mod.forward(A=a, U=u, B=b)["L"] for mod in (chol_counted, chol_loops)]
    np.testing.assert_array_equal(got[0], got[1])
    low = got[0]
    below = np.tril(np.ones((size, size), dtype=bool))
    assert np.all(low[~below] == 0)
    assert np.isnan(low[j:, j:][below[j:, j:]]).all()
    assert np.isfinite(low[:, :j]).all()
    np.testing.assert_allclose(low[:j, :j], np.linalg.cholesky(((a + a.T) / 2)[:j, :j]), rtol=1e-11, atol=1e-13)
    a, u, b = _draw_spd(size)
    a[size - 1, 0] = np.nan
    for mod in (chol_counted, chol_loops):
        out = mod.forward(A=a, U=u, B=b)
        assert np.isnan(out["L"][size - 1, 0]) and np.isnan(out["X"][size - 1]).all()


def test_potrf_and_trsm_run_from_their_size_up_and_not_below(chol_counted):
    if find_blas() is None:
        pytest.skip("no BLAS installed: modules are built without LAPACK")
    chol_counted.value_and_grad(**dict(zip("AUB", _draw_spd(1))))  # the library is loaded
    before = _lapack_calls(chol_counted)
    assert before is not None, "built with a BLAS, but without the LAPACK path"
    chol_counted.value_and_grad(**dict(zip("AUB", _draw_spd(CHOLESKY_LAPACK_MIN_SIZE - 1))))
    assert _lapack_calls(chol_counted) == before  # below the size: the loops
    chol_counted.value_and_grad(**dict(zip("AUB", _draw_spd(CHOLESKY_LAPACK_MIN_SIZE))))
    # forward: potrf, trsm by L and by triu(U); gradient: trsm by L^T and by
    # triu(U)^T for B-bar, two by L^T in cholesky's rule (L^-T Phi L^-1)
    assert _lapack_calls(chol_counted) == before + 7


def test_without_a_blas_cholesky_takes_the_loops(chol_loops):
    chol_loops.value_and_grad(**dict(zip("AUB", _draw_spd(130))))
    assert _lapack_calls(chol_loops) is None
