"""Convolutional layers (symbackprop.declare.conv, symbackprop.ops.conv): the
compiled values and gradients against PyTorch autograd in float64, on odd
shapes, batch 1 and odd batches, stride > 1 with padding and several
channels. (tests/ops/test_op_rules.py checks the same ops' rules by finite
differences through the interpreter, without torch or C.)"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from c_driver import unwrapped

import symbackprop as sbp
from symbackprop import nn

torch = pytest.importorskip("torch")
F = torch.nn.functional

n = sp.Symbol("n", integer=True, positive=True)
BATCHES = (1, 3)


def _close(got, want, what, rel=1e-10):
    want = want.detach().numpy().reshape(np.shape(got))
    scale = max(np.abs(want).max(), 1e-300)
    assert np.abs(np.asarray(got, dtype=np.float64) - want).max() <= rel * scale, what


def _check(model, build_torch, shapes, batch, seed=0, wrt=None, rel=1e-10, **compile_kwargs):
    """Compile `model` (with `compile_kwargs`), draw arrays of `shapes` (n:
    the batch), and compare its loss and gradients with build_torch(tensors)
    -> loss under float64 autograd, to `rel` relative."""
    rng = np.random.default_rng(seed + batch)
    arrays = {name: rng.standard_normal(tuple(batch if d == "n" else d for d in shape)) for name, shape in shapes.items()}
    mod = sbp.compile(model, **compile_kwargs)
    dtype = compile_kwargs.get("dtype", "float64")
    loss, grads = mod.value_and_grad(**{name: a.astype(dtype) for name, a in arrays.items()})
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in arrays.items()}
    want = build_torch(tensors)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=rel, abs=1e-12)
    for name in wrt or grads:
        _close(grads[name], tensors[name].grad, f"d loss / d {name}", rel)
    return mod, arrays


@pytest.mark.parametrize("batch", BATCHES)
def test_conv2d_stride_padding_channels(batch):
    x = sbp.images("x", n, 2, 7, 6)
    w, b = sbp.conv_weight("w", 3, 2, 3), sp.MatrixSymbol("b", 1, 3)
    y = nn.conv2d(x, w, b, stride=2, padding=1)
    assert (y.channels, y.height, y.width) == (3, 4, 3)
    model = sbp.Model("conv_s2p1", inputs=[x.matrix], params=[w, b], grad_inputs=[x.matrix],
                      loss=nn.sum_all(y.matrix.applyfunc(sp.sin)))

    def reference(t):
        out = F.conv2d(t["x"].reshape(-1, 2, 7, 6), t["w"].reshape(3, 2, 3, 3), t["b"][0], stride=2, padding=1)
        return torch.sin(out).sum()

    _check(model, reference, {"x": ("n", 84), "w": (3, 18), "b": (1, 3)}, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_conv2d_constant_adjoint_and_wide_padding(batch):
    """A loss that is the sum of the convolution (its adjoint is the constant
    1, never stored), padding 2 on a 5x5 kernel over a 4x5 image."""
    x = sbp.images("x", n, 1, 4, 5)
    w = sbp.conv_weight("w", 2, 1, 5)
    y = nn.conv2d(x, w, padding=2, stride=1)
    model = sbp.Model("conv_sum", inputs=[x.matrix], params=[w], grad_inputs=[x.matrix], loss=nn.sum_all(y.matrix))
    _check(model, lambda t: F.conv2d(t["x"].reshape(-1, 1, 4, 5), t["w"].reshape(2, 1, 5, 5), padding=2).sum(),
           {"x": ("n", 20), "w": (2, 25)}, batch)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(("k", "stride"), [(2, 2), (3, 2)])
def test_pools(batch, k, stride):
    """Max and average pools on an odd 7x5 image (the last row and column
    fall outside every window), overlapping windows for k=3, stride 2."""
    x = sbp.images("x", n, 2, 7, 5)
    top, mean = nn.max_pool2d(x, k, stride), nn.avg_pool2d(x, k, stride)
    loss = nn.sum_all(top.matrix.applyfunc(sp.sin)) + nn.sum_all(mean.matrix.applyfunc(sp.cos))
    model = sbp.Model(f"pools_{k}_{stride}", inputs=[x.matrix], grad_inputs=[x.matrix], loss=loss)

    def reference(t):
        image = t["x"].reshape(-1, 2, 7, 5)
        return torch.sin(F.max_pool2d(image, k, stride)).sum() + torch.cos(F.avg_pool2d(image, k, stride)).sum()

    _check(model, reference, {"x": ("n", 70)}, batch)


@pytest.mark.parametrize("batch", (2, 5))
def test_batch_norm_training(batch):
    """The gradient through the batch's mean and variance (batch 1 has no
    variance to speak of: the smallest batch is 2)."""
    x = sbp.images("x", n, 3, 3, 5)
    gamma, beta = sp.MatrixSymbol("gamma", 1, 3), sp.MatrixSymbol("beta", 1, 3)
    y = nn.batch_norm(x, gamma, beta, eps=1e-5)
    model = sbp.Model("bn_train", inputs=[x.matrix], params=[gamma, beta], grad_inputs=[x.matrix],
                      loss=nn.sum_all(y.matrix.applyfunc(sp.sin)))

    def reference(t):
        out = F.batch_norm(t["x"].reshape(-1, 3, 3, 5), None, None, t["gamma"][0], t["beta"][0], training=True, eps=1e-5)
        return torch.sin(out).sum()

    _check(model, reference, {"x": ("n", 45), "gamma": (1, 3), "beta": (1, 3)}, batch)


@pytest.mark.parametrize("batch", BATCHES)
def test_batch_norm_inference_and_batch_stats(batch):
    x = sbp.images("x", n, 2, 3, 3)
    gamma, beta = sp.MatrixSymbol("gamma", 1, 2), sp.MatrixSymbol("beta", 1, 2)
    mean, var = sp.MatrixSymbol("mean", 1, 2), sp.MatrixSymbol("var", 1, 2)
    y = nn.batch_norm(x, gamma, beta, running=(mean, var))
    model = sbp.Model("bn_eval", inputs=[x.matrix, mean, var], params=[gamma, beta], grad_inputs=[x.matrix],
                      loss=nn.sum_all(y.matrix.applyfunc(sp.sin)))
    shapes = {"x": ("n", 18), "gamma": (1, 2), "beta": (1, 2), "mean": (1, 2), "var": (1, 2)}

    def reference(t):
        out = F.batch_norm(t["x"].reshape(-1, 2, 3, 3), t["mean"][0], t["var"][0], t["gamma"][0],
                           t["beta"][0], training=False, eps=1e-5)
        return torch.sin(out).sum()

    rng = np.random.default_rng(batch)
    arrays = {name: rng.standard_normal(tuple(batch if d == "n" else d for d in shape)) for name, shape in shapes.items()}
    arrays["var"] = arrays["var"] ** 2 + 0.5
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    tensors = {name: torch.tensor(a, requires_grad=name not in ("mean", "var")) for name, a in arrays.items()}
    want = reference(tensors)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for name in ("x", "gamma", "beta"):
        _close(grads[name], tensors[name].grad, f"d loss / d {name}")

    stats = sbp.compile(sbp.Model("bn_stats", inputs=[x.matrix], params=[gamma], loss=nn.sum_all(gamma),
                                  outputs=dict(zip(("mean", "var"), nn.batch_stats(x)))))
    out = stats.forward(x=arrays["x"], gamma=arrays["gamma"])
    images = torch.tensor(arrays["x"]).reshape(-1, 2, 3, 3)
    _close(out["mean"], images.mean(dim=(0, 2, 3)), "batch mean")
    _close(out["var"], images.var(dim=(0, 2, 3), unbiased=False), "batch variance")


def _lenet_block():
    x = sbp.images("x", n, 1, 8, 8)
    t = sp.MatrixSymbol("t", n, 4)
    w1, b1 = sbp.conv_weight("w1", 3, 1, 3), sp.MatrixSymbol("b1", 1, 3)
    w2, b2 = sbp.conv_weight("w2", 4, 3, 3), sp.MatrixSymbol("b2", 1, 4)
    gamma, beta = sp.MatrixSymbol("gamma", 1, 4), sp.MatrixSymbol("beta", 1, 4)
    v, c = sp.MatrixSymbol("v", 4 * 1 * 1, 4), sp.MatrixSymbol("c", 1, 4)
    h = nn.max_pool2d(nn.conv2d(x, w1, b1, padding=1).map(nn.relu), 2)          # 3 x 4 x 4
    h = nn.avg_pool2d(nn.batch_norm(nn.conv2d(h, w2, b2, stride=2, padding=1), gamma, beta), 2)  # 4 x 1 x 1
    logits = nn.linear(nn.flatten(h), v, c)
    model = sbp.Model("lenet_block", inputs=[x.matrix, t], params=[w1, b1, w2, b2, gamma, beta, v, c],
                      loss=nn.softmax_cross_entropy(logits, t))

    def reference(p):
        z = F.conv2d(p["x"].reshape(-1, 1, 8, 8), p["w1"].reshape(3, 1, 3, 3), p["b1"][0], padding=1)
        z = F.max_pool2d(torch.relu(z), 2)
        z = F.conv2d(z, p["w2"].reshape(4, 3, 3, 3), p["b2"][0], stride=2, padding=1)
        z = F.avg_pool2d(F.batch_norm(z, None, None, p["gamma"][0], p["beta"][0], training=True), 2)
        z = z.flatten(1) @ p["v"] + p["c"]
        # PyTorch's cross-entropy with probability targets, -sum(t * log_softmax(z)) (rows need not sum to 1)
        return -(p["t"] * torch.log_softmax(z, 1)).sum() / z.shape[0]

    shapes = {"x": ("n", 64), "t": ("n", 4), "w1": (3, 9), "b1": (1, 3), "w2": (4, 27), "b2": (1, 4),
              "gamma": (1, 4), "beta": (1, 4), "v": (4, 4), "c": (1, 4)}
    return model, reference, shapes


def test_lenet_block_end_to_end():
    """conv -> relu -> max pool -> conv -> batch norm -> avg pool -> flatten ->
    linear -> softmax cross-entropy: every parameter's gradient."""
    model, reference, shapes = _lenet_block()
    mod, arrays = _check(model, reference, shapes, 5, wrt=["w1", "b1", "w2", "gamma", "beta", "v", "c"])
    # batch norm subtracts the batch mean: the bias before it has no effect
    assert np.abs(mod.value_and_grad(**arrays)[1]["b2"]).max() < 1e-15


@pytest.mark.parametrize(("dtype", "blas", "rel"), [("float32", None, 1e-4), ("float64", False, 1e-10)])
def test_lenet_block_float32_and_plain_loops(dtype, blas, rel):
    """The same net compiled in float32 (the conv kernels' C in float, their
    products through the float matmul helper) and without BLAS (the
    helper's plain loops), against PyTorch float64."""
    from symbackprop.toolchain.builder import BuildOptions

    model, reference, shapes = _lenet_block()
    mod, _ = _check(model, reference, shapes, 5, wrt=["w1", "b1", "w2", "gamma", "beta", "v", "c"], rel=rel,
                    dtype=dtype, options=BuildOptions(blas=blas))
    assert f"Real type: {dtype}" in mod.source


def test_generated_c_is_loops_with_math():
    """The convolution's C is a loop nest over the batch with its math in a
    comment, the same size whatever the image size (no unrolled pixels)."""
    def source(side):
        x = sbp.images("x", n, 2, side, side)
        w = sbp.conv_weight("w", 3, 2, 3)
        y = nn.max_pool2d(nn.conv2d(x, w, padding=1), 2)
        model = sbp.Model(f"c_{side}", inputs=[x.matrix], params=[w], loss=nn.sum_all(y.matrix.applyfunc(sp.sin)))
        return sbp.compile(model).source

    small, large = source(6), source(30)
    assert "for (int64_t ky = 0; ky < 3; ++ky)" in small and "sum_{ic,ky,kx}" in small
    # statements, not lines: a call too long for a line lists one argument a line, and a
    # larger image's constants make more calls too long
    assert abs(len(unwrapped(small).splitlines()) - len(unwrapped(large).splitlines())) <= 2


def test_bad_geometry_is_a_model_error():
    x = sbp.images("x", n, 2, 4, 4)
    with pytest.raises(sbp.ModelError, match="C_in"):
        nn.conv2d(x, sbp.conv_weight("w", 3, 3, 3))
    with pytest.raises(sbp.ModelError, match="larger than"):
        nn.max_pool2d(x, 5)
    with pytest.raises(sbp.ModelError, match="stride"):
        nn.conv2d(x, sbp.conv_weight("w", 3, 2, 3), stride=0)
    with pytest.raises(sbp.ModelError, match="columns"):
        sbp.Images(sp.MatrixSymbol("y", n, 30), 2, 4, 4)


def test_cnn_digits_example_trains_beside_pytorch_for_two_epochs(capsys):
    """examples/cnn_digits.py for 2 of its 10 epochs: PyTorch's loss curve
    from the same start and data order agrees, and the test accuracy is
    already far above chance (the whole run to its 98%: the slow test
    below)."""
    pytest.importorskip("sklearn")
    from conftest import load_example

    assert load_example("cnn_digits").main(["--epochs", "2"]) in (0, 1)
    printed = capsys.readouterr().out
    difference = float(printed.split("largest loss difference ")[1].split()[0])
    assert difference < 1e-9, printed
    accuracy = float(printed.split("symbackprop: ")[1].split("test accuracy ")[1].split("%")[0])
    assert accuracy > 80, printed


@pytest.mark.slow
def test_cnn_digits_example_trains_beside_pytorch(capsys):
    """examples/cnn_digits.py: at least 98% test accuracy (its exit status),
    and PyTorch's loss curve from the same start and data order agrees."""
    pytest.importorskip("sklearn")
    from conftest import load_example

    assert load_example("cnn_digits").main([]) == 0
    printed = capsys.readouterr().out
    difference = float(printed.split("largest loss difference ")[1].split()[0])
    assert difference < 1e-9, printed


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lenet5_sized_layers(dtype):
    """LeNet-5's convolutions at their real sizes (1x28x28 -> 6, 5x5,
    padding 2; max pool 2; 6x14x14 -> 16, 5x5; max pool 2) at batch 9 (two
    batch blocks of one and eight of more): the loss and the gradients by
    both kernels, both biases and the images (im2col's clipped columns,
    gemm weight gradients, col2im, the pools' write-once unpool) against
    PyTorch float64 autograd."""
    x = sbp.images("x", n, 1, 28, 28)
    k1, c1 = sbp.conv_weight("k1", 6, 1, 5), sp.MatrixSymbol("c1", 1, 6)
    k2, c2 = sbp.conv_weight("k2", 16, 6, 5), sp.MatrixSymbol("c2", 1, 16)
    h = nn.max_pool2d(nn.conv2d(x, k1, c1, padding=2).map(nn.relu), 2)
    h = nn.max_pool2d(nn.conv2d(h, k2, c2).map(nn.relu), 2)
    model = sbp.Model("lenet_layers", inputs=[x.matrix], params=[k1, c1, k2, c2], grad_inputs=[x.matrix],
                      loss=nn.sum_all(nn.flatten(h).applyfunc(sp.sin)))

    def reference(t):
        out = F.max_pool2d(F.relu(F.conv2d(t["x"].reshape(-1, 1, 28, 28), t["k1"].reshape(6, 1, 5, 5), t["c1"][0],
                                           padding=2)), 2)
        out = F.max_pool2d(F.relu(F.conv2d(out, t["k2"].reshape(16, 6, 5, 5), t["c2"][0])), 2)
        return torch.sin(out).sum()

    _check(model, reference, {"x": ("n", 784), "k1": (6, 25), "c1": (1, 6), "k2": (16, 150), "c2": (1, 16)}, 9,
           rel=1e-10 if dtype == "float64" else 2e-3, dtype=dtype)


@pytest.mark.parametrize("channels", [1, 64])
def test_conv_wide_padding_stride_and_gapped_pool(channels):
    """Stride 3 with padding 3 on a 4x4 kernel (rows and columns of windows
    wholly in the padding, clipped column ranges that start past 0) and a
    max pool of 2 with stride 3 (gaps between windows: the unpool's entries
    outside every window stay zero), channels 1 and 64."""
    x = sbp.images("x", n, channels, 11, 10)
    w, b = sbp.conv_weight("w", 5, channels, 4), sp.MatrixSymbol("b", 1, 5)
    y = nn.conv2d(x, w, b, stride=3, padding=3)
    p = nn.max_pool2d(y, 2, stride=3)
    model = sbp.Model(f"conv_gaps{channels}", inputs=[x.matrix], params=[w, b], grad_inputs=[x.matrix],
                      loss=nn.sum_all(nn.flatten(p).applyfunc(sp.sin)))

    def reference(t):
        out = F.conv2d(t["x"].reshape(-1, channels, 11, 10), t["w"].reshape(5, channels, 4, 4), t["b"][0],
                       stride=3, padding=3)
        return torch.sin(F.max_pool2d(out, 2, stride=3)).sum()

    _check(model, reference, {"x": ("n", channels * 110), "w": (5, channels * 16), "b": (1, 5)}, 3)
