"""What from_torch translates: torch functions, tensor methods and torch.nn
layers, each as the symbackprop expression that computes the same thing.

A value is a SymPy matrix expression (rows, columns): the batch
(n, features), a parameter (a 1-D one, a bias or a scale, as a row (1, k),
broadcast over the batch as torch broadcasts it), or a Python number; or a
batch of images (n, C, H, W), an `Images` (its n x C*H*W matrix in NCHW
order, torch's memory order, and its C, H, W); or a convolution's 4-D
weight, a `Kernel` (the C_out x C_in*kh*kw matrix of the same memory). A
layer is translated through the function its forward calls (nn.GELU through
F.gelu, nn.Linear through F.linear), so each computation is written once
here, for both a torch.nn.Sequential and a traced custom forward.

A converter takes the torch function's own arguments (positional and
keyword, as torch.fx recorded them) and returns the value; it raises
ModelError naming the function and what it cannot translate.
"""

from __future__ import annotations

import builtins
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import sympy as sp

from symbackprop.declare import nn
from symbackprop.declare.conv import AvgPool2d, Conv2d, Images, MaxPool2d, channel_broadcast, channel_sum, out_size
from symbackprop.declare.tensor import gather, reduce
from symbackprop.errors import ModelError

Converter: TypeAlias = Callable[..., Any]
# (layer, its input, param) -> output; param(key) is the layer's parameter `key` as a symbol (None if unset)
Layer: TypeAlias = Callable[[Any, sp.MatrixExpr, Callable[[str], Any]], sp.MatrixExpr]


def _torch() -> Any:
    import torch

    return torch


# --- values ----------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(v: Any) -> sp.Expr:
    return sp.Integer(v) if isinstance(v, int) else sp.Float(v)  # a float64 constant, as torch's


@dataclass(frozen=True)
class Kernel:
    """A convolution's weight, torch's (C_out, C_in, kh, kw), as the
    C_out x (C_in*kh*kw) matrix of the same memory."""

    matrix: sp.MatrixExpr
    shape: tuple[int, int, int, int]


def _matrix(v: Any, what: str) -> sp.MatrixExpr:
    if isinstance(v, Images):
        raise ModelError(f"{what} of images (batch, {v.channels}, {v.height}, {v.width}) is not translated; "
                         "flatten them first (torch.flatten(x, 1), nn.Flatten())")
    if isinstance(v, Kernel):
        raise ModelError(f"{what} of a convolution's 4-D weight {v.shape} is not translated (only F.conv2d takes it)")
    if getattr(v, "is_index", False):
        raise ModelError(f"{what} of the integer ids {v} is not translated; only an Embedding takes them")
    if not isinstance(v, (sp.MatrixExpr, sp.MatrixBase)):
        raise ModelError(f"{what} takes a tensor; got {v!r}")
    return v


def _expand(x: sp.MatrixExpr, rows: Any, cols: Any) -> sp.MatrixExpr:
    """x broadcast to (rows, cols), as torch broadcasts a row or a column."""
    if x.shape[0] == 1 and rows != 1:
        x = nn.ones(rows, 1) * x
    if x.shape[1] == 1 and cols != 1:
        x = x * nn.ones(1, cols)
    return x


def _broadcast(a: sp.MatrixExpr, b: sp.MatrixExpr, what: str) -> tuple[sp.MatrixExpr, sp.MatrixExpr]:
    rows = b.shape[0] if a.shape[0] == 1 else a.shape[0]
    cols = b.shape[1] if a.shape[1] == 1 else a.shape[1]
    a, b = _expand(a, rows, cols), _expand(b, rows, cols)
    if a.shape != b.shape:
        raise ModelError(f"{what} of shapes {a.shape} and {b.shape}, which do not broadcast")
    return a, b


def _elementwise(x: Any, fn: Callable[[sp.Expr], sp.Expr], what: str) -> Any:
    if _is_number(x):
        return fn(_number(x))
    return _matrix(x, what).applyfunc(fn)


def _on_images(convert: Converter) -> Converter:
    """convert, applied to an Images' matrix where its first argument is
    images (an elementwise function: the image shape stays)."""

    @functools.wraps(convert)
    def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, Images):
            return x.map(lambda m: convert(m, *args, **kwargs))
        return convert(x, *args, **kwargs)

    return wrapped


def _images_binary(a: Any, b: Any, fn: Callable[[Any, Any], Any], what: str) -> Any:
    """fn of two operands one of which is images: the other a number or
    images of the same shape (what torch broadcasts beside is refused)."""
    image = a if isinstance(a, Images) else b
    other = b if image is a else a
    if isinstance(other, Images):
        if (other.channels, other.height, other.width) != (image.channels, image.height, image.width):
            raise ModelError(f"{what} of images of shapes {(image.channels, image.height, image.width)} and "
                             f"{(other.channels, other.height, other.width)}")
        return image.map(lambda m: fn(a.matrix, b.matrix))
    if not _is_number(other):
        raise ModelError(f"{what} of images (batch, {image.channels}, {image.height}, {image.width}) and "
                         f"{other!r}: only a number or images of the same shape are translated")
    return image.map(lambda m: fn(m, b) if image is a else fn(a, m))


# --- arithmetic --------------------------------------------------------------------


def _add(a: Any, b: Any, alpha: Any = 1) -> Any:
    if alpha != 1:
        b = _mul(b, alpha)
    if isinstance(a, Images) or isinstance(b, Images):
        return _images_binary(a, b, _add, "+")
    if _is_number(a) and _is_number(b):
        return a + b
    if _is_number(a) or _is_number(b):
        m, c = (b, a) if _is_number(a) else (a, b)
        m = _matrix(m, "+")
        return m + _number(c) * nn.ones(*m.shape)
    a, b = _broadcast(_matrix(a, "+"), _matrix(b, "+"), "+")
    return a + b


def _neg(a: Any) -> Any:
    if isinstance(a, Images):
        return a.map(lambda m: -m)
    return -a if _is_number(a) else -_matrix(a, "-")


def _sub(a: Any, b: Any, alpha: Any = 1) -> Any:
    return _add(a, _neg(b), alpha)


def _mul(a: Any, b: Any) -> Any:
    if isinstance(a, Images) or isinstance(b, Images):
        return _images_binary(a, b, _mul, "*")
    if _is_number(a) and _is_number(b):
        return a * b
    if _is_number(a) or _is_number(b):
        m, c = (b, a) if _is_number(a) else (a, b)
        return _number(c) * _matrix(m, "*")
    a, b = _broadcast(_matrix(a, "*"), _matrix(b, "*"), "*")
    return sp.HadamardProduct(a, b)


def _truediv(a: Any, b: Any) -> Any:
    if isinstance(a, Images) or isinstance(b, Images):
        return _images_binary(a, b, _truediv, "/")
    if _is_number(b):
        return _mul(a, 1 / b) if not _is_number(a) else a / b
    return _mul(a, _elementwise(b, lambda v: 1 / v, "/"))


def _div(a: Any, b: Any, rounding_mode: Any = None) -> Any:
    if rounding_mode is not None:
        raise ModelError(f"div with rounding_mode={rounding_mode!r}: only true division is supported")
    return _truediv(a, b)


def _pow(a: Any, b: Any) -> Any:
    if not _is_number(b):
        raise ModelError("** takes a number as the exponent")
    if isinstance(a, Images):
        return a.map(lambda m: _pow(m, b))
    return _elementwise(a, lambda v: v ** _number(b), "**")


def _matmul(a: Any, b: Any) -> sp.MatrixExpr:
    a, b = _matrix(a, "@"), _matrix(b, "@")
    if a.shape[1] != b.shape[0]:
        raise ModelError(f"@ of shapes {a.shape} and {b.shape} (a 1-D parameter is a row (1, k) here: "
                         "a product with a vector is not translated)")
    return a * b


def _t(x: Any) -> sp.MatrixExpr:
    return _matrix(x, "t").T


def _dims(x: Any, what: str) -> tuple:
    """A tensor's shape as torch gives it: (n, C, H, W) of images, (n, k) of a batch (n the batch's symbol)."""
    if isinstance(x, Images):
        return (x.matrix.shape[0], x.channels, x.height, x.width)
    return tuple(_matrix(x, what).shape)


def _getattr(x: Any, name: str) -> Any:
    if name == "T":
        return _t(x)
    if name == "shape":
        return _dims(x, ".shape")
    raise ModelError(f"the tensor attribute .{name} is not supported (only .T and .shape)")


def _getitem(x: Any, index: Any) -> Any:
    """An entry of a shape (x.shape[0]); indexing a tensor is not translated."""
    if isinstance(x, tuple) and isinstance(index, int):
        return x[index]
    raise ModelError("indexing a tensor (x[...]) is not supported; only a shape's entry (x.shape[0])")


def _size(x: Any, dim: Any = None) -> Any:
    """Tensor.size(): the shape, or its entry `dim` (the batch's is its symbol n)."""
    dims = _dims(x, "Tensor.size()")
    if dim is None:
        return dims
    if not isinstance(dim, int) or not -len(dims) <= dim < len(dims):
        raise ModelError(f"Tensor.size({dim!r}) of a tensor of {len(dims)} dimensions")
    return dims[dim]


def _reshape_to(x: Any, shape: tuple, what: str) -> sp.MatrixExpr:
    """view/reshape to (batch, features): of images, their flattening
    (exact: the NCHW matrix is torch's memory); of a batch, the identity.
    Any other shape is refused."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    dims = _dims(x, what)
    batch, features = dims[0], int(sp.prod(dims[1:]))
    if (len(shape) == 2 and (shape[0] == batch or shape[0] == -1)
            and (shape[1] == -1 or (isinstance(shape[1], int) and shape[1] == features)) and shape != (-1, -1)):
        return x.matrix if isinstance(x, Images) else x
    raise ModelError(f"{what} of a tensor of shape {dims} to {shape}: only to (batch, {features}) "
                     f"(x.view(x.size(0), -1), x.reshape(-1, {features})) is translated")


def _view(x: Any, *shape: Any) -> sp.MatrixExpr:
    return _reshape_to(x, shape, "Tensor.view()")


def _reshape_method(x: Any, *shape: Any) -> sp.MatrixExpr:
    return _reshape_to(x, shape, "Tensor.reshape()")


def _reshape(input: Any, shape: Any) -> sp.MatrixExpr:
    return _reshape_to(input, tuple(shape), "torch.reshape")


def _cat(tensors: Any, dim: int = 0) -> Any:
    """Side by side: the sum of each block times the 0/1 matrix placing its
    columns, exact (one product by 1 per entry; the rest adds zeros)."""
    if dim not in (1, -1) or (dim == -1 and any(isinstance(t, Images) for t in tensors)):
        raise ModelError(f"cat along dim {dim}: only along the features or the channels (dim=1) is supported")
    if any(isinstance(t, Images) for t in tensors):  # NCHW rows: the channels' blocks side by side
        if not all(isinstance(t, Images) for t in tensors) or len({(t.height, t.width) for t in tensors}) != 1:
            raise ModelError("cat of images along the channels takes images of one height and width")
        return Images(_cat([t.matrix for t in tensors], 1), sum(t.channels for t in tensors), tensors[0].height,
                      tensors[0].width)
    blocks = [_matrix(t, "cat") for t in tensors]
    if len({b.shape[0] for b in blocks}) != 1:
        raise ModelError(f"cat of blocks of rows {[b.shape[0] for b in blocks]}: they differ")
    widths = [int(b.shape[1]) for b in blocks]
    total, out, start = sum(widths), [], 0
    for block, width in zip(blocks, widths):
        place = sp.zeros(width, total)
        place[:, start:start + width] = sp.eye(width)
        out.append(block * sp.ImmutableMatrix(place))
        start += width
    return sp.MatAdd(*out) if len(out) > 1 else out[0]


def _flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> sp.MatrixExpr:
    if isinstance(x, Images):  # NCHW rows: the matrix is torch's flatten(x, 1)
        if start_dim != 1 or end_dim != -1:
            raise ModelError(f"flatten(start_dim={start_dim}, end_dim={end_dim}) of images: only start_dim=1, "
                             "end_dim=-1 (a batch of feature rows) is translated")
        return x.matrix
    if start_dim not in (1, -1) or end_dim != -1:
        raise ModelError(f"flatten(start_dim={start_dim}, end_dim={end_dim}) of a (batch, features) input: "
                         "only start_dim=1 (the identity there) is supported")
    return _matrix(x, "flatten")


@_on_images
def _dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> sp.MatrixExpr:
    if training and p > 0:
        raise ModelError("Dropout in training mode is random; call .eval() on the network first "
                         "(in eval mode it is the identity)")
    return _matrix(x, "dropout")


# --- activations -------------------------------------------------------------------


@_on_images
def _relu(x: Any, inplace: bool = False) -> Any:
    return nn.relu(_matrix(x, "relu"))


@_on_images
def _tanh(x: Any) -> Any:
    return nn.tanh(_matrix(x, "tanh"))


@_on_images
def _sigmoid(x: Any) -> Any:
    return nn.sigmoid(_matrix(x, "sigmoid"))


@_on_images
def _silu(x: Any, inplace: bool = False) -> Any:
    return nn.silu(_matrix(x, "silu"))


@_on_images
def _gelu(x: Any, approximate: str = "none") -> Any:
    return nn.gelu(_matrix(x, "gelu"), approximate=approximate)


@_on_images
def _softplus(x: Any, beta: float = 1.0, threshold: float = 20.0) -> Any:
    # torch returns x itself where beta*x > threshold (20): ours differs there by log1p(exp(-beta*x))/beta < 2.1e-9
    x = _matrix(x, "softplus")
    if beta == 1:
        return nn.softplus(x)
    return nn.softplus(x * sp.Float(beta)) / sp.Float(beta)


@_on_images
def _leaky_relu(x: Any, negative_slope: float = 0.01, inplace: bool = False) -> Any:
    return nn.leaky_relu(_matrix(x, "leaky_relu"), sp.Float(negative_slope))


@_on_images
def _elu(x: Any, alpha: float = 1.0, inplace: bool = False) -> Any:
    return nn.elu(_matrix(x, "elu"), sp.Float(alpha))


def _softmax_args(dim: Any, dtype: Any, what: str) -> None:
    if dim not in (None, 1, -1):  # None: torch's implicit choice, dim 1 for a 2-D input
        raise ModelError(f"{what} along dim {dim}: only dim=1 (= -1, along each row) is supported")
    if dtype is not None and dtype != _torch().float64:
        raise ModelError(f"{what} in {str(dtype).removeprefix('torch.')}: from_torch computes in float64")


def _softmax(x: Any, dim: Any = None, _stacklevel: Any = 3, dtype: Any = None) -> Any:
    _softmax_args(dim, dtype, "softmax")
    return nn.softmax(_matrix(x, "softmax"))


def _log_softmax(x: Any, dim: Any = None, _stacklevel: Any = 3, dtype: Any = None) -> Any:
    _softmax_args(dim, dtype, "log_softmax")
    return nn.log_softmax(_matrix(x, "log_softmax"))


# --- layers with parameters --------------------------------------------------------


def _linear(x: Any, weight: Any, bias: Any = None) -> sp.MatrixExpr:
    """x @ weight.T + bias, the weight in torch's (out, in) layout."""
    x, weight = _matrix(x, "linear"), _matrix(weight, "linear")
    if x.shape[1] != weight.shape[1]:
        raise ModelError(f"Linear takes {weight.shape[1]} features; its input has {x.shape[1]}")
    return nn.linear(x, weight.T, bias)


def _layer_norm(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> sp.MatrixExpr:
    x = _matrix(x, "layer_norm")
    rows, cols = x.shape
    if tuple(normalized_shape) != (cols,):
        raise ModelError(f"LayerNorm over {tuple(normalized_shape)}; from_torch normalizes rows of {cols} features only")
    centred = x - reduce("mean", x, 1) * nn.ones(1, cols)
    variance = reduce("mean", sp.HadamardPower(centred, 2), 1)  # biased, as torch's
    scale = variance.applyfunc(lambda v: 1 / sp.sqrt(v + sp.Float(eps)))
    y = sp.HadamardProduct(centred, scale * nn.ones(1, cols))
    if weight is not None:
        y = sp.HadamardProduct(y, _expand(weight, rows, cols))
    if bias is not None:
        y = y + _expand(bias, rows, cols)
    return y


# --- images -----------------------------------------------------------------------


def _images(x: Any, what: str) -> Images:
    if not isinstance(x, Images):
        raise ModelError(f"{what} takes images (batch, C, H, W); its input is {_dims(x, what) if not _is_number(x) else x!r} "
                         "(from_torch reads an example input of 4 dimensions as images)")
    return x


def _pair(value: Any, what: str) -> tuple[int, int]:
    """An int or an (h, w) pair of torch's arguments, as (h, w)."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise ModelError(f"{what} {value!r}: an int or a pair of ints")
    return pair


def _same(value: Any, what: str, name: str) -> int:
    """One int for both axes: the image ops take the same stride, padding and window along each."""
    h, w = _pair(value, f"{what}'s {name}")
    if h != w:
        raise ModelError(f"{what} with {name}={value!r}: a different {name} along each axis is not translated "
                         f"(symbackprop's image ops take one {name} for both)")
    return h


def _rows(row: sp.MatrixExpr, x: Images) -> sp.MatrixExpr:
    """A 1 x C per-channel row as n x C*H*W: over each channel's pixels, then over the batch."""
    return nn.ones(x.matrix.shape[0], 1) * channel_broadcast(row, x.channels, x.pixels)


def _conv2d(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
            groups: int = 1) -> Images:
    """F.conv2d: zero padding, kh x kw windows, one stride and padding for both axes."""
    x = _images(input, "conv2d")
    if not isinstance(weight, Kernel):
        raise ModelError(f"conv2d's weight must be a 4-D parameter (C_out, C_in, kh, kw); got {weight!r}")
    if groups != 1:
        raise ModelError(f"Conv2d with groups={groups}: grouped (and depthwise) convolutions are not translated; "
                         "only groups=1")
    if _pair(dilation, "conv2d's dilation") != (1, 1):
        raise ModelError(f"Conv2d with dilation={dilation!r}: dilated convolutions are not translated; only dilation=1")
    out, per, kh, kw = weight.shape
    if per != x.channels:
        raise ModelError(f"Conv2d takes {per} channels; its input has {x.channels}")
    step = _same(stride, "Conv2d", "stride")
    if padding == "valid":
        padding = 0
    elif padding == "same":
        if kh % 2 == 0 or kw % 2 == 0:
            raise ModelError(f"Conv2d with padding='same' and a {kh}x{kw} kernel: torch pads unevenly there, "
                             "which is not translated")
        padding = (kh // 2, kw // 2)
    pad = _same(padding, "Conv2d", "padding")
    height, width = out_size(x.height, kh, step, pad), out_size(x.width, kw, step, pad)
    if height < 1 or width < 1:
        raise ModelError(f"Conv2d's {kh}x{kw} window is larger than the padded {x.height}x{x.width} image")
    y = Images(Conv2d(x.matrix, weight.matrix, x.channels, x.height, x.width, out, kh, kw, step, pad), out, height,
               width)
    if bias is not None:
        y = y.map(lambda m: m + _rows(_matrix(bias, "conv2d's bias"), y))
    return y


def _pool_args(x: Images, kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool, what: str) -> tuple[int, int]:
    """(window, stride) of a pool torch computes as the op does: square, no
    padding, and ceil_mode only where it keeps the floor rule's size."""
    k = _same(kernel_size, what, "kernel_size")
    step = k if stride is None or (isinstance(stride, (tuple, list)) and not stride) else _same(stride, what, "stride")
    if _pair(padding, f"{what}'s padding") != (0, 0):
        raise ModelError(f"{what} with padding={padding!r}: padded pooling is not translated; only padding=0")
    if k > min(x.height, x.width):
        raise ModelError(f"{what}'s {k}x{k} window is larger than the {x.height}x{x.width} image")
    if ceil_mode:
        for size in (x.height, x.width):
            if (size - k) % step:  # ceil mode adds a partial window at the end
                raise ModelError(f"{what} with ceil_mode=True over {x.height}x{x.width} images with a {k}x{k} "
                                 f"window and stride {step}: the last, partial window is not translated; "
                                 "only ceil_mode=False (or sizes where the windows tile exactly)")
    return k, step


def _pooled(cls: type, x: Images, k: int, step: int) -> Images:
    return Images(cls(x.matrix, x.channels, x.height, x.width, k, step), x.channels,
                  out_size(x.height, k, step, 0), out_size(x.width, k, step, 0))


def _max_pool2d(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                ceil_mode: bool = False, return_indices: bool = False) -> Images:
    x = _images(input, "max_pool2d")
    if return_indices:
        raise ModelError("MaxPool2d with return_indices=True is not translated")
    if _pair(dilation, "max_pool2d's dilation") != (1, 1):
        raise ModelError(f"MaxPool2d with dilation={dilation!r} is not translated; only dilation=1")
    k, step = _pool_args(x, kernel_size, stride, padding, ceil_mode, "MaxPool2d")
    return _pooled(MaxPool2d, x, k, step)


def _avg_pool2d(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                count_include_pad: bool = True, divisor_override: Any = None) -> Images:
    x = _images(input, "avg_pool2d")
    if divisor_override is not None:
        raise ModelError(f"AvgPool2d with divisor_override={divisor_override!r} is not translated")
    k, step = _pool_args(x, kernel_size, stride, padding, ceil_mode, "AvgPool2d")
    return _pooled(AvgPool2d, x, k, step)


def _adaptive_avg_pool2d(input: Any, output_size: Any) -> Images:
    """AdaptiveAvgPool2d where its windows tile the image: an AvgPool2d of
    k = H / out (the same along W); to 1x1, the mean of each channel."""
    x = _images(input, "adaptive_avg_pool2d")
    sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    sizes = tuple(size if size is not None else whole for size, whole in zip(sizes, (x.height, x.width)))
    if sizes == (1, 1):  # global average pooling, of any image
        return _mean(x, (2, 3), keepdim=True)
    if (len(sizes) != 2 or any(not isinstance(s, int) or s < 1 for s in sizes)
            or x.height % sizes[0] or x.width % sizes[1] or x.height // sizes[0] != x.width // sizes[1]):
        raise ModelError(f"AdaptiveAvgPool2d to {output_size!r} of {x.height}x{x.width} images: only output sizes "
                         "that divide the image into equal square windows are translated")
    k = x.height // sizes[0]
    return _pooled(AvgPool2d, x, k, k)


def _batch_norm2d(x: Any, mean: Any, var: Any, weight: Any, bias: Any, eps: float) -> Images:
    """BatchNorm2d in eval mode, per channel: (x - running_mean) / sqrt(running_var + eps) * weight + bias."""
    x = _images(x, "BatchNorm2d")
    scale = _matrix(var, "batch_norm").applyfunc(lambda v: 1 / sp.sqrt(v + sp.Float(eps)))
    if weight is not None:
        scale = sp.HadamardProduct(_matrix(weight, "batch_norm"), scale)
    y = sp.HadamardProduct(x.matrix - _rows(_matrix(mean, "batch_norm"), x), _rows(scale, x))
    if bias is not None:
        y = y + _rows(_matrix(bias, "batch_norm"), x)
    return Images(y, x.channels, x.height, x.width)


def _eval_mode(m: Any) -> None:
    """Refuse a batch norm that normalizes by the batch's statistics (training mode, or no running ones)."""
    kind = type(m).__name__
    if m.training:
        raise ModelError(f"{kind} in training mode (statistics of the batch, running ones updated) is not "
                         "translated; call .eval() on the network first (running statistics)"
                         + (", or declare the model with symbackprop's nn.batch_norm" if kind == "BatchNorm2d" else ""))
    if m.running_mean is None:
        raise ModelError(f"{kind}(track_running_stats=False) normalizes by the batch's statistics even in eval "
                         "mode, which is not translated")


def _batch_norm1d_layer(m: Any, x: Any, param: Callable[[str], Any]) -> sp.MatrixExpr:
    """BatchNorm1d of (batch, features) in eval mode: per feature,
    (x - running_mean) / sqrt(running_var + eps) * weight + bias."""
    _eval_mode(m)
    x = _matrix(x, "BatchNorm1d")
    rows, cols = x.shape
    if m.num_features != cols:
        raise ModelError(f"BatchNorm1d of {m.num_features} features; its input has {cols}")
    scale = _matrix(param("running_var"), "batch_norm").applyfunc(lambda v: 1 / sp.sqrt(v + sp.Float(m.eps)))
    weight, bias = param("weight"), param("bias")
    if weight is not None:
        scale = sp.HadamardProduct(weight, scale)
    y = sp.HadamardProduct(x - _expand(param("running_mean"), rows, cols), _expand(scale, rows, cols))
    return y + _expand(bias, rows, cols) if bias is not None else y


def _batch_norm_layer(m: Any, x: Any, param: Callable[[str], Any]) -> Images:
    _eval_mode(m)
    images = _images(x, "BatchNorm2d")
    if m.num_features != images.channels:
        raise ModelError(f"BatchNorm2d of {m.num_features} channels; its input has {images.channels}")
    return _batch_norm2d(images, param("running_mean"), param("running_var"), param("weight"), param("bias"), m.eps)


def _conv_layer(m: Any, x: Any, param: Callable[[str], Any]) -> Images:
    if m.padding_mode != "zeros":
        raise ModelError(f"Conv2d with padding_mode={m.padding_mode!r} is not translated; only 'zeros'")
    weight = Kernel(param("weight"), tuple(m.weight.shape))
    return _conv2d(x, weight, param("bias"), m.stride, m.padding, m.dilation, m.groups)


def _mean(input: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    """The mean of images over their height and width (global average
    pooling written x.mean((2, 3))): (batch, C), or images of 1x1 with keepdim."""
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if not isinstance(input, Images) or sorted(d % 4 if isinstance(d, int) else d for d in dims) != [2, 3]:
        shape = _dims(input, "mean") if not _is_number(input) else input
        raise ModelError(f"mean over {dim!r} of a tensor of shape {shape}: only over the height and width of "
                         "images (x.mean((2, 3))) is translated")
    if dtype is not None and dtype != _torch().float64:
        raise ModelError(f"mean in {str(dtype).removeprefix('torch.')}: from_torch computes in float64")
    y = channel_sum(input.matrix, input.channels, input.pixels) / input.pixels
    return Images(y, input.channels, 1, 1) if keepdim else y


# --- embeddings -------------------------------------------------------------------


def _embedding(input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None, norm_type: float = 2.0,
               scale_grad_by_freq: bool = False, sparse: bool = False) -> sp.MatrixExpr:
    """F.embedding of one id per example: the rows of the table at the ids
    (a gather; its gradient adds into the rows, as torch's, sparse or not)."""
    if not getattr(input, "is_index", False):
        shape = _dims(input, "Embedding") if not _is_number(input) else input
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
    return gather(_matrix(weight, "embedding"), input)


# --- the tables --------------------------------------------------------------------


@functools.cache
def functions() -> dict[Any, Converter]:
    """The torch functions (and operators) from_torch translates in a traced
    forward, each with its converter (torch's arguments) -> value. A tensor
    method is the torch function of its name (x.relu() as torch.relu(x))."""
    torch = _torch()
    F = torch.nn.functional
    table: dict[Any, Converter] = {
        operator.add: _add, operator.sub: _sub, operator.mul: _mul, operator.truediv: _truediv,
        operator.neg: _neg, operator.pow: _pow, operator.matmul: _matmul, builtins.getattr: _getattr,
        torch.add: _add, torch.sub: _sub, torch.mul: _mul, torch.div: _div, torch.true_divide: _truediv,
        torch.neg: _neg, torch.pow: _pow, torch.matmul: _matmul, torch.mm: _matmul,
        torch.t: _t, torch.cat: _cat, torch.concat: _cat, torch.flatten: _flatten, torch.reshape: _reshape,
        operator.getitem: _getitem,
        F.conv2d: _conv2d, F.max_pool2d: _max_pool2d, F.avg_pool2d: _avg_pool2d,
        F.adaptive_avg_pool2d: _adaptive_avg_pool2d, F.embedding: _embedding,
        torch.mean: _mean,
        F.linear: _linear, F.layer_norm: _layer_norm, F.dropout: _dropout, F.dropout2d: _dropout,
        F.relu: _relu, torch.relu: _relu, torch.tanh: _tanh, F.tanh: _tanh, torch.sigmoid: _sigmoid, F.sigmoid: _sigmoid,
        F.silu: _silu, F.gelu: _gelu, F.softplus: _softplus, F.leaky_relu: _leaky_relu, F.elu: _elu,
        F.softmax: _softmax, F.log_softmax: _log_softmax,  # F's third argument is _stacklevel; torch's is dtype
        torch.softmax: lambda x, dim, dtype=None: _softmax(x, dim, dtype=dtype),
        torch.log_softmax: lambda x, dim, dtype=None: _log_softmax(x, dim, dtype=dtype),
    }
    return table


# tensor methods that are no torch function of the name, or that take their arguments otherwise
METHODS: dict[str, Converter] = {"size": _size, "view": _view, "reshape": _reshape_method}


def method(name: str) -> Converter | None:
    """The converter of the tensor method `name` (that of the torch function of that name), or None."""
    if name in METHODS:
        return METHODS[name]
    fn = getattr(_torch(), name, None)
    return functions().get(fn) if fn is not None else None


def op_name(target: Any) -> str:
    """A function's name as a user writes it: F.gelu, torch.cat, operator.add."""
    torch = _torch()
    name = getattr(target, "__name__", repr(target))
    for prefix, owner in (("F", torch.nn.functional), ("torch", torch), ("operator", operator)):
        if getattr(owner, name, None) is target:
            return f"{prefix}.{name}"
    return name


@functools.cache
def layers() -> dict[type, Layer]:
    """The torch layer classes from_torch converts, each with its converter
    (layer, input expression, param) -> output expression, through the
    converter of the function the layer's forward calls."""
    tnn = _torch().nn
    return {
        tnn.Linear: lambda m, x, param: _linear(x, param("weight"), param("bias")),
        tnn.LayerNorm: lambda m, x, param: _layer_norm(x, m.normalized_shape, param("weight"), param("bias"), m.eps),
        tnn.Dropout: lambda m, x, param: _dropout(x, m.p, m.training),
        tnn.Dropout2d: lambda m, x, param: _dropout(x, m.p, m.training),
        tnn.Flatten: lambda m, x, param: _flatten(x, m.start_dim, m.end_dim),
        tnn.Identity: lambda m, x, param: x,
        tnn.Conv2d: _conv_layer,
        tnn.MaxPool2d: lambda m, x, param: _max_pool2d(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode,
                                                       m.return_indices),
        tnn.AvgPool2d: lambda m, x, param: _avg_pool2d(x, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                                       m.count_include_pad, m.divisor_override),
        tnn.AdaptiveAvgPool2d: lambda m, x, param: _adaptive_avg_pool2d(x, m.output_size),
        tnn.BatchNorm2d: _batch_norm_layer,
        tnn.BatchNorm1d: _batch_norm1d_layer,
        tnn.Embedding: lambda m, x, param: _embedding(x, param("weight"), m.padding_idx, m.max_norm, m.norm_type,
                                                      m.scale_grad_by_freq, m.sparse),
        tnn.ReLU: lambda m, x, param: _relu(x),
        tnn.Tanh: lambda m, x, param: _tanh(x),
        tnn.Sigmoid: lambda m, x, param: _sigmoid(x),
        tnn.SiLU: lambda m, x, param: _silu(x),
        tnn.GELU: lambda m, x, param: _gelu(x, m.approximate),
        tnn.Softplus: lambda m, x, param: _softplus(x, m.beta, m.threshold),
        tnn.LeakyReLU: lambda m, x, param: _leaky_relu(x, m.negative_slope),
        tnn.ELU: lambda m, x, param: _elu(x, m.alpha),
        tnn.Softmax: lambda m, x, param: _softmax(x, m.dim),
        tnn.LogSoftmax: lambda m, x, param: _log_softmax(x, m.dim),
    }


__all__ = ["METHODS", "Converter", "Kernel", "Layer", "functions", "layers", "method", "op_name"]
