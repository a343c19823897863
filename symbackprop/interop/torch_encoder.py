"""from_torch's transformer encoders: torch.nn.TransformerEncoderLayer and
torch.nn.TransformerEncoder as they compute, made of the translations of
their parts (torch_attention's MultiheadAttention, and the per-position
Linear, LayerNorm, Dropout and activation).

A layer is x + sa(norm1(x)), then + ff(norm2(.)) (norm_first), or
norm1(x + sa(x)), then norm2(. + ff(.)), with sa the self-attention
(under the layer's src_mask: none, or torch's causal one) followed by
dropout1 and ff linear2(dropout(activation(linear1))) followed by
dropout2; its activation relu, gelu (the strings, the functions or the
modules) or another per-position function or layer. An encoder is its
layers in turn, each given the encoder's mask, and its final norm where
it has one. Dropout is translated in eval mode or with p=0 only (it is
random otherwise); a src_key_padding_mask reaches the attention as it is
(the forward's second input, torch_attention.KeyPadding). The
decoder (TransformerDecoderLayer, TransformerDecoder, Transformer) attends
to a memory, cross-attention, and is refused.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

from symbackprop.errors import ModelError
from symbackprop.interop.torch_attention import per_position, per_position_functions
from symbackprop.interop.torch_ops import functions, op_name
from symbackprop.interop.torch_rnn import Sequence
from symbackprop.interop.torch_values import Positions, torch_module

# builder.layer: (module, its state_dict path, args, kwargs) -> what the module returns
Layer = Callable[[Any, str, tuple, dict], Any]


def is_transformer(module: Any) -> bool:
    """Whether module is one of torch's transformer layers (translated or refused here)."""
    tnn = torch_module().nn
    return isinstance(module, (tnn.TransformerEncoderLayer, tnn.TransformerEncoder, tnn.TransformerDecoderLayer,
                               tnn.TransformerDecoder, tnn.Transformer))


def transformer(module: Any, path: str, args: tuple, kwargs: dict, layer: Layer) -> Any:
    """What a TransformerEncoderLayer or TransformerEncoder computes on the
    sequences; the decoders refused."""
    tnn = torch_module().nn
    kind = type(module).__name__
    if not isinstance(module, (tnn.TransformerEncoderLayer, tnn.TransformerEncoder)):
        raise ModelError(f"{kind} is not translated: its decoder layers attend to a memory (cross-attention, "
                         "query and key/value different sequences), which symbackprop's self-attention does not "
                         "compute; from_torch translates TransformerEncoderLayer and TransformerEncoder")
    try:
        a = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError as error:
        raise ModelError(f"{kind} called with arguments from_torch does not translate ({error})") from error
    if not isinstance(next(iter(a.values())), Positions):
        raise ModelError(f"{kind} takes sequences: from_torch's example input (batch, L, features), or (L, "
                         "batch, features) where batch_first=False, or token ids into an Embedding")
    if isinstance(module, tnn.TransformerEncoder):
        return _stack(module, path, a, layer)
    return _encoder_layer(module, path, a, layer)


def _part(module: Any, path: str, name: str, layer: Layer, *args: Any, **kwargs: Any) -> Any:
    """Submodule `name` of module called on args, its errors named by that submodule."""
    try:
        return layer(module.get_submodule(name), f"{path}.{name}" if path else name, args, kwargs)
    except ModelError as error:
        raise ModelError(f"{name}: {error}") from error


def _stack(module: Any, path: str, a: dict, layer: Layer) -> Positions:
    """TransformerEncoder: its layers in turn under its mask, then its norm."""
    x = a["src"]
    masks = {"src_mask": a.get("mask"), "src_key_padding_mask": a.get("src_key_padding_mask"),
             "is_causal": bool(a.get("is_causal"))}
    for i in range(len(module.layers)):
        x = _part(module, path, f"layers.{i}", layer, x, **masks)
    return x if module.norm is None else _part(module, path, "norm", layer, x)


def _refuse_random(module: Any) -> None:
    dropouts = {module.dropout.p, module.dropout1.p, module.dropout2.p, module.self_attn.dropout}
    if module.training and max(dropouts) > 0:
        raise ModelError(f"TransformerEncoderLayer(dropout={max(dropouts)}) in training mode is random; call "
                         ".eval() on the network first (or make dropout 0)")


def _encoder_layer(module: Any, path: str, a: dict, layer: Layer) -> Positions:
    """TransformerEncoderLayer's forward, post-norm or pre-norm (norm_first)."""
    _refuse_random(module)

    def part(name: str, *args: Any, **kwargs: Any) -> Any:
        return _part(module, path, name, layer, *args, **kwargs)

    def attend(x: Positions) -> Positions:
        out, _ = part("self_attn", x, x, x, attn_mask=a.get("src_mask"),
                      key_padding_mask=a.get("src_key_padding_mask"), need_weights=False,
                      is_causal=bool(a.get("is_causal")))
        return part("dropout1", out)

    def feed_forward(x: Positions) -> Positions:
        hidden = _activation(module, path, part("linear1", x), layer)
        return part("dropout2", part("linear2", part("dropout", hidden)))

    x = a["src"]
    if module.norm_first:
        x = _sum(x, attend(part("norm1", x)))
        return _sum(x, feed_forward(part("norm2", x)))
    x = part("norm1", _sum(x, attend(x)))
    return part("norm2", _sum(x, feed_forward(x)))


def _sum(x: Positions, y: Positions) -> Positions:
    return _as_positions(per_position(operator.add, (x, y), {}, "a residual addition"))


def _as_positions(value: Positions | Sequence) -> Positions:
    """per_position's result of positions (a recurrent layer's steps never reach an encoder)."""
    assert isinstance(value, Positions), type(value)
    return value


def _activation(module: Any, path: str, x: Positions, layer: Layer) -> Positions:
    """The layer's activation: a module (nn.GELU()) translated as a layer, a
    function (F.relu, F.gelu, what the strings "relu" and "gelu" are) per position."""
    act = module.activation
    if isinstance(act, torch_module().nn.Module):
        return _part(module, path, "activation", layer, x)
    convert = functions().get(act) if act in per_position_functions() else None
    if convert is None:
        raise ModelError(f"TransformerEncoderLayer(activation={act!r}) is not translated; from_torch translates "
                         "\"relu\", \"gelu\", the per-position functions of torch_attention and the per-position "
                         "layers")
    return _as_positions(per_position(convert, (x,), {}, op_name(act)))


__all__ = ["is_transformer", "transformer"]
