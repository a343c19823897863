"""Layer norm's normalization as one op a direction (ops.normalize:
normalize_rows and normalize_rows_vjp, one loop over the rows each), its
values and derivatives against PyTorch autograd in float64: first order on
odd shapes (a single row, one feature, widths around the eight lanes), a
Hessian-vector product (forward over reverse: the VJP op's JVP), and a
gradient penalty (reverse over reverse: the VJP op's own VJP)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

torch = pytest.importorskip("torch")
F = torch.nn.functional

m = sp.Symbol("m", integer=True, positive=True)


def _symbols(d):
    return (sp.MatrixSymbol("X", m, d), sp.MatrixSymbol("V", d, d), sp.MatrixSymbol("g", 1, d),
            sp.MatrixSymbol("b", 1, d))


def _arrays(rng, rows, d):
    return {"X": rng.normal(size=(rows, d)), "V": rng.normal(size=(d, d)), "g": rng.normal(size=(1, d)),
            "b": rng.normal(size=(1, d))}


def _tensors(arrays):
    return {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}


def _close(got, want, rel=1e-10):
    """Relative to the largest entry; a gradient that is 0 exactly (one feature:
    the normalized row is 0 whatever X) is PyTorch's rounding, below 1e-3 * rel."""
    want = want.detach().numpy() if hasattr(want, "detach") else want
    assert np.abs(got - want).max() <= rel * max(np.abs(want).max(), 1e-3)


@pytest.mark.parametrize("rows,d", [(1, 5), (7, 1), (5, 8), (9, 13), (3, 64)])
def test_layer_norm_and_its_gradient_match_torch(rows, d):
    X, V, g, b = _symbols(d)
    y = nn.layer_norm(X * V, g, b)
    model = sbp.Model(f"ln_{rows}_{d}", inputs=[], params=[X, V, g, b], loss=nn.sum_all(y.applyfunc(sp.sin)))
    arrays = _arrays(np.random.default_rng(rows * d), rows, d)
    mod = sbp.compile(model)
    loss, grads = mod.value_and_grad(**arrays)
    t = _tensors(arrays)
    want = torch.sin(F.layer_norm(t["X"] @ t["V"], (d,), t["g"][0], t["b"][0])).sum()
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    for name in arrays:
        _close(grads[name], t[name].grad)
    if d > 1:  # one loop a direction, and no m x d derivative array kept for the backward
        comments = re.findall(r"/\* (\w+(?:\[[^]]*\])? = [^*]*?) \*/", mod.source.replace("\n     * ", " "))
        assert sum("mu_i" in c and not c.startswith("grad_") for c in comments) == 1, comments
        assert sum(c.startswith("grad_") and "r_i (" in c for c in comments) == 1, comments
        assert not [c for c in comments if re.match(r"d\w+_d\w+ = ", c)], comments


def test_hessian_vector_product_through_layer_norm():
    rows, d = 6, 5
    X, V, g, b = _symbols(d)
    model = sbp.Model("ln_hvp", inputs=[X], params=[V, g, b],
                      loss=nn.sum_all(nn.layer_norm(X * V, g, b).applyfunc(sp.tanh)))
    rng = np.random.default_rng(2)
    arrays = _arrays(rng, rows, d)
    directions = {k: rng.normal(size=arrays[k].shape) for k in ("V", "g", "b")}
    loss, grads, hvp = sbp.compile(model).value_grad_and_hvp(directions, **arrays)
    t = _tensors(arrays)
    want = torch.tanh(F.layer_norm(t["X"] @ t["V"], (d,), t["g"][0], t["b"][0])).sum()
    names = ["V", "g", "b"]
    first = torch.autograd.grad(want, [t[n] for n in names], create_graph=True)
    dot = sum((f * torch.tensor(directions[n])).sum() for f, n in zip(first, names))
    second = torch.autograd.grad(dot, [t[n] for n in names])
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for n, f, h in zip(names, first, second):
        _close(grads[n], f)
        _close(hvp[n], h, rel=1e-9)


def test_gradient_penalty_through_layer_norm():
    """sum(d/dX [sum(sin(layer_norm(X V)))]^2): the VJP op differentiated again (reverse over reverse)."""
    rows, d = 4, 7
    X, V, g, b = _symbols(d)
    inner = sbp.grad(nn.sum_all(nn.layer_norm(X * V, g, b).applyfunc(sp.sin)), X)
    model = sbp.Model("ln_penalty", inputs=[X], params=[V, g, b], loss=nn.sum_all(sp.HadamardPower(inner, 2)))
    arrays = _arrays(np.random.default_rng(4), rows, d)
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    t = _tensors(arrays)
    inner_t = torch.autograd.grad(torch.sin(F.layer_norm(t["X"] @ t["V"], (d,), t["g"][0], t["b"][0])).sum(),
                                  t["X"], create_graph=True)[0]
    want = (inner_t**2).sum()
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for name in ("V", "g", "b"):
        _close(grads[name], t[name].grad, rel=1e-9)


@pytest.mark.parametrize("d", [15, 16, 17, 40, 257])
def test_float32_layer_norm_in_one_registers_lanes_matches_torch(d):
    """float32 rows run in sixteen lanes (one vector register's floats):
    widths below, at and past one and several registers, the entries after
    the last whole sixteen added apart, against PyTorch in float64 (the
    float32 result within float32 rounding)."""
    rows = 9
    X, V, g, b = _symbols(d)
    y = nn.layer_norm(X * V, g, b)
    model = sbp.Model(f"ln32_{d}", inputs=[], params=[X, V, g, b], loss=nn.sum_all(y.applyfunc(sp.sin)))
    arrays = _arrays(np.random.default_rng(d), rows, d)
    mod = sbp.compile(model, dtype="float32")
    assert re.search(r"sum_lane\[16\]", mod.source)
    arrays32 = {k: v.astype(np.float32) for k, v in arrays.items()}
    loss, grads = mod.value_and_grad(**arrays32)
    t = _tensors({k: v.astype(np.float64) for k, v in arrays32.items()})
    want = torch.sin(F.layer_norm(t["X"] @ t["V"], (d,), t["g"][0], t["b"][0])).sum()
    want.backward()
    assert loss == pytest.approx(want.item(), rel=2e-4, abs=1e-3)
    for name in arrays:
        _close(grads[name], t[name].grad, rel=2e-4)
