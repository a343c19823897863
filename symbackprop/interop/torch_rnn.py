"""from_torch's recurrent layers: torch.nn.LSTM and torch.nn.GRU as an
`sbp.scan` over time, batched (`batch=n`), each layer one scan.

A sequence is a `Sequence`: the time-major (L*n) x features matrix whose
rows t*n .. t*n+n-1 are step t of the n sequences (torch's (L, n, F)
memory; a batch_first (n, L, F) tensor is x.transpose(0, 1).reshape(-1, F)).
The fused weights weight_ih_l{k} (G*H x in), weight_hh_l{k} (G*H x H) and
the biases bias_ih_l{k}, bias_hh_l{k} are one parameter each, sliced per
gate in torch's order (LSTM i, f, g, o; GRU r, z, n), so their gradients
are torch's parameters' own. The layer returns what torch's does: the
outputs (a Sequence, of which the last step `out[:, -1]` / `out[-1]` is
translated) and the final states, one (n, H) matrix a layer (`h[-1]`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.declare.activations import sigmoid, tanh
from symbackprop.declare.nn import linear, lstm_cell
from symbackprop.errors import ModelError
from symbackprop.loops.declare import final_state, scan


@dataclass(frozen=True)
class Sequence:
    """A batch of sequences: `matrix` the time-major (L*n) x features rows,
    `batch` the batch's symbol n, `batch_first` how the module that made it
    indexes it (None for the network's input), `last` its last step's
    (n, features) rows where known (a recurrent layer's final hidden state)."""

    matrix: sp.MatrixExpr
    batch: sp.Symbol
    batch_first: bool | None = None
    last: sp.MatrixExpr | None = None

    def step(self, index: Any) -> sp.MatrixExpr:
        """out[:, -1] (batch_first) or out[-1]: the last step, (n, features)."""
        index = index if isinstance(index, tuple) else (index,)
        while len(index) > 1 and index[-1] == slice(None):
            index = index[:-1]
        last = (slice(None), -1) if self.batch_first else (-1,)
        if self.last is None or index != last:
            wanted = "out[:, -1]" if self.batch_first else "out[-1]"
            raise ModelError(f"indexing a recurrent layer's outputs by {index!r} is not translated; only the last "
                             f"step ({wanted}, or the final state h_n[-1]) is")
        return self.last


def _gates(weight: sp.MatrixExpr, bias: sp.MatrixExpr | None, count: int, hidden: int) -> tuple[list, list]:
    """The per-gate slices of a fused weight (count*H x in) as (in, H)
    transposes, and of its bias row (None: no bias)."""
    rows = [slice(g * hidden, (g + 1) * hidden) for g in range(count)]
    return [weight[r, :].T for r in rows], [None if bias is None else bias[:, r] for r in rows]


def _plus(a: sp.MatrixExpr, b: sp.MatrixExpr | None) -> sp.MatrixExpr:
    return a if b is None else a + b


def _lstm_step(x: Any, state: tuple, weights: tuple, hidden: int) -> tuple:
    """torch.nn.LSTM's step: gates i, f, g, o of x W_ih^T + b_ih + h W_hh^T + b_hh."""
    w_ih, w_hh, b_ih, b_hh = weights
    W, bi = _gates(w_ih, b_ih, 4, hidden)
    U, bh = _gates(w_hh, b_hh, 4, hidden)
    zero = sp.ZeroMatrix(1, hidden)
    b = [_plus(_plus(zero, i), h) for i, h in zip(bi, bh)]
    return lstm_cell(x, state[0], state[1], W, U, b)


def _gru_step(x: Any, state: tuple, weights: tuple, hidden: int) -> tuple:
    """torch.nn.GRU's step, exactly: r = sigmoid(x W_ir^T + b_ir + h W_hr^T + b_hr),
    z likewise, n = tanh(x W_in^T + b_in + r * (h W_hn^T + b_hn)),
    h' = (1 - z) * n + z * h."""
    w_ih, w_hh, b_ih, b_hh = weights
    W, bi = _gates(w_ih, b_ih, 3, hidden)
    U, bh = _gates(w_hh, b_hh, 3, hidden)
    h = state[0]
    r = sigmoid(linear(x, W[0], bi[0]) + linear(h, U[0], bh[0]))
    z = sigmoid(linear(x, W[1], bi[1]) + linear(h, U[1], bh[1]))
    n = tanh(linear(x, W[2], bi[2]) + sp.HadamardProduct(r, linear(h, U[2], bh[2])))
    keep = z.applyfunc(lambda v: 1 - v)
    return (sp.HadamardProduct(keep, n) + sp.HadamardProduct(z, h),)


def _refuse(module: Any, kind: str, x: Any) -> None:
    """What the scan does not compute as torch does, named."""
    if not isinstance(x, Sequence):
        raise ModelError(f"{kind} takes a sequence: from_torch's example input (batch, L, features) or (L, batch, "
                         f"features), 3-D; got {x!r}")
    if module.bidirectional:
        raise ModelError(f"{kind}(bidirectional=True) is not supported yet: from_torch translates a "
                         f"unidirectional {kind} (a scan forward in time)")
    if getattr(module, "proj_size", 0):
        raise ModelError(f"{kind}(proj_size={module.proj_size}) is not supported yet")
    if module.dropout and module.training and module.num_layers > 1:
        raise ModelError(f"{kind}(dropout={module.dropout}) in training mode is not translated; call .eval()")


def recurrent_layer(module: Any, x: Any, param: Callable[[str], Any], kind: str) -> tuple:
    """torch.nn.LSTM / GRU called on a Sequence: (outputs, final states) as torch returns them."""
    _refuse(module, kind, x)
    step, states = (_lstm_step, 2) if kind == "LSTM" else (_gru_step, 1)
    hidden, n, seq = module.hidden_size, x.batch, x.matrix
    finals: list[list[sp.MatrixExpr]] = [[] for _ in range(states)]
    for layer in range(module.num_layers):
        weights = tuple(param(f"{key}_l{layer}") for key in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        base = str(weights[0])
        state = tuple(sp.MatrixSymbol(f"{base}_{s}", n, hidden) for s in "hc"[:states])
        inp = sp.MatrixSymbol(f"{base}_x", n, seq.shape[1])
        new = step(inp, state, weights, hidden)
        zero = sp.ZeroMatrix(n, hidden)
        seq = scan(new if states > 1 else new[0], new[0], state if states > 1 else state[0], inp,
                   (zero,) * states if states > 1 else zero, seq, batch=n)
        last = final_state(seq)
        for k, value in enumerate(last if states > 1 else (last,)):
            finals[k].append(value)
    out = Sequence(seq, n, bool(module.batch_first), finals[0][-1])
    if kind == "LSTM":
        return out, (tuple(finals[0]), tuple(finals[1]))
    return out, tuple(finals[0])


def lstm_layer(module: Any, x: Any, param: Callable[[str], Any]) -> tuple:
    return recurrent_layer(module, x, param, "LSTM")


def gru_layer(module: Any, x: Any, param: Callable[[str], Any]) -> tuple:
    return recurrent_layer(module, x, param, "GRU")


__all__ = ["Sequence", "gru_layer", "lstm_layer", "recurrent_layer"]
