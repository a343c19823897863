"""Lowerings that save passes over a batch's activations (the transformer
step, benchmarks W11): broadcasts read with a stride of 0 instead of
stored, a residual stream's sums reused, a product's scalar coefficient on
its smallest factor. Each model's loss and gradients against PyTorch
autograd in float64; the generated C's comments show what is computed."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp
from oracles import assert_matches_autograd

import symbackprop as sbp
from symbackprop import nn

torch = pytest.importorskip("torch")
F = torch.nn.functional

m = sp.Symbol("m", integer=True, positive=True)
D = 6


def _check(model, reference, arrays):
    """The compiled loss and every parameter's gradient against autograd (float64)."""
    mod = sbp.compile(model)
    assert_matches_autograd(mod, model, reference, arrays)
    return mod


def _comments(source: str) -> list[str]:
    """The one-line equations of the kernels' comments: 'lhs = rhs'."""
    return re.findall(r"/\* (\w+ = [^*]*?) \*/", source)


def _arrays(rng, rows, **shapes):
    return {"X": rng.normal(size=(rows, D)), "T": rng.normal(size=(rows, D)),
            **{name: rng.normal(size=shape) for name, shape in shapes.items()}}


def test_layer_norm_reads_gamma_beta_and_the_row_scale_unstored():
    X, T = sp.MatrixSymbol("X", m, D), sp.MatrixSymbol("T", m, D)
    g, b = sp.MatrixSymbol("g", 1, D), sp.MatrixSymbol("b", 1, D)
    V, W = sp.MatrixSymbol("V", D, D), sp.MatrixSymbol("W", D, D)
    model = sbp.Model("ln_spread", inputs=[X, T], params=[V, g, b, W], loss=nn.mse(nn.layer_norm(X * V, g, b) * W, T))
    arrays = _arrays(np.random.default_rng(0), 7, V=(D, D), g=(1, D), b=(1, D), W=(D, D))
    mod = _check(model, lambda t: ((F.layer_norm(t["X"] @ t["V"], (D,), t["g"][0], t["b"][0]) @ t["W"]
                                    - t["T"]) ** 2).mean(), arrays)
    equations = _comments(mod.source)
    # no kernel copies gamma or beta onto every row: the loops read g[j], b[j]
    assert not [e for e in equations if re.fullmatch(r"\w+ = [gb]", e)], equations
    # the per-row 1/sqrt(var + eps) is not stored at all: each direction's
    # loop over the rows computes it (ops.normalize)
    assert not [e for e in equations if re.fullmatch(r"\w+ = 1/sqrt\(.*\)", e)], equations
    assert mod.source.count("r_i = 1/sqrt(") == 1 and mod.source.count("r_i (grad_") == 1


def test_residual_stream_adds_each_blocks_term_once():
    X, T = sp.MatrixSymbol("X", m, D), sp.MatrixSymbol("T", m, D)
    ws = [sp.MatrixSymbol(f"W{k}", D, D) for k in range(4)]
    g, b = sp.MatrixSymbol("g", 1, D), sp.MatrixSymbol("b", 1, D)
    x = X * ws[0]
    for w in ws[1:]:  # x + f(x): SymPy flattens the sums into one of every earlier term
        x = x + nn.tanh(nn.layer_norm(x, g, b) * w)
    model = sbp.Model("residual", inputs=[X, T], params=[*ws, g, b], loss=nn.mse(nn.layer_norm(x, g, b), T))

    def reference(t):
        h = t["X"] @ t["W0"]
        for k in (1, 2, 3):
            h = h + torch.tanh(F.layer_norm(h, (D,), t["g"][0], t["b"][0]) @ t[f"W{k}"])
        return ((F.layer_norm(h, (D,), t["g"][0], t["b"][0]) - t["T"]) ** 2).mean()

    arrays = _arrays(np.random.default_rng(1), 5, **{f"W{k}": (D, D) for k in range(4)}, g=(1, D), b=(1, D))
    mod = _check(model, reference, arrays)
    # each sum of the stream reads the previous one and its block's term (x3 = x2 + tanh(..)),
    # not every earlier term (x3 = x0 + tanh(..) + tanh(..) + tanh(..))
    sums = [e for e in _comments(mod.source) if re.fullmatch(r"\w+ = \w+ \+ tanh\(\w+\)", e)]
    assert len(sums) == 3, _comments(mod.source)


def test_a_products_coefficient_scales_its_smallest_factor():
    X, T, W = sp.MatrixSymbol("X", m, D), sp.MatrixSymbol("T", m, D), sp.MatrixSymbol("W", D, D)
    model = sbp.Model("scaled", inputs=[X, T], params=[W], loss=nn.mse(nn.tanh(X * W / 3), T))
    arrays = _arrays(np.random.default_rng(2), 9, W=(D, D))
    mod = _check(model, lambda t: ((torch.tanh(t["X"] @ t["W"] / 3) - t["T"]) ** 2).mean(), arrays)
    assert "W/3" in " ".join(_comments(mod.source))  # a D x D map, not one over the m x D product


def test_attention_hessian_vector_product_through_the_softmax_vjp_op():
    """The softmax's backward is one op (softmax_vjp); its own derivatives
    give the Hessian times a vector, against PyTorch's double backward."""
    L, heads = 4, 2
    X = sp.MatrixSymbol("X", m, D)
    wq, wk, wv = (sp.MatrixSymbol(w, D, D) for w in ("Wq", "Wk", "Wv"))
    out = nn.causal_attention(*(nn.Sequences(X * w, L) for w in (wq, wk, wv)), heads)
    model = sbp.Model("attn_hvp", inputs=[X], params=[wq, wk, wv], loss=nn.sum_all(out.matrix.applyfunc(sp.sin)))
    rng = np.random.default_rng(3)
    arrays = {"X": rng.normal(size=(7, D)), **{w: rng.normal(size=(D, D)) / 2 for w in ("Wq", "Wk", "Wv")}}
    directions = {w: rng.normal(size=(D, D)) for w in ("Wq", "Wk", "Wv")}
    loss, grads, hvp = sbp.compile(model).value_grad_and_hvp(directions, **arrays)

    t = {k: torch.tensor(a, requires_grad=True) for k, a in arrays.items()}
    q, k, v = (t["X"] @ t[w] for w in ("Wq", "Wk", "Wv"))
    rows, dh = [], D // heads
    for first in range(0, 7, L):
        at = slice(first, min(first + L, 7))
        size = at.stop - at.start
        qe, ke, ve = (z[at].reshape(size, heads, dh).transpose(0, 1) for z in (q, k, v))
        scores = (qe @ ke.transpose(1, 2) / dh**0.5).masked_fill(torch.triu(torch.ones(size, size, dtype=torch.bool), 1),
                                                                  float("-inf"))
        rows.append((torch.softmax(scores, -1) @ ve).transpose(0, 1).reshape(size, D))
    want = torch.sin(torch.cat(rows)).sum()
    names = ["Wq", "Wk", "Wv"]
    first = torch.autograd.grad(want, [t[n] for n in names], create_graph=True)
    dot = sum((g * torch.tensor(directions[n])).sum() for g, n in zip(first, names))
    second = torch.autograd.grad(dot, [t[n] for n in names])
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for n, g, h in zip(names, first, second):
        np.testing.assert_allclose(grads[n], g.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(hvp[n], h.numpy(), rtol=1e-9, atol=1e-11)
