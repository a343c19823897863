"""from_torch's attention: torch.nn.MultiheadAttention as symbackprop's
causal self-attention (nn.self_attention), and the per-position layers of
a transformer around it.

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
from typing import Any

import sympy as sp

from symbackprop.declare.attention import Sequences, self_attention
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


class Unused:
    """MultiheadAttention's weights (need_weights=True): not translated; refused where used."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return (f"the attention weights of {self.path or 'the module'} (need_weights=True), which are not "
                "translated: use only its output")


def _refuse(module: Any, a: dict, length: int) -> None:
    """What symbackprop's causal self-attention does not compute as torch does, named."""
    query = a["query"]
    if not isinstance(query, Positions) or getattr(query.matrix, "is_index", False):
        raise ModelError("MultiheadAttention takes sequences: from_torch's example input (batch, L, features), "
                         "or (L, batch, features) where batch_first=False, or token ids into an Embedding")
    if not (query is a["key"] and query is a["value"]):
        raise ModelError("MultiheadAttention with different query, key and value (cross-attention) is not "
                         "translated; from_torch translates self-attention, mha(x, x, x, attn_mask=causal)")
    if not module._qkv_same_embed_dim:
        raise ModelError(f"MultiheadAttention(kdim={module.kdim}, vdim={module.vdim}) with embed_dim="
                         f"{module.embed_dim}: separate key/value projections are not translated")
    if module.bias_k is not None or module.add_zero_attn:
        raise ModelError("MultiheadAttention(add_bias_kv=True or add_zero_attn=True) is not translated")
    if a.get("key_padding_mask") is not None:
        raise ModelError("MultiheadAttention with a key_padding_mask is not translated (symbackprop's attention "
                         "masks the keys after each query only)")
    if module.dropout and module.training:
        raise ModelError(f"MultiheadAttention(dropout={module.dropout}) in training mode is random; call .eval()")
    mask, hinted = a.get("attn_mask"), a.get("is_causal", False) and not a.get("need_weights", True)
    if mask is None:
        raise ModelError("MultiheadAttention without a causal attn_mask: symbackprop's attention is causal only; "
                         f"pass attn_mask=torch.triu(torch.ones({length}, {length}, dtype=torch.bool), diagonal=1) "
                         "(or a float mask of -inf above the diagonal), with is_causal=True if you like")
    if not hinted and not causal_mask(mask, length):
        shape = tuple(mask.shape) if hasattr(mask, "shape") else mask
        raise ModelError(f"MultiheadAttention's attn_mask {shape} is not the causal mask of {length} x {length} "
                         "(True or -inf above the diagonal, False or 0 elsewhere); symbackprop's attention is "
                         "causal only")


def mha_layer(module: Any, path: str, args: tuple, kwargs: dict, param: Callable[[str], Any]) -> tuple:
    """torch.nn.MultiheadAttention(x, x, x, attn_mask=causal): (output, weights) as torch returns them,
    the weights refused where used."""
    try:
        a = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError as error:
        raise ModelError(f"MultiheadAttention called with arguments from_torch does not translate ({error}); it "
                         "translates mha(x, x, x, attn_mask=causal mask)") from error
    query = a["query"]
    length = query.length if isinstance(query, Positions) else 0
    _refuse(module, a, length)
    d, heads = module.embed_dim, module.num_heads
    w, b = param("in_proj_weight"), param("in_proj_bias")
    rows = [slice(k * d, (k + 1) * d) for k in range(3)]
    wq, wk, wv = (w[r, :].T for r in rows)
    biases = (*(None if b is None else b[:, r] for r in rows), param("out_proj.bias"))
    out = self_attention(Sequences(query.matrix, length), wq, wk, wv, param("out_proj.weight").T, heads,
                         biases=biases)
    assert isinstance(out, Sequences)
    return query.like(out.matrix), Unused(path) if a.get("need_weights", True) else None


def is_attention(module: Any) -> bool:
    return isinstance(module, torch_module().nn.MultiheadAttention)


__all__ = [
    "PER_POSITION_LAYERS",
    "PER_POSITION_METHODS",
    "Unused",
    "add_positions",
    "attention_layout",
    "causal_mask",
    "concrete",
    "fold",
    "has_positions",
    "is_attention",
    "mha_layer",
    "per_position",
    "per_position_functions",
    "position_rows",
    "reads_shape",
    "shape_or_device",
]
