"""A wide per-example body (hundreds of operations an example) runs over
whole eights of examples, then the rest in a scalar loop: every count of
examples gives the closed form's value and gradient. A wide body adding
into many sums marks its function SYMBACKPROP_WIDE_SUMS (256-bit vectors)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.ops.emap import WIDE_SUMS_NARROW

M = 64  # coefficients: a body far over LANES_MAX_OPS


@pytest.fixture(scope="module")
def polyfit():
    """Least squares of a degree-63 polynomial (GradBench llsq's form)."""
    N = sp.Symbol("N", integer=True, positive=True)
    points = sp.MatrixSymbol("ts", N, 2)
    coeffs = sp.MatrixSymbol("x", 1, M)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{M}", real=True)
    squared = sbp.map_examples((s - sum(k[j] * t**j for j in range(M))) ** 2, [((t, s), points), (sp.Matrix(k), coeffs)])
    model = sbp.Model("wide_polyfit", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", squared, 0) / 2)
    return sbp.compile(model, functions=("forward", "value_and_grad"))


def test_the_wide_loop_has_a_scalar_tail(polyfit):
    assert "SYMBACKPROP_SCALAR_TAIL" in polyfit.emitted.source
    assert "& ~(int64_t)7" in polyfit.emitted.source


@pytest.mark.parametrize("n", [1, 5, 7, 8, 13, 16, 21])
def test_every_count_of_examples_gives_the_closed_form(polyfit, n):
    rng = np.random.default_rng(n)
    t = rng.uniform(-1, 1, n)
    s = rng.normal(size=n)
    x = rng.normal(size=M) / np.arange(1, M + 1)
    V = t[:, None] ** np.arange(M)[None, :]
    r = s - V @ x
    ts, row = np.stack([t, s], axis=1), x.reshape(1, -1)
    loss, grads = polyfit.value_and_grad(ts=ts, x=row)
    np.testing.assert_allclose(float(np.asarray(loss).ravel()[0]), 0.5 * r @ r, rtol=1e-10)
    np.testing.assert_allclose(grads["x"].ravel(), -(V.T @ r), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(float(np.asarray(polyfit.forward(ts=ts, x=row)["loss"]).ravel()[0]), 0.5 * r @ r,
                               rtol=1e-10)


@pytest.fixture(scope="module")
def many_sums():
    """A wide body whose gradient adds into WIDE_SUMS_NARROW sums: squared
    residuals of one line per coefficient, k_j t - s."""
    count = WIDE_SUMS_NARROW
    N = sp.Symbol("N", integer=True, positive=True)
    points = sp.MatrixSymbol("ts", N, 2)
    coeffs = sp.MatrixSymbol("k", 1, count)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{count}", real=True)
    body = sum((k[j] * t - s) ** 2 for j in range(count)) / 2
    squared = sbp.map_examples(body, [((t, s), points), (sp.Matrix(k), coeffs)])
    model = sbp.Model("wide_many_sums", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", squared, 0))
    return sbp.compile(model, functions=("forward", "value_and_grad"))


def test_many_sums_mark_their_function_and_few_do_not(polyfit, many_sums):
    # the shared function, or (a module split into units: emit/cunits.py) its parts
    assert re.search(r"^SYMBACKPROP_WIDE_SUMS (static|WIDE_MANY_SUMS_SHARED) ", many_sums.emitted.source, re.M)
    assert "SYMBACKPROP_WIDE_SUMS" not in polyfit.emitted.source  # 64 sums
    assert re.search(r"^SYMBACKPROP_WIDE (static|WIDE_POLYFIT_SHARED) ", polyfit.emitted.source, re.M)


@pytest.mark.parametrize("n", [1, 7, 8, 13])
def test_many_sums_give_the_closed_form(many_sums, n):
    rng = np.random.default_rng(100 + n)
    t, s = rng.normal(size=n), rng.normal(size=n)
    k = rng.normal(size=WIDE_SUMS_NARROW)
    r = k[None, :] * t[:, None] - s[:, None]  # examples x coefficients
    ts = np.stack([t, s], axis=1)
    loss, grads = many_sums.value_and_grad(ts=ts, k=k.reshape(1, -1))
    np.testing.assert_allclose(float(np.asarray(loss).ravel()[0]), 0.5 * np.sum(r * r), rtol=1e-12)
    np.testing.assert_allclose(grads["k"].ravel(), (r * t[:, None]).sum(0), rtol=1e-12, atol=1e-12)
