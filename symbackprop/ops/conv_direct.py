"""The direct convolution (templates/kernel_conv_direct.c.j2): a forward
convolution of dilation 1 without a window matrix.

Each example's image is copied once into a zero-padded workspace (not at
all when there is no padding), and each tile of OCB output channels x R
output rows x NV*V output columns is summed in OCB*R*NV vectors of V
lanes (GCC's vector extension) over the window and the input channels:
one load of V input pixels serves OCB output channels, one weight serves
R*NV vectors. im2col copies every pixel KH*KW times and hands the BLAS a
thin product (16 x 144 by 144 x 1024 for a 16-channel 3x3 layer on 32x32),
which reaches half its peak.

A stride S splits each padded image into S x S phase planes (plane (py, px)
holds the pixels at rows py, py + S, ... and columns px, px + S, ...), so
that kernel tap (ky, kx) reads plane (ky % S, kx % S) at row oy + ky / S
and column ox + kx / S: whole vectors of consecutive pixels again, where the
window matrix copies every pixel KH*KW / S^2 times (2.25 for 3x3, stride 2).
The input gradient of a strided convolution splits the other way: each of
the image's S x S phases is a stride-1 convolution of the output gradient
with its taps of the kernel (2 x 2, 2 x 1, 1 x 2 and 1 x 1 of a 3 x 3 at
stride 2), whose sums land on every S-th pixel.

`plan` is the rule: which convolutions take this kernel (measured in the
commit that added it), and its tile.
"""

from __future__ import annotations

from dataclasses import dataclass

from symbackprop.emit.emitted import VECTOR_BYTES
from symbackprop.ops.conv_numpy import Conv

MAX_ACCUMULATORS = 16  # of the 32 vector registers: the rest hold the loaded pixels and the weights
MAX_IN_CHANNELS = 256  # measured to 256 (faster than the window matrix there); past it, untried
# the input gradient's image width from which the direct kernel wins: measured 1.4-2.5x at 16 and 32
# columns, 1.1-2.2x at 8 (16 to 256 channels, both dtypes; once its workspace held the flipped
# weights: conv.workspace), 0.85x at 4 (cnn_digits)
MIN_INPUT_GRAD_WIDTH = 8
WEIGHT_GRAD = True  # False: the weight gradient through the window matrix (to measure one against the other)
# The weight gradient's tile: 8 output channels x 3 kernel columns of vectors of 32 bytes (512-bit ones
# measured 1.5-2.5x slower: two of the three shifted loads split cache lines), summed over up to 8
# examples (a batch block's) before each reduction. Where it wins (commit body; 3x3 kernels, 16 to 64
# in-channels measured): where im2col's product per example is thin, 16 output channels or fewer
# (1.4-2.4x at ResNet's 16->16 32x32), or short, 64 pixels or fewer in float32 (1.2-1.3x at 64->64
# 8x8; level in float64); level with it at 32->32 16x16, where it stays.
WGRAD_OCB = 8
WGRAD_VECTOR_BYTES = 32
WGRAD_EXAMPLES = 8
WGRAD_THIN = 16
WGRAD_SHORT = {"float32": 64, "float64": 0}
WGRAD_IN_CHANNELS = (16, 64)
# A strided convolution's input gradient by phases (strided_input_grad_fields): in float32, 1.2-1.6x
# im2col at 16 to 32 columns a phase (ResNet's 16 -> 32 and 32 -> 64 layers: 1.57x, 1.19x), level at
# 64 -> 128 on 16 x 16; in float64 0.90-1.19x (0.90x at 16 -> 32 on 64 x 64), so float32 only.
STRIDED_INPUT_GRAD = ("float32",)  # (): through im2col in both (to measure one against the other)
MAX_STRIDE = 2  # measured at 2 (ResNet's downsampling 3x3 layers); past it, untried
ENABLED = True  # False: every convolution through the window matrix (to measure one against the other)


@dataclass(frozen=True)
class DirectPlan:
    """A direct convolution's tile and workspace: V lanes per vector of
    `nbytes` bytes; OCB output channels x R rows x NV vectors per tile; the
    padded image's SH x SW phase planes of HP x WP each (the stride's; one
    plane, the padded image, at stride 1), copied into the workspace when
    `padded` (a padding or a stride), read in place otherwise."""

    V: int
    nbytes: int
    OCB: int
    R: int
    NV: int
    HP: int
    WP: int
    padded: bool
    SH: int = 1
    SW: int = 1


def _divisors(n: int, choices: tuple[int, ...]) -> list[int]:
    return [d for d in choices if n % d == 0]


def plan(c: Conv, real: str, operands_in_buffers: bool) -> DirectPlan | None:
    """The direct kernel's plan for convolution `c` in `real` ("float32" /
    "float64"), or None: the window matrix and the BLAS instead."""
    if not operands_in_buffers or (c.DH, c.DW) != (1, 1) or c.SH > MAX_STRIDE or c.SW > MAX_STRIDE:
        return None
    if not ENABLED or c.C > MAX_IN_CHANNELS or c.F % 4:
        return None
    size = 4 if real == "float32" else 8
    lanes = [v for v in (VECTOR_BYTES // size, VECTOR_BYTES // size // 2) if c.WO % v == 0]
    if not lanes:
        return None
    v = lanes[0]
    best: tuple[float, int, int, int] | None = None
    for nv in _divisors(c.WO // v, (4, 3, 2, 1)):
        for ocb in _divisors(c.F, (16, 8, 4)):
            for r in _divisors(c.HO, (4, 2, 1)):
                if ocb * r * nv > MAX_ACCUMULATORS:
                    continue
                # loads per multiply-add: a pixel vector serves ocb channels, a weight r*nv vectors
                cost = 1 / ocb + 1 / (r * nv)
                if best is None or cost < best[0]:
                    best = (cost, ocb, r, nv)
    if best is None:
        return None
    _, ocb, r, nv = best
    padded = bool(c.PH or c.PW) or (c.SH, c.SW) != (1, 1)
    hp, wp = -(-(c.H + 2 * c.PH) // c.SH), -(-(c.W + 2 * c.PW) // c.SW)
    return DirectPlan(v, v * size, ocb, r, nv, hp, wp, padded, c.SH, c.SW)


def transposed(c: Conv) -> Conv | None:
    """The input gradient of a stride-1 convolution as a forward one: the
    output gradient (F channels of HO x WO) convolved with the weights
    flipped and transposed (C x F x KH x KW), padded by K-1-P; None where
    that is not a convolution (a stride or dilation, a padding over K-1)."""
    if (c.SH, c.SW, c.DH, c.DW) != (1, 1, 1, 1) or c.PH > c.KH - 1 or c.PW > c.KW - 1:
        return None
    return Conv(c.F, c.HO, c.WO, c.C, c.KH, c.KW, 1, 1, c.KH - 1 - c.PH, c.KW - 1 - c.PW, 1, 1)


def template_fields(c: Conv, scatter: bool, batch_sum: bool, real: str, buffers: bool, room: int) -> dict | None:
    """kernel_conv_direct.c.j2's `d` for an image op of geometry `c` (the
    forward, or with `scatter` its input gradient), or None: im2col. The
    workspace a batch block has (`room` entries) must hold the padded
    image and, for the input gradient, the flipped weights."""
    if batch_sum:
        return None
    run = transposed(c) if scatter else c
    if run is None or (scatter and run.WO < MIN_INPUT_GRAD_WIDTH):
        return None
    p = plan(run, real, buffers)
    flip = run.F * run.C * run.KH * run.KW if scatter else 0
    if p is None or (run.C * p.SH * p.SW * p.HP * p.WP if p.padded else 0) + flip > room:
        return None
    planes = [(py, px, *_phase_range(run.H, run.PH, py, p.SH), *_phase_range(run.W, run.PW, px, p.SW))
              for py in range(p.SH) for px in range(p.SW)] if (p.SH, p.SW) != (1, 1) else []
    return {"plan": p, "g": run, "HO": run.HO, "WO": run.WO, "flip": scatter, "pad_at": flip, "planes": planes}


def weight_grad_fields(c: Conv, real: str, buffers: bool) -> dict | None:
    """kernel_conv_direct_wgrad.c.j2's `d` for the weight gradient of `c`,
    or None: im2col. Each of OCB output channels x KW kernel columns keeps
    a vector of sums over the pixels of EB examples, for one input channel
    and kernel row at a time (the window matrix's workspace holds the EB
    padded images, and the block's sum where im2col keeps it)."""
    if not ENABLED or not WEIGHT_GRAD or not buffers or (c.SH, c.SW, c.DH, c.DW) != (1, 1, 1, 1):
        return None
    size = 4 if real == "float32" else 8
    v = WGRAD_VECTOR_BYTES // size
    low, high = WGRAD_IN_CHANNELS
    if not low <= c.C <= high or c.F % WGRAD_OCB or (c.KH, c.KW) != (3, 3) or c.WO % v:
        return None
    if c.F > WGRAD_THIN and WGRAD_SHORT.get(real, 0) < c.HO * c.WO:
        return None
    hp, wp = c.H + 2 * c.PH, c.W + 2 * c.PW
    padded = bool(c.PH or c.PW)
    # the padded images go where im2col keeps one example's windows
    eb = min(WGRAD_EXAMPLES, c.KH * c.KW * c.HO * c.WO // (hp * wp)) if padded else WGRAD_EXAMPLES
    if eb < 1:
        return None
    return {"V": v, "nbytes": WGRAD_VECTOR_BYTES, "OCB": WGRAD_OCB, "HP": hp, "WP": wp, "padded": padded, "EB": eb}


@dataclass(frozen=True)
class Phase:
    """One phase (py, px) of a strided convolution's input gradient: the
    padded image's pixels (S*qy + py, S*qx + px) for qy in qy0 .. qy0+NY-1,
    qx in qx0 .. qx0+NX-1 (the image's own, none of the padding), summed by
    a stride-1 convolution of the padded output gradient with the taps
    (py + S*a, px + S*b), a < A, b < B, flipped (at flip_at in the flipped
    weights); its rows start dy rows, its columns dx columns, into the
    padded gradient past qy, qx."""

    py: int
    px: int
    A: int
    B: int
    qy0: int
    NY: int
    qx0: int
    NX: int
    dy: int
    dx: int
    flip_at: int
    plan: DirectPlan


def _phase_range(size: int, pad: int, p: int, s: int) -> tuple[int, int]:
    """(first, count) of the q with s*q + p - pad inside 0 .. size-1."""
    first = max(0, -(-(pad - p) // s))
    return first, (size - 1 + pad - p) // s - first + 1


def strided_input_grad_fields(c: Conv, real: str, buffers: bool) -> dict | None:
    """kernel_conv_direct_sgrad.c.j2's `d` for the input gradient of a
    strided convolution `c`, or None: im2col. Each of the S x S phases of
    the image is a stride-1 convolution of the output gradient (padded by
    TY, TX on top and left, to HG x WG) with its taps of the kernel; each
    phase's result lands on every S-th pixel of the image, so the phases
    write every pixel once. Every phase must have whole vectors of columns
    (`plan`) and at least one tap in each direction (S <= K)."""
    if not ENABLED or real not in STRIDED_INPUT_GRAD or not buffers or (c.DH, c.DW) != (1, 1) or (c.SH, c.SW) == (1, 1):
        return None
    if max(c.SH, c.SW) > MAX_STRIDE or c.SH > c.KH or c.SW > c.KW:
        return None
    ty, tx = -(-c.KH // c.SH) - 1, -(-c.KW // c.SW) - 1
    hg, wg = ty + c.HO, tx + c.WO
    phases, flip_at = [], 0
    for py in range(c.SH):
        for px in range(c.SW):
            a, b = -(-(c.KH - py) // c.SH), -(-(c.KW - px) // c.SW)
            (qy0, ny), (qx0, nx) = _phase_range(c.H, c.PH, py, c.SH), _phase_range(c.W, c.PW, px, c.SW)
            if ny < 1 or nx < MIN_INPUT_GRAD_WIDTH:
                return None
            p = plan(Conv(c.F, ny + a - 1, nx + b - 1, c.C, a, b, 1, 1, 0, 0, 1, 1), real, True)
            if p is None:
                return None
            dy, dx = ty - (a - 1), tx - (b - 1)
            hg, wg = max(hg, qy0 + ny + dy + a - 1), max(wg, qx0 + nx + dx + b - 1)
            phases.append(Phase(py, px, a, b, qy0, ny, qx0, nx, dy, dx, flip_at, p))
            flip_at += c.C * c.F * a * b
    return {"phases": phases, "TY": ty, "TX": tx, "HG": hg, "WG": wg, "pad_at": flip_at,
            "room": flip_at + c.F * hg * wg}
