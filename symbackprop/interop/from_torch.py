"""A PyTorch network as a symbackprop Model: `from_torch(module, example_input, loss=...)`.

    model, params = sbp.from_torch(net, torch.randn(4, 3), loss="mse")
    mod = sbp.compile(model)
    loss, grads = mod.value_and_grad(X=x, T=t, **params)
    net_grads = params.state_dict(grads)         # {"0.weight": tensor, ...}

The module is a torch.nn layer of `layers()`, a torch.nn.Sequential of them,
or any module whose forward torch.fx can trace (no data-dependent control
flow) into those layers and the functions of `functions()`; the graph is
translated node by node (symbackprop.interop.torch_ops), each into the
symbackprop.nn expression computing what torch computes, weights kept in
torch's (out, in) layout (x @ W.T). The model's inputs are X
(batch, features) and T, the targets ((batch, outputs), or an Index of class
labels for "cross_entropy_labels"); the batch is the symbolic dimension n;
its output Y is the network's. An example input of (batch, C, H, W) is a
batch of images: X is then its n x C*H*W matrix (torch's NCHW memory, pass
x.reshape(len(x), -1)) and the convolutions, pools and BatchNorm2d
translate (a batch norm in training mode by the batch's statistics, what it
writes into its running ones an output: TorchParams.running); one of
(batch,) integers is an Index X of ids for an Embedding; one of 3
dimensions (or (batch, L) token ids), of a network with an LSTM or GRU, a
batch of sequences: X is its time-major (L*n) x features matrix (or Index
of ids), and where no input has a row a sequence (outputs per step) the
model's Index input `batch`, np.arange(n), binds n
(symbackprop.interop.torch_rnn);
of a network with a MultiheadAttention, (batch, L, features) floats or
(batch, L) token ids are sequences for attention: X their example-major
(n*L) rows (symbackprop.interop.torch_attention).
Parameters are named after their state_dict keys, made identifiers
("0.weight" -> "l0_weight"); `params.torch_names` maps them back.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import sympy as sp

from symbackprop.declare import nn
from symbackprop.declare.conv import Images
from symbackprop.declare.derivatives import stop_gradient
from symbackprop.declare.model import Model
from symbackprop.declare.tensor import Index
from symbackprop.errors import ModelError
from symbackprop.interop import torch_attention as att
from symbackprop.interop import torch_encoder as enc
from symbackprop.interop.torch_graph import Writes, out_of_place, refuse_hooks, trace, writes_in_place, written
from symbackprop.interop.torch_images import running_updates
from symbackprop.interop.torch_ops import functions, layers, method, op_name
from symbackprop.interop.torch_rnn import Sequence, declared, states_examples, without_states
from symbackprop.interop.torch_values import Kernel, Positions, example_inputs

BATCH = sp.Symbol("n", integer=True, positive=True)
ROWS = sp.Symbol("N", integer=True, positive=True)  # a sequence's rows, L*n time-major (the steps L = N / n)
POSITIONS = sp.Symbol("m", integer=True, positive=True)  # attention's rows, n*L example-major


# torch.nn layers from_torch does not convert, and the symbackprop built-in a
# model declared by hand uses instead (named in the refusal)
BUILT_INS = {
    "Conv1d": "nn.conv2d on images of height 1 (sbp.images, nn.conv_weight)",
    "Embedding": "nn.embedding (with an sbp.Index of token ids)",
    "LSTMCell": "nn.lstm_cell",
    "GRUCell": "nn.gru_cell",
}


def built_in_hint(kind: str) -> str:
    """'; declare it with symbackprop's <built-in> instead' where one exists, else ''."""
    use = BUILT_INS.get(kind)
    return f"; declare the model with symbackprop's {use} instead" if use else ""


def _is_recurrent(module: Any) -> bool:
    return isinstance(module, (_torch().nn.LSTM, _torch().nn.GRU))


def _recurrent(module: Any) -> bool:
    """Whether the network has an LSTM or a GRU (whose input is a sequence)."""
    return any(_is_recurrent(sub) for sub in module.modules()) if hasattr(module, "modules") else False


def _refuse_by_layer(module: Any, shape: tuple) -> None:
    """An example input that is not (batch, features), images nor (batch,)
    ids: where the network has a layer from_torch does not convert on it (a
    Conv1d, an Embedding of sequences), the refusal names that layer and the
    built-in to use, not the input's shape."""
    known = layers()
    for path, sub in module.named_modules() if hasattr(module, "named_modules") else ():
        kind = type(sub)
        if kind.__name__ in BUILT_INS and (kind not in known or kind.__name__ == "Embedding"):
            what = (", or an Embedding of (batch,) integer ids" if kind in known
                    else f", and no {kind.__name__} on any input")
            raise ModelError(f"{path or 'the module'}: {kind.__name__} of an example input of shape {shape} is not "
                             f"supported by from_torch, which converts networks of (batch, features) or (batch, C, "
                             f"H, W) inputs{what}{built_in_hint(kind.__name__)}")


class Loss(NamedTuple):
    """A named loss: fn(output Y, targets T, reduction) and whether T is class labels (an Index)."""

    fn: Callable[[sp.MatrixExpr, sp.MatrixExpr, str], sp.MatrixExpr]
    labels: bool


LOSSES: dict[str, Loss] = {
    "mse": Loss(nn.mse, False),  # torch.nn.MSELoss()
    "cross_entropy": Loss(nn.softmax_cross_entropy, False),  # CrossEntropyLoss() of class probabilities (one-hot)
    "cross_entropy_labels": Loss(nn.softmax_cross_entropy, True),  # CrossEntropyLoss() of class numbers
}


class TorchParams(dict):
    """The parameters of a converted network: {our name: float64 array}
    (torch's 1-d biases and scales as rows (1, k)).

    Attributes:
        torch_names: {our name: its torch state_dict key}.
        torch_shapes: {our name: its shape in torch}.
        frozen: the names of the parameters of requires_grad=False, the
            model's inputs (passed as the others are, never differentiated
            nor updated by train_step).
        running: {output name: running statistic}: the outputs holding
            what a batch norm in training mode writes into its running
            mean and variance (see update_running).
    """

    def __init__(self, arrays: dict[str, np.ndarray], torch_names: dict[str, str],
                 torch_shapes: dict[str, tuple[int, ...]], frozen: tuple[str, ...] = (),
                 running: dict[str, str] | None = None) -> None:
        super().__init__(arrays)
        self.torch_names = dict(torch_names)
        self.torch_shapes = dict(torch_shapes)
        self.frozen = tuple(frozen)
        self.running = dict(running or {})

    def update_running(self, outputs: dict[str, Any]) -> None:
        """Copy the new running statistics of a forward pass (the outputs
        `running` names) into their arrays here, in place, as torch's
        forward in training mode updates its buffers.

        Args:
            outputs: the outputs of mod.forward(...) (or value_and_grad's
                outputs) by name.
        """
        for output, name in self.running.items():
            self[name][...] = np.asarray(outputs[output]).reshape(self[name].shape)

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
    """Collects the parameters the network uses, one symbol per tensor."""

    def __init__(self) -> None:
        self.symbols: list[sp.MatrixSymbol] = []  # the trainable parameters
        self.frozen: list[sp.MatrixSymbol] = []  # requires_grad=False: inputs of the model, not differentiated
        self.arrays: dict[str, np.ndarray] = {}
        self.torch_names: dict[str, str] = {}
        self.torch_shapes: dict[str, tuple[int, ...]] = {}
        self.seen: dict[int, sp.MatrixSymbol] = {}  # id(tensor) -> its symbol: a shared weight is one param
        self.updates: dict[str, sp.MatrixExpr] = {}  # a running statistic -> its new value (batch norm, training)
        self.attention = False  # sequences for attention: buffers are values, calls on constants run by torch
        self.positions: Index | None = None  # each row's position, where a positional table is added
        self.starts: Index | None = None  # each sequence's first row, where the sequences are pooled
        self.states: list[sp.MatrixSymbol] = []  # initial states of LSTMs and GRUs given as the forward's inputs

    def position_ids(self) -> Index:
        """The model's Index input `positions` (sbp.position_ids(n, L)), made where first used."""
        if self.positions is None:
            self.positions = Index("positions", POSITIONS)
        return self.positions

    def sequence_starts(self) -> Index:
        """The model's Index input `starts` (sbp.sequence_starts(n, L)), made where first used."""
        if self.starts is None:
            self.starts = Index("starts", BATCH)
        return self.starts

    def param(self, torch_key: str, tensor: Any) -> sp.MatrixSymbol:
        if id(tensor) in self.seen:
            return self.seen[id(tensor)]
        name = _identifier(torch_key)
        if name in self.arrays:
            raise ModelError(f"{torch_key}: two parameters are both named {name!r} once made identifiers")
        value = tensor.detach().cpu().to(dtype=_torch().float64).numpy().copy()
        if value.ndim not in (1, 2, 4):
            raise ModelError(f"{torch_key}: a parameter of shape {tuple(value.shape)}; from_torch takes 1-D and 2-D "
                             "ones, and 4-D convolution weights")
        self.torch_shapes[name] = value.shape
        if value.ndim == 1:  # a bias or a norm's scale: a row, broadcast over the batch
            value = value.reshape(1, -1)
        elif value.ndim == 4:  # (C_out, C_in, kh, kw): the C_out x C_in*kh*kw matrix of the same memory
            value = value.reshape(value.shape[0], -1)
        symbol = sp.MatrixSymbol(name, *value.shape)
        (self.symbols if tensor.requires_grad else self.frozen).append(symbol)
        self.arrays[name] = value
        self.torch_names[name] = torch_key
        self.seen[id(tensor)] = symbol
        return symbol

    def layer(self, module: Any, path: str, args: tuple, kwargs: dict) -> sp.MatrixExpr:
        """A torch.nn layer called on args, as its converter computes it."""
        kind = type(module)
        if att.is_attention(module):
            return att.mha_layer(module, path, args, kwargs, lambda key: self._dotted(module, path, key))
        if enc.is_transformer(module):
            return enc.transformer(module, path, args, kwargs, self.layer)
        if self.attention and kind.__name__ == "Embedding" and args and att.concrete(args[0]):
            return att.position_rows(args[0], self._dotted(module, path, "weight"))
        convert = layers().get(kind)
        per_step = kind.__name__ in att.PER_POSITION_LAYERS and convert is not None
        if att.has_positions(args, kwargs) and not per_step and not _is_recurrent(module):
            raise ModelError(f"{kind.__name__} of sequences is not translated; on sequences from_torch translates "
                             f"the per-position layers {', '.join(sorted(att.PER_POSITION_LAYERS))}, "
                             "MultiheadAttention, LSTM and GRU")
        if convert is None:
            known = ("the layers of torch_ops.layers()" if kind.__name__ in BUILT_INS  # the hint is what to read
                     else f"the layers {', '.join(sorted(t.__name__ for t in layers()))}")
            raise ModelError(f"{kind.__name__} is not supported yet; from_torch converts {known} and the functions "
                             "of torch_ops.functions()" + built_in_hint(kind.__name__))
        args, kwargs, hx = without_states(args, kwargs) if _is_recurrent(module) else (args, kwargs, None)
        if len(args) != 1 or kwargs:
            takes = "the sequences and its initial states hx" if _is_recurrent(module) else "one"
            raise ModelError(f"{kind.__name__} called with {len(args) + len(kwargs)} arguments; it takes {takes}")

        def param(key: str) -> sp.MatrixSymbol | None:
            tensor = getattr(module, key, None)
            return None if tensor is None else self.param(f"{path}.{key}" if path else key, tensor)

        if isinstance(args[0], Positions) or (isinstance(args[0], Sequence) and per_step):
            return att.per_position(lambda x: convert(module, x, param), args, {}, kind.__name__)
        takes_hx: Any = convert  # (LSTM's and GRU's, which also take their initial states)
        out = convert(module, args[0], param) if hx is None else takes_hx(module, args[0], param, hx)
        for name, value in running_updates(module, args[0], param):
            if name in self.updates:
                raise ModelError(f"{kind.__name__} called twice in training mode: torch updates its running "
                                 "statistics at each call, which is not translated")
            self.updates[name] = value
        return out


    def _dotted(self, module: Any, path: str, key: str) -> sp.MatrixSymbol | None:
        """The parameter `key` (dotted: "out_proj.weight") of module at path, or None where unset."""
        owner, _, leaf = key.rpartition(".")
        tensor = getattr(module.get_submodule(owner) if owner else module, leaf, None)
        return None if tensor is None else self.param(f"{path}.{key}" if path else key, tensor)


def _identifier(key: str) -> str:
    """A state_dict key as an identifier: "0.weight" -> "l0_weight"."""
    name = re.sub(r"[^0-9A-Za-z_]", "_", key)  # ASCII: the names reach C (sanitized there too)
    return f"l{name}" if name[0].isdigit() else name


def _torch() -> Any:
    import torch

    return torch


def _dtype(example: Any) -> np.dtype:
    """The example input's dtype, as numpy's."""
    if hasattr(example, "detach"):
        return example.detach().cpu().numpy().dtype
    return np.asarray(example).dtype


# --- reading the network -----------------------------------------------------------


def _where(node: Any, root: Any) -> str:
    """The module path a node is in, for messages (the root by its class)."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack)[-1]) if stack else f"{type(root).__name__}.forward"


def _value(node: Any, root: Any, builder: _Builder, values: dict, x: sp.MatrixExpr) -> Any:
    """What the node computes, from the values of the nodes before it."""
    fx = _torch().fx
    args = fx.node.map_arg(node.args, values.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
    if node.op == "placeholder":
        return x
    if node.op == "output":
        return args[0]
    if node.op == "get_attr":
        params = dict(root.named_parameters(remove_duplicate=False))
        if node.target not in params and builder.attention:  # a buffer (a mask): its value
            return functools.reduce(getattr, node.target.split("."), root)
        if node.target not in params:
            raise ModelError("a tensor that is not a parameter (a buffer or a constant) is not supported")
        symbol = builder.param(node.target, params[node.target])
        shape = builder.torch_shapes[str(symbol)]
        return Kernel(symbol, shape) if len(shape) == 4 else symbol
    if node.op == "call_module":
        return builder.layer(root.get_submodule(node.target), node.target, args, kwargs)
    if _is_detach(node):  # the same value; _stopped stops its gradient
        if len(args) != 1 or kwargs:
            raise ModelError("Tensor.detach() takes no arguments")
        return args[0]
    if builder.attention and node.op in ("call_function", "call_method") and att.concrete((args, kwargs)):
        return att.fold(node, args, kwargs)  # a mask, torch.arange: computed by torch
    if builder.attention and att.reads_shape(node, args):  # x.size(1), x.shape, x.device: known
        return att.shape_or_device(node, args, kwargs)
    if att.has_positions(args, kwargs) and not writes_in_place(node, root) and not _indexes(node, args):
        pooled = att.pooled(node, args, kwargs, builder.sequence_starts)  # x.mean(1), x[:, 0]: (n, features)
        if pooled is not None:
            return pooled
        if node.target in (operator.add, _torch().add, "add") and _any_positions(args):  # x + a positional table
            args = att.add_positions(args, builder.position_ids)
        return _per_position(node, args, kwargs)
    if writes_in_place(node, root):  # y.mul_(2): y * 2, what the caller makes y stand for
        convert, name = out_of_place(node)
    elif node.op == "call_method":
        convert, name = method(node.target), f"Tensor.{node.target}()"
    else:
        convert, name = functions().get(node.target), op_name(node.target)
    if convert is None:
        known = sorted({op_name(f) for f in functions()})
        raise ModelError(f"{name} is not supported yet; from_torch converts {', '.join(known)} "
                         "(and the tensor methods of those names)")
    try:
        inspect.signature(convert).bind(*args, **kwargs)
    except TypeError as error:
        raise ModelError(f"{name}: arguments from_torch does not translate ({error})") from error
    return convert(*args, **kwargs)


def _indexes(node: Any, args: tuple) -> bool:
    """out[:, -1]: indexing a recurrent layer's outputs, which the converter of getitem translates."""
    return node.op == "call_function" and node.target is operator.getitem and isinstance(args[0], Sequence)


def _any_positions(args: tuple) -> bool:
    return any(isinstance(a, Positions) for a in args)


def _any_steps(args: tuple) -> bool:
    return any(isinstance(a, Sequence) for a in args)


def _per_position(node: Any, args: tuple, kwargs: dict) -> Positions | Sequence:
    """A function or method of sequences that is computed per position, on their rows."""
    if node.op == "call_method":
        convert, name = method(node.target), f"Tensor.{node.target}()"
        known = node.target in att.PER_POSITION_METHODS
    else:
        convert, name = functions().get(node.target), op_name(node.target)
        known = node.target in att.per_position_functions()
    if convert is None or not known:
        steps = ("; a recurrent layer's outputs stay per step: return them as they are (Y is their time-major "
                 "(L*n) x k rows) or take a step (out[:, -1])") if _any_steps(args) else ""
        raise ModelError(f"{name} of sequences is not translated; on sequences from_torch translates per-position "
                         f"layers and functions, elementwise arithmetic, MultiheadAttention, LSTM and GRU{steps}")
    return att.per_position(convert, args, kwargs, name)


def _is_detach(node: Any) -> bool:
    return (node.op == "call_method" and node.target == "detach") or (
        node.op == "call_function" and node.target is _torch().detach)


def _stopped(node: Any, value: Any, builder: _Builder) -> Any:
    """A value torch computes without autograd (a detach, or in
    torch.no_grad()): as it is where it depends on no trainable parameter
    (their gradients are the same either way), under sbp.stop_gradient
    where it does; a convolution's weight so computed is refused."""
    if not (_is_detach(node) or not node.meta.get("grad_enabled", True)):
        return value
    matrix = value.matrix if isinstance(value, (Images, Kernel)) else value
    used: set = getattr(matrix, "free_symbols", set()) & set(builder.symbols)
    if not used:
        return value
    if isinstance(value, Images):
        return Images(stop_gradient(value.matrix), value.channels, value.height, value.width)
    if isinstance(matrix, (sp.Expr, sp.MatrixExpr)) and not isinstance(value, Kernel):
        return stop_gradient(matrix)
    what = "Tensor.detach()" if _is_detach(node) else "a value computed in torch.no_grad()"
    names = ", ".join(sorted(builder.torch_names[str(s)] for s in used))
    raise ModelError(f"{what} of the parameters {names}, used as {type(value).__name__}: from_torch translates "
                     "it as a matrix or images only; compute it outside the forward, or freeze those parameters "
                     "(requires_grad=False)")


def _overwrite(node: Any, values: dict, writes: Writes) -> None:
    """An in-place write's result as the value of every node that is its
    tensor (Writes refused the writes where a view shares it)."""
    result, target = values[node], values[written(node)]
    matrix = result.matrix if isinstance(result, Images) else result
    shape = getattr(target.matrix if isinstance(target, Images) else target, "shape", None)
    if getattr(matrix, "shape", None) != shape:
        raise ModelError(f"an in-place write of shape {getattr(matrix, 'shape', result)} into a tensor of shape "
                         f"{shape}: torch does not broadcast the tensor written into")
    for alias in writes.aliases(written(node), values):  # images and their flattening: the same memory
        old = values[alias]
        values[alias] = Images(matrix, old.channels, old.height, old.width) if isinstance(old, Images) else matrix


def _network(module: Any, x: sp.MatrixExpr | Images, builder: _Builder, extra: list) -> sp.MatrixExpr:
    """The network's output: a torch.nn layer as it is, anything else traced
    (its forward's inputs x and, after it, those of `extra`)."""
    if _torch().fx.Tracer().is_leaf_module(module, ""):
        if extra:
            raise ModelError(f"the module: {type(module).__name__} as the network takes one input; wrap it in a "
                             "module whose forward(x, mask) passes the mask on")
        try:
            out = builder.layer(module, "", (x,), {})
        except (ModelError, sp.ShapeError) as error:
            raise ModelError(f"the module: {error}") from error
        if isinstance(out, Positions):  # a TransformerEncoderLayer as the network: (n, L, k), its n*L rows
            out = out.matrix
        if isinstance(out, Images):
            raise ModelError(f"the module: {type(module).__name__} returns images (batch, {out.channels}, "
                             f"{out.height}, {out.width}); from_torch converts a network returning (batch, outputs): "
                             "end it with nn.Flatten() and a Linear")
        return out
    graph = trace(module)
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    defaults = {node: node.args[0] for node in inputs[1 + len(extra):] if node.args}  # forward(x, h0, c0=None)
    if len(inputs) != 1 + len(extra) + len(defaults):
        raise ModelError(f"{type(module).__name__}.forward takes {[node.target for node in inputs]}; from_torch "
                         f"converts a forward of one input, the batch, and of a key padding mask after it where "
                         f"given one (from_torch(net, (x, mask))), or of an LSTM's or GRU's initial states "
                         f"(from_torch(net, (x, h0)) or (x, (h0, c0))); it was given {1 + len(extra)}")
    taken = {*builder.arrays, "X", "T", "batch"}
    given = {node: declared(item, node.target, BATCH, taken, builder.states) for node, item in zip(inputs[1:], extra)}
    given |= defaults
    writes = Writes(graph, module, lambda node: _where(node, module))
    values: dict[Any, Any] = {}
    node = None
    try:
        for node in graph.nodes:
            values[node] = given[node] if node in given else _stopped(
                node, _value(node, module, builder, values, x), builder)
            if writes_in_place(node, module):  # every name of what it overwrote reads its result, as in torch
                _overwrite(node, values, writes)
    except (ModelError, sp.ShapeError) as error:
        raise ModelError(f"{_where(node, module)}: {error}") from error
    out = values[next(node for node in graph.nodes if node.op == "output")]
    if isinstance(out, (Positions, Sequence)) and not getattr(out.matrix, "is_index", False):  # its rows
        out = out.matrix
    if isinstance(out, Images):
        raise ModelError(f"{type(module).__name__}.forward returns images (batch, {out.channels}, {out.height}, "
                         f"{out.width}); from_torch converts a forward returning (batch, outputs): flatten them "
                         "(torch.flatten(x, 1))")
    if not isinstance(out, sp.MatrixExpr) or not sp.sympify(out.shape[1]).is_Integer:
        raise ModelError(f"{type(module).__name__}.forward returns {out!r}; from_torch converts a forward "
                         "returning one (batch, outputs) tensor")
    return out


def _batch_input(builder: _Builder) -> Index:
    """The input `batch` (np.arange(n)), whose length binds n where no other
    input has a row a sequence: X's rows are L*n, and the targets of a loss
    per step are too."""
    if "batch" in builder.arrays:
        raise ModelError("a parameter is named 'batch', the name of the input that gives the number of sequences; "
                         "rename it")
    return Index("batch", BATCH)


def _loss(loss: Any, Y: sp.MatrixExpr, X: Any, reduction: str) -> tuple[Any, list]:
    """The model's loss of the output Y and its inputs: X, and the targets T
    (one row per row of Y: an example, or a position of sequences for attention)."""
    if loss is None:
        return None, [X]
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ModelError(f"from_torch's loss must be one of {sorted(LOSSES)}, a callable (Y, T) -> loss, "
                             f"or None; got {loss!r}")
        named = LOSSES[loss]
        T = Index("T", Y.shape[0]) if named.labels else sp.MatrixSymbol("T", Y.shape[0], Y.shape[1])
        return named.fn(Y, T, reduction), [X, T]
    T = sp.MatrixSymbol("T", Y.shape[0], Y.shape[1])
    return loss(Y, T), [X, T]


def _batch(shape: tuple, integer: bool, attention: Any, sequences: bool) -> tuple[Any, Any]:
    """The model's input X of an example's shape, and the network's: X or the Images, Sequence, Positions of X."""
    rows = POSITIONS if attention else ROWS if sequences else BATCH
    ids = len(shape) == 1 and integer
    X = Index("X", rows) if ids or (integer and (attention or sequences) and len(shape) == 2) else sp.MatrixSymbol(
        "X", rows, int(shape[-1] if sequences or attention else np.prod(shape[1:])))
    x = (Images(X, *(int(s) for s in shape[1:])) if len(shape) == 4 else Sequence(X, BATCH) if sequences
         else Positions(X, attention[1], BATCH, attention[0]) if attention else X)
    return X, x


def _no_padding(more: list) -> list:
    raise ModelError(f"from_torch was given {1 + len(more)} example inputs; the ones after the first are a key padding "
                     "mask (taken by a network with MultiheadAttention only) or an LSTM's or GRU's initial states")


def from_torch(module: Any, example_input: Any, loss: str | Callable[[sp.MatrixExpr, sp.MatrixSymbol], Any] | None = "mse",
               name: str = "from_torch", reduction: str = "mean") -> tuple[Model, TorchParams]:
    """A PyTorch network, and a loss, as a symbackprop Model and its
    parameters (see the module's docstring).

    Args:
        module: the network: a layer of `layers()`, a torch.nn.Sequential
            (nested ones too) of them, or a module whose forward torch.fx
            traces into those layers and the functions of `functions()`
            (Dropout in eval mode).
        example_input: an input batch (batch, features), a tensor or array:
            it fixes the number of features (the batch is the symbol n);
            or images (batch, C, H, W) (X is then n x C*H*W, their NCHW
            rows), or (batch,) integer ids for an Embedding (X an Index),
            or sequences (batch, L, features) or (L, batch, features) for
            an LSTM or GRU, or their (batch, L) token ids for an Embedding
            before it (X the time-major (L*n) x features rows or ids; the
            input `batch`, np.arange(n), where the outputs are per step), or
            sequences (batch, L, features) / (batch, L) token ids for a
            network with a MultiheadAttention (X the example-major n*L
            rows; (L, batch, ...) where it is not batch_first), with a
            key padding mask: a tuple (x, mask), mask (batch, L) bool or
            float, the forward's second input (the model's input
            padding, sbp.key_padding(mask)); of an LSTM or GRU, with its
            initial states, the forward's inputs after x: (x, h0, c0),
            (x, (h0, c0)), (x, h0), each (layers * directions, batch, H)
            (the model's (n, H) inputs h0 or h0_0, h0_1, ...: torch_rnn).
        loss: "mse" (torch.nn.MSELoss()), "cross_entropy"
            (torch.nn.CrossEntropyLoss() with class probabilities as
            targets, T (batch, classes)), "cross_entropy_labels" (the same
            with class numbers as targets: T is an Index, an integer array
            of batch entries), a callable (Y, T) -> a 1x1 symbackprop loss
            of the output Y and the targets T, or None (no loss: the model
            has only the output Y).
        name: the model's name.
        reduction: "mean" (the default) or "sum", as torch's losses' (for
            a named loss).

    Returns:
        (model, params): the Model (inputs X and T, output Y) and its
        parameters as float64 arrays by name (a TorchParams: its
        torch_names maps them back to the state_dict keys).

    Raises:
        ModelError: a layer or function that is not supported (named with
            the path of the module it is in), a forward torch.fx cannot
            trace, an example input that is not 2-D, 4-D or 1-D integers,
            an unknown loss, or a
            reduction with a loss that is not named.
    """
    example_input, *more = example_inputs(example_input)
    shape = tuple(np.shape(example_input.detach().cpu().numpy() if hasattr(example_input, "detach") else example_input))
    integer = np.issubdtype(_dtype(example_input), np.integer)
    ids = len(shape) == 1 and integer
    attention = att.attention_layout(module, shape, integer)
    sequences = len(shape) == (2 if integer else 3) and _recurrent(module) and attention is None
    if len(shape) not in (2, 4) and not ids and not sequences and attention is None:
        _refuse_by_layer(module, shape)
        raise ModelError(f"from_torch takes a (batch, features), (batch, C, H, W) or, for an Embedding, (batch,) "
                         f"integer example input; got shape {shape}")
    if reduction != "mean" and not isinstance(loss, str):
        raise ModelError(f"from_torch's reduction {reduction!r} applies to a named loss; the callable or None "
                         "loss reduces as it computes")
    refuse_hooks(module)
    X, x = _batch(shape, integer, attention, sequences)
    builder = _Builder()
    builder.attention = attention is not None
    paddings = att.padding_inputs(more, attention[1], POSITIONS) if attention else []
    extra = paddings if attention else states_examples(more) if sequences else _no_padding(more) if more else []
    Y = _network(module, x, builder, extra)
    loss_expr, inputs = _loss(loss, Y, X, reduction)
    inputs += builder.states
    if sequences and not any(BATCH in getattr(v, "shape", ()) for v in inputs):
        inputs.append(_batch_input(builder))
    running = {f"{key}_new": key for key in builder.updates}  # output -> the running statistic it updates
    inputs += [index for index in (builder.positions, builder.starts) if index is not None] + [p.column for p in paddings]
    model = Model(name, inputs=(*inputs, *builder.frozen), params=tuple(builder.symbols), loss=loss_expr,
                  outputs={"Y": Y, **{out: builder.updates[key] for out, key in running.items()}})
    return model, TorchParams(builder.arrays, builder.torch_names, builder.torch_shapes,
                              tuple(str(s) for s in builder.frozen), running)


__all__ = ["BATCH", "LOSSES", "Loss", "TorchParams", "from_torch", "functions", "layers"]
