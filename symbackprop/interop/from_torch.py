"""A PyTorch network as a symbackprop Model: `from_torch(module, example_input, loss=...)`.

    model, params = sbp.from_torch(net, torch.randn(4, 3), loss="mse")
    mod = sbp.compile(model)
    loss, grads = mod.value_and_grad(X=x, T=t, **params)
    net_grads = params.state_dict(grads)         # {"0.weight": tensor, ...}

The module is a torch.nn.Sequential (nested ones too) of the layers in
`layers()`: each becomes the symbackprop.nn expression that computes what the
layer computes, weights kept in torch's (out, in) layout (x @ W.T). The
model's inputs are X (batch, features) and T, the targets (batch, outputs);
the batch is the symbolic dimension n; its output Y is the network's.
Parameters are named after their state_dict keys, made identifiers
("0.weight" -> "l0_weight"); `params.torch_names` maps them back.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
import sympy as sp

from symbackprop.declare import nn
from symbackprop.declare.model import Model
from symbackprop.declare.tensor import reduce
from symbackprop.errors import ModelError

BATCH = sp.Symbol("n", integer=True, positive=True)

# loss name -> the symbackprop loss of (network output, targets), as torch's default (mean) reduction
LOSSES: dict[str, Callable[[sp.MatrixExpr, sp.MatrixExpr], sp.MatrixExpr]] = {
    "mse": nn.mse,  # torch.nn.MSELoss()
    "cross_entropy": nn.softmax_cross_entropy,  # torch.nn.CrossEntropyLoss() with class probabilities (one-hot) as targets
}


class TorchParams(dict):
    """The parameters of a converted network: {our name: float64 array}
    (torch's 1-d biases and scales as rows (1, k)).

    Attributes:
        torch_names: {our name: its torch state_dict key}.
        torch_shapes: {our name: its shape in torch}.
    """

    def __init__(self, arrays: dict[str, np.ndarray], torch_names: dict[str, str],
                 torch_shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(arrays)
        self.torch_names = dict(torch_names)
        self.torch_shapes = dict(torch_shapes)

    def state_dict(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Arrays by our names (gradients, trained params) as float64 torch
        tensors keyed and shaped as the network's state_dict.

        Args:
            arrays: {our name: array}, e.g. value_and_grad's gradients;
                names that are not parameters (inputs) are left out.

        Returns:
            {state_dict key: tensor}, e.g. for ``net.load_state_dict(..., strict=False)``.
        """
        import torch

        return {self.torch_names[name]: torch.from_numpy(np.array(value, dtype=np.float64).reshape(self.torch_shapes[name]))
                for name, value in arrays.items() if name in self.torch_names}


class _Builder:
    """Walks the module tree, building the expression and collecting the params."""

    def __init__(self) -> None:
        self.symbols: list[sp.MatrixSymbol] = []
        self.arrays: dict[str, np.ndarray] = {}
        self.torch_names: dict[str, str] = {}
        self.torch_shapes: dict[str, tuple[int, ...]] = {}

    def param(self, path: str, key: str, tensor: Any) -> sp.MatrixSymbol:
        torch_key = f"{path}.{key}" if path else key
        name = _identifier(torch_key)
        if name in self.arrays:
            raise ModelError(f"{torch_key}: two parameters are both named {name!r} once made identifiers")
        value = tensor.detach().cpu().to(dtype=_torch().float64).numpy().copy()
        self.torch_shapes[name] = value.shape
        if value.ndim == 1:  # a bias or a norm's scale: a row, broadcast over the batch
            value = value.reshape(1, -1)
        symbol = sp.MatrixSymbol(name, *value.shape)
        self.symbols.append(symbol)
        self.arrays[name] = value
        self.torch_names[name] = torch_key
        return symbol

    def apply(self, module: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
        torch = _torch()
        kind = type(module)
        if kind is torch.nn.Sequential:
            for child_name, child in module.named_children():
                x = self.apply(child, f"{path}.{child_name}" if path else child_name, x)
            return x
        layer = layers().get(kind)
        if layer is None:
            where = path or "the module"
            raise ModelError(f"{where}: {kind.__name__} is not supported yet; from_torch converts a "
                             f"torch.nn.Sequential of {', '.join(sorted(t.__name__ for t in layers()))}")
        return layer(self, module, path, x)


def _identifier(key: str) -> str:
    """A state_dict key as an identifier: "0.weight" -> "l0_weight"."""
    name = re.sub(r"[^0-9A-Za-z_]", "_", key)  # ASCII: the names reach C (sanitized there too)
    return f"l{name}" if name[0].isdigit() else name


def _torch() -> Any:
    import torch

    return torch


def _columns(x: sp.MatrixExpr) -> Any:
    return x.shape[1]


# --- the layers ------------------------------------------------------------------


def _linear(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    if _columns(x) != m.in_features:
        raise ModelError(f"{path}: Linear takes {m.in_features} features; its input has {_columns(x)}")
    weight = b.param(path, "weight", m.weight)
    bias = b.param(path, "bias", m.bias) if m.bias is not None else None
    return nn.linear(x, weight.T, bias)


def _layer_norm(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    if tuple(m.normalized_shape) != (_columns(x),):
        raise ModelError(f"{path}: LayerNorm over {tuple(m.normalized_shape)}; from_torch normalizes rows "
                         f"of {_columns(x)} features only")
    rows, cols = x.shape
    centred = x - reduce("mean", x, 1) * nn.ones(1, cols)
    variance = reduce("mean", sp.HadamardPower(centred, 2), 1)  # biased, as torch's
    eps = sp.Float(m.eps)
    scale = variance.applyfunc(lambda v: 1 / sp.sqrt(v + eps))
    y = sp.HadamardProduct(centred, scale * nn.ones(1, cols))
    if m.weight is not None:
        y = sp.HadamardProduct(y, nn.ones(rows, 1) * b.param(path, "weight", m.weight))
    if getattr(m, "bias", None) is not None:
        y = y + nn.ones(rows, 1) * b.param(path, "bias", m.bias)
    return y


def _dropout(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    if m.training and m.p > 0:
        raise ModelError(f"{path}: Dropout in training mode is random; call .eval() on the network first "
                         "(in eval mode it is the identity)")
    return x


def _flatten(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    if m.start_dim not in (1, -1) or m.end_dim != -1:
        raise ModelError(f"{path}: Flatten(start_dim={m.start_dim}, end_dim={m.end_dim}) of a (batch, features) "
                         "input; only Flatten() (the identity there) is supported")
    return x


def _gelu(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    return nn.gelu(x, approximate=m.approximate)


def _softplus(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    # torch returns x itself where beta*x > threshold (20): ours differs there by log1p(exp(-beta*x))/beta < 2.1e-9
    if m.beta == 1:
        return nn.softplus(x)
    beta = sp.Float(m.beta)
    return nn.softplus(x * beta) / beta


def _softmax_dim(m: Any, path: str) -> None:
    if m.dim not in (1, -1):
        raise ModelError(f"{path}: {type(m).__name__}(dim={m.dim}); only dim=1 (= -1, along each row) is supported")


def _softmax(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    _softmax_dim(m, path)
    return nn.softmax(x)


def _log_softmax(b: _Builder, m: Any, path: str, x: sp.MatrixExpr) -> sp.MatrixExpr:
    _softmax_dim(m, path)
    return nn.log_softmax(x)


def _activation(fn: Callable[[sp.MatrixExpr], Any]) -> Callable[[_Builder, Any, str, sp.MatrixExpr], Any]:
    """A layer without parameters or options."""
    return lambda b, m, path, x: fn(x)


Layer: TypeAlias = Callable[[_Builder, Any, str, sp.MatrixExpr], sp.MatrixExpr]


@functools.cache
def layers() -> dict[type, Layer]:
    """The torch layer classes from_torch converts, each with its converter
    (builder, layer, path, input expression) -> output expression."""
    tnn = _torch().nn
    return {
        tnn.Linear: _linear,
        tnn.LayerNorm: _layer_norm,
        tnn.Dropout: _dropout,
        tnn.Flatten: _flatten,
        tnn.Identity: _activation(lambda x: x),
        tnn.ReLU: _activation(nn.relu),
        tnn.Tanh: _activation(nn.tanh),
        tnn.Sigmoid: _activation(nn.sigmoid),
        tnn.SiLU: _activation(nn.silu),
        tnn.GELU: _gelu,
        tnn.Softplus: _softplus,
        tnn.LeakyReLU: lambda b, m, path, x: nn.leaky_relu(x, sp.Float(m.negative_slope)),
        tnn.ELU: lambda b, m, path, x: nn.elu(x, sp.Float(m.alpha)),
        tnn.Softmax: _softmax,
        tnn.LogSoftmax: _log_softmax,
    }


def from_torch(module: Any, example_input: Any, loss: str | Callable[[sp.MatrixExpr, sp.MatrixSymbol], Any] | None = "mse",
               name: str = "from_torch") -> tuple[Model, TorchParams]:
    """A torch.nn.Sequential network, and a loss, as a symbackprop Model
    and its parameters (see the module's docstring).

    Args:
        module: the network: a torch.nn.Sequential (nested ones too) of the
            layers of `layers()` (Dropout in eval mode).
        example_input: an input batch (batch, features), a tensor or array:
            it fixes the number of features (the batch is the symbol n).
        loss: "mse" (torch.nn.MSELoss()), "cross_entropy"
            (torch.nn.CrossEntropyLoss() with class probabilities, one-hot
            for class labels, as targets), a callable (Y, T) -> a 1x1
            symbackprop loss of the output Y and the targets T, or None
            (no loss: the model has only the output Y).
        name: the model's name.

    Returns:
        (model, params): the Model (inputs X and T, output Y) and its
        parameters as float64 arrays by name (a TorchParams: its
        torch_names maps them back to the state_dict keys).

    Raises:
        ModelError: a layer that is not supported (named by its path in
            the tree), an example input that is not 2-D, or an unknown loss.
    """
    shape = tuple(np.shape(example_input.detach().cpu().numpy() if hasattr(example_input, "detach") else example_input))
    if len(shape) != 2:
        raise ModelError(f"from_torch takes a (batch, features) example input; got shape {shape}")
    X = sp.MatrixSymbol("X", BATCH, shape[1])
    builder = _Builder()
    Y = builder.apply(module, "", X)
    T = sp.MatrixSymbol("T", BATCH, Y.shape[1])
    if loss is None:
        loss_expr, inputs = None, [X]
    else:
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ModelError(f"from_torch's loss must be one of {sorted(LOSSES)}, a callable (Y, T) -> loss, "
                                 f"or None; got {loss!r}")
            loss = LOSSES[loss]
        loss_expr, inputs = loss(Y, T), [X, T]
    model = Model(name, inputs=tuple(inputs), params=tuple(builder.symbols), loss=loss_expr, outputs={"Y": Y})
    return model, TorchParams(builder.arrays, builder.torch_names, builder.torch_shapes)


__all__ = ["BATCH", "LOSSES", "TorchParams", "from_torch", "layers"]
