"""The geometry of the image ops of symbackprop.ops.conv and their numpy
references (the interpreter's evaluators: the C-free test layer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from symbackprop.declare import conv as declared
from symbackprop.ir.node import Node

# --- geometry -----------------------------------------------------------------


@dataclass(frozen=True)
class Conv:
    """A convolution's geometry: C in-channels of H x W, F out-channels, a
    KH x KW window of entries DH, DW apart, moved by SH, SW, over the image
    padded by PH, PW zeros."""

    C: int
    H: int
    W: int
    F: int  # the out-channels (filters)
    KH: int
    KW: int
    SH: int
    SW: int
    PH: int
    PW: int
    DH: int
    DW: int

    @property
    def HO(self) -> int:
        return declared.out_size(self.H, self.KH, self.SH, self.PH, self.DH)

    @property
    def WO(self) -> int:
        return declared.out_size(self.W, self.KW, self.SW, self.PW, self.DW)


@dataclass(frozen=True)
class Pool:
    """A pool's geometry: C channels of H x W, a KH x KW window moved by SH,
    SW over the image padded by PH, PW (-inf for a max, zeros for a mean)."""

    C: int
    H: int
    W: int
    KH: int
    KW: int
    SH: int
    SW: int
    PH: int
    PW: int

    @property
    def HO(self) -> int:
        return declared.out_size(self.H, self.KH, self.SH, self.PH)

    @property
    def WO(self) -> int:
        return declared.out_size(self.W, self.KW, self.SW, self.PW)

    @property
    def padded(self) -> bool:
        return bool(self.PH or self.PW)


# --- numpy references ---------------------------------------------------------------


def _images(a: np.ndarray, rows: int, channels: int, height: int, width: int) -> np.ndarray:
    return np.broadcast_to(a, (rows, channels * height * width)).reshape(rows, channels, height, width)


def _windows(kernel: tuple[int, int], stride: tuple[int, int], out: tuple[int, int], dilation: tuple[int, int] = (1, 1)):
    """(ky, kx, the slice of a padded n x C x H x W array that window entry
    (ky, kx) reads for every output pixel)."""
    (kh, kw), (sh, sw), (ho, wo), (dh, dw) = kernel, stride, out, dilation
    for ky in range(kh):
        for kx in range(kw):
            yield ky, kx, (slice(None), slice(None), slice(ky * dh, ky * dh + sh * (ho - 1) + 1, sh),
                           slice(kx * dw, kx * dw + sw * (wo - 1) + 1, sw))


def _conv_windows(c: Conv):
    return _windows((c.KH, c.KW), (c.SH, c.SW), (c.HO, c.WO), (c.DH, c.DW))


def _pool_windows(p: Pool):
    return _windows((p.KH, p.KW), (p.SH, p.SW), (p.HO, p.WO))


def _padded(x4: np.ndarray, ph: int, pw: int, value: float = 0.0) -> np.ndarray:
    return np.pad(x4, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _cropped(x4: np.ndarray, ph: int, pw: int) -> np.ndarray:
    return x4[:, :, ph:x4.shape[2] - ph, pw:x4.shape[3] - pw]


def eval_conv(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    c = Conv(*node.attrs)
    n = context.shape(node)[0]
    x = _padded(_images(args[0], n, c.C, c.H, c.W), c.PH, c.PW)
    w = np.broadcast_to(args[1], (c.F, c.C * c.KH * c.KW)).reshape(c.F, c.C, c.KH, c.KW)
    y = np.zeros((n, c.F, c.HO, c.WO))
    for ky, kx, at in _conv_windows(c):
        y += np.einsum("nchw,oc->nohw", x[at], w[:, :, ky, kx])
    return y.reshape(n, -1)


def eval_input_grad(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    c = Conv(*node.attrs)
    n = context.shape(node)[0]
    g = _images(args[0], n, c.F, c.HO, c.WO)
    w = np.broadcast_to(args[1], (c.F, c.C * c.KH * c.KW)).reshape(c.F, c.C, c.KH, c.KW)
    dx = np.zeros((n, c.C, c.H + 2 * c.PH, c.W + 2 * c.PW))
    for ky, kx, at in _conv_windows(c):
        dx[at] += np.einsum("nohw,oc->nchw", g, w[:, :, ky, kx])
    return _cropped(dx, c.PH, c.PW).reshape(n, -1)


def eval_weight_grad(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    c = Conv(*node.attrs)
    n = context.shape(node.args[0])[0]
    g = _images(args[0], n, c.F, c.HO, c.WO)
    x = _padded(_images(args[1], n, c.C, c.H, c.W), c.PH, c.PW)
    dw = np.zeros((c.F, c.C, c.KH, c.KW))
    for ky, kx, at in _conv_windows(c):
        dw[:, :, ky, kx] = np.einsum("nohw,nchw->oc", g, x[at])
    return dw.reshape(c.F, -1)


def _argmax(x4: np.ndarray, p: Pool) -> np.ndarray:
    """Each window's first largest entry (-inf padding), as its (ky*kw + kx): n x C x Ho x Wo."""
    x4 = _padded(x4, p.PH, p.PW, -np.inf)
    return np.argmax(np.stack([x4[at] for _, _, at in _pool_windows(p)]), axis=0)


def eval_max(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    p = Pool(*node.attrs)
    n = context.shape(node)[0]
    x, t = (_images(a, n, p.C, p.H, p.W) for a in args)
    chosen = _argmax(x, p)
    t = _padded(t, p.PH, p.PW)
    y = np.zeros((n, p.C, p.HO, p.WO))
    for ky, kx, at in _pool_windows(p):
        y = np.where(chosen == ky * p.KW + kx, t[at], y)
    return y.reshape(n, -1)


def eval_unpool(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    p = Pool(*node.attrs)
    n = context.shape(node)[0]
    x = _images(args[0], n, p.C, p.H, p.W)
    g = _images(args[1], n, p.C, p.HO, p.WO)
    chosen = _argmax(x, p)
    dx = np.zeros((n, p.C, p.H + 2 * p.PH, p.W + 2 * p.PW))
    for ky, kx, at in _pool_windows(p):
        dx[at] += np.where(chosen == ky * p.KW + kx, g, 0.0)
    return _cropped(dx, p.PH, p.PW).reshape(n, -1)


def eval_avg(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    p = Pool(*node.attrs)
    n = context.shape(node)[0]
    x = _padded(_images(args[0], n, p.C, p.H, p.W), p.PH, p.PW)
    return (sum(x[at] for _, _, at in _pool_windows(p)) / (p.KH * p.KW)).reshape(n, -1)


def eval_avg_unpool(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    p = Pool(*node.attrs)
    n = context.shape(node)[0]
    g = _images(args[0], n, p.C, p.HO, p.WO) / (p.KH * p.KW)
    dx = np.zeros((n, p.C, p.H + 2 * p.PH, p.W + 2 * p.PW))
    for _, _, at in _pool_windows(p):
        dx[at] += g
    return _cropped(dx, p.PH, p.PW).reshape(n, -1)


def eval_channel_sum(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    channels, pixels = node.attrs
    rows = context.shape(node)[0]
    return np.broadcast_to(args[0], (rows, channels * pixels)).reshape(rows, channels, pixels).sum(axis=2)


def eval_channel_broadcast(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    channels, pixels = node.attrs
    rows = context.shape(node)[0]
    return np.repeat(np.broadcast_to(args[0], (rows, channels)), pixels, axis=1)
