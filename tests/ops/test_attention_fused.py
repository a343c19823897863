"""nn.self_attention with one fused projection weight (d x 3d, sliced
W[:, 0:d], W[:, d:2d], W[:, 2d:3d]; or PyTorch's 3d x d in_proj_weight,
its row blocks transposed): Q, K and V are one product X W and views of
its columns, the attention ops read them in place (a row stride of 3d),
and the three slices' gradients scatter into one buffer, so the fused
weight's gradient is one product. Values and gradients against PyTorch
float64 autograd, both builds (loops, BLAS); the C's structure; the
scatter merge itself (disjoint slices merge, overlapping ones do not)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.ir.construct import leaf
from symbackprop.ops.slices import merge_scatters, slice_scatter

torch = pytest.importorskip("torch")
from symbackprop.toolchain.builder import BuildOptions, find_blas  # noqa: E402

F = torch.nn.functional
m = sp.Symbol("m", integer=True, positive=True)
BUILDS = pytest.mark.parametrize("blas", [pytest.param(False, id="loops"), pytest.param(
    True, id="blas", marks=pytest.mark.skipif(find_blas() is None, reason="no BLAS: pip install scipy-openblas32"))])


def _model(length: int, d: int, heads: int, bias: str, name: str) -> sbp.Model:
    """Attention with W (d x 3d) sliced; bias "fused" (one 1 x 3d row, sliced), "apart" (three rows) or "none"."""
    x = nn.sequences("X", m, length, d)
    w, wo = sp.MatrixSymbol("W", d, 3 * d), sp.MatrixSymbol("Wo", d, d)
    b, rows = sp.MatrixSymbol("b", 1, 3 * d), [sp.MatrixSymbol(f"b{c}", 1, d) for c in "qkv"]
    biases = {"fused": [b[:, i * d:(i + 1) * d] for i in range(3)] + [None], "apart": rows + [None], "none": None}[bias]
    out = nn.self_attention(x, *(w[:, i * d:(i + 1) * d] for i in range(3)), wo, heads, biases=biases)
    params = [w, wo] + {"fused": [b], "apart": rows, "none": []}[bias]
    return sbp.Model(name, inputs=[x.matrix], params=params, grad_inputs=[x.matrix],
                     loss=nn.sum_all(out.matrix.applyfunc(sp.sin)), outputs={"Y": out.matrix})


def _torch_loss(t: dict, n: int, length: int, d: int, heads: int, bias: str):
    qkv = t["X"] @ t["W"]
    if bias == "fused":
        qkv = qkv + t["b"]
    q, k, v = qkv.split(d, dim=1)
    if bias == "apart":
        q, k, v = q + t["bq"], k + t["bk"], v + t["bv"]
    q, k, v = (z.reshape(n, length, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(-1, d) @ t["Wo"]
    return torch.sin(y).sum(), y


@BUILDS
@pytest.mark.parametrize(("n", "length", "d", "heads", "bias"), [
    (2, 5, 8, 2, "fused"), (3, 4, 6, 3, "none"), (1, 3, 4, 1, "apart"),
])
def test_fused_projection_is_pytorch(n, length, d, heads, bias, blas):
    rng = np.random.default_rng(n * 10 + d)
    model = _model(length, d, heads, bias, f"fused_qkv_{n}_{length}_{d}_{heads}_{bias}_{int(blas)}")
    arrays = {p.name: rng.normal(size=p.shape) / np.sqrt(d) for p in model.params}
    arrays["X"] = rng.normal(size=(n * length, d))
    mod = sbp.compile(model, options=BuildOptions(blas=blas))
    loss, grads = mod.value_and_grad(**arrays)
    y = mod.forward(**arrays)["Y"]
    tensors = {k: torch.tensor(a, requires_grad=True) for k, a in arrays.items()}
    want, want_y = _torch_loss(tensors, n, length, d, heads, bias)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-12)
    np.testing.assert_allclose(y, want_y.detach().numpy(), rtol=1e-12, atol=1e-12)
    for name, t in tensors.items():
        g = t.grad.numpy().reshape(grads[name].shape)
        np.testing.assert_allclose(grads[name], g, rtol=1e-12, atol=1e-12 * max(np.abs(g).max(), 1), err_msg=name)


def _attend(q, k, v, length: int, heads: int, causal: bool):
    """PyTorch's attention of each sequence of `length` rows (the last may be shorter), apart."""
    out, dh = [], q.shape[1] // heads
    for first in range(0, q.shape[0], length):
        qe, ke, ve = (z[first:first + length].reshape(-1, heads, dh).transpose(0, 1) for z in (q, k, v))
        out.append(F.scaled_dot_product_attention(qe, ke, ve, is_causal=causal).transpose(0, 1).reshape(-1, q.shape[1]))
    return torch.cat(out)


@BUILDS
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("rows", "length", "d", "heads"), [(13, 5, 12, 2), (7, 7, 9, 3)])
def test_scale_and_block_gradients_at_odd_head_widths(rows, length, d, heads, causal, blas):
    """Heads of 6 and 3 columns (1/sqrt(dh) irrational: a wrong factor, or
    one applied twice or not at all, moves every gradient) and a shorter
    last sequence: the loss and the gradients of the fused weight (its Q, K
    and V blocks: a wrong offset or row stride swaps or shears them) and of
    X, against PyTorch float64."""
    x = nn.sequences("X", m, length, d)
    w, wo = sp.MatrixSymbol("W", d, 3 * d), sp.MatrixSymbol("Wo", d, d)
    out = nn.self_attention(x, *(w[:, i * d:(i + 1) * d] for i in range(3)), wo, heads, causal=causal)
    model = sbp.Model(f"fused_odd_{rows}_{d}_{heads}_{int(causal)}_{int(blas)}", inputs=[x.matrix], params=[w, wo],
                      grad_inputs=[x.matrix], loss=nn.sum_all(out.matrix.applyfunc(sp.sin)))
    rng = np.random.default_rng(rows + d)
    arrays = {"X": rng.normal(size=(rows, d)), "W": rng.normal(size=(d, 3 * d)), "Wo": rng.normal(size=(d, d)) / d}
    loss, grads = sbp.compile(model, options=BuildOptions(blas=blas)).value_and_grad(**arrays)
    t = {k: torch.tensor(a, requires_grad=True) for k, a in arrays.items()}
    q, k, v = (t["X"] @ t["W"]).split(d, dim=1)
    want = torch.sin(_attend(q, k, v, length, heads, causal) @ t["Wo"]).sum()
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-12)
    for name, tensor in t.items():
        g = tensor.grad.numpy()
        np.testing.assert_allclose(grads[name], g, rtol=1e-11, atol=1e-12 * np.abs(g).max(), err_msg=name)


def _comments(source: str) -> list[str]:
    return [" ".join(re.sub(r"\n\s*\*", " ", c).split()) for c in re.findall(r"/\* (.*?) \*/", source, re.S)]


def test_fused_projection_is_one_product_each_way():
    """One product X W (not three), one for the gradient of X and one for
    W's, whose three column blocks are copied into one buffer (no zeroed
    m x 3d per slice, no sums of them)."""
    mod = sbp.compile(_model(4, 8, 2, "none", "fused_qkv_structure"))
    comments = _comments(mod.source)
    assert sum(c.startswith("mm_W = X @ W") for c in comments) == 1, comments
    assert sum(re.fullmatch(r"grad_W = X\^T @ \w+", c) is not None for c in comments) == 1, comments
    assert sum(c.startswith("grad_X = ") for c in comments) == 1 and not any(c.startswith("grad_X +=") for c in comments)
    scatters = [c for c in comments if " at [0:m, " in c]
    assert len(scatters) == 1 and scatters[0].count(" at [0:m, ") == 3 and "0 (" not in scatters[0], scatters
    assert not re.search(r"attention_scores reads", mod.source)


def test_disjoint_slice_adjoints_merge_into_one_buffer():
    """merge_scatters: disjoint slices of one parent become one node (the
    numpy evaluation the parent with each part in place); overlapping ones stay apart."""
    g = [leaf(f"g{i}", (2, 3), "input") for i in range(3)]
    parts = [slice_scatter(g[i], (0, 1, 3 * i, 1), (2, 9)) for i in range(3)]
    (merged,) = merge_scatters(parts)
    assert merged.op == "slice_scatter" and len(merged.args) == 3
    overlapping = [slice_scatter(g[0], (0, 1, 0, 1), (2, 9)), slice_scatter(g[1], (0, 1, 2, 1), (2, 9))]
    assert merge_scatters(overlapping) == overlapping
    rows = [slice_scatter(g[0], (0, 1, 0, 1), (4, 9)), slice_scatter(g[1], (2, 1, 0, 1), (4, 9))]
    assert len(merge_scatters(rows)) == 1  # disjoint rows, the same columns


def test_separately_sliced_weights_gradient_is_one_buffer():
    """Slices of one parameter used apart (not self_attention's pattern):
    their gradients still land in one buffer, zeroed once where uncovered."""
    w, x = sp.MatrixSymbol("W", 3, 7), sp.MatrixSymbol("X", m, 3)
    loss = nn.sum_all((x * w[:, 0:2]).applyfunc(sp.sin)) + nn.sum_all((x * w[:, 4:7]).applyfunc(sp.cos))
    mod = sbp.compile(sbp.Model("two_slices", inputs=[x], params=[w], loss=loss))
    (scatter,) = [c for c in _comments(mod.source) if c.startswith("grad_W = ")]
    assert scatter.startswith("grad_W = 0 (3 x 7), ") and scatter.count(" at [") == 2, scatter
    rng = np.random.default_rng(0)
    xv, wv = rng.normal(size=(5, 3)), rng.normal(size=(3, 7))
    _, grads = mod.value_and_grad(X=xv, W=wv)
    want = np.zeros((3, 7))
    want[:, 0:2] = xv.T @ np.cos(xv @ wv[:, 0:2])
    want[:, 4:7] = -xv.T @ np.sin(xv @ wv[:, 4:7])
    np.testing.assert_allclose(grads["W"], want, rtol=1e-12, atol=1e-12)


def _product_slices(expr: sp.MatrixExpr) -> int:
    """How many column blocks of a product (X W) the expression takes."""
    return sum(isinstance(e, sp.MatrixSlice) and isinstance(e.parent, sp.MatMul) for e in sp.preorder_traversal(expr))


def test_only_one_parameter_in_order_fuses():
    """PyTorch's 3d x d in_proj_weight (row blocks transposed) and a d x 3d
    weight (column blocks) fuse; blocks out of order, of two parameters, or
    three parameters do not (three products, as before)."""
    d = 4
    x, wo = nn.sequences("X", m, 3, d), sp.MatrixSymbol("Wo", d, d)
    w_in, w, other = sp.MatrixSymbol("Win", 3 * d, d), sp.MatrixSymbol("W", d, 3 * d), sp.MatrixSymbol("V", d, 3 * d)
    rows = [w_in[i * d:(i + 1) * d, :].T for i in range(3)]
    cols = [w[:, i * d:(i + 1) * d] for i in range(3)]
    assert _product_slices(nn.self_attention(x, *rows, wo, 2).matrix) == 3
    assert _product_slices(nn.self_attention(x, *cols, wo, 2).matrix) == 3
    for ws in ([cols[1], cols[0], cols[2]], [cols[0], other[:, d:2 * d], cols[2]],
               [sp.MatrixSymbol(f"W{c}", d, d) for c in "qkv"]):
        assert _product_slices(nn.self_attention(x, *ws, wo, 2).matrix) == 0
