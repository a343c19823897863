"""A long loop-free kernel whose values are sums of products runs from a
table (schedule/straight.py `as_table`, ops/elementwise.py `_table`): its
C reads rows of indices where the written-out body had statements, so GCC
compiles it in a fraction of the time. Checked here: which expressions are
rows and which are not; that a tabulated module computes what numpy's
closed forms and sympy.diff compute (float64 and float32, the forward-only
call, coefficients other than +-1, powers, constants, sums inside
products, a loss that is a load); that a kernel with anything else is
written out as before; that a user's names cannot collide with the table's;
and that the C is deterministic and shows each value's equation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package

from c_driver import STRICT_FLAGS, write_runtime_header

import symbackprop as sbp
from benchmarks.gradbench import det
from symbackprop.ir.node import SCALAR
from symbackprop.pipeline import generate
from symbackprop.schedule import straight
from symbackprop.schedule.kernel import MapKernel, View
from symbackprop.schedule.straight import table_rows
from symbackprop.toolchain.builder import BuildOptions

x, y, z = sp.symbols("x y z", real=True)


@pytest.fixture
def tables(monkeypatch):
    """Tables for kernels of more than 10 statements (500 by default)."""
    monkeypatch.setattr(straight, "TABLE_MIN_STATEMENTS", 10)


def _value(rows: list, env: dict) -> float:
    """Evaluate rows (table_rows' form) as the C does: each row a sum of
    signed products of two factors, a missing factor 1."""
    done: list[float] = []
    for row in rows:
        total = 0.0
        for sign, factors in row:
            product = 1.0
            for f in factors:
                product *= done[f] if isinstance(f, int) else float(f) if isinstance(f, sp.Number) else env[f]
            total += sign * product
        done.append(total)
    return done[-1]


@pytest.mark.parametrize("expr", [
    x * y - y * z,
    2 * x * y - sp.Rational(1, 3) * z + 7,
    x**2 - 3 * x**3 * y + x**4,
    -x * (y + z) * (y - 2 * z) + x * y * z,
    sp.Float(0.25) * x,
    -x,
    sp.Integer(-5),
])
def test_rows_evaluate_to_the_expression(expr):
    rows = table_rows(expr, {x, y, z})
    assert rows is not None
    assert all(len(factors) <= 2 for row in rows for _, factors in row)
    assert all(sign in (1, -1) for row in rows for sign, _ in row)
    env = {x: 0.7, y: -1.3, z: 2.1}
    assert _value(rows, env) == pytest.approx(float(expr.subs(env)), rel=1e-14)


@pytest.mark.parametrize("expr", [sp.exp(x) * y, x / y, x**5, sp.sqrt(x), x * sp.Symbol("unknown")])
def test_anything_but_a_polynomial_in_known_values_is_no_table(expr):
    assert table_rows(expr, {x, y, z}) is None


def _det_module(ell: int, tmp_path: Path, dtype: str = "float64"):
    return sbp.compile(det.build_model({"ell": ell}), functions=det.SBP_FUNCTIONS, dtype=dtype,
                       options=BuildOptions(cache_dir=tmp_path))


@pytest.mark.parametrize("ell", [4, 6])
def test_a_tabulated_determinant_matches_numpy(ell, tables, tmp_path):
    mod = _det_module(ell, tmp_path)
    assert "table_products" in mod.emitted.source and "SYMBACKPROP_STRAIGHT" not in mod.emitted.source
    A = np.random.default_rng(ell).standard_normal((ell, ell))
    value, grads = mod.value_and_grad(A=A)
    assert value == pytest.approx(np.linalg.det(A), rel=1e-12)
    np.testing.assert_allclose(grads["A"], np.linalg.det(A) * np.linalg.inv(A).T, rtol=1e-10, atol=1e-13)
    assert mod.forward(A=A)["loss"] == pytest.approx(value, rel=1e-15)  # the call without the backward pass


def test_a_tabulated_determinant_in_float32(tables, tmp_path):
    mod = _det_module(5, tmp_path, "float32")
    A = np.random.default_rng(5).standard_normal((5, 5)).astype(np.float32)
    value, grads = mod.value_and_grad(A=A)
    A64 = A.astype(np.float64)
    assert value == pytest.approx(np.linalg.det(A64), rel=1e-4)
    np.testing.assert_allclose(grads["A"], np.linalg.det(A64) * np.linalg.inv(A64).T, rtol=1e-3, atol=1e-4)


def _polynomial_model(name: str = "poly"):
    """A loss of sums of products with coefficients, powers, constants and
    sums inside products of the entries of p, and its sympy form."""
    p = sp.MatrixSymbol(name, 1, 4)
    a, b, c, d = (p[0, k] for k in range(4))
    terms = [a * b - sp.Rational(3, 2) * c * d, a**2 * b - c**3, (a + b) * (c - 2 * d) * a, 2.5 * d**4 - 7,
             a * b * c * d, -(b - c) ** 2 * d]
    loss = sum(t * (k + 1) + t**2 for k, t in enumerate(terms))
    return sbp.Model(f"{name}_model", params=[p], loss=loss), p, loss


def test_a_tabulated_polynomial_matches_sympy_diff(tables, tmp_path):
    model, p, loss = _polynomial_model()
    mod = sbp.compile(model, options=BuildOptions(cache_dir=tmp_path))
    assert "table_products" in mod.emitted.source
    at = np.array([[0.3, -1.1, 0.8, 1.7]])
    env = {p[0, k]: at[0, k] for k in range(4)}
    value, grads = mod.value_and_grad(poly=at)
    assert value == pytest.approx(float(loss.subs(env)), rel=1e-12)
    expected = [float(sp.diff(loss, p[0, k]).subs(env)) for k in range(4)]
    np.testing.assert_allclose(grads["poly"][0], expected, rtol=1e-11)


def test_a_kernel_with_a_function_is_written_out(tables, tmp_path):
    p = sp.MatrixSymbol("q", 1, 3)
    a, b, c = (p[0, k] for k in range(3))
    loss = sum(sp.exp(a * k) * b - c**2 * k for k in range(1, 12))
    mod = sbp.compile(sbp.Model("with_exp", params=[p], loss=loss), options=BuildOptions(cache_dir=tmp_path))
    assert "table_products" not in mod.emitted.source
    at = np.array([[0.1, -0.4, 0.9]])
    env = {p[0, k]: at[0, k] for k in range(3)}
    value, grads = mod.value_and_grad(q=at)
    assert value == pytest.approx(float(loss.subs(env)), rel=1e-12)
    np.testing.assert_allclose(grads["q"][0], [float(sp.diff(loss, p[0, k]).subs(env)) for k in range(3)], rtol=1e-11)


def test_user_names_do_not_collide_with_the_tables(tables, tmp_path):
    """A parameter named as the table's arrays and locals would be."""
    model, p, loss = _polynomial_model("table_values")
    mod = sbp.compile(model, options=BuildOptions(cache_dir=tmp_path))
    at = np.array([[0.5, 0.2, -0.6, 1.1]])
    value, grads = mod.value_and_grad(table_values=at)
    env = {p[0, k]: at[0, k] for k in range(4)}
    assert value == pytest.approx(float(loss.subs(env)), rel=1e-12)
    np.testing.assert_allclose(grads["table_values"][0], [float(sp.diff(loss, p[0, k]).subs(env)) for k in range(4)],
                               rtol=1e-11)


def test_the_table_is_deterministic_and_shows_each_equation(tables):
    first = generate(det.build_model({"ell": 5}), functions=det.SBP_FUNCTIONS)[0].source
    again = generate(det.build_model({"ell": 5}), functions=det.SBP_FUNCTIONS)[0].source
    assert first == again
    assert "/* x0 = A[" in first  # a value's equation, above its row of products
    assert "runs of values of as many products each" in first


def test_det_ell_9_runs_from_tables_by_default():
    """The GradBench size issue 17 asks for: both long kernels (the
    minors, their adjoints) are tables, none is written out or cut."""
    source = generate(det.build_model({"ell": 9}), functions=det.SBP_FUNCTIONS)[0].source
    assert source.count("static const int16_t table_products[][2]") == 2
    assert "SYMBACKPROP_STRAIGHT GRADBENCH" not in source and "_kept" not in source


def _random_polynomial(rng, p, depth: int = 3):
    """A random polynomial in the entries of p: sums and products of
    entries, integer and rational coefficients, small powers, nested."""
    entries = [p[0, k] for k in range(p.shape[1])]
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(entries) if rng.random() < 0.85 else sp.Rational(rng.randint(-7, 7), rng.randint(1, 4))
    parts = [_random_polynomial(rng, p, depth - 1) for _ in range(rng.randint(2, 4))]
    shape = rng.random()
    if shape < 0.4:
        return sp.Add(*parts)
    if shape < 0.8:
        return sp.Mul(*parts[:3])
    return parts[0] ** rng.randint(2, 4)


@pytest.mark.parametrize("seed", range(6))  # (40 seeds passed once, 2026-12-01)
def test_random_polynomials_from_tables_match_sympy_diff(seed, monkeypatch, tmp_path):
    """Every kernel of more than one statement a table: random sums,
    products, powers and coefficients, against sympy.diff evaluated. (Seed
    0 found runs of the four-at-once loop that spanned two levels: x**6 read
    x**5 computed beside it.)"""
    import random

    monkeypatch.setattr(straight, "TABLE_MIN_STATEMENTS", 1)
    rng = random.Random(seed)
    p = sp.MatrixSymbol("p", 1, 4)
    loss = sum(_random_polynomial(rng, p) for _ in range(6))
    mod = sbp.compile(sbp.Model(f"random_poly_{seed}", params=[p], loss=loss), options=BuildOptions(cache_dir=tmp_path))
    assert "table_products" in mod.emitted.source
    at = np.array([[0.6, -0.9, 1.3, 0.4]])
    env = {p[0, k]: at[0, k] for k in range(4)}
    value, grads = mod.value_and_grad(p=at)
    expected = float(loss.subs(env))
    assert value == pytest.approx(expected, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(grads["p"][0], [float(sp.diff(loss, p[0, k]).subs(env)) for k in range(4)],
                               rtol=1e-11, atol=1e-11)


def _strict_build(emitted, folder: Path) -> subprocess.CompletedProcess:
    (folder / f"{emitted.prefix}.c").write_text(emitted.source)
    (folder / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(folder)
    return subprocess.run(["cc", *STRICT_FLAGS, "-O1", "-c", str(folder / f"{emitted.prefix}.c"), "-o", os.devnull,
                           f"-I{folder}"], capture_output=True, text=True)


@pytest.mark.parametrize("ell", [5, 9])
def test_tabulated_c_builds_under_a_c_users_strict_flags(ell, monkeypatch, tmp_path):
    """-Wall -Wextra -Wpedantic -Werror: the workspace pointers a table
    writes through `work` are not left unused (in parts, and in one
    function where every kernel is a table)."""
    monkeypatch.setattr(straight, "TABLE_MIN_STATEMENTS", 1 if ell == 5 else 500)
    emitted = generate(det.build_model({"ell": ell}), functions=det.SBP_FUNCTIONS)[0]
    assert "table_products" in emitted.source
    built = _strict_build(emitted, tmp_path)
    assert built.returncode == 0, built.stderr[:2000]


def test_a_kernel_of_copies_only_is_no_table():
    """Stores of loads as they are: nothing to compute, no (empty) table."""
    loads = tuple((sp.Symbol(f"_load{k}", real=True), View(f"in{k}", sp.Integer(0), sp.Integer(0), sp.Integer(0)))
                  for k in range(600))
    kernel = MapKernel(SCALAR, loads, (), tuple((f"out{k}", sym) for k, (sym, _) in enumerate(loads)), ())
    assert straight.as_table(kernel) is None
    products = MapKernel(SCALAR, loads, (), tuple((f"out{k}", 2 * sym) for k, (sym, _) in enumerate(loads)), ())
    assert straight.as_table(products) is not None
