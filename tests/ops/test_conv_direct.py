"""The direct convolution (symbackprop/ops/conv_direct.py,
templates/kernel_conv_direct.c.j2): the forward of a convolution of
stride 1 or 2 without a window matrix, chosen per layer shape. Its values and the
gradients of a model through it against PyTorch float64 (float64 to
1e-12, float32 to 1e-5 relative) and an independent numpy loop, at shapes
that take it and shapes that fall back to im2col; the generated C names
the kernel exactly where the rule says."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.ops import conv, conv_direct
from symbackprop.ops.conv_numpy import Conv

n = sp.Symbol("n", integer=True, positive=True)

# (C_in, H, W, C_out, kernel, stride, padding, dilation, whether the forward is direct in float32 and in
# float64, whether the input gradient is in float32 and in float64)
SHAPES = [
    (3, 16, 16, 8, 3, 1, 1, 1, True, True, False, False),
    (5, 10, 10, 4, 3, 1, 0, 1, True, True, False, False),  # odd in-channels, no padding (read in place), 8 x 8 out
    (2, 6, 16, 8, (3, 5), 1, (1, 2), 1, True, True, False, False),  # rectangular
    (4, 8, 16, 16, 1, 1, 0, 1, True, True, True, True),  # 1x1
    (3, 8, 8, 3, 3, 1, 1, 1, False, False, False, False),  # odd out-channels
    # stride 2: the padded image's 2 x 2 phase planes; the input gradient by the image's phases (float32)
    (4, 16, 16, 8, 3, 2, 1, 1, True, True, True, False),
    (8, 15, 32, 8, 3, 2, 1, 1, True, True, True, False),  # odd rows: the input gradient's phases 7 and 8 rows
    (4, 16, 16, 4, 3, 2, 0, 1, False, False, True, False),  # 7 x 7 out; the gradient's phases read past its end
    (4, 16, 16, 8, 4, 2, 1, 1, True, True, True, False),  # 4 x 4 taps at stride 2: 2 x 2 taps in every phase
    (4, 16, 32, 4, (3, 5), (2, 1), (1, 2), 1, True, True, True, False),  # a stride in rows only: 2 x 1 phases
    (3, 17, 33, 8, 3, 2, 0, 1, True, True, False, False),  # stride 2, no padding, odd sides: planes of 9 x 17
    (2, 16, 32, 4, (3, 5), (2, 1), (1, 2), 1, True, True, False, False),  # a stride in rows only: 2 x 1 planes
    (5, 15, 31, 8, 3, 2, 1, 1, True, True, False, False),  # stride 2 off the tile: 8 x 16 out of odd sides
    (8, 16, 18, 8, 3, 2, 1, 1, False, False, False, False),  # 9 columns out; the gradient's phases 9 wide
    (4, 32, 32, 16, 1, 2, 0, 1, False, False, False, False),  # 1x1 stride 2: 4 planes outgrow the workspace
    (2, 24, 48, 4, 3, 3, 0, 1, False, False, False, False),  # stride 3: untried, im2col
    (2, 12, 12, 4, 3, 1, 2, 2, False, False, False, False),  # dilation 2
    (2, 10, 10, 4, 3, 1, 1, 1, False, False, False, False),  # 10 columns: no whole vectors
    (8, 8, 16, 4, 3, 1, 1, 1, True, True, True, True),  # both directions direct, padded
    (8, 8, 8, 4, 3, 1, 1, 1, True, True, True, True),  # an input gradient 8 wide: direct
    (8, 4, 4, 8, 3, 1, 1, 1, False, True, False, False),  # 4 wide: float64's vectors only; its input gradient im2col
    (4, 10, 16, 4, 3, 1, 0, 1, False, False, True, True),  # 14 columns out; the input gradient's 16 direct
    (16, 8, 8, 32, 3, 1, 1, 1, True, True, True, True),  # the weight gradient direct in float32 only (64 pixels)
    (16, 4, 32, 8, 3, 1, 1, 1, True, True, True, True),  # the weight gradient direct in both (8 out-channels)
    (16, 6, 34, 8, 3, 1, 0, 1, True, True, False, False),  # the same without padding: the images read in place
    (8, 8, 32, 8, 3, 1, 1, 1, True, True, True, True),  # 8 in-channels: the weight gradient keeps im2col
    (16, 8, 32, 4, 3, 1, 1, 1, True, True, True, True),  # 4 out-channels (not a tile of 8): im2col
    (16, 16, 16, 32, 3, 1, 1, 1, True, True, True, True),  # 32 out-channels, 256 pixels: im2col
]
# the weight gradients the rule sends to the direct kernel: the last six shapes' first three in float32,
# the second and third in float64 (64 pixels of 32 out-channels are not few enough there)
WEIGHT_GRADS = {"float32": 3, "float64": 2}


def _pair(v):
    return v if isinstance(v, tuple) else (v, v)


def _model(dtype):
    """Every shape's convolution in one model (one compile): loss = sum_k <conv_k(x_k, w_k) + b_k, g_k>."""
    inputs, params, terms, outputs = [], [], [], {}
    for at, (cin, h, w, cout, kernel, stride, padding, dilation, *_) in enumerate(SHAPES):
        kh, kw = _pair(kernel)
        x = sbp.images(f"x{at}", n, cin, h, w)
        k, b = sbp.conv_weight(f"w{at}", cout, cin, kh, kw), sp.MatrixSymbol(f"b{at}", 1, cout)
        y = nn.conv2d(x, k, b, stride, padding, kernel_size=(kh, kw), dilation=dilation)
        g = sp.MatrixSymbol(f"g{at}", n, y.matrix.shape[1])
        inputs += [x.matrix, g]
        params += [k, b]
        terms.append(nn.sum_all(sp.HadamardProduct(y.matrix, g)))
        outputs[f"y{at}"] = y.matrix
    return sbp.Model(f"direct_conv_{dtype}", inputs=inputs, params=params, grad_inputs=inputs[::2], loss=sp.Add(*terms),
                     outputs=outputs)


def _numpy_conv(x, w, b, stride, padding, dilation):
    """A plain loop over the window: (n, C, H, W) by (F, C, kh, kw), zero padding."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    batch, _, h, wd = x.shape
    f, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    ho, wo = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((batch, f, ho, wo)) + b.reshape(1, f, 1, 1)
    for ky in range(kh):
        for kx in range(kw):
            win = xp[:, :, ky * dh: ky * dh + sh * (ho - 1) + 1: sh, kx * dw: kx * dw + sw * (wo - 1) + 1: sw]
            out += np.einsum("nchw,fc->nfhw", win, w[:, :, ky, kx])
    return out.reshape(batch, -1)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_direct_conv_values_and_gradients(dtype):
    torch = pytest.importorskip("torch")
    mod = sbp.compile(_model(dtype), dtype=dtype)
    # the generated C names the kernel once for each convolution (and input gradient) the rule sends to it
    flags = (-4, -2) if dtype == "float32" else (-3, -1)
    forward, backward = (sum(shape[f] for shape in SHAPES) for f in flags)
    assert mod.source.count("direct: no window matrix") == forward + backward + WEIGHT_GRADS[dtype]
    assert mod.source.count("the weight gradient in") == WEIGHT_GRADS[dtype]
    strided = sum(shape[flags[1]] for shape in SHAPES if _pair(shape[5]) != (1, 1))
    assert mod.source.count("(the input gradient: the weights flipped") == backward - strided
    assert mod.source.count("direct: no window matrix; the input gradient in") == strided
    # n is bound at call time: one module, every batch; 45 examples: batch blocks of 5-6, more than one
    # weight-gradient chunk of up to 5 padded images (the last one partial)
    for batch in (1, 3, 45):
        _check(mod, dtype, batch, torch)


def _check(mod, dtype, batch, torch):
    rng = np.random.default_rng(batch)
    arrays, wants, outs = {}, [], []
    for at, (cin, h, w, cout, kernel, stride, padding, dilation, *_) in enumerate(SHAPES):
        kh, kw = _pair(kernel)
        x, k = rng.standard_normal((batch, cin * h * w)), rng.standard_normal((cout, cin * kh * kw))
        b = rng.standard_normal((1, cout))
        want = _numpy_conv(x.reshape(batch, cin, h, w), k.reshape(cout, cin, kh, kw), b, stride, padding, dilation)
        arrays |= {f"x{at}": x, f"g{at}": rng.standard_normal(want.shape), f"w{at}": k, f"b{at}": b}
        wants.append(want)
    t = {key: torch.tensor(a, requires_grad=True) for key, a in arrays.items()}
    for at, (cin, h, w, cout, kernel, stride, padding, dilation, *_) in enumerate(SHAPES):
        kh, kw = _pair(kernel)
        out = torch.nn.functional.conv2d(t[f"x{at}"].reshape(batch, cin, h, w), t[f"w{at}"].reshape(cout, cin, kh, kw),
                                         t[f"b{at}"][0], stride=stride, padding=padding, dilation=dilation)
        assert np.abs(out.detach().numpy().reshape(batch, -1) - wants[at]).max() <= 1e-12 * np.abs(wants[at]).max()
        outs.append((out.reshape(batch, -1) * t[f"g{at}"]).sum())
    ref = sum(outs)
    ref.backward()
    cast = {key: a.astype(dtype) for key, a in arrays.items()}
    rel = 1e-12 if dtype == "float64" else 1e-5
    got = mod.forward(**cast)
    for at, want in enumerate(wants):
        y = np.asarray(got[f"y{at}"], dtype=np.float64)
        assert np.abs(y - want).max() <= rel * np.abs(want).max(), SHAPES[at]
    loss, grads = mod.value_and_grad(**cast)
    assert abs(loss - ref.item()) <= rel * sum(np.abs(w * arrays[f"g{at}"]).sum() for at, w in enumerate(wants))
    assert sorted(grads) == sorted(key for key in arrays if not key.startswith("g"))
    for key in grads:
        expect = t[key].grad.numpy()
        assert np.abs(np.asarray(grads[key], dtype=np.float64) - expect).max() <= rel * np.abs(expect).max(), key


def test_the_rule():
    """Stride 1, dilation 1, out-channels in fours, whole vectors of columns, at most 64 in-channels."""
    resnet = Conv(16, 32, 32, 16, 3, 3, 1, 1, 1, 1, 1, 1)
    p32, p64 = conv_direct.plan(resnet, "float32", True), conv_direct.plan(resnet, "float64", True)
    assert p32 is not None and p64 is not None and (p32.V, p64.V) == (16, 8)
    assert p32.OCB * p32.R * p32.NV <= conv_direct.MAX_ACCUMULATORS and (p32.HP, p32.WP) == (34, 34)
    assert conv_direct.plan(resnet, "float32", False) is None  # a constant operand
    strided = conv_direct.plan(Conv(16, 32, 32, 16, 3, 3, 2, 2, 1, 1, 1, 1), "float32", True)
    assert strided is not None and (strided.SH, strided.SW, strided.HP, strided.WP, strided.padded) == (2, 2, 17, 17, True)
    assert conv_direct.plan(Conv(16, 33, 33, 16, 3, 3, 3, 3, 0, 0, 1, 1), "float32", True) is None  # stride 3
    assert conv_direct.plan(Conv(16, 32, 32, 16, 3, 3, 1, 1, 2, 2, 2, 2), "float32", True) is None
    assert conv_direct.plan(Conv(16, 32, 32, 6, 3, 3, 1, 1, 1, 1, 1, 1), "float32", True) is None
    wide = conv_direct.MAX_IN_CHANNELS + 1
    assert conv_direct.plan(Conv(wide, 8, 8, 16, 3, 3, 1, 1, 1, 1, 1, 1), "float32", True) is None
    narrow = Conv(16, 4, 4, 16, 3, 3, 1, 1, 1, 1, 1, 1)  # the forward direct, the input gradient not
    assert conv_direct.template_fields(narrow, False, False, "float64", True, 16 * 9 * 16) is not None
    assert conv_direct.template_fields(narrow, True, False, "float64", True, 16 * 9 * 16) is None
    # 64 x 64 channels of 8 x 8: the flipped weights and the padded gradient outgrow the windows
    deep = Conv(64, 8, 8, 64, 3, 3, 1, 1, 1, 1, 1, 1)
    room = conv.workspace(deep, conv.ImageAttrs("im2col", scatter=True))
    assert room == 64 * 64 * 9 + 64 * 10 * 10 > 64 * 9 * 64
    assert conv_direct.template_fields(deep, True, False, "float32", True, room) is not None
    assert conv_direct.template_fields(deep, True, False, "float32", True, 64 * 9 * 64) is None


def test_the_strided_input_gradient_rule():
    """ResNet's stride-2 layers: four phases of 2 x 2, 2 x 1, 1 x 2 and 1 x 1
    taps covering the image's rows and columns once; the 32 -> 64 layer's
    flipped taps and padded gradient outgrow its windows (the workspace
    grows); float64, a stride over the kernel (1 x 1 at 2), a stride 3 and columns
    in no whole vectors keep im2col."""
    for c in (Conv(16, 32, 32, 32, 3, 3, 2, 2, 1, 1, 1, 1), Conv(32, 16, 16, 64, 3, 3, 2, 2, 1, 1, 1, 1)):
        d = conv_direct.strided_input_grad_fields(c, "float32", True)
        assert d is not None and [(p.A, p.B) for p in d["phases"]] == [(2, 2), (2, 1), (1, 2), (1, 1)]
        rows = sorted(2 * (p.qy0 + q) + p.py - c.PH for p in d["phases"] if p.px == 0 for q in range(p.NY))
        assert rows == list(range(c.H))
        assert d["pad_at"] == c.C * c.F * 9
    room = conv.workspace(Conv(32, 16, 16, 64, 3, 3, 2, 2, 1, 1, 1, 1), conv.ImageAttrs("im2col", scatter=True))
    assert room == 32 * 64 * 9 + 64 * 10 * 10 > 32 * 9 * 64  # rows -1 .. 8 of the 8 x 8 gradient: 10 x 10
    assert conv_direct.strided_input_grad_fields(Conv(16, 32, 32, 32, 3, 3, 2, 2, 1, 1, 1, 1), "float64", True) is None
    assert conv_direct.strided_input_grad_fields(Conv(16, 32, 32, 32, 1, 1, 2, 2, 0, 0, 1, 1), "float32", True) is None
    assert conv_direct.strided_input_grad_fields(Conv(16, 33, 33, 32, 3, 3, 3, 3, 0, 0, 1, 1), "float32", True) is None
    assert conv_direct.strided_input_grad_fields(Conv(16, 18, 18, 32, 3, 3, 2, 2, 1, 1, 1, 1), "float32", True) is None


def test_the_weight_gradient_rule():
    """The ResNet stack's 3x3 layers (batch 32) whose weight gradient the direct kernel takes: where it
    measured faster than im2col (16->16 32x32 in both types, 64->64 8x8 in float32), not where level."""
    def direct(c_in, side, c_out, real, kernel=3, pad=1):
        return conv_direct.weight_grad_fields(Conv(c_in, side, side, c_out, kernel, kernel, 1, 1, pad, pad, 1, 1),
                                              real, True) is not None
    assert direct(16, 32, 16, "float32") and direct(16, 32, 16, "float64")
    assert direct(64, 8, 64, "float32") and not direct(64, 8, 64, "float64")
    assert not direct(32, 16, 32, "float32") and not direct(32, 16, 32, "float64")
    assert not direct(3, 32, 16, "float32")  # 3 in-channels: the stem keeps im2col
    assert not direct(16, 32, 16, "float32", kernel=1, pad=0)  # a 1x1 kernel (unmeasured)
    d = conv_direct.weight_grad_fields(Conv(16, 32, 32, 16, 3, 3, 1, 1, 1, 1, 1, 1), "float32", True)
    assert d is not None and (d["V"], d["OCB"], d["HP"], d["WP"]) == (8, 8, 34, 34)
    assert conv_direct.weight_grad_fields(Conv(16, 32, 32, 16, 3, 3, 1, 1, 1, 1, 1, 1), "float32", False) is None
    assert conv_direct.weight_grad_fields(Conv(16, 32, 32, 16, 3, 3, 2, 2, 1, 1, 1, 1), "float32", True) is None


def test_direct_weight_gradient_on_two_threads():
    """Built with OpenMP, the direct weight gradient's batch blocks (each with its own padded images)
    run on two threads: the same bits as on one, and PyTorch's float64 gradient."""
    torch = pytest.importorskip("torch")
    from test_conv_openmp import _gomp

    from symbackprop.toolchain.builder import BuildOptions
    gomp = _gomp()
    x = sbp.images("x", n, 16, 8, 8)
    k = sbp.conv_weight("w", 16, 16, 3, 3)
    y = nn.conv2d(x, k, padding=1)
    g = sp.MatrixSymbol("g", n, y.matrix.shape[1])
    model = sbp.Model("direct_wgrad_omp", inputs=[x.matrix, g], params=[k], loss=nn.sum_all(sp.HadamardProduct(y.matrix, g)))
    mod = sbp.compile(model, dtype="float64", options=BuildOptions(openmp=True))
    assert mod.source.count("the weight gradient in") == 1 and "SYMBACKPROP_PARALLEL_BLOCKS" in mod.source
    rng = np.random.default_rng(7)
    arrays = {"x": rng.standard_normal((37, 16 * 64)), "g": rng.standard_normal((37, 16 * 64)),
              "w": rng.standard_normal((16, 16 * 9))}
    got = {}
    try:
        for threads in (1, 2):
            gomp.omp_set_num_threads(threads)
            got[threads] = mod.value_and_grad(**arrays)[1]["w"]
    finally:
        gomp.omp_set_num_threads(1)
    assert np.array_equal(got[1], got[2])
    want = torch.nn.grad.conv2d_weight(torch.tensor(arrays["x"]).reshape(37, 16, 8, 8), (16, 16, 3, 3),
                                       torch.tensor(arrays["g"]).reshape(37, 16, 8, 8), padding=1).numpy()
    assert np.abs(got[1] - want.reshape(16, -1)).max() <= 1e-12 * np.abs(want).max()
