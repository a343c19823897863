"""A module's link names the BLAS only where one of its objects calls it
(symbackprop.toolchain.builder._linked): an elementwise model's link reads no
BLAS library, a matrix product's does, the same model at -O0 (where the
runtime header's unused static helpers, the products among them, are
compiled too) loads, and all give numpy's values."""

import shlex
import subprocess
from dataclasses import replace

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.toolchain.builder import BuildOptions, find_blas

pytestmark = pytest.mark.skipif(find_blas() is None, reason="no BLAS: pip install scipy-openblas32")


def _links_blas(mod) -> bool:
    """Whether the module's link command (the last in its build log) names the BLAS's library."""
    commands = [line[2:] for line in (mod.folder / "build.log").read_text().splitlines() if line.startswith("$ ")]
    blas = find_blas()
    return any(arg in shlex.split(commands[-1]) for arg in blas.link_args)


def _elementwise(name: str):
    x = sp.MatrixSymbol("x", 1, 5)
    return sbp.Model(name, inputs=[], params=[x], loss=nn.sum_all(nn.tanh(x)))


def _check_elementwise(mod) -> None:
    v = np.random.default_rng(2).standard_normal((1, 5))
    loss, grads = mod.value_and_grad(x=v)
    assert np.isclose(loss, np.tanh(v).sum(), rtol=1e-13)
    assert np.allclose(grads["x"], 1 - np.tanh(v) ** 2, rtol=1e-13, atol=0)


def test_only_a_module_that_calls_the_blas_links_it(tmp_path):
    options = BuildOptions(cache_dir=tmp_path, blas=True)
    plain = sbp.compile(_elementwise("no_blas"), options=options)
    n = sp.Symbol("n", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", n, 64), sp.MatrixSymbol("W", 64, 16)
    product = sbp.compile(sbp.Model("with_blas", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W))),
                          options=options)
    assert not _links_blas(plain)
    assert _links_blas(product)
    _check_elementwise(plain)
    rng = np.random.default_rng(3)
    a, w = rng.standard_normal((70, 64)), 0.1 * rng.standard_normal((64, 16))
    loss, grads = product.value_and_grad(X=a, W=w)
    t = np.tanh(a @ w)
    assert np.isclose(loss, t.sum(), rtol=1e-12)
    assert np.allclose(grads["W"], a.T @ (1 - t * t), rtol=1e-11, atol=1e-12)


def test_unoptimized_objects_that_keep_the_product_helpers_link_the_blas(tmp_path):
    options = replace(BuildOptions(cache_dir=tmp_path, blas=True), flags=("-O0", "-std=c99"))
    mod = sbp.compile(_elementwise("no_blas_o0"), options=options)
    assert _links_blas(mod)  # GCC at -O0 compiles every static helper: the products' call cblas
    _check_elementwise(mod)


def test_a_blas_with_a_link_stub_is_linked_through_it_and_loaded_itself(tmp_path):
    """oneMKL (Blas.stub): the link reads a stub of its cblas entry points
    (not its 65,000 symbols), the module still names the library, and its
    products are the library's (the stub's do nothing, and are not kept)."""
    blas = find_blas()
    if blas.stub is None:
        pytest.skip(f"{blas.name} is linked as it is")
    n = sp.Symbol("n", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", n, 200), sp.MatrixSymbol("W", 200, 50)
    mod = sbp.compile(sbp.Model("blas_stub", inputs=[X], params=[W], loss=nn.sum_all(X * W)),  # (its C: blas_stub.c)
                      options=BuildOptions(cache_dir=tmp_path, blas=True))
    link = [line for line in (mod.folder / "build.log").read_text().splitlines() if line.startswith("$ ")][-1]
    assert "-Lblas-stub" in shlex.split(link[2:]) and f"-l:{blas.stub}" in shlex.split(link[2:])
    assert not any(path.name.startswith("blas-stub") for path in mod.folder.iterdir())
    library = next(mod.folder.glob("*.so"))
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert f"[{blas.stub}]" in dynamic  # NEEDED: loaded by its soname, through the rpath
    plain = sbp.compile(_elementwise("no_blas_no_stub"), options=BuildOptions(cache_dir=tmp_path, blas=True))
    assert "blas-stub" not in (plain.folder / "build.log").read_text()  # built only for a link that names the BLAS
    rng = np.random.default_rng(4)
    a, w = rng.standard_normal((300, 200)), rng.standard_normal((200, 50))  # 15,000 outputs: BLAS's size
    loss, grads = mod.value_and_grad(X=a, W=w)
    assert np.isclose(loss, (a @ w).sum(), rtol=1e-12)
    np.testing.assert_allclose(grads["W"], np.repeat(a.sum(axis=0)[:, None], 50, axis=1), rtol=1e-12)
