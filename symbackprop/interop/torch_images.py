"""What from_torch translates on images and ids: Conv2d, the pools,
BatchNorm2d and BatchNorm1d (by the batch's statistics in training mode,
with the running ones' update as outputs: running_updates), the mean over
height and width, Embedding; the converters of the tables of symbackprop.interop.torch_ops
(which see), each computing what torch computes or raising ModelError
naming what it cannot translate.

Images are an `Images`: the n x C*H*W matrix of NCHW rows (torch's memory
order) and C, H, W; a convolution's weight a `Kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy as sp

from symbackprop.declare import nn
from symbackprop.declare.conv import (
    Images,
    channel_broadcast,
    channel_sum,
    inverse_deviation,
    pair,
    pool_geometry,
)
from symbackprop.declare.tensor import gather
from symbackprop.errors import ModelError
from symbackprop.interop.torch_values import Kernel, as_matrix, expand, is_number, shape_of, torch_module

# --- images -----------------------------------------------------------------------


def _images(x: Any, what: str) -> Images:
    if not isinstance(x, Images):
        raise ModelError(f"{what} takes images (batch, C, H, W); its input is {shape_of(x, what) if not is_number(x) else x!r} "
                         "(from_torch reads an example input of 4 dimensions as images)")
    return x


def _rows(row: sp.MatrixExpr, x: Images) -> sp.MatrixExpr:
    """A 1 x C per-channel row as n x C*H*W: over each channel's pixels, then over the batch."""
    return nn.ones(x.matrix.shape[0], 1) * channel_broadcast(row, x.channels, x.pixels)


def _pair(value: Any, what: str) -> tuple[int, int]:
    """An int or an (h, w) pair of torch's arguments, as (h, w)."""
    return pair(what, value, 0)


def conv2d(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
           groups: int = 1) -> Images:
    """F.conv2d: zero padding, kh x kw windows, a stride, padding and dilation per axis (groups=1)."""
    x = _images(input, "conv2d")
    if not isinstance(weight, Kernel):
        raise ModelError(f"conv2d's weight must be a 4-D parameter (C_out, C_in, kh, kw); got {weight!r}")
    if groups != 1:
        raise ModelError(f"Conv2d with groups={groups}: grouped (and depthwise) convolutions are not translated; "
                         "use groups=1 (a Conv2d whose weight is zero between the groups' channels computes the same)")
    _, per, kh, kw = weight.shape
    if per != x.channels:
        raise ModelError(f"Conv2d takes {per} channels; its input has {x.channels}")
    dh, dw = pair("Conv2d's dilation", dilation)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        if (dh * (kh - 1)) % 2 or (dw * (kw - 1)) % 2:
            raise ModelError(f"Conv2d with padding='same', a {kh}x{kw} kernel and dilation ({dh}, {dw}): torch "
                             "pads unevenly there, which is not translated")
        padding = (dh * (kh - 1) // 2, dw * (kw - 1) // 2)
    y = nn.conv2d(x, weight.matrix, None, stride, padding, (kh, kw), (dh, dw))
    if bias is not None:
        y = y.map(lambda m: m + _rows(as_matrix(bias, "conv2d's bias"), y))
    return y


def _pool_args(x: Images, kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool, what: str) -> tuple:
    """(window, stride, padding) of a pool torch computes as the op does:
    ceil_mode only where it keeps the floor rule's size."""
    if stride is None or (isinstance(stride, (tuple, list)) and not stride):
        stride = kernel_size
    geometry = pool_geometry(what, x, kernel_size, stride, padding)
    _, height, width, kh, kw, sh, sw, ph, pw = geometry
    if ceil_mode:
        for size, k, step, pad in ((height, kh, sh, ph), (width, kw, sw, pw)):
            if (size + 2 * pad - k) % step:  # ceil mode adds a partial window at the end
                raise ModelError(f"{what} with ceil_mode=True over {height}x{width} images with a {kh}x{kw} "
                                 f"window, stride ({sh}, {sw}) and padding ({ph}, {pw}): the last, partial window "
                                 "is not translated; only ceil_mode=False (or sizes where the windows tile exactly)")
    return (kh, kw), (sh, sw), (ph, pw)


def max_pool2d(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False, return_indices: bool = False) -> Images:
    """F.max_pool2d: the largest entry of each window, -inf padding (no dilation nor indices)."""
    x = _images(input, "max_pool2d")
    if return_indices:
        raise ModelError("MaxPool2d with return_indices=True is not translated")
    if _pair(dilation, "max_pool2d's dilation") != (1, 1):
        raise ModelError(f"MaxPool2d with dilation={dilation!r} is not translated; only dilation=1 (a Conv2d "
                         "takes dilation)")
    return nn.max_pool2d(x, *_pool_args(x, kernel_size, stride, padding, ceil_mode, "MaxPool2d"))


def avg_pool2d(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: Any = None) -> Images:
    """F.avg_pool2d: the mean of each window, its padding's zeros counted (count_include_pad=True)."""
    x = _images(input, "avg_pool2d")
    if divisor_override is not None:
        raise ModelError(f"AvgPool2d with divisor_override={divisor_override!r} is not translated")
    k, step, pad = _pool_args(x, kernel_size, stride, padding, ceil_mode, "AvgPool2d")
    if not count_include_pad and pad != (0, 0):
        raise ModelError(f"AvgPool2d with count_include_pad=False and padding={padding!r}: a mean over only the "
                         "entries inside the image is not translated; use count_include_pad=True (the default)")
    return nn.avg_pool2d(x, k, step, pad)


def adaptive_avg_pool2d(input: Any, output_size: Any) -> Images:
    """AdaptiveAvgPool2d where its windows tile the image: an AvgPool2d of
    k = H / out (the same along W); to 1x1, the mean of each channel."""
    x = _images(input, "adaptive_avg_pool2d")
    sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    sizes = tuple(size if size is not None else whole for size, whole in zip(sizes, (x.height, x.width)))
    if sizes == (1, 1):  # global average pooling, of any image
        return mean(x, (2, 3), keepdim=True)
    if (len(sizes) != 2 or any(not isinstance(s, int) or s < 1 for s in sizes)
            or x.height % sizes[0] or x.width % sizes[1] or x.height // sizes[0] != x.width // sizes[1]):
        raise ModelError(f"AdaptiveAvgPool2d to {output_size!r} of {x.height}x{x.width} images: only output sizes "
                         "that divide the image into equal square windows are translated")
    return nn.avg_pool2d(x, x.height // sizes[0])


def _batch_norm2d(x: Images, mean: Any, var: Any, weight: Any, bias: Any, eps: float) -> Images:
    """BatchNorm2d per channel: (x - mean) / sqrt(var + eps) * weight + bias."""
    scale = inverse_deviation(as_matrix(var, "batch_norm"), eps)
    if weight is not None:
        scale = sp.HadamardProduct(as_matrix(weight, "batch_norm"), scale)
    y = sp.HadamardProduct(x.matrix - _rows(as_matrix(mean, "batch_norm"), x), _rows(scale, x))
    if bias is not None:
        y = y + _rows(as_matrix(bias, "batch_norm"), x)
    return Images(y, x.channels, x.height, x.width)


def batch_statistics(m: Any) -> bool:
    """Whether a batch norm normalizes by the batch's statistics, as torch's
    forward does: in training mode, and without running statistics in
    either mode (track_running_stats=False)."""
    return bool(m.training or m.running_mean is None)


def _statistics(m: Any, x: Any, param: Callable[[str], Any]) -> tuple[Any, Any]:
    """The mean and variance a batch norm normalizes by: the batch's (biased,
    nn.batch_stats) or its running ones (frozen inputs of the model)."""
    if m.training and m.running_mean is not None and m.momentum is None:
        raise ModelError(f"{type(m).__name__}(momentum=None) in training mode (a cumulative average of the running "
                         "statistics, by num_batches_tracked) is not translated; give it a momentum")
    if batch_statistics(m):
        return nn.batch_stats(x)
    return param("running_mean"), param("running_var")


def running_updates(m: Any, x: Any, param: Callable[[str], Any]) -> list[tuple[str, sp.MatrixExpr]]:
    """What a batch norm in training mode writes into its running statistics,
    as torch's forward does: (1 - momentum) * running + momentum * the
    batch's, its variance unbiased (times N / (N - 1), N = batch * pixels).
    (The running statistic's name, its new value); none in eval mode or
    without running statistics."""
    if not (m.training and getattr(m, "running_mean", None) is not None):  # (of any layer: a batch norm's only)
        return []
    mean, var = nn.batch_stats(x)
    count = (x.matrix.shape[0] * x.pixels) if isinstance(x, Images) else x.shape[0]
    momentum = sp.Float(m.momentum)
    new_mean = (1 - momentum) * param("running_mean") + momentum * mean
    new_var = (1 - momentum) * param("running_var") + (momentum * count / (count - 1)) * var
    return [(str(param("running_mean")), new_mean), (str(param("running_var")), new_var)]


def batch_norm1d_layer(m: Any, x: Any, param: Callable[[str], Any]) -> sp.MatrixExpr:
    """BatchNorm1d of (batch, features): per feature,
    (x - mean) / sqrt(var + eps) * weight + bias, by the batch's statistics
    in training mode, else by the running ones."""
    x = as_matrix(x, "BatchNorm1d")
    rows, cols = x.shape
    if m.num_features != cols:
        raise ModelError(f"BatchNorm1d of {m.num_features} features; its input has {cols}")
    mean, var = _statistics(m, x, param)
    scale = inverse_deviation(as_matrix(var, "batch_norm"), m.eps)
    weight, bias = param("weight"), param("bias")
    if weight is not None:
        scale = sp.HadamardProduct(weight, scale)
    y = sp.HadamardProduct(x - expand(mean, rows, cols), expand(scale, rows, cols))
    return y + expand(bias, rows, cols) if bias is not None else y


def batch_norm_layer(m: Any, x: Any, param: Callable[[str], Any]) -> Images:
    """BatchNorm2d: by the batch's statistics in training mode, else by the
    running ones (frozen inputs of the model)."""
    images = _images(x, "BatchNorm2d")
    if m.num_features != images.channels:
        raise ModelError(f"BatchNorm2d of {m.num_features} channels; its input has {images.channels}")
    mean, var = _statistics(m, images, param)
    return _batch_norm2d(images, mean, var, param("weight"), param("bias"), m.eps)


def conv_layer(m: Any, x: Any, param: Callable[[str], Any]) -> Images:
    """Conv2d through F.conv2d, zero padding only."""
    if m.padding_mode != "zeros":
        raise ModelError(f"Conv2d with padding_mode={m.padding_mode!r} is not translated; only 'zeros'")
    weight = Kernel(param("weight"), tuple(m.weight.shape))
    return conv2d(x, weight, param("bias"), m.stride, m.padding, m.dilation, m.groups)


def mean(input: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    """The mean of images over their height and width (global average
    pooling written x.mean((2, 3))): (batch, C), or images of 1x1 with keepdim."""
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if not isinstance(input, Images) or sorted(d % 4 if isinstance(d, int) else d for d in dims) != [2, 3]:
        shape = shape_of(input, "mean") if not is_number(input) else input
        raise ModelError(f"mean over {dim!r} of a tensor of shape {shape}: only over the height and width of "
                         "images (x.mean((2, 3))) is translated")
    if dtype is not None and dtype != torch_module().float64:
        raise ModelError(f"mean in {str(dtype).removeprefix('torch.')}: from_torch computes in float64")
    y = channel_sum(input.matrix, input.channels, input.pixels) / input.pixels
    return Images(y, input.channels, 1, 1) if keepdim else y


# --- embeddings -------------------------------------------------------------------


def embedding(input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None, norm_type: float = 2.0,
              scale_grad_by_freq: bool = False, sparse: bool = False) -> sp.MatrixExpr:
    """F.embedding of one id per example: the rows of the table at the ids
    (a gather; its gradient adds into the rows, as torch's, sparse or not)."""
    if not getattr(input, "is_index", False):
        shape = shape_of(input, "Embedding") if not is_number(input) else input
        raise ModelError(f"Embedding of {shape}: from_torch translates an Embedding of one id per example (an "
                         "example input of (batch,) integers, the model's Index X); for sequences of ids declare "
                         "the model with symbackprop's nn.embedding (sbp.Index of token ids)")
    if padding_idx is not None:
        raise ModelError(f"Embedding with padding_idx={padding_idx}: torch leaves that row's gradient zero, which "
                         "is not translated")
    if max_norm is not None:
        raise ModelError(f"Embedding with max_norm={max_norm}: torch renormalizes the table in place, which is "
                         "not translated")
    if scale_grad_by_freq:
        raise ModelError("Embedding with scale_grad_by_freq=True is not translated")
    return gather(as_matrix(weight, "embedding"), input)


__all__ = ["adaptive_avg_pool2d", "avg_pool2d", "batch_norm1d_layer", "batch_norm_layer", "batch_statistics", "conv2d",
           "conv_layer", "embedding", "max_pool2d", "mean", "running_updates"]
