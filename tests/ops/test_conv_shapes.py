"""Convolutions and pools of every shape PyTorch users write: rectangular
kernels, a stride, padding and dilation per axis, padded max pools (-inf
padding) and average pools (the padding's zeros counted, PyTorch's
count_include_pad=True). Values and every gradient against PyTorch float64
autograd to 1e-12 relative; the refusals name what was wrong; a small CNN
with a rectangular convolution trained one step beside torch.optim.SGD."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

torch = pytest.importorskip("torch")
F = torch.nn.functional

n = sp.Symbol("n", integer=True, positive=True)
REL = 1e-12


def _relative(got, want) -> float:
    want = want.detach().numpy().reshape(np.shape(got))
    return float(np.abs(np.asarray(got) - want).max() / max(np.abs(want).max(), 1e-300))


def _compare(model, arrays, reference):
    """The compiled loss and gradients of `model` against reference(tensors) under torch autograd."""
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in arrays.items()}
    want = reference(tensors)
    want.backward()
    assert abs(loss - want.item()) <= REL * abs(want.item())
    assert sorted(grads) == sorted(arrays)
    for name in arrays:
        assert _relative(grads[name], tensors[name].grad) <= REL, f"d loss / d {name}"


# (C_in, H, W, C_out, kernel, stride, padding, dilation, batch)
CONVS = [
    (1, 9, 11, 2, (3, 5), (2, 3), (1, 2), 1, 2),
    (3, 7, 8, 4, (5, 2), (1, 2), (2, 1), 1, 1),
    (3, 10, 9, 2, (3, 5), 1, (1, 2), (2, 1), 3),
    (1, 6, 5, 3, 3, (2, 3), 0, 1, 3),
    (3, 5, 7, 2, (2, 3), 2, (0, 1), (1, 2), 2),
]


@pytest.mark.parametrize("cin, height, width, cout, kernel, stride, padding, dilation, batch", CONVS)
def test_conv2d_of_every_shape_matches_pytorch(cin, height, width, cout, kernel, stride, padding, dilation, batch):
    kh, kw = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    x = sbp.images("x", n, cin, height, width)
    w, b = sbp.conv_weight("w", cout, cin, kh, kw), sp.MatrixSymbol("b", 1, cout)
    y = nn.conv2d(x, w, b, stride, padding, kernel_size=kernel if isinstance(kernel, tuple) else None,
                  dilation=dilation)
    model = sbp.Model(f"conv_shape_{cin}_{height}_{width}_{kh}_{kw}", inputs=[x.matrix], params=[w, b],
                      grad_inputs=[x.matrix], loss=nn.sum_all(y.matrix.applyfunc(sp.sin)))
    rng = np.random.default_rng(height * width + kh)
    arrays = {"x": rng.standard_normal((batch, cin * height * width)), "w": rng.standard_normal((cout, cin * kh * kw)),
              "b": rng.standard_normal((1, cout))}

    def reference(t):
        out = F.conv2d(t["x"].reshape(batch, cin, height, width), t["w"].reshape(cout, cin, kh, kw), t["b"][0],
                       stride=stride, padding=padding, dilation=dilation)
        assert out.shape[1:] == (y.channels, y.height, y.width)
        return torch.sin(out).sum()

    _compare(model, arrays, reference)


# (C, H, W, kernel, stride (None: the kernel), padding, batch)
POOLS = [
    (3, 9, 11, (3, 5), (2, 3), (1, 2), 2),
    (1, 7, 6, (2, 3), (1, 2), (1, 1), 3),
    (3, 8, 8, 3, None, 1, 1),
    (1, 5, 7, (5, 2), (2, 1), (2, 1), 2),
    (3, 9, 11, (2, 3), None, (1, 1), 2),  # windows that do not overlap, padded
    (1, 6, 9, (2, 3), (2, 3), 0, 3),  # rectangular windows tiling the image
]


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("channels, height, width, kernel, stride, padding, batch", POOLS)
def test_pools_of_every_shape_match_pytorch(kind, channels, height, width, kernel, stride, padding, batch):
    x = sbp.images("x", n, channels, height, width)
    pool, torch_pool = (nn.max_pool2d, F.max_pool2d) if kind == "max" else (nn.avg_pool2d, F.avg_pool2d)
    y = pool(x.map(lambda m: m.applyfunc(sp.sin)), kernel, stride, padding)
    model = sbp.Model(f"pool_shape_{kind}_{height}_{width}", inputs=[], params=[x.matrix],
                      loss=nn.sum_all(y.matrix.applyfunc(sp.exp)))
    rng = np.random.default_rng(height * width)
    arrays = {"x": rng.standard_normal((batch, channels * height * width))}

    def reference(t):
        out = torch_pool(torch.sin(t["x"].reshape(batch, channels, height, width)), kernel, stride, padding)
        assert out.shape[1:] == (y.channels, y.height, y.width)
        return torch.exp(out).sum()

    _compare(model, arrays, reference)


def test_bad_shapes_are_model_errors_naming_what_is_wrong():
    x = sbp.images("x", n, 3, 5, 6)
    w = sbp.conv_weight("w", 4, 3, 3, 5)
    refusals = [
        (lambda: nn.conv2d(x, w, kernel_size=(3, 5, 1)), r"conv2d's kernel_size must be an int or an \(h, w\) pair; "
                                                          r"got \(3, 5, 1\), of 3 entries"),
        (lambda: nn.conv2d(x, w, kernel_size=(3, 5), stride=(1, 2, 3)), r"conv2d's stride .* of 3 entries"),
        (lambda: nn.conv2d(x, w, kernel_size=(3, 5), padding=(1, -1)), r"conv2d's padding must be an int >= 0 or a "
                                                                         r"pair of them; got \(1, -1\)"),
        (lambda: nn.conv2d(x, w, kernel_size=(3, 5), stride=0), r"conv2d's stride must be an int >= 1"),
        (lambda: nn.conv2d(x, w), r"45 columns are C_in\*15 for C_in = 3, not C_in\*k\*k; .*kernel_size=\(kh, kw\)"),
        (lambda: nn.conv2d(x, w, kernel_size=(3, 3)),
         r"not C_out x \(C_in\*kh\*kw\) = 4 x 27 for C_in = 3 and kernel_size \(3, 3\)"),
        (lambda: nn.conv2d(sbp.images("s", n, 3, 2, 6), w, kernel_size=(3, 5)),
         r"conv2d's 3x5 window is larger than the 2x6 image padded by \(0, 0\): 2x6"),
        (lambda: nn.conv2d(x, w, kernel_size=(3, 5), dilation=2),
         r"conv2d's 3x5 window \(dilation \(2, 2\): it spans 5x9\) is larger than the 5x6 image"),
        (lambda: nn.max_pool2d(x, (2, 7)), r"max_pool2d's 2x7 window is larger than the 5x6 image padded by \(0, 0\)"),
        (lambda: nn.max_pool2d(x, (3, 3), padding=(1, 2)), r"max_pool2d's padding \(1, 2\) is more than half its 3x3 "
                                                            r"window"),
        (lambda: nn.avg_pool2d(x, 2, padding=-1), r"avg_pool2d's padding must be an int >= 0"),
        (lambda: nn.avg_pool2d(x, [2]), r"avg_pool2d's window must be an int or an \(h, w\) pair; got \[2\]"),
        (lambda: nn.avg_pool2d(x, 3, padding=1, count_include_pad=False), r"count_include_pad=False and padding"),
    ]
    for build, message in refusals:
        with pytest.raises(sbp.ModelError, match=message):
            build()


def _small_cnn():
    """conv (3 -> 4, a 3x5 kernel, stride (2, 1), padding (1, 2)) -> relu ->
    padded 2x3 max pool -> conv 1x3 -> padded avg pool -> linear -> softmax
    cross-entropy, on 3 x 9 x 8 images."""
    x = sbp.images("x", n, 3, 9, 8)
    t = sp.MatrixSymbol("t", n, 3)
    w1, b1 = sbp.conv_weight("w1", 4, 3, 3, 5), sp.MatrixSymbol("b1", 1, 4)
    w2 = sbp.conv_weight("w2", 2, 4, 1, 3)
    h = nn.conv2d(x, w1, b1, stride=(2, 1), padding=(1, 2), kernel_size=(3, 5)).map(nn.relu)  # 4 x 5 x 8
    h = nn.max_pool2d(h, (2, 3), padding=(1, 1))  # 4 x 3 x 3
    h = nn.avg_pool2d(nn.conv2d(h, w2, kernel_size=(1, 3), padding=(0, 1)).map(nn.tanh), 2, 1, 1)  # 2 x 4 x 4
    v, c = sp.MatrixSymbol("v", 2 * 4 * 4, 3), sp.MatrixSymbol("c", 1, 3)
    loss = nn.softmax_cross_entropy(nn.linear(nn.flatten(h), v, c), t)
    return sbp.Model("small_rect_cnn", inputs=[x.matrix, t], params=[w1, b1, w2, v, c], loss=loss)


def test_small_cnn_with_a_rectangular_conv_trains_one_step_beside_pytorch():
    rng = np.random.default_rng(7)
    batch = 5
    params = {"w1": rng.standard_normal((4, 45)) / 4, "b1": rng.standard_normal((1, 4)) / 4,
              "w2": rng.standard_normal((2, 12)) / 3, "v": rng.standard_normal((32, 3)) / 5, "c": np.zeros((1, 3))}
    x, t = rng.standard_normal((batch, 3 * 9 * 8)), np.eye(3)[rng.integers(0, 3, batch)]
    before = {name: a.copy() for name, a in params.items()}
    torch_params = {name: torch.tensor(a, requires_grad=True) for name, a in params.items()}
    mod = sbp.compile(_small_cnn(), optimizer=sbp.SGD(lr=0.5))
    loss = mod.train_step(x=x, t=t, **params)  # updates params in place

    p = torch_params
    h = torch.relu(F.conv2d(torch.tensor(x).reshape(batch, 3, 9, 8), p["w1"].reshape(4, 3, 3, 5), p["b1"][0],
                            stride=(2, 1), padding=(1, 2)))
    h = F.max_pool2d(h, (2, 3), padding=(1, 1))
    h = F.avg_pool2d(torch.tanh(F.conv2d(h, p["w2"].reshape(2, 4, 1, 3), padding=(0, 1))), 2, 1, 1)
    want = F.cross_entropy(h.flatten(1) @ p["v"] + p["c"], torch.tensor(t))
    optimizer = torch.optim.SGD(list(p.values()), lr=0.5)
    want.backward()
    optimizer.step()
    assert abs(loss - want.item()) <= REL * abs(want.item())
    for name, a in params.items():
        assert _relative(a, p[name]) <= REL, f"{name} after one step"
        assert np.abs(a - before[name]).max() > 1e-6, f"{name} moved"
