"""Integer powers of a common base share their multiplications
(schedule.cse.share_powers): a polynomial's gradient needs x**j for every
coefficient j, and gets them from one chain of temporaries (x2 = x*x,
x3 = x2*x, ...), never from pow(); x**-k is 1/x**k from the same chain; a
lone x**2 or x**3 still prints as a product."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences

import symbackprop as sbp
from symbackprop.pipeline import generate
from symbackprop.schedule.cse import _power_chain, share_powers

N = sp.Symbol("N", integer=True, positive=True)
TESTS = Path(__file__).resolve().parent
POW = re.compile(r"\bpowf?\(")


def polynomial_model(degree: int, form: str) -> sbp.Model:
    """The mean squared error of a polynomial through N points, in a
    per-example map: written as sum(k_j x**j) ("sum"), sum(k_j / x**j)
    ("inverse"), or in Horner form ("horner")."""
    points = sp.MatrixSymbol("points", N, 2)
    coeffs = sp.MatrixSymbol("coeffs", 1, degree + 1)
    x, y = sp.symbols("x y", real=True)
    k = sp.symbols(f"k0:{degree + 1}", real=True)
    if form == "horner":
        p = k[degree]
        for j in range(degree - 1, -1, -1):
            p = p * x + k[j]
    else:
        sign = -1 if form == "inverse" else 1
        p = sum(k[j] * x ** (sign * j) for j in range(degree + 1))
    error = sbp.map_examples((p - y) ** 2, [((x, y), points), (sp.Matrix(k), coeffs)])
    return sbp.Model(f"{form}{degree}", inputs=[points], params=[coeffs], loss=sbp.reduce("mean", error, 0))


def _data(degree: int, form: str) -> dict:
    rng = np.random.default_rng(degree)
    xs = rng.uniform(1.0, 2.0, 40) if form == "inverse" else rng.uniform(-1.1, 1.1, 40)
    return {"points": np.stack([xs, np.cos(3 * xs)], axis=1),
            "coeffs": rng.standard_normal((1, degree + 1)) / np.arange(1, degree + 2)}


def _closed_form(degree: int, form: str, data: dict) -> tuple[float, np.ndarray]:
    """The loss and d loss / d k_j = mean(2 (p - y) x**(+-j)), in numpy."""
    xs, ys = data["points"][:, 0], data["points"][:, 1]
    powers = xs[:, None] ** ((-1 if form == "inverse" else 1) * np.arange(degree + 1.0))
    residual = powers @ data["coeffs"][0] - ys
    return float(np.mean(residual ** 2)), 2 * residual @ powers / len(xs)


@pytest.mark.parametrize("degree, form", [(20, "sum"), (40, "sum"), (20, "horner"), (40, "horner"), (12, "inverse")])
def test_polynomial_gradient_without_pow(degree, form):
    mod = sbp.compile(polynomial_model(degree, form))
    assert not POW.search(mod.source), "an integer power is printed as pow()"
    data = _data(degree, form)
    loss, grads = mod.value_and_grad(**data)
    expected_loss, expected_grad = _closed_form(degree, form, data)
    assert np.isclose(loss, expected_loss, rtol=1e-10)
    np.testing.assert_allclose(grads["coeffs"][0], expected_grad, rtol=1e-10, atol=1e-13)
    # central differences carry their own error (~1e-9 here): the compiled loss is what they differentiate
    fd = central_differences(lambda d: mod.value_and_grad(**d)[0], data, "coeffs")
    np.testing.assert_allclose(grads["coeffs"], fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("degree, form", [(40, "sum"), (40, "horner"), (12, "inverse")])
def test_polynomial_gradient_float32(degree, form):
    mod = sbp.compile(polynomial_model(degree, form), dtype="float32")
    assert not POW.search(mod.source)
    data = _data(degree, form)
    loss, grads = mod.value_and_grad(**{name: a.astype(np.float32) for name, a in data.items()})
    expected_loss, expected_grad = _closed_form(degree, form, data)
    assert np.isclose(loss, expected_loss, rtol=1e-4)
    scale = np.abs(expected_grad).max()
    np.testing.assert_allclose(grads["coeffs"][0], expected_grad, rtol=1e-3, atol=1e-5 * scale)


def test_the_gradient_of_a_power_sum_multiplies_once_per_power():
    """x**2 ... x**40: 39 multiplications, one temporary each (not 2 ... 8
    factors each and pow() above)."""
    source = generate(polynomial_model(40, "sum"))[0].source
    # the gradient's loop (forward has its own copy: in the same function, or
    # in a module split into units a part of its own, emit/cunits.py)
    run = source[source.index("if (with_grads) {"):].split("the forward values only")[0]
    run = run.split("for (int64_t i = k;")[0]  # its eight-lane part (the examples after the last eight repeat it)
    products = re.findall(r"const \w+ (x\d+) = \(?(points\[2\*i\]|x\d+)\*(points\[2\*i\]|x\d+)\)?;", run)
    powers = {"points[2*i]"}  # the products of powers of the point, in the order the C computes them
    for name, a, b in products:
        if a in powers and b in powers:
            powers.add(name)
    assert len(powers) - 1 == 39
    assert "points[2*i]*points[2*i]*points[2*i]" not in run


def test_generated_c_is_the_same_in_every_process():
    """The chains are built in a fixed order: no set or hash order leaks
    into the C (two interpreters, different hash seeds)."""
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]; import test_powers; "
            "from symbackprop.pipeline import generate; print(generate(test_powers.polynomial_model(24, 'sum'))[0].source)")
    sources = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert sources[0] == sources[1] and "SUM24_REAL x" in sources[0]


# --- share_powers itself ------------------------------------------------------

x, y, z = sp.symbols("x y z", real=True)


@pytest.mark.parametrize("exponents", [[2], [3], [64], [63], [5, 17], list(range(2, 41)), [7, 100, 1000]])
def test_power_chain_reaches_each_exponent(exponents):
    steps = _power_chain(exponents)
    reached = {1}
    for k, (a, b) in steps.items():  # in order: each from two already there
        assert a + b == k and a in reached and b in reached
        reached.add(k)
    assert set(exponents) <= reached


def test_power_chain_lengths():
    assert len(_power_chain([64])) == 6  # square and multiply, not 63 multiplications
    assert len(_power_chain(list(range(2, 41)))) == 39
    assert len(_power_chain([1000])) <= 2 * 10
    assert _power_chain(list(range(2, 9)))[8] == (7, 1)  # up to MAX_PRODUCT_POWER: what a product of x computes
    assert _power_chain(list(range(2, 41)))[40] == (20, 20)  # above: as even as can be, a short dependency path


def test_a_lone_square_or_cube_is_left_alone():
    for outputs in ([x**2 * y], [x**3 + y], [1 / x**2], [(x + y) ** 2 * z]):
        assert share_powers([], outputs) == ([], outputs)


def test_powers_of_one_base_share_a_chain():
    temps, outputs = share_powers([], [x**2 * y + x**3, y / x**3, x**12])
    assert [str(e) for _, e in temps] == ["x**2", "x*x0", "x1**2", "x2**2"]  # x2 = x**2, x3, x6, x12
    assert [str(e) for e in outputs] == ["x0*y + x1", "y/x1", "x3"]


def test_a_temporary_that_was_a_power_becomes_the_chains():
    t0, t1 = sp.symbols("x0 x1", real=True)
    temps, outputs = share_powers([(t0, x**9), (t1, x**3 * y)], [t0 + t1])
    # x**9 from x2 = x*x, x3 = x*x2, x6 = x3**2, x9 = x3*x6; x**3*y after it
    assert [str(e) for _, e in temps] == ["x**2", "x*x0", "x1**2", "x1*x2", "x1*y"]
    assert [str(e) for e in outputs] == ["x3 + x4"]


def test_a_compound_base_is_named_once():
    temps, outputs = share_powers([], [(x + y) ** 10 + (x + y) ** 3])
    assert str(temps[0][1]) == "x + y"
    assert not any(isinstance(node, sp.Pow) and node.exp > 2
                   for e in [*(e for _, e in temps), *outputs] for node in sp.preorder_traversal(e))


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-13), ("float32", 1e-5)])
def test_half_integer_powers_print_as_products_with_sqrt(dtype, rtol):
    """r**(k/2) for |k| >= 3 (an inverse-distance potential's gradient has
    r**(-3/2)) prints as products of r and one sqrt(r), not pow(); values and
    gradient against numpy's closed form."""
    points = sp.MatrixSymbol("points", N, 2)
    c = sp.MatrixSymbol("c", 1, 2)
    x, y, cx, cy = sp.symbols("x y cx cy", real=True)
    r2 = (x - cx) ** 2 + (y - cy) ** 2 + 1
    term = sbp.map_examples(1 / sp.sqrt(r2) + r2 ** sp.Rational(5, 2), [((x, y), points), ((cx, cy), c)])
    model = sbp.Model(f"half_powers_{dtype}", inputs=[points], params=[c], loss=sbp.reduce("sum", term, 0))
    mod = sbp.compile(model, dtype=dtype)
    assert not re.search(r"\bpowf?\([^;]*[35]\.0F?/2\.0F?\)", mod.source), "r**(3/2) or r**(5/2) printed as pow()"
    assert re.search(r"\bsqrtf?\(", mod.source)
    rng = np.random.default_rng(0)
    pts, cv = rng.standard_normal((9, 2)), rng.standard_normal((1, 2))
    loss, grads = mod.value_and_grad(points=pts.astype(dtype), c=cv.astype(dtype))
    d = pts - cv
    s = 1 + np.sum(d**2, axis=1)
    want = np.sum(s**-0.5 + s**2.5)
    dds = -0.5 * s**-1.5 + 2.5 * s**1.5  # d term / d s; ds/dc = -2 d
    np.testing.assert_allclose(loss, want, rtol=rtol)
    np.testing.assert_allclose(grads["c"][0], np.sum(dds[:, None] * -2 * d, axis=0), rtol=rtol * 10)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_half_powers_print_as_sqrt(dtype):
    """x**(-1/2) and x**(+-3/2) (layer norm's and their derivatives) print
    through sqrt, never pow(); values and gradients against numpy's."""
    points = sp.MatrixSymbol("points", N, 2)
    scale = sp.MatrixSymbol("scale", 1, 1)
    x, y, c = sp.symbols("x y c", real=True)
    body = y / sp.sqrt(x * c + 1) + (x + c) ** sp.Rational(3, 2) + c * x ** sp.Rational(-3, 2)
    error = sbp.map_examples(body, [((x, y), points), (sp.Matrix([c]), scale)])
    model = sbp.Model("halfpowers", inputs=[points], params=[scale], loss=sbp.reduce("sum", error, 0))
    assert not POW.search(generate(model, dtype)[0].source)
    rng = np.random.default_rng(1)
    xs, ys, cv = rng.uniform(0.5, 2.0, 30), rng.standard_normal(30), 0.7
    loss, grads = sbp.compile(model, dtype=dtype).value_and_grad(
        points=np.stack([xs, ys], axis=1).astype(dtype), scale=np.array([[cv]], dtype=dtype))
    want = np.sum(ys / np.sqrt(xs * cv + 1) + (xs + cv) ** 1.5 + cv * xs ** -1.5)
    dwant = np.sum(-0.5 * ys * xs * (xs * cv + 1) ** -1.5 + 1.5 * (xs + cv) ** 0.5 + xs ** -1.5)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert loss == pytest.approx(want, rel=tol)
    assert grads["scale"][0, 0] == pytest.approx(dwant, rel=tol)
