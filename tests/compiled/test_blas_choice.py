"""Which BLAS a module links (symbackprop.toolchain.blas): each installed one
gives numpy's products and their gradients, is the library the process
loads, and a wrong $SYMBACKPROP_BLAS is an error that names it."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from symbackprop.errors import BuildError
from symbackprop.toolchain import blas
from symbackprop.toolchain.blas import BLAS_ENV, FINDERS, find_blas

# In a child process: the choice is read once per process (find_blas is cached).
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, sympy as sp
    import symbackprop as sbp
    from symbackprop import nn
    from symbackprop.toolchain.blas import find_blas

    n = sp.Symbol("n", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", n, 300), sp.MatrixSymbol("W", 300, 40)
    model = sbp.Model("blas_choice", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W)))
    rng = np.random.default_rng(3)
    errors = {}
    for dtype in ("float64", "float32"):
        x, w = rng.standard_normal((257, 300)).astype(dtype), 0.1 * rng.standard_normal((300, 40)).astype(dtype)
        mod = sbp.compile(model, dtype=dtype)
        loss, grads = mod.value_and_grad(X=x, W=w)
        t = np.tanh(x.astype(np.float64) @ w.astype(np.float64))
        expected = x.astype(np.float64).T @ (1 - t * t)
        errors[dtype] = [abs(loss - t.sum()) / abs(t.sum()),
                         float(np.abs(grads["W"] - expected).max() / np.abs(expected).max())]
    maps = open("/proc/self/maps").read()
    print(json.dumps({"name": find_blas().name, "loaded": str(find_blas().library) in maps, "errors": errors}))
""")


@pytest.mark.parametrize("name", sorted(FINDERS))
def test_each_installed_blas_gives_numpy_products(name, tmp_path):
    if FINDERS[name]() is None:
        pytest.skip(f"{name} is not installed")
    env = dict(os.environ, **{BLAS_ENV: name, "SYMBACKPROP_CACHE_DIR": str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["name"] == name and result["loaded"], result
    assert max(result["errors"]["float64"]) < 1e-12, result
    assert max(result["errors"]["float32"]) < 1e-4, result


def test_an_unknown_choice_is_named(monkeypatch):
    monkeypatch.setenv(BLAS_ENV, "atlas")
    find_blas.cache_clear()
    try:
        with pytest.raises(BuildError, match="SYMBACKPROP_BLAS='atlas': expected one of mkl, openblas"):
            find_blas()
    finally:
        monkeypatch.delenv(BLAS_ENV)
        find_blas.cache_clear()


def test_a_choice_that_is_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(FINDERS, "mkl", lambda: None)
    monkeypatch.setenv(BLAS_ENV, "mkl")
    find_blas.cache_clear()
    try:
        with pytest.raises(BuildError, match=r"SYMBACKPROP_BLAS=mkl, but it is not installed \(pip install mkl\)"):
            blas.find_blas()
    finally:
        monkeypatch.delenv(BLAS_ENV)
        find_blas.cache_clear()


@pytest.mark.parametrize(("vendor", "installed", "chosen"), [
    ("GenuineIntel", ("mkl", "openblas"), "mkl"),
    ("", ("mkl", "openblas"), "mkl"),
    ("AuthenticAMD", ("mkl", "openblas"), "openblas"),  # oneMKL's generic code path there
    ("AuthenticAMD", ("mkl",), "mkl"),
    ("GenuineIntel", ("openblas",), "openblas"),
])
def test_the_default_choice_follows_the_cpu(monkeypatch, vendor, installed, chosen):
    monkeypatch.delenv(BLAS_ENV, raising=False)
    monkeypatch.setattr(blas, "cpu_vendor", lambda: vendor)
    for name in FINDERS:
        monkeypatch.setitem(FINDERS, name, (lambda name=name: name) if name in installed else (lambda: None))
    find_blas.cache_clear()
    try:
        assert find_blas() == chosen
    finally:
        find_blas.cache_clear()


def test_the_cpu_vendor_is_read_from_linux():
    if not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"):
        pytest.skip("an x86-64 Linux's /proc/cpuinfo names the vendor")
    vendor = blas.cpu_vendor()
    assert vendor and f"vendor_id\t: {vendor}\n" in Path("/proc/cpuinfo").read_text()
