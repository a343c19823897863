"""from_torch's attention: torch.nn.MultiheadAttention as symbackprop's
self-attention (nn.self_attention: causal under torch's causal attn_mask,
over every key without one), and the per-position layers of a
transformer around it.

A network with a MultiheadAttention takes sequences: an example input of
(batch, L, features) floats or (batch, L) integer token ids for an
Embedding ((L, batch, ...) where its attention is not batch_first). Its
values are `Positions`: the example-major (n*L) x features rows, sequence
e's L consecutive rows (what nn.causal_attention reads: the memory of a
batch_first tensor; pass x.transpose(0, 1).reshape(-1, F) for an (L, n, F)
one). Linear, LayerNorm, the activations, Dropout (eval), Embedding and
elementwise arithmetic apply per position, on the rows as on a batch;
anything that mixes positions otherwise (indexing, reshapes, reductions
over L) is refused. The fused in_proj_weight (3d x d) and in_proj_bias
stay one parameter each, sliced per q, k, v where they are used.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.declare.attention import Sequences, first_positions, self_attention, sequence_mean
from symbackprop.declare.tensor import Index, gather
from symbackprop.errors import ModelError
from symbackprop.interop.torch_rnn import Sequence
from symbackprop.interop.torch_values import Positions, torch_module

# torch.nn layers that act on each position alone (on the (n*L) x F rows as on a batch)
PER_POSITION_LAYERS = frozenset({"Linear", "LayerNorm", "Dropout", "Identity", "ReLU", "Tanh", "Sigmoid", "SiLU",
                                 "GELU", "Softplus", "LeakyReLU", "ELU", "Embedding"})
PER_POSITION_METHODS = frozenset({"add", "sub", "mul", "div", "neg", "pow", "relu", "tanh", "sigmoid"})


def per_position_functions() -> frozenset:
    """The torch functions (and operators) computed per position or elementwise."""
    torch = torch_module()
    F = torch.nn.functional
    return frozenset({
        operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
        torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.neg, torch.pow,
        torch.relu, torch.tanh, torch.sigmoid, F.linear, F.layer_norm, F.dropout, F.relu, F.tanh, F.sigmoid,
        F.silu, F.gelu, F.softplus, F.leaky_relu, F.elu, F.embedding,
    })


def attention_layout(module: Any, shape: tuple, integer: bool) -> tuple[bool, int] | None:
    """(batch_first, L) where the network has a MultiheadAttention and the
    example input is sequences ((batch, L, F) floats or (batch, L) ids, or
    (L, batch, ...) for batch_first=False); None otherwise."""
    kind = torch_module().nn.MultiheadAttention
    found = [(path, sub) for path, sub in module.named_modules()
             if isinstance(sub, kind)] if hasattr(module, "named_modules") else []
    if not found:
        return None
    if len(shape) != (2 if integer else 3):
        raise ModelError(f"{found[0][0] or 'the module'}: MultiheadAttention takes sequences: from_torch's example "
                         "input (batch, L, features) floats or (batch, L) token ids for an Embedding ((L, batch, "
                         f"...) where batch_first=False); got shape {shape}")
    layouts = {bool(sub.batch_first) for _, sub in found}
    if len(layouts) > 1:
        paths = ", ".join(f"{path or 'the module'} (batch_first={sub.batch_first})" for path, sub in found)
        raise ModelError(f"MultiheadAttention layers of both layouts: {paths}; from_torch reads the example "
                         "input in one")
    batch_first = layouts.pop()
    return batch_first, int(shape[1] if batch_first else shape[0])


def concrete(value: Any) -> bool:
    """Whether a value is known when tracing (a buffer, a constant tensor,
    numbers, dtypes), not a symbolic one: a call on such values is run by torch."""
    torch = torch_module()
    if isinstance(value, (tuple, list)):
        return all(concrete(v) for v in value)
    if isinstance(value, dict):
        return all(concrete(v) for v in value.values())
    if isinstance(value, slice):
        return concrete((value.start, value.stop, value.step))
    if isinstance(value, torch.Tensor):
        return not value.requires_grad
    return value is None or value is Ellipsis or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


def fold(node: Any, args: tuple, kwargs: dict) -> Any:
    """A call on concrete values, as torch computes it (a mask, torch.arange)."""
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def has_positions(args: tuple, kwargs: dict) -> bool:
    """Whether an argument is sequences (for attention, or a recurrent layer's rows)."""
    return any(isinstance(v, (Positions, Sequence)) for v in (*args, *kwargs.values()))


def reads_shape(node: Any, args: tuple) -> bool:
    """x.size(...), x.shape or x.device of sequences."""
    if not args or not isinstance(args[0], Positions):
        return False
    if node.op == "call_method":
        return node.target == "size"
    return node.target is getattr and len(args) == 2 and args[1] in ("shape", "device")


def shape_or_device(node: Any, args: tuple, kwargs: dict) -> Any:
    """torch's shape of sequences ((n, L, ...) or (L, n, ...), n a symbol), an entry of it, or the cpu device."""
    x = args[0]
    if node.op == "call_function" and args[1] == "device":
        return torch_module().device("cpu")
    shape = x.shape()
    dim = (args[1] if len(args) > 1 else kwargs.get("dim")) if node.op == "call_method" else None
    if dim is None:
        return shape
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        raise ModelError(f"Tensor.size({dim!r}) of sequences {shape}")
    return shape[dim]


def _layout(seqs: Any) -> tuple:
    """What sequences must share to be computed on row by row: their kind,
    length and batch (a recurrent layer's rows: their batch and time-major
    order, whatever layout torch indexes them by)."""
    if isinstance(seqs, Sequence):
        return (Sequence, seqs.batch)
    return (Positions, seqs.length, seqs.batch_first)


def per_position(convert: Callable[..., Any], args: tuple, kwargs: dict, what: str) -> Positions | Sequence:
    """convert on the rows of the sequences among the arguments, as sequences again."""
    seqs = [v for v in (*args, *kwargs.values()) if isinstance(v, (Positions, Sequence))]
    first = next((s for s in seqs if s.batch_first is not None), seqs[0])  # the layout torch indexes by
    if any(_layout(s) != _layout(first) for s in seqs):
        raise ModelError(f"{what} of sequences of different lengths or layouts")

    def rows(v: Any) -> Any:
        return v.matrix if isinstance(v, (Positions, Sequence)) else v

    return first.like(convert(*(rows(a) for a in args), **{k: rows(v) for k, v in kwargs.items()}))


def position_rows(ids: Any, table: Any) -> Any:
    """Embedding of constant ids, torch.arange(L): the table's first L rows (a positional embedding)."""
    torch = torch_module()
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or not torch.equal(ids.cpu(), torch.arange(len(ids))):
        raise ModelError(f"Embedding of the constant ids {ids!r}: from_torch translates constant ids "
                         "torch.arange(L) only (a positional embedding added to the sequences)")
    return table if len(ids) == table.shape[0] else table[0:len(ids), :]


def add_positions(args: tuple, positions: Callable[[], Index]) -> tuple:
    """The terms of a sum with sequences, where one is an (L, features)
    matrix (a positional table, or its first L rows): torch broadcasts it
    over the batch, row t to position t of each sequence; it is the
    table's rows at the positions Index (nn.add_positions)."""
    seq = next(a for a in args if isinstance(a, Positions))
    out = []
    for a in args:
        if isinstance(a, sp.MatrixExpr) and seq.length > 1 and a.shape == (seq.length, seq.matrix.shape[1]):
            if not seq.batch_first:
                raise ModelError("an (L, features) tensor added to sequences (L, batch, features): torch broadcasts "
                                 "it over the batch, not the positions; this is translated for batch_first "
                                 "sequences only")
            if isinstance(a, sp.MatrixSlice) and a.rowslice[0] == 0 and tuple(a.colslice) == (0, a.shape[1], 1):
                a = a.parent  # its first L rows: the positions 0..L-1 read the same ones
            a = seq.like(gather(a, positions()))
        out.append(a)
    return tuple(out)


def causal_mask(mask: Any, length: int) -> bool:
    """Whether mask is torch's causal attn_mask of L x L: True (bool) or
    -inf (float) above the diagonal, False / 0 elsewhere."""
    torch = torch_module()
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (length, length):
        return False
    upper = torch.triu(torch.ones(length, length, dtype=torch.bool, device=mask.device), diagonal=1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    if not mask.is_floating_point():
        return False
    return bool((mask[upper] == -float("inf")).all()) and bool((mask[~upper] == 0).all())


@dataclass(frozen=True)
class KeyPadding:
    """The forward's second input, a key padding mask (n, L): the model's
    m x 1 input `column` (sbp.key_padding(mask)), added to each key's scores."""

    column: sp.MatrixExpr

    def __repr__(self) -> str:
        return ("the key padding mask (the forward's second input), which only MultiheadAttention's "
                "key_padding_mask (TransformerEncoder's src_key_padding_mask) takes")


def padding_inputs(extra: list, length: int, rows: sp.Expr) -> list[KeyPadding]:
    """The forward's inputs after the first, for a network with attention
    on sequences of `length`: one key padding mask (n, L), bool or float,
    as the model's input `padding`."""
    if not extra:
        return []
    mask_shape = tuple(getattr(extra[0], "shape", ()))
    if len(extra) != 1 or len(mask_shape) != 2 or mask_shape[1] != length:
        raise ModelError(f"from_torch's example inputs after the first are one key padding mask (batch, L) for a "
                         f"network with MultiheadAttention; got {len(extra)} more of shapes "
                         f"{[tuple(getattr(e, 'shape', ())) for e in extra]}")
    return [KeyPadding(sp.MatrixSymbol("padding", rows, 1))]


class Unused:
    """MultiheadAttention's weights (need_weights=True): not translated; refused where used."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return (f"the attention weights of {self.path or 'the module'} (need_weights=True), which are not "
                "translated: use only its output")


def masks_nothing(mask: Any) -> bool:
    """Whether mask is an attn_mask that masks nothing: all False (bool) or all 0 (float)."""
    torch = torch_module()
    if not isinstance(mask, torch.Tensor):
        return False
    return not bool(mask.any()) if mask.dtype == torch.bool or mask.is_floating_point() else False


def _refuse(module: Any, a: dict, length: int) -> bool:
    """What symbackprop's self-attention does not compute as torch does,
    named; else whether the attention is causal (False: no mask, every key)."""
    query = a["query"]
    if not isinstance(query, Positions) or getattr(query.matrix, "is_index", False):
        raise ModelError("MultiheadAttention takes sequences: from_torch's example input (batch, L, features), "
                         "or (L, batch, features) where batch_first=False, or token ids into an Embedding")
    if not (query is a["key"] and query is a["value"]):
        raise ModelError("MultiheadAttention with different query, key and value (cross-attention) is not "
                         "translated; from_torch translates self-attention, mha(x, x, x) or mha(x, x, x, attn_mask=causal)")
    if not module._qkv_same_embed_dim:
        raise ModelError(f"MultiheadAttention(kdim={module.kdim}, vdim={module.vdim}) with embed_dim="
                         f"{module.embed_dim}: separate key/value projections are not translated")
    if module.bias_k is not None or module.add_zero_attn:
        raise ModelError("MultiheadAttention(add_bias_kv=True or add_zero_attn=True) is not translated")
    if a.get("key_padding_mask") is not None and not isinstance(a["key_padding_mask"], KeyPadding):
        raise ModelError("MultiheadAttention's key_padding_mask is a constant of the module (a buffer, or made of "
                         "constants): from_torch translates one that is the forward's second input, "
                         "forward(x, mask) translated by from_torch(net, (x, mask)) (the model's input padding, "
                         "sbp.key_padding(mask))")
    if module.dropout and module.training:
        raise ModelError(f"MultiheadAttention(dropout={module.dropout}) in training mode is random; call .eval()")
    mask, hinted = a.get("attn_mask"), a.get("is_causal", False) and not a.get("need_weights", True)
    if mask is None and a.get("is_causal", False):
        raise ModelError("MultiheadAttention(is_causal=True) without an attn_mask: torch takes is_causal as a hint "
                         "about the mask; pass the causal attn_mask too")
    if mask is None or masks_nothing(mask):
        return False
    if not hinted and not causal_mask(mask, length):
        shape = tuple(mask.shape) if hasattr(mask, "shape") else mask
        raise ModelError(f"MultiheadAttention's attn_mask {shape} is neither the causal mask of {length} x {length} "
                         "(True or -inf above the diagonal, False or 0 elsewhere) nor one that masks nothing; "
                         "symbackprop's attention reads every key or the keys up to the query, no other pattern")
    return True


def mha_layer(module: Any, path: str, args: tuple, kwargs: dict, param: Callable[[str], Any]) -> tuple:
    """torch.nn.MultiheadAttention(x, x, x), with attn_mask=causal or none:
    (output, weights) as torch returns them, the weights refused where used."""
    try:
        a = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError as error:
        raise ModelError(f"MultiheadAttention called with arguments from_torch does not translate ({error}); it "
                         "translates mha(x, x, x) and mha(x, x, x, attn_mask=causal mask)") from error
    query = a["query"]
    length = query.length if isinstance(query, Positions) else 0
    causal = _refuse(module, a, length)
    d, heads = module.embed_dim, module.num_heads
    w, b = param("in_proj_weight"), param("in_proj_bias")
    rows = [slice(k * d, (k + 1) * d) for k in range(3)]
    wq, wk, wv = (w[r, :].T for r in rows)
    biases = (*(None if b is None else b[:, r] for r in rows), param("out_proj.bias"))
    padding = a.get("key_padding_mask")
    out = self_attention(Sequences(query.matrix, length), wq, wk, wv, param("out_proj.weight").T, heads,
                         biases=biases, causal=causal, key_bias=padding.column if padding is not None else None)
    assert isinstance(out, Sequences)
    return query.like(out.matrix), Unused(path) if a.get("need_weights", True) else None


def _positions_dim(dim: Any, x: Positions) -> bool:
    """Whether dim (an int, or a tuple of one) is the positions' (L's) dimension of x's torch shape."""
    dim = dim[0] if isinstance(dim, tuple) and len(dim) == 1 else dim
    along = 1 if x.batch_first else 0
    return isinstance(dim, int) and dim in (along, along - 3)


def _first_index(index: Any, x: Positions) -> bool:
    """Whether index is x[:, 0] (batch_first) or x[0], what a classifier reads (its first token)."""
    index = index if isinstance(index, tuple) else (index,)
    while len(index) > 1 and index[-1] == slice(None):
        index = index[:-1]
    return index == ((slice(None), 0) if x.batch_first else (0,))


def pooled(node: Any, args: tuple, kwargs: dict, starts: Callable[[], Index]) -> sp.MatrixExpr | None:
    """x.mean over the positions (x.mean(1), torch.mean(x, dim=1); dim 0
    where not batch_first) or the first position (x[:, 0], x[0]) of
    sequences, as the (n, features) matrix (nn.sequence_mean,
    nn.first_positions at the rows `starts`); None for anything else."""
    x = args[0] if args else None
    if not isinstance(x, Positions) or getattr(x.matrix, "is_index", False):
        return None
    mean = node.target == "mean" if node.op == "call_method" else node.target is torch_module().mean
    if mean and set(kwargs) <= {"dim", "keepdim"} and not kwargs.get("keepdim", False) and len(args) <= 2 and \
            _positions_dim(args[1] if len(args) > 1 else kwargs.get("dim"), x):
        return sequence_mean(Sequences(x.matrix, x.length), starts())
    if node.op == "call_function" and node.target is operator.getitem and _first_index(args[1], x):
        return first_positions(Sequences(x.matrix, x.length), starts())
    return None


def is_attention(module: Any) -> bool:
    return isinstance(module, torch_module().nn.MultiheadAttention)


__all__ = [
    "PER_POSITION_LAYERS",
    "PER_POSITION_METHODS",
    "KeyPadding",
    "Unused",
    "add_positions",
    "attention_layout",
    "causal_mask",
    "concrete",
    "fold",
    "has_positions",
    "is_attention",
    "mha_layer",
    "padding_inputs",
    "per_position",
    "per_position_functions",
    "pooled",
    "position_rows",
    "reads_shape",
    "shape_or_device",
]
