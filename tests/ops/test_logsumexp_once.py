"""sbp.reduce("logsumexp", ...) computes each exponential once: its node
reads the softmax along the axis (ops/reduce.py, the helpers of
templates/reduce.c.j2), whose entries are also the gradient. Checked
against float64 closed forms computed with numpy (the value, softmax(z) as
its gradient, (diag(p) - p p^T) v as its Hessian-vector product), on both
sides of the helpers' 64-entry vector paths, down columns (strided) and
along rows, with infinities and NaN."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp

n, m = sp.symbols("n m", integer=True, positive=True)
Z = sp.MatrixSymbol("Z", n, m)


def _closed_form(z: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-sum-exp over axis, softmax along it), in float64."""
    z = z.astype(np.float64)
    top = z.max(axis=axis, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=axis, keepdims=True)
    return top + np.log(total), e / total


@pytest.fixture(scope="module", params=["float64", "float32"])
def modules(request):
    """(module of sum(logsumexp(Z, axis)) for axis 0 and 1, dtype)."""
    mods = {axis: sbp.compile(sbp.Model(f"lse_once_{axis}_{request.param}", params=[Z],
                                        loss=sbp.as_scalar(sbp.reduce("sum", sbp.reduce("logsumexp", Z, axis), 1 - axis))),
                              dtype=request.param)
            for axis in (0, 1)}
    return mods, np.dtype(request.param)


@pytest.mark.parametrize("length", [3, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("axis", [0, 1])
def test_value_and_gradient_match_the_closed_form(modules, length, axis):
    mods, dtype = modules
    shape = (length, 3) if axis == 0 else (3, length)
    z = (30.0 * np.random.default_rng(length).standard_normal(shape)).astype(dtype)
    loss, grads = mods[axis].value_and_grad(Z=z)
    lse, softmax = _closed_form(z, axis)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert loss == pytest.approx(lse.sum(), rel=tol)
    np.testing.assert_allclose(grads["Z"], softmax, rtol=1e-12 if dtype == np.float64 else 1e-5,
                               atol=1e-15 if dtype == np.float64 else 1e-7)
    np.testing.assert_allclose(grads["Z"].sum(axis=axis), 1.0, rtol=tol * 10)


def test_hessian_vector_product_matches_the_closed_form(modules):
    mods, dtype = modules
    if dtype != np.float64:
        pytest.skip("the closed form in float64")
    rng = np.random.default_rng(5)
    z, v = rng.standard_normal((70, 3)), rng.standard_normal((70, 3))
    _, hv = mods[0].hvp({"Z": v}, Z=z).popitem()
    _, p = _closed_form(z, 0)
    expected = p * v - p * (p * v).sum(axis=0, keepdims=True)  # (diag(p) - p p^T) v, column by column
    np.testing.assert_allclose(hv, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("length", [5, 100])
def test_infinities_and_nan(modules, length):
    mods, dtype = modules
    mod = mods[0]

    def column(first, rest):
        z = np.full((length, 3), rest, dtype)
        z[0] = first
        return z

    loss, grads = mod.value_and_grad(Z=column(-np.inf, -np.inf))
    assert loss == -np.inf and np.isnan(grads["Z"]).all()  # exp(z - lse): -inf - -inf
    loss, grads = mod.value_and_grad(Z=column(np.inf, 1.0))
    assert loss == np.inf and (grads["Z"][1:] == 0).all()
    loss, grads = mod.value_and_grad(Z=column(np.nan, 1.0))
    assert np.isnan(loss) and np.isnan(grads["Z"]).all()
    loss, grads = mod.value_and_grad(Z=column(-np.inf, 1.0))  # one entry's exp is 0: the rest share 1
    assert loss == pytest.approx(3 * (1 + np.log(length - 1)), rel=1e-6)
    assert (grads["Z"][0] == 0).all()
    np.testing.assert_allclose(grads["Z"][1:], 1 / (length - 1), rtol=1e-6)


def test_each_exp_is_computed_once():
    """The C of value_and_grad runs the softmax helper once and no exp of
    its own: the log-sum-exp and the gradient read the softmax."""
    v = sp.MatrixSymbol("v", n, 1)
    mod = sbp.compile(sbp.Model("lse_once_vector", params=[v], loss=sbp.reduce("logsumexp", v, 0)))
    body = re.sub(r"/\*.*?\*/", "", mod.source, flags=re.S)  # its C without comments (helpers: the runtime header's)
    assert len(re.findall(r"_softmax_axis\(", body)) == 1
    assert re.search(r"\bexp\(|_exp\(|_exp_term\(", body) is None
    x = np.random.default_rng(1).standard_normal((200, 1))
    loss, grads = mod.value_and_grad(v=x)
    lse, softmax = _closed_form(x, 0)
    assert loss == pytest.approx(lse.item(), rel=1e-14)
    np.testing.assert_allclose(grads["v"], softmax, rtol=1e-13)
