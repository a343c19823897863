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
from typing import Any, TypeAlias

import sympy as sp

from symbackprop.declare import nn
from symbackprop.declare.conv import Images
from symbackprop.declare.tensor import reduce
from symbackprop.errors import ModelError
from symbackprop.interop import torch_images as im
from symbackprop.interop.torch_rnn import Sequence, gru_layer, lstm_layer
from symbackprop.interop.torch_values import as_matrix, expand, is_number, shape_of, torch_module

Converter: TypeAlias = Callable[..., Any]
# (layer, its input, param) -> output; param(key) is the layer's parameter `key` as a symbol (None if unset)
Layer: TypeAlias = Callable[[Any, sp.MatrixExpr, Callable[[str], Any]], sp.MatrixExpr]


# --- values ----------------------------------------------------------------------


def _number(v: Any) -> sp.Expr:
    return sp.Integer(v) if isinstance(v, int) else sp.Float(v)  # a float64 constant, as torch's


def _broadcast(a: sp.MatrixExpr, b: sp.MatrixExpr, what: str) -> tuple[sp.MatrixExpr, sp.MatrixExpr]:
    rows = b.shape[0] if a.shape[0] == 1 else a.shape[0]
    cols = b.shape[1] if a.shape[1] == 1 else a.shape[1]
    a, b = expand(a, rows, cols), expand(b, rows, cols)
    if a.shape != b.shape:
        raise ModelError(f"{what} of shapes {a.shape} and {b.shape}, which do not broadcast")
    return a, b


def _elementwise(x: Any, fn: Callable[[sp.Expr], sp.Expr], what: str) -> Any:
    if is_number(x):
        return fn(_number(x))
    return as_matrix(x, what).applyfunc(fn)


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
    if not is_number(other):
        raise ModelError(f"{what} of images (batch, {image.channels}, {image.height}, {image.width}) and "
                         f"{other!r}: only a number or images of the same shape are translated")
    return image.map(lambda m: fn(m, b) if image is a else fn(a, m))


# --- arithmetic --------------------------------------------------------------------


def _add(a: Any, b: Any, alpha: Any = 1) -> Any:
    if alpha != 1:
        b = _mul(b, alpha)
    if isinstance(a, Images) or isinstance(b, Images):
        return _images_binary(a, b, _add, "+")
    if is_number(a) and is_number(b):
        return a + b
    if is_number(a) or is_number(b):
        m, c = (b, a) if is_number(a) else (a, b)
        m = as_matrix(m, "+")
        return m + _number(c) * nn.ones(*m.shape)
    a, b = _broadcast(as_matrix(a, "+"), as_matrix(b, "+"), "+")
    return a + b


def _neg(a: Any) -> Any:
    if isinstance(a, Images):
        return a.map(lambda m: -m)
    return -a if is_number(a) else -as_matrix(a, "-")


def _sub(a: Any, b: Any, alpha: Any = 1) -> Any:
    return _add(a, _neg(b), alpha)


def _mul(a: Any, b: Any) -> Any:
    if isinstance(a, Images) or isinstance(b, Images):
        return _images_binary(a, b, _mul, "*")
    if is_number(a) and is_number(b):
        return a * b
    if is_number(a) or is_number(b):
        m, c = (b, a) if is_number(a) else (a, b)
        return _number(c) * as_matrix(m, "*")
    a, b = _broadcast(as_matrix(a, "*"), as_matrix(b, "*"), "*")
    return sp.HadamardProduct(a, b)


def _truediv(a: Any, b: Any) -> Any:
    if isinstance(a, Images) or isinstance(b, Images):
        return _images_binary(a, b, _truediv, "/")
    if is_number(b):
        return _mul(a, 1 / b) if not is_number(a) else a / b
    return _mul(a, _elementwise(b, lambda v: 1 / v, "/"))


def _div(a: Any, b: Any, rounding_mode: Any = None) -> Any:
    if rounding_mode is not None:
        raise ModelError(f"div with rounding_mode={rounding_mode!r}: only true division is supported")
    return _truediv(a, b)


def _pow(a: Any, b: Any) -> Any:
    if not is_number(b):
        raise ModelError("** takes a number as the exponent")
    if isinstance(a, Images):
        return a.map(lambda m: _pow(m, b))
    return _elementwise(a, lambda v: v ** _number(b), "**")


def _matmul(a: Any, b: Any) -> sp.MatrixExpr:
    a, b = as_matrix(a, "@"), as_matrix(b, "@")
    if a.shape[1] != b.shape[0]:
        raise ModelError(f"@ of shapes {a.shape} and {b.shape} (a 1-D parameter is a row (1, k) here: "
                         "a product with a vector is not translated)")
    return a * b


def _t(x: Any) -> sp.MatrixExpr:
    return as_matrix(x, "t").T


def _getattr(x: Any, name: str) -> Any:
    if name == "T":
        return _t(x)
    if name == "shape":
        return shape_of(x, ".shape")
    raise ModelError(f"the tensor attribute .{name} is not supported (only .T and .shape)")


def _getitem(x: Any, index: Any) -> Any:
    """An entry of a shape (x.shape[0]); indexing a tensor is not translated."""
    if isinstance(x, tuple) and isinstance(index, int):
        return x[index]
    if isinstance(x, Sequence):  # a recurrent layer's outputs: the last step
        return x.step(index)
    raise ModelError("indexing a tensor (x[...]) is not supported; only a shape's entry (x.shape[0])")


def _size(x: Any, dim: Any = None) -> Any:
    """Tensor.size(): the shape, or its entry `dim` (the batch's is its symbol n)."""
    dims = shape_of(x, "Tensor.size()")
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
    dims = shape_of(x, what)
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
    """Side by side (nn.concat_columns)."""
    if dim not in (1, -1) or (dim == -1 and any(isinstance(t, Images) for t in tensors)):
        raise ModelError(f"cat along dim {dim}: only along the features or the channels (dim=1) is supported")
    if any(isinstance(t, Images) for t in tensors):  # NCHW rows: the channels' blocks side by side
        if not all(isinstance(t, Images) for t in tensors) or len({(t.height, t.width) for t in tensors}) != 1:
            raise ModelError("cat of images along the channels takes images of one height and width")
        return Images(_cat([t.matrix for t in tensors], 1), sum(t.channels for t in tensors), tensors[0].height,
                      tensors[0].width)
    return nn.concat_columns([as_matrix(t, "cat") for t in tensors])


def _flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> sp.MatrixExpr:
    if isinstance(x, Images):  # NCHW rows: the matrix is torch's flatten(x, 1)
        if start_dim != 1 or end_dim != -1:
            raise ModelError(f"flatten(start_dim={start_dim}, end_dim={end_dim}) of images: only start_dim=1, "
                             "end_dim=-1 (a batch of feature rows) is translated")
        return x.matrix
    if start_dim not in (1, -1) or end_dim != -1:
        raise ModelError(f"flatten(start_dim={start_dim}, end_dim={end_dim}) of a (batch, features) input: "
                         "only start_dim=1 (the identity there) is supported")
    return as_matrix(x, "flatten")


@_on_images
def _dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> sp.MatrixExpr:
    if training and p > 0:
        raise ModelError("Dropout in training mode is random; call .eval() on the network first "
                         "(in eval mode it is the identity)")
    return as_matrix(x, "dropout")


# --- activations -------------------------------------------------------------------


@_on_images
def _relu(x: Any, inplace: bool = False) -> Any:
    return nn.relu(as_matrix(x, "relu"))


@_on_images
def _tanh(x: Any) -> Any:
    return nn.tanh(as_matrix(x, "tanh"))


@_on_images
def _sigmoid(x: Any) -> Any:
    return nn.sigmoid(as_matrix(x, "sigmoid"))


@_on_images
def _silu(x: Any, inplace: bool = False) -> Any:
    return nn.silu(as_matrix(x, "silu"))


@_on_images
def _gelu(x: Any, approximate: str = "none") -> Any:
    return nn.gelu(as_matrix(x, "gelu"), approximate=approximate)


@_on_images
def _softplus(x: Any, beta: float = 1.0, threshold: float = 20.0) -> Any:
    # torch returns x itself where beta*x > threshold (20): ours differs there by log1p(exp(-beta*x))/beta < 2.1e-9
    x = as_matrix(x, "softplus")
    if beta == 1:
        return nn.softplus(x)
    return nn.softplus(x * sp.Float(beta)) / sp.Float(beta)


@_on_images
def _leaky_relu(x: Any, negative_slope: float = 0.01, inplace: bool = False) -> Any:
    return nn.leaky_relu(as_matrix(x, "leaky_relu"), sp.Float(negative_slope))


@_on_images
def _elu(x: Any, alpha: float = 1.0, inplace: bool = False) -> Any:
    return nn.elu(as_matrix(x, "elu"), sp.Float(alpha))


def _softmax_args(dim: Any, dtype: Any, what: str) -> None:
    if dim not in (None, 1, -1):  # None: torch's implicit choice, dim 1 for a 2-D input
        raise ModelError(f"{what} along dim {dim}: only dim=1 (= -1, along each row) is supported")
    if dtype is not None and dtype != torch_module().float64:
        raise ModelError(f"{what} in {str(dtype).removeprefix('torch.')}: from_torch computes in float64")


def _softmax(x: Any, dim: Any = None, _stacklevel: Any = 3, dtype: Any = None) -> Any:
    _softmax_args(dim, dtype, "softmax")
    return nn.softmax(as_matrix(x, "softmax"))


def _log_softmax(x: Any, dim: Any = None, _stacklevel: Any = 3, dtype: Any = None) -> Any:
    _softmax_args(dim, dtype, "log_softmax")
    return nn.log_softmax(as_matrix(x, "log_softmax"))


# --- layers with parameters --------------------------------------------------------


def _linear(x: Any, weight: Any, bias: Any = None) -> sp.MatrixExpr:
    """x @ weight.T + bias, the weight in torch's (out, in) layout."""
    x, weight = as_matrix(x, "linear"), as_matrix(weight, "linear")
    if x.shape[1] != weight.shape[1]:
        raise ModelError(f"Linear takes {weight.shape[1]} features; its input has {x.shape[1]}")
    return nn.linear(x, weight.T, bias)


def _layer_norm(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> sp.MatrixExpr:
    x = as_matrix(x, "layer_norm")
    rows, cols = x.shape
    if tuple(normalized_shape) != (cols,):
        raise ModelError(f"LayerNorm over {tuple(normalized_shape)}; from_torch normalizes rows of {cols} features only")
    centred = x - reduce("mean", x, 1) * nn.ones(1, cols)
    variance = reduce("mean", sp.HadamardPower(centred, 2), 1)  # biased, as torch's
    scale = variance.applyfunc(lambda v: 1 / sp.sqrt(v + sp.Float(eps)))
    y = sp.HadamardProduct(centred, scale * nn.ones(1, cols))
    if weight is not None:
        y = sp.HadamardProduct(y, expand(weight, rows, cols))
    if bias is not None:
        y = y + expand(bias, rows, cols)
    return y


# --- the tables --------------------------------------------------------------------


@functools.cache
def functions() -> dict[Any, Converter]:
    """The torch functions (and operators) from_torch translates in a traced
    forward, each with its converter (torch's arguments) -> value. A tensor
    method is the torch function of its name (x.relu() as torch.relu(x))."""
    torch = torch_module()
    F = torch.nn.functional
    table: dict[Any, Converter] = {
        operator.add: _add, operator.sub: _sub, operator.mul: _mul, operator.truediv: _truediv,
        operator.neg: _neg, operator.pow: _pow, operator.matmul: _matmul, builtins.getattr: _getattr,
        torch.add: _add, torch.sub: _sub, torch.mul: _mul, torch.div: _div, torch.true_divide: _truediv,
        torch.neg: _neg, torch.pow: _pow, torch.matmul: _matmul, torch.mm: _matmul,
        torch.t: _t, torch.cat: _cat, torch.concat: _cat, torch.flatten: _flatten, torch.reshape: _reshape,
        operator.getitem: _getitem,
        F.conv2d: im.conv2d, F.max_pool2d: im.max_pool2d, F.avg_pool2d: im.avg_pool2d,
        F.adaptive_avg_pool2d: im.adaptive_avg_pool2d, F.embedding: im.embedding,
        torch.mean: im.mean,
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
    fn = getattr(torch_module(), name, None)
    return functions().get(fn) if fn is not None else None


def op_name(target: Any) -> str:
    """A function's name as a user writes it: F.gelu, torch.cat, operator.add."""
    torch = torch_module()
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
    tnn = torch_module().nn
    return {
        tnn.Linear: lambda m, x, param: _linear(x, param("weight"), param("bias")),
        tnn.LayerNorm: lambda m, x, param: _layer_norm(x, m.normalized_shape, param("weight"), param("bias"), m.eps),
        tnn.Dropout: lambda m, x, param: _dropout(x, m.p, m.training),
        tnn.Dropout2d: lambda m, x, param: _dropout(x, m.p, m.training),
        tnn.Flatten: lambda m, x, param: _flatten(x, m.start_dim, m.end_dim),
        tnn.Identity: lambda m, x, param: x,
        tnn.Conv2d: im.conv_layer,
        tnn.MaxPool2d: lambda m, x, param: im.max_pool2d(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode,
                                                       m.return_indices),
        tnn.AvgPool2d: lambda m, x, param: im.avg_pool2d(x, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                                       m.count_include_pad, m.divisor_override),
        tnn.AdaptiveAvgPool2d: lambda m, x, param: im.adaptive_avg_pool2d(x, m.output_size),
        tnn.BatchNorm2d: im.batch_norm_layer,
        tnn.BatchNorm1d: im.batch_norm1d_layer,
        tnn.Embedding: lambda m, x, param: im.embedding(x, param("weight"), m.padding_idx, m.max_norm, m.norm_type,
                                                      m.scale_grad_by_freq, m.sparse),
        tnn.LSTM: lstm_layer,
        tnn.GRU: gru_layer,
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


__all__ = ["METHODS", "Converter", "Layer", "functions", "layers", "method", "op_name"]
