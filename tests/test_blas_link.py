"""A module is linked to the BLAS only where its C calls it
(symbackprop.build.builder.calls_blas: an entry point, or a runtime helper
that calls one): an elementwise model's link reads no BLAS library, a
matrix product's does, and both give numpy's values."""

import shlex

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.build.builder import BuildOptions, blas_helpers, calls_blas, find_blas

pytestmark = pytest.mark.skipif(find_blas() is None, reason="no BLAS: pip install scipy-openblas32")


def _link(mod) -> list[str]:
    """The link command of the module's build (the last command in its log)."""
    commands = [line[2:] for line in (mod.folder / "build.log").read_text().splitlines() if line.startswith("$ ")]
    return shlex.split(commands[-1])


def _blas_args(link: list[str]) -> list[str]:
    library = str(find_blas().library)
    return [a for a in link if a.endswith(find_blas().library.name) or library in a or "openblas" in a or "mkl" in a]


def test_an_elementwise_model_links_no_blas_and_a_product_does(tmp_path):
    options = BuildOptions(cache_dir=tmp_path, blas=True)
    x = sp.MatrixSymbol("x", 1, 5)
    plain = sbp.compile(sbp.Model("no_blas", inputs=[], params=[x], loss=nn.sum_all(nn.tanh(x))), options=options)
    n = sp.Symbol("n", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", n, 64), sp.MatrixSymbol("W", 64, 16)
    product = sbp.compile(sbp.Model("with_blas", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W))),
                          options=options)
    assert not calls_blas(plain.source) and calls_blas(product.source)
    assert {"symbackprop_f64_matmul", "symbackprop_f32_matmul", "symbackprop_f64_causal_scores"} <= blas_helpers()
    assert _blas_args(_link(plain)) == []
    assert _blas_args(_link(product)) != []
    rng = np.random.default_rng(2)
    v = rng.standard_normal((1, 5))
    loss, grads = plain.value_and_grad(x=v)
    assert np.isclose(loss, np.tanh(v).sum(), rtol=1e-13)
    assert np.allclose(grads["x"], 1 - np.tanh(v) ** 2, rtol=1e-13, atol=0)
    a, w = rng.standard_normal((70, 64)), 0.1 * rng.standard_normal((64, 16))
    loss, grads = product.value_and_grad(X=a, W=w)
    t = np.tanh(a @ w)
    assert np.isclose(loss, t.sum(), rtol=1e-12)
    assert np.allclose(grads["W"], a.T @ (1 - t * t), rtol=1e-11, atol=1e-12)
