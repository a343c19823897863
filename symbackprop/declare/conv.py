"""Convolutional layers over batches of images (docs/conv.md).

A batch of images is a matrix: one row per example, its C*H*W entries in
NCHW order (channel, then row, then column: PyTorch's layout, so a torch
tensor's memory is the matrix's). The IR stays 2-D; what a matrix alone
does not say, the image shape (C, H, W), an `Images` value carries beside
it. The batch size n is a symbol bound at call time; C, H and W are fixed
integers, so every loop bound but the batch's is a number in the C.

The layers return `Images` (conv2d, pools, batch_norm) or the plain matrix
(flatten). Their SymPy classes below are matrix expressions whose
arguments are the operand matrices followed by the integers of their
geometry; symbackprop.ops.conv lowers them to the IR ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import sympy as sp

from symbackprop.declare.standing import Standing
from symbackprop.errors import ModelError


def out_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    """The output length of a window of `kernel` entries `dilation` apart
    sliding by `stride` over `size` entries padded by `padding` on both
    sides (PyTorch's floor rule)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _conv_cols(channels: int, height: int, width: int, out: int, kh: int, kw: int, sh: int, sw: int, ph: int,
               pw: int, dh: int, dw: int) -> int:
    return out * out_size(height, kh, sh, ph, dh) * out_size(width, kw, sw, pw, dw)


def _pool_cols(channels: int, height: int, width: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int) -> int:
    return channels * out_size(height, kh, sh, ph) * out_size(width, kw, sw, pw)


# Each image op's result columns from its geometry (the one place this is
# written; the IR ops read it too): a convolution's (C, H, W, F, kh, kw,
# sh, sw, ph, pw, dh, dw: strides, paddings and dilations per axis), a
# pool's (C, H, W, kh, kw, sh, sw, ph, pw), a channel op's (C, P).
_OUT_COLS: dict[str, Callable[..., int]] = {
    "conv2d": _conv_cols,
    "max_pool2d": _pool_cols,
    "avg_pool2d": _pool_cols,
    "channel_sum": lambda channels, pixels: channels,
    "channel_broadcast": lambda channels, pixels: channels * pixels,
}


def out_cols(op: str, geometry: tuple[int, ...]) -> int:
    """The columns of an image op's result from its geometry (_OUT_COLS)."""
    rule = _OUT_COLS.get(op)
    if rule is None:
        raise ModelError(f"unknown image op {op!r}")
    return rule(*geometry)


class ImageOp(Standing, sp.MatrixExpr):
    """An image op: `op` of `arity` operand matrices, with integer geometry.
    The result has the first operand's rows (the batch)."""

    op: ClassVar[str]
    arity: ClassVar[int]

    def __new__(cls, *args: sp.Basic) -> ImageOp:
        """ImageOp(*operands, *geometry): flat, as SymPy rebuilds an expression (func(*args))."""
        operands = args[: cls.arity]
        for operand in operands:
            if not isinstance(operand, (sp.MatrixExpr, sp.MatrixBase)):
                raise ModelError(f"{cls.op} of matrices; got {operand!r}")
        return super().__new__(cls, *(sp.sympify(o) for o in operands), *(sp.Integer(g) for g in args[cls.arity:]))

    @property
    def operands(self) -> tuple:
        return self.args[: self.arity]

    @property
    def geometry(self) -> tuple[int, ...]:
        return tuple(int(g) for g in self.args[self.arity:])

    @property
    def shape(self) -> tuple:
        return (self.operands[0].shape[0], out_cols(self.op, self.geometry))

    def _entry(self, i, j, **kwargs):
        return sp.matrices.expressions.matexpr.MatrixElement(self, i, j)


class Conv2d(ImageOp):
    """conv2d(x, w): geometry (C_in, H, W, C_out, kh, kw, sh, sw, ph, pw, dh, dw)."""

    op, arity = "conv2d", 2


class MaxPool2d(ImageOp):
    """The maximum of each kh x kw window (-inf outside the image): geometry (C, H, W, kh, kw, sh, sw, ph, pw)."""

    op, arity = "max_pool2d", 1


class AvgPool2d(ImageOp):
    """The sum of each kh x kw window (zero outside the image) over kh*kw: geometry (C, H, W, kh, kw, sh, sw, ph, pw)."""

    op, arity = "avg_pool2d", 1


class ChannelSum(ImageOp):
    """Each row's sum over each channel's pixels: (r x C*P) -> (r x C); geometry (C, P)."""

    op, arity = "channel_sum", 1


class ChannelBroadcast(ImageOp):
    """Each entry repeated over its channel's pixels: (r x C) -> (r x C*P); geometry (C, P)."""

    op, arity = "channel_broadcast", 1


@dataclass(frozen=True)
class Images:
    """A batch of images: `matrix` is n x (channels*height*width), one row
    per example in NCHW order.

    Args:
        matrix: the n x (channels*height*width) matrix expression.
        channels: C, a positive int.
        height: H, a positive int.
        width: W, a positive int.
    """

    matrix: sp.MatrixExpr
    channels: int
    height: int
    width: int

    def __post_init__(self) -> None:
        for what in ("channels", "height", "width"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"an image's {what} must be a positive int; got {value!r}")
        cols = self.matrix.shape[1]
        if cols != self.channels * self.height * self.width:
            raise ModelError(f"{self.matrix} has {cols} columns, not channels*height*width = "
                             f"{self.channels}*{self.height}*{self.width}")

    @property
    def pixels(self) -> int:
        """H*W: the entries of one channel of one image."""
        return self.height * self.width

    def map(self, fn: Callable[[sp.MatrixExpr], sp.MatrixExpr]) -> Images:
        """fn applied to the matrix, same shape.

        Args:
            fn: an elementwise function of a matrix (nn.relu).
        """
        return Images(fn(self.matrix), self.channels, self.height, self.width)


def images(name: str, n: sp.Expr | int, channels: int, height: int, width: int) -> Images:
    """A batch input of n images: the n x (C*H*W) MatrixSymbol `name` and
    its image shape (Model's inputs take it, or its `.matrix`).

    Args:
        name: the input's name.
        n: the batch size: a positive integer Symbol bound at call time, or an int.
        channels: C.
        height: H.
        width: W.
    """
    return Images(sp.MatrixSymbol(name, n, channels * height * width), channels, height, width)


def conv_weight(name: str, out_channels: int, in_channels: int, kh: int, kw: int | None = None) -> sp.MatrixSymbol:
    """The weights of a convolution as PyTorch stores them, (C_out, C_in, kh, kw),
    as the C_out x (C_in*kh*kw) matrix of the same memory
    (`torch_weight.reshape(C_out, -1)`).

    Args:
        name: the parameter's name.
        out_channels: C_out.
        in_channels: C_in.
        kh: the window's height.
        kw: its width (default kh: a square window).
    """
    return sp.MatrixSymbol(name, out_channels, in_channels * kh * (kh if kw is None else kw))


def _checked(x: Images, what: str) -> Images:
    if not isinstance(x, Images):
        raise ModelError(f"{what} takes Images (sbp.images(...) or a layer's result); got {type(x).__name__}")
    return x


def whole_number(what: str, value: int, least: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ModelError(f"{what} must be an int >= {least}; got {value!r}")
    return value


def channel_broadcast(values: sp.MatrixExpr, channels: int, pixels: int) -> sp.MatrixExpr:
    """(r x C) -> (r x C*P): each entry repeated over its channel's P pixels."""
    return ChannelBroadcast(values, channels, pixels)


def channel_sum(x: sp.MatrixExpr, channels: int, pixels: int) -> sp.MatrixExpr:
    """(r x C*P) -> (r x C): each row's sum over each channel's P pixels."""
    return ChannelSum(x, channels, pixels)


def _per_channel(x: Images, row: sp.MatrixExpr) -> sp.MatrixExpr:
    """A 1 x C row of per-channel values, as a 1 x C*H*W row (added to a batch, it broadcasts)."""
    if row.shape != (1, x.channels):
        raise ModelError(f"a per-channel row must be 1 x {x.channels}; {row} is {row.shape[0]} x {row.shape[1]}")
    return channel_broadcast(row, x.channels, x.pixels)


def _rows(m: sp.MatrixExpr, rows: sp.Expr | int) -> sp.MatrixExpr:
    """A 1 x c row repeated over `rows` rows (SymPy's broadcast: ones * row)."""
    return sp.OneMatrix(rows, 1) * m


Pair = int | tuple[int, int]


def pair(what: str, value: Pair, least: int = 1) -> tuple[int, int]:
    """An int (the same along both axes) or an (h, w) pair, each entry an int >= least, as (h, w)."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2:
        raise ModelError(f"{what} must be an int or an (h, w) pair; got {value!r}, of {len(items)} entries")
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool) or item < least:
            raise ModelError(f"{what} must be an int >= {least} or a pair of them; got {value!r}")
    return items[0], items[1]


def _kernel_size(x: Images, w: sp.MatrixExpr, kernel_size: Pair | None) -> tuple[int, int, int]:
    """(C_out, kh, kw) of convolution weights w, C_out x (C_in*kh*kw); a square kernel unless kernel_size says."""
    out_channels, per = w.shape
    if not isinstance(out_channels, (int, sp.Integer)) or not isinstance(per, (int, sp.Integer)) or per % x.channels:
        raise ModelError(f"conv2d's weights {w} must be C_out x (C_in*kh*kw) with C_in = {x.channels}; "
                         f"they are {out_channels} x {per}")
    area = int(per) // x.channels
    if kernel_size is None:
        k = math.isqrt(area)
        if k * k != area:
            raise ModelError(f"conv2d's weights {w}: {per} columns are C_in*{area} for C_in = {x.channels}, not "
                             f"C_in*k*k; for a kh x kw kernel pass kernel_size=(kh, kw)")
        return int(out_channels), k, k
    kh, kw = pair("conv2d's kernel_size", kernel_size)
    if kh * kw != area:
        raise ModelError(f"conv2d's weights {w} are {out_channels} x {per}, not C_out x (C_in*kh*kw) = "
                         f"{out_channels} x {x.channels * kh * kw} for C_in = {x.channels} and kernel_size "
                         f"({kh}, {kw})")
    return int(out_channels), kh, kw


def conv2d(x: Images, w: sp.MatrixExpr, b: sp.MatrixExpr | None = None, stride: Pair = 1, padding: Pair = 0,
           kernel_size: Pair | None = None, dilation: Pair = 1) -> Images:
    """2-D cross-correlation (PyTorch's Conv2d), zero padding:
    y[i, o, p, q] = b[o] + sum_{c, u, v} w[o, c, u, v] * x[i, c, p*sh + u*dh - ph, q*sw + v*dw - pw].

    Args:
        x: a batch of images (C_in channels).
        w: C_out x (C_in*kh*kw) (conv_weight).
        b: 1 x C_out, or None.
        stride: the window's step: an int (both axes) or (sh, sw).
        padding: zeros added on each side: an int or (ph, pw).
        kernel_size: (kh, kw), or an int; None: the square kernel w's columns
            give (a rectangular one must be named).
        dilation: the spacing of the window's entries: an int or (dh, dw).

    Raises:
        ModelError: shapes that do not fit, a stride, padding or dilation
            that is not an int or a pair of them (ints >= 1; padding >= 0),
            or a window larger than the padded image.
    """
    x = _checked(x, "conv2d")
    sh, sw = pair("conv2d's stride", stride)
    ph, pw = pair("conv2d's padding", padding, 0)
    dh, dw = pair("conv2d's dilation", dilation)
    out_channels, kh, kw = _kernel_size(x, w, kernel_size)
    height, width = out_size(x.height, kh, sh, ph, dh), out_size(x.width, kw, sw, pw, dw)
    if height < 1 or width < 1:
        spread = f" (dilation ({dh}, {dw}): it spans {dh * (kh - 1) + 1}x{dw * (kw - 1) + 1})" if (dh, dw) != (1, 1) else ""
        raise ModelError(f"conv2d's {kh}x{kw} window{spread} is larger than the {x.height}x{x.width} image padded "
                         f"by ({ph}, {pw}): {x.height + 2 * ph}x{x.width + 2 * pw}")
    geometry = (x.channels, x.height, x.width, out_channels, kh, kw, sh, sw, ph, pw, dh, dw)
    y = Conv2d(x.matrix, w, *geometry)
    if b is not None:
        y = y + _rows(_per_channel(Images(y, out_channels, height, width), b), x.matrix.shape[0])
    return Images(y, out_channels, height, width)


def pool_geometry(what: str, x: Images, k: Pair, stride: Pair | None, padding: Pair) -> tuple[int, ...]:
    """A pool's geometry (C, H, W, kh, kw, sh, sw, ph, pw) from PyTorch's
    arguments (stride None: the window), checked as PyTorch checks them."""
    kh, kw = pair(f"{what}'s window", k)
    sh, sw = pair(f"{what}'s stride", (kh, kw) if stride is None else stride)
    ph, pw = pair(f"{what}'s padding", padding, 0)
    if ph > kh // 2 or pw > kw // 2:
        raise ModelError(f"{what}'s padding ({ph}, {pw}) is more than half its {kh}x{kw} window (as PyTorch, "
                         "at most (kh // 2, kw // 2))")
    if out_size(x.height, kh, sh, ph) < 1 or out_size(x.width, kw, sw, pw) < 1:
        raise ModelError(f"{what}'s {kh}x{kw} window is larger than the {x.height}x{x.width} image padded by "
                         f"({ph}, {pw}): {x.height + 2 * ph}x{x.width + 2 * pw}")
    return (x.channels, x.height, x.width, kh, kw, sh, sw, ph, pw)


def _pool(cls: type[ImageOp], x: Images, k: Pair, stride: Pair | None, padding: Pair) -> Images:
    geometry = pool_geometry(cls.op, _checked(x, cls.op), k, stride, padding)
    _, height, width, kh, kw, sh, sw, ph, pw = geometry
    return Images(cls(x.matrix, *geometry), x.channels, out_size(height, kh, sh, ph), out_size(width, kw, sw, pw))


def max_pool2d(x: Images, k: Pair, stride: Pair | None = None, padding: Pair = 0) -> Images:
    """The maximum of each k x k window (PyTorch's MaxPool2d): k, stride
    (default: k) and padding an int or an (h, w) pair. The padding is -inf
    (at most half the window, as PyTorch). Its gradient goes to the window's
    first largest entry (as PyTorch)."""
    return _pool(MaxPool2d, x, k, stride, padding)


def avg_pool2d(x: Images, k: Pair, stride: Pair | None = None, padding: Pair = 0,
               count_include_pad: bool = True) -> Images:
    """The mean of each k x k window (PyTorch's AvgPool2d): k, stride
    (default: k) and padding an int or an (h, w) pair. The padding is zeros
    counted in the mean (PyTorch's default count_include_pad=True: every
    window's sum over kh*kw); count_include_pad=False with padding is a
    ModelError."""
    if not count_include_pad and pair("avg_pool2d's padding", padding, 0) != (0, 0):
        raise ModelError("avg_pool2d with count_include_pad=False and padding: a mean over only the window's "
                         "entries inside the image is not supported; the padding's zeros are counted "
                         "(count_include_pad=True, PyTorch's default)")
    return _pool(AvgPool2d, x, k, stride, padding)


def batch_stats(x: Images | sp.MatrixExpr) -> tuple[sp.MatrixExpr, sp.MatrixExpr]:
    """The batch's per-channel mean and (biased) variance, 1 x C each, over
    the examples and pixels of Images, or over the rows of a plain n x C
    matrix (what batch_norm normalizes with in training; make them outputs
    to update running statistics)."""
    from symbackprop.declare.tensor import reduce

    if not isinstance(x, Images):
        rows = _features(x, "batch_stats")
        mu = reduce("sum", x, 0) / rows
        centred = x - _rows(mu, rows)
        return mu, reduce("sum", sp.hadamard_product(centred, centred), 0) / rows
    n = x.matrix.shape[0]
    count = n * x.pixels

    def mean(m: sp.MatrixExpr) -> sp.MatrixExpr:
        return channel_sum(reduce("sum", m, 0), x.channels, x.pixels) / count

    mu = mean(x.matrix)
    centred = x.matrix - _rows(_per_channel(x, mu), n)
    return mu, mean(sp.hadamard_product(centred, centred))


def _features(x: object, what: str) -> sp.Expr:
    """The rows of a plain n x C matrix given where Images may be (a
    BatchNorm1d's batch of feature rows)."""
    if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
        raise ModelError(f"{what} takes Images (sbp.images(...) or a layer's result) or an n x C matrix; "
                         f"got {type(x).__name__}")
    return x.shape[0]


def inverse_deviation(var: sp.MatrixExpr, eps: float) -> sp.MatrixExpr:
    """1 / sqrt(var + eps), entrywise (one channel's 1 x 1 too: SymPy's
    applyfunc would call the function on the 1 x 1 matrix itself)."""
    if var.shape == (1, 1):
        return sp.ImmutableMatrix([[1 / sp.sqrt(var[0, 0] + eps)]])
    return var.applyfunc(lambda v: 1 / sp.sqrt(v + eps))


def batch_norm(x: Images | sp.MatrixExpr, gamma: sp.MatrixExpr, beta: sp.MatrixExpr, eps: float = 1e-5,
               running: tuple[sp.MatrixExpr, sp.MatrixExpr] | None = None) -> Images | sp.MatrixExpr:
    """Batch normalization: per channel (BatchNorm2d, of Images) or per
    column (BatchNorm1d, of a plain n x C matrix: the result is one too),
    y = gamma * (x - mean) / sqrt(var + eps) + beta.

    Training mode (running=None): mean and var are the batch's (batch_stats),
    and the gradient flows through them. Inference mode: running = (mean, var),
    1 x C inputs (the running statistics).
    """
    if not isinstance(x, Images):
        rows = _features(x, "batch_norm")
        channels = x.shape[1]
        for what, row in (("gamma", gamma), ("beta", beta), *zip(("mean", "var"), running or ())):
            if row.shape != (1, channels):
                raise ModelError(f"batch_norm's {what} must be 1 x {channels}; {row} is {row.shape[0]} x {row.shape[1]}")
        mean, var = batch_stats(x) if running is None else running
        scale = sp.hadamard_product(gamma, inverse_deviation(var, eps))
        return sp.hadamard_product(x - _rows(mean, rows), _rows(scale, rows)) + _rows(beta, rows)
    n = x.matrix.shape[0]
    mean, var = batch_stats(x) if running is None else running
    scale = sp.hadamard_product(gamma, inverse_deviation(var, eps))
    centred = x.matrix - _rows(_per_channel(x, mean), n)
    y = sp.hadamard_product(centred, _rows(_per_channel(x, scale), n)) + _rows(_per_channel(x, beta), n)
    return Images(y, x.channels, x.height, x.width)


def flatten(x: Images) -> sp.MatrixExpr:
    """The batch as its n x (C*H*W) matrix, for the linear layers that follow
    (no copy: it is the matrix, as torch.flatten(x, 1) of NCHW)."""
    return _checked(x, "flatten").matrix
