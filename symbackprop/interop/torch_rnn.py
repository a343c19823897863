"""from_torch's recurrent layers: torch.nn.LSTM and torch.nn.GRU as an
`sbp.scan` over time, batched (`batch=n`), each layer and direction one scan.

A sequence is a `Sequence`: the time-major (L*n) x features matrix whose
rows t*n .. t*n+n-1 are step t of the n sequences (torch's (L, n, F)
memory; a batch_first (n, L, F) tensor is x.transpose(0, 1).reshape(-1, F)),
or the Index of L*n token ids in that order for an Embedding. The fused
weights weight_ih_l{k} (G*H x in), weight_hh_l{k} (G*H x H) and the biases
bias_ih_l{k}, bias_hh_l{k} (and their _reverse twins) are one parameter
each, sliced per gate in torch's order (LSTM i, f, g, o; GRU r, z, n), so
their gradients are torch's parameters' own. The layer returns what torch's
does: the outputs, a Sequence of the same rows (the directions side by
side, per step), on which the per-step layers apply (from_torch.py) and of
which the last and first steps (out[:, -1], out[:, 0]) are translated; and
the final states, one (n, H) matrix a layer and direction in torch's h_n
order (layer 0 forward, layer 0 backward, layer 1 forward, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.declare.activations import sigmoid, tanh
from symbackprop.declare.nn import column_blocks, concat_columns, linear, lstm_cell
from symbackprop.errors import ModelError
from symbackprop.loops.declare import final_state, scan


@dataclass(frozen=True)
class Sequence:
    """A batch of sequences: `matrix` the time-major (L*n) x features rows
    (or an Index of L*n token ids), `batch` the batch's symbol n,
    `batch_first` how the module that made it indexes it (None for the
    network's input and what is computed from it per step), `last` its
    last step's (n, features) rows where known (a recurrent layer's final
    hidden state)."""

    matrix: Any
    batch: sp.Symbol
    batch_first: bool | None = None
    last: sp.MatrixExpr | None = None

    def like(self, matrix: Any) -> Sequence:
        """matrix, computed per step from this one's rows, as a Sequence of the same layout."""
        return Sequence(matrix, self.batch, self.batch_first)

    def step(self, index: Any) -> sp.MatrixExpr:
        """out[:, -1] or out[:, 0] (batch_first), out[-1] or out[0]: the last or the first step, (n, features)."""
        index = index if isinstance(index, tuple) else (index,)
        while len(index) > 1 and index[-1] == slice(None):
            index = index[:-1]
        at = (slice(None),) if self.batch_first else ()
        if self.batch_first is None or index not in ((*at, -1), (*at, 0)) or getattr(self.matrix, "is_index", False):
            wanted = "out[:, -1] or out[:, 0]" if self.batch_first else "out[-1] or out[0]"
            raise ModelError(f"indexing a recurrent layer's outputs by {index!r} is not translated; only the last "
                             f"or the first step ({wanted}, or the final state h_n[-1]) is")
        if index[-1] == -1 and self.last is not None:
            return self.last
        return end_rows(self.matrix, self.batch, first=index[-1] == 0)


def end_rows(rows: sp.MatrixExpr, batch: sp.Symbol, first: bool) -> sp.MatrixExpr:
    """The last (or first) step's n rows of time-major rows: the final state of
    a scan that keeps the rows it reads (run backwards for the first), a
    copy of N*F entries where a slice would need N - n as a number."""
    width = rows.shape[1]
    kept, read = sp.MatrixSymbol(f"end_{width}_kept", batch, width), sp.MatrixSymbol(f"end_{width}_row", batch, width)
    return scan(read, None, kept, read, sp.ZeroMatrix(batch, width), rows, batch=batch, reverse=first)


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
    """What the scans do not compute as torch does, named with what to do."""
    if not isinstance(x, Sequence):
        raise ModelError(f"{kind} takes a sequence: from_torch's example input (batch, L, features) or (L, batch, "
                         f"features), 3-D, or (batch, L) token ids into an Embedding; got {x!r}")
    if getattr(x.matrix, "is_index", False):
        raise ModelError(f"{kind} of token ids: embed them first (an nn.Embedding before the {kind})")
    if getattr(module, "proj_size", 0):
        raise ModelError(f"{kind}(proj_size={module.proj_size}) is not translated; use proj_size=0 and a Linear "
                         "on the outputs")
    if module.dropout and module.training and module.num_layers > 1:
        raise ModelError(f"{kind}(dropout={module.dropout}) in training mode is random between the layers and not "
                         "translated; call .eval() (or set dropout=0)")


def _parts(seq: sp.MatrixExpr) -> list[sp.MatrixExpr]:
    """The sequences side by side in seq (a bidirectional layer's outputs):
    the blocks of concat_columns where they tile its columns, else [seq]."""
    blocks = sorted(column_blocks(seq) or [], key=lambda found: found[1])
    starts = [sum(int(b.shape[1]) for b, _ in blocks[:k]) for k in range(len(blocks))]
    if not blocks or starts != [start for _, start in blocks] or sum(int(b.shape[1]) for b, _ in blocks) != seq.shape[1]:
        return [seq]
    return [block for block, _ in blocks]


def _direction(step: Callable, seq: sp.MatrixExpr, weights: tuple, initial: tuple, hidden: int, n: sp.Symbol,
               reverse: bool) -> tuple[sp.MatrixExpr, tuple]:
    """One layer's scan in one direction from the `initial` states (h, or
    h and c): (its outputs, (N x H), its final states). A layer below's
    directions are read as two sequences: the step multiplies each by its
    columns of the weights (nn.linear of blocks side by side), never
    computing them side by side."""
    states = len(initial)
    base = str(weights[0])  # weight_ih_l{k}[_reverse]'s name: the scan's symbols, apart from every other's
    state = tuple(sp.MatrixSymbol(f"{base}_{s}", n, hidden) for s in "hc"[:states])
    parts = _parts(seq)
    inputs = [sp.MatrixSymbol(f"{base}_x{k if len(parts) > 1 else ''}", n, p.shape[1]) for k, p in enumerate(parts)]
    new = step(concat_columns(inputs), state, weights, hidden)
    out = scan(new if states > 1 else new[0], new[0], state if states > 1 else state[0], tuple(inputs),
               initial if states > 1 else initial[0], tuple(parts), batch=n, reverse=reverse)
    last = final_state(out)
    return out, tuple(last) if states > 1 else (last,)


def initial_states(module: Any, kind: str, hx: Any, n: sp.Symbol) -> list[tuple]:
    """The initial states of each layer and direction (torch's h_0 order):
    (h,) for a GRU, (h, c) for an LSTM, each (n, H); zeros where hx is
    None. Given, hx is as torch's: h_0, or (h_0, c_0) for an LSTM, each a
    sequence of one (n, H) matrix a layer and direction (a model's input
    from an initial state tensor, or a recurrent layer's final states)."""
    count, hidden = module.num_layers * (2 if module.bidirectional else 1), module.hidden_size
    states = 2 if kind == "LSTM" else 1
    if hx is None:
        return [(sp.ZeroMatrix(n, hidden),) * states] * count
    given = tuple(hx) if kind == "LSTM" and isinstance(hx, (tuple, list)) and len(hx) == 2 else (hx,)
    wanted = "(h_0, c_0)" if kind == "LSTM" else "h_0"
    if len(given) != states or not all(isinstance(h, (tuple, list)) and len(h) == count for h in given):
        raise ModelError(f"{kind}'s initial states must be {wanted}, each of {count} layers and directions "
                         f"(num_layers * directions, batch, {hidden}) as torch's; got {hx!r}")
    for h in (h for group in given for h in group):
        if not isinstance(h, sp.MatrixExpr) or tuple(h.shape) != (n, hidden):
            raise ModelError(f"{kind}'s initial state {h!r} has shape {getattr(h, 'shape', None)}; one layer and "
                             f"direction's is (batch, {hidden})")
    return [tuple(group[k] for group in given) for k in range(count)]


def recurrent_layer(module: Any, x: Any, param: Callable[[str], Any], kind: str, hx: Any = None) -> tuple:
    """torch.nn.LSTM / GRU called on a Sequence, from the initial states hx
    (see initial_states): (outputs, final states) as torch returns them."""
    _refuse(module, kind, x)
    step, states = (_lstm_step, 2) if kind == "LSTM" else (_gru_step, 1)
    hidden, n, seq = module.hidden_size, x.batch, x.matrix
    suffixes = ("", "_reverse") if module.bidirectional else ("",)
    initial = initial_states(module, kind, hx, n)
    finals: list[list[sp.MatrixExpr]] = [[] for _ in range(states)]  # h_n (c_n): layer-major, then direction
    for layer in range(module.num_layers):
        outs = []
        for reverse, suffix in enumerate(suffixes):
            weights = tuple(param(f"{key}_l{layer}{suffix}") for key in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
            start = initial[layer * len(suffixes) + reverse]
            out, last = _direction(step, seq, weights, start, hidden, n, bool(reverse))
            outs.append(out)
            for k, value in enumerate(last):
                finals[k].append(value)
        seq = concat_columns(outs) if len(outs) > 1 else outs[0]
    last_step = None if module.bidirectional else finals[0][-1]  # the backward direction's is its first step's
    out = Sequence(seq, n, bool(module.batch_first), last_step)
    if kind == "LSTM":
        return out, (tuple(finals[0]), tuple(finals[1]))
    return out, tuple(finals[0])


def lstm_layer(module: Any, x: Any, param: Callable[[str], Any], hx: Any = None) -> tuple:
    return recurrent_layer(module, x, param, "LSTM", hx)


def gru_layer(module: Any, x: Any, param: Callable[[str], Any], hx: Any = None) -> tuple:
    return recurrent_layer(module, x, param, "GRU", hx)


class GivenStates(tuple):
    """The model's inputs a forward argument `name` (an initial state
    tensor) is made of, one (n, H) matrix a layer and direction: the hx of
    an LSTM or GRU as they are, and nothing else (named so in refusals)."""

    name: str

    def __new__(cls, symbols: list[sp.MatrixSymbol], name: str) -> GivenStates:
        made = super().__new__(cls, symbols)
        made.name = name
        return made

    def __repr__(self) -> str:
        return (f"the initial states {self.name} (the model's inputs {', '.join(map(str, self))}), which from_torch "
                "translates only as an LSTM's or GRU's hx as given")


@dataclass(frozen=True)
class StatesExample:
    """An example initial state given to from_torch after the sequences:
    `shape` (num_layers * directions, batch, H) of a tensor, or a tuple of
    them ((h_0, c_0) as one forward argument)."""

    shape: Any

    def declare(self, name: str, n: sp.Symbol) -> tuple[Any, list[sp.MatrixSymbol]]:
        """The forward argument `name`'s value, and the model's inputs it
        is made of: one (n, H) matrix a layer and direction, named `name`
        (one) or name_0, name_1, ... (torch's h_0[k]); a tuple's k-th
        tensor's named name_k first."""
        if isinstance(self.shape, tuple) and all(isinstance(s, tuple) for s in self.shape):
            parts = [StatesExample(s).declare(f"{name}_{k}", n) for k, s in enumerate(self.shape)]
            return tuple(value for value, _ in parts), [symbol for _, symbols in parts for symbol in symbols]
        count, _, hidden = self.shape
        symbols = [sp.MatrixSymbol(name if count == 1 else f"{name}_{k}", n, hidden) for k in range(count)]
        return GivenStates(symbols, name), symbols


def states_examples(more: list) -> list[StatesExample]:
    """The examples after the sequences, for a network with an LSTM or GRU:
    initial states, each a (num_layers * directions, batch, H) tensor or a
    tuple of them."""
    def shape_of(example: Any) -> Any:
        if isinstance(example, (tuple, list)):
            return tuple(shape_of(e) for e in example)
        shape = tuple(int(d) for d in getattr(example, "shape", ()))
        if len(shape) != 3:
            raise ModelError(f"from_torch's example inputs after the sequences are initial states of an LSTM or GRU, "
                             f"each (num_layers * directions, batch, hidden) (or a tuple (h_0, c_0) of them); "
                             f"got one of shape {shape}")
        return shape

    return [StatesExample(shape_of(example)) for example in more]


def without_states(args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
    """An LSTM's or GRU's call's (args, kwargs) less its initial states hx
    (second, or by name; None where not given: the zero states), and hx."""
    kwargs = dict(kwargs)
    hx = kwargs.pop("hx", None) if len(args) == 1 else args[1] if len(args) == 2 else None
    return args[:1] if len(args) == 2 else args, kwargs, hx


def declared(item: Any, name: str, n: sp.Symbol, taken: set[str], inputs: list[sp.MatrixSymbol]) -> Any:
    """A forward input's value: of an initial state, the model's inputs
    named after the forward's argument `name` (see StatesExample.declare),
    appended to `inputs`; item itself otherwise (a key padding mask)."""
    if not isinstance(item, StatesExample):
        return item
    value, symbols = item.declare(name, n)
    for symbol in symbols:
        if str(symbol) in taken:
            raise ModelError(f"the forward's input {name!r} would be the model's input {symbol}, a name taken by a "
                             "parameter or another input; rename it")
    inputs += symbols
    return value


__all__ = [
    "GivenStates",
    "Sequence",
    "StatesExample",
    "declared",
    "end_rows",
    "gru_layer",
    "initial_states",
    "lstm_layer",
    "recurrent_layer",
    "states_examples",
    "without_states",
]
