"""Convolutions, pools and causal attention on geometries drawn at random
(seeded, so a failure names its draw): channels, image sizes, kernel,
stride, padding, batch, sequence length, heads and a shorter last sequence,
compiled and compared with PyTorch autograd in float64 to 1e-10 relative.
The fixed shapes of tests/ops/test_conv.py and tests/ops/test_attention.py pick the
edge cases by hand; these look for the ones nobody thought of. Three draws
per op by default, twenty more with --runslow."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.declare.conv import out_size

torch = pytest.importorskip("torch")
F = torch.nn.functional

n = sp.Symbol("n", integer=True, positive=True)
DEFAULT_DRAWS, SLOW_DRAWS = 3, 20
DRAWS = [pytest.param(i) for i in range(DEFAULT_DRAWS)] + [
    pytest.param(i, marks=pytest.mark.slow) for i in range(DEFAULT_DRAWS, DEFAULT_DRAWS + SLOW_DRAWS)]


def _close(got, want, what):
    want = want.detach().numpy().reshape(np.shape(got))
    scale = max(np.abs(want).max(), 1e-300)
    err = np.abs(np.asarray(got, dtype=np.float64) - want).max()
    assert err <= 1e-10 * scale, f"{what}: max abs error {err:.3g} against scale {scale:.3g}"


def _compare(model, reference, arrays, where):
    """Loss and every gradient of the compiled `model` against
    reference(tensors) -> loss under float64 autograd."""
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    tensors = {k: torch.tensor(a, requires_grad=True) for k, a in arrays.items()}
    want = reference(tensors)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10, abs=1e-12), where
    for name in grads:
        _close(grads[name], tensors[name].grad, f"{where}: d loss / d {name}")


def _conv_geometry(rng):
    """A convolution whose padded image holds at least one window."""
    k, stride, padding = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(0, 3))
    least = max(1, k - 2 * padding)
    height, width = (int(rng.integers(least, least + 7)) for _ in range(2))
    return {"batch": int(rng.integers(1, 4)), "c_in": int(rng.integers(1, 4)), "c_out": int(rng.integers(1, 5)),
                "height": height, "width": width, "k": k, "stride": stride, "padding": padding}


@pytest.mark.parametrize("draw", DRAWS)
def test_conv2d_on_a_random_geometry(draw):
    rng = np.random.default_rng(1000 + draw)
    g = _conv_geometry(rng)
    x = sbp.images("x", n, g["c_in"], g["height"], g["width"])
    w, b = sbp.conv_weight("w", g["c_out"], g["c_in"], g["k"]), sp.MatrixSymbol("b", 1, g["c_out"])
    y = nn.conv2d(x, w, b, stride=g["stride"], padding=g["padding"])
    assert (y.height, y.width) == tuple(out_size(s, g["k"], g["stride"], g["padding"]) for s in (g["height"], g["width"]))
    model = sbp.Model(f"conv_draw{draw}", inputs=[x.matrix], params=[w, b], grad_inputs=[x.matrix],
                      loss=nn.sum_all(y.matrix.applyfunc(sp.sin)))
    arrays = {"x": rng.standard_normal((g["batch"], g["c_in"] * g["height"] * g["width"])),
              "w": rng.standard_normal((g["c_out"], g["c_in"] * g["k"] ** 2)), "b": rng.standard_normal((1, g["c_out"]))}

    def reference(t):
        image = t["x"].reshape(-1, g["c_in"], g["height"], g["width"])
        kernel = t["w"].reshape(g["c_out"], g["c_in"], g["k"], g["k"])
        return torch.sin(F.conv2d(image, kernel, t["b"][0], stride=g["stride"], padding=g["padding"])).sum()

    _compare(model, reference, arrays, f"draw {draw}: {g}")


@pytest.mark.parametrize("draw", DRAWS)
def test_pools_on_a_random_geometry(draw):
    rng = np.random.default_rng(2000 + draw)
    k, stride = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    batch, channels = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    height, width = (int(rng.integers(k, k + 6)) for _ in range(2))
    x = sbp.images("x", n, channels, height, width)
    top, mean = nn.max_pool2d(x, k, stride), nn.avg_pool2d(x, k, stride)
    loss = nn.sum_all(top.matrix.applyfunc(sp.sin)) + nn.sum_all(mean.matrix.applyfunc(sp.cos))
    model = sbp.Model(f"pools_draw{draw}", inputs=[x.matrix], grad_inputs=[x.matrix], loss=loss)

    def reference(t):
        image = t["x"].reshape(-1, channels, height, width)
        return torch.sin(F.max_pool2d(image, k, stride)).sum() + torch.cos(F.avg_pool2d(image, k, stride)).sum()

    # Normal draws have no ties, so max pooling's gradient is unambiguous.
    arrays = {"x": rng.standard_normal((batch, channels * height * width))}
    _compare(model, reference, arrays, f"draw {draw}: k={k} stride={stride} batch={batch} {channels}x{height}x{width}")


def _torch_causal_attention(q, k, v, length, heads):
    """Per sequence of `length` rows (the last may be shorter) and per head,
    the mask as -inf scores (PyTorch's recipe)."""
    rows, d = q.shape
    dh = d // heads
    out = []
    for first in range(0, rows, length):
        size = min(length, rows - first)
        qe, ke, ve = (z[first:first + size].reshape(size, heads, dh).transpose(0, 1) for z in (q, k, v))
        masked = torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1)
        weights = torch.softmax((qe @ ke.transpose(1, 2) / dh**0.5).masked_fill(masked, float("-inf")), dim=-1)
        out.append((weights @ ve).transpose(0, 1).reshape(size, d))
    return torch.cat(out)


@pytest.mark.parametrize("draw", DRAWS)
def test_causal_attention_on_a_random_geometry(draw):
    rng = np.random.default_rng(3000 + draw)
    heads, per_head, length = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 7))
    rows, d = int(rng.integers(1, 3 * length + 1)), heads * per_head
    m = sp.Symbol("m", integer=True, positive=True)
    q, k, v = (sbp.sequences(s, m, length, d) for s in ("q", "k", "v"))
    out = nn.causal_attention(q, k, v, heads)
    model = sbp.Model(f"attn_draw{draw}", inputs=[q.matrix, k.matrix, v.matrix],
                      grad_inputs=[q.matrix, k.matrix, v.matrix], params=[], loss=nn.sum_all(out.matrix.applyfunc(sp.sin)))
    arrays = {s: rng.standard_normal((rows, d)) for s in ("q", "k", "v")}
    _compare(model, lambda t: torch.sin(_torch_causal_attention(t["q"], t["k"], t["v"], length, heads)).sum(),
             arrays, f"draw {draw}: rows={rows} length={length} heads={heads} d={d}")
