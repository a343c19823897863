"""The runtime header's exp (templates/exp.c.j2) against mpmath over its
whole range: within 1 ulp everywhere, subnormal results included, exact
at the ends (inf, 0) and for the special values (NaN, +-inf, 0)."""

import ctypes
import subprocess

import mpmath
import numpy as np
import pytest
from c_driver import STRICT_FLAGS

from symbackprop.emit.codegen import FLOAT32, FLOAT64, runtime_type, template_environment
from symbackprop.toolchain.builder import DEFAULT_FLAGS, compiler_command

TYPES = {"float64": (FLOAT64, np.float64), "float32": (FLOAT32, np.float32)}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """Both types' exp and exp_term, each behind a loop over an array (the vectorized form)."""
    folder = tmp_path_factory.mktemp("exp")
    env = template_environment()
    parts = ["#include <math.h>", "#include <stdint.h>", "#include <string.h>", "#define SYMBACKPROP_HELPER static"]
    for real, _ in TYPES.values():
        m = runtime_type(real)
        parts.append(env.get_template("exp.c.j2").render(m=m))
        parts.append(
            f"void loop_{real.name}(const {real.c} *x, {real.c} *y, long n)\n"
            f"{{ for (long i = 0; i < n; ++i) y[i] = {m.prefix}_exp(x[i]); }}"
        )
        parts.append(
            f"void term_{real.name}(const {real.c} *x, {real.c} *y, long n)\n"
            f"{{ for (long i = 0; i < n; ++i) y[i] = {m.prefix}_exp_term(x[i]); }}"
        )
    source = folder / "exp.c"
    source.write_text("\n".join(parts) + "\n")
    out = folder / "exp.so"
    subprocess.run(
        [*compiler_command(), *DEFAULT_FLAGS, *STRICT_FLAGS, "-fPIC", "-shared", str(source), "-o", str(out)], check=True
    )
    return ctypes.CDLL(str(out))


def call(library, dtype: str, x: np.ndarray, loop: str = "loop") -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=TYPES[dtype][1])
    y = np.empty_like(x)
    getattr(library, f"{loop}_{dtype}")(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_long(x.size))
    return y


def reference(x: np.ndarray) -> np.ndarray:
    """exp by mpmath at 200 bits, rounded once to x's type."""
    with mpmath.workprec(200):
        exact = [mpmath.exp(mpmath.mpf(float(v))) for v in x]
    if x.dtype == np.float32:  # via a 30-digit decimal string: one rounding to float32
        with np.errstate(over="ignore"):
            return np.array([mpmath.nstr(e, 30) for e in exact]).astype(np.float32)
    return np.array([float(e) for e in exact])


# per type: (below this exp is 0, above it inf, the smallest normal result's argument)
RANGES = {"float64": (-745.2, 709.8, -708.4), "float32": (-104.0, 88.8, -87.4)}


def arguments(dtype: str) -> np.ndarray:
    low, high, normal = RANGES[dtype]
    rng = np.random.default_rng(7)
    return np.concatenate(
        [
            rng.uniform(low - 5, high + 5, 6000),  # the whole range and past both ends
            rng.uniform(low, normal + 1, 3000),  # subnormal results and the step to normal ones
            rng.uniform(high - 2, high, 1000),  # near overflow
            rng.uniform(-1, 1, 2000),
            np.arange(-40, 41) * np.log(2.0),  # k*ln2: the reduction's rounding boundaries
        ]
    ).astype(TYPES[dtype][1])


def ulps(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """|actual - expected| in units of the spacing at `expected` (subnormal spacing below the normal range)."""
    return np.abs(actual.astype(np.float64) - expected.astype(np.float64)) / np.spacing(expected)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_within_one_ulp_over_the_whole_range(library, dtype):
    x = arguments(dtype)
    got, want = call(library, dtype, x), reference(x)
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite])  # overflow to inf, exactly where it should
    assert ulps(got[finite], want[finite]).max() <= 1.0
    assert np.mean(got == want) > 0.9  # mostly correctly rounded
    low, high, normal = RANGES[dtype]
    tiny = (x < normal) & (want > 0)
    assert tiny.sum() > 100 and np.all(got[tiny] > 0)  # subnormal results exist, rounded, not flushed
    assert np.all(got[x < low] == 0) and np.all(np.isinf(got[x > high]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_special_values(library, dtype):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -np.nan])
    assert np.signbit(x[6])  # a NaN with its sign bit set, too
    got = call(library, dtype, x)
    assert np.isnan(got[0]) and np.isnan(got[6])
    assert got[1] == np.inf and got[2] == 0 and got[3] == 1 and got[4] == 1
    assert got[5] == TYPES[dtype][1](np.e)


# exp_term's arguments below which it returns 0, and the bound on exp there
TERM_FLUSH = {"float64": (-707.0, 2.0**-1019), "float32": (-86.0, 2.0**-124)}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exp_term_within_one_ulp_and_zero_only_below_its_bound(library, dtype):
    """exp_term (log-sum-exp's terms, x <= 0): within 1 ulp of mpmath down to
    its flush bound, 0 below it where exp itself is under the documented bound,
    exact at 0, -inf and NaN."""
    x = arguments(dtype)
    x = np.concatenate([x[x <= 0], np.linspace(TERM_FLUSH[dtype][0] - 1, TERM_FLUSH[dtype][0] + 1, 401)]).astype(x.dtype)
    got, want = call(library, dtype, x, "term"), reference(x)
    flush, bound = TERM_FLUSH[dtype]
    kept = x >= flush
    assert kept.sum() > 1000 and (~kept).sum() > 1000
    assert ulps(got[kept], want[kept]).max() <= 1.0
    assert np.all(got[~kept] == 0) and np.all(want[~kept].astype(np.float64) < bound)
    special = call(library, dtype, np.array([0.0, -0.0, -np.inf, np.nan, -np.nan]), "term")
    assert special[0] == 1 and special[1] == 1 and special[2] == 0 and np.isnan(special[3]) and np.isnan(special[4])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", ["plain", "underflow", "nan", "inf", "minus_inf"])
def test_logsumexp_of_a_long_vector(dtype, case):
    """log(sum(exp(v))) and softmax of 1003 contiguous entries (the vectorized
    maximum and exp, past the eight lanes, a tail) against numpy in float64,
    with most terms underflowing and with NaN and infinite entries."""
    import sympy as sp

    import symbackprop as sbp

    n = sp.Symbol("n", integer=True, positive=True)
    v = sp.MatrixSymbol("v", n, 1)
    mod = sbp.compile(sbp.Model("lse_long", params=[v], loss=sbp.reduce("logsumexp", v, 0)), dtype=dtype)
    x = np.random.default_rng(11).standard_normal((1003, 1)) * (300.0 if case == "underflow" else 3.0)
    special = {"nan": np.nan, "inf": np.inf, "minus_inf": -np.inf}
    if case in special:
        x[500, 0] = special[case]
    x = x.astype(dtype)
    loss, grads = mod.value_and_grad(v=x)
    wide = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.max(wide)
        want = top + np.log(np.sum(np.exp(wide - top))) if np.isfinite(top) else top
    got = float(np.asarray(loss).ravel()[0])
    if case == "nan":
        assert np.isnan(got)
        return
    assert got == want if case == "inf" else np.isclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-14)
    if case != "inf":
        np.testing.assert_allclose(grads["v"], np.exp(wide - want), rtol=1e-5 if dtype == "float32" else 1e-13, atol=1e-30)
