"""Attention and the layers of a transformer over batches of sequences (docs/attention.md).

A batch of sequences is a matrix with one row per *position*: m rows of d
features, each sequence L consecutive rows (m = n*L for n whole sequences;
the last may be shorter). Its memory is PyTorch's (n, L, d) tensor's, and
the n x (L*d) matrix's: a row per position is the view on which a
per-position linear layer, layer norm, gelu and residual additions are
plain matrix ops, so only attention needs ops of its own. The row count m
is a symbol bound at call time (by the token ids' length, an Index of m
entries); L, d and the heads are fixed integers, so every loop bound of
the C but the positions' is a number.

Attention's SymPy classes below are matrix expressions whose arguments are
the operand matrices followed by (L, heads); symbackprop.ops.attention
lowers them to IR ops. Row (e, t) is position t of sequence e; a head h
owns the columns h*dh .. h*dh + dh - 1 of Q, K and V (heads split the
columns), and the L columns h*L .. h*L + L - 1 of a scores matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.declare.conv import ImageOp, whole_number
from symbackprop.declare.standing import Standing
from symbackprop.declare.tensor import Index, gather
from symbackprop.errors import ModelError

# The attention ops (the IR's too) whose result is a scores matrix, m x
# (heads*L); every other one's has its last operand's columns (heads of
# Q, K, V; or scores, from scores).
SCORES_OPS = frozenset({"attention_scores"})


def attention_geometry(geometry: Sequence) -> tuple[int, int, bool]:
    """(L, heads, causal) of an attention op's geometry: (L, heads) is
    causal attention (keys s <= t), (L, heads, 0) attention over every key
    of the sequence. The one place this spelling is read."""
    length, heads, *rest = (int(g) for g in geometry)
    return length, heads, not rest or bool(rest[0])


def sequence_shape(op: str, geometry: tuple, shapes: Sequence[tuple]) -> tuple:
    """The shape of attention op `op`'s result from its geometry (L, heads)
    or (L, heads, 0) and its operands' shapes: the rows of the first (the
    positions). The one place this is written; the IR ops read it too."""
    length, heads, _ = attention_geometry(geometry)
    return (shapes[0][0], heads * length if op in SCORES_OPS else shapes[-1][1])


class SequenceOp(ImageOp):
    """An attention op of `arity` matrices with geometry (L, heads), or
    (L, heads, 0) over every key (no causal mask); rows: positions."""

    @property
    def shape(self) -> tuple:
        return sequence_shape(self.op, self.geometry, [o.shape for o in self.operands])


class AttentionScores(SequenceOp):
    """S[(e,t), (h,s)] = Q[(e,t), h] . K[(e,s), h] (each head's columns) for keys s <= t; 0 for s > t."""

    op, arity = "attention_scores", 2


class CausalSoftmax(SequenceOp):
    """Each head's row of scores softmaxed over keys s <= t; exactly 0 for s > t (over every key: (L, heads, 0))."""

    op, arity = "causal_softmax", 1


class AttentionMix(SequenceOp):
    """O[(e,t), h] = sum over s <= t of P[(e,t), (h,s)] V[(e,s), h]: each head's weights times its values."""

    op, arity = "attention_mix", 2


@dataclass(frozen=True)
class Sequences:
    """A batch of sequences: `matrix` is m x d, one row per position, each
    sequence `length` consecutive rows.

    Args:
        matrix: the m x d matrix expression.
        length: L, the rows of one sequence (the last may be shorter).
    """

    matrix: sp.MatrixExpr
    length: int

    def __post_init__(self) -> None:
        whole_number("a sequence's length", self.length)

    @property
    def features(self) -> int:
        """d: the features of a position."""
        return int(self.matrix.shape[1])

    def map(self, fn: Callable[[sp.MatrixExpr], sp.MatrixExpr]) -> Sequences:
        """fn applied to the matrix, same length.

        Args:
            fn: a function of the matrix, per position (nn.gelu, a linear layer, layer_norm).
        """
        return Sequences(fn(self.matrix), self.length)

    def __add__(self, other: Sequences) -> Sequences:
        """The residual connection x + f(x)."""
        other = _checked(other, "a residual addition")
        if other.length != self.length or other.matrix.shape != self.matrix.shape:
            raise ModelError(f"cannot add sequences of length {self.length}, {self.matrix.shape} and "
                             f"length {other.length}, {other.matrix.shape}")
        return Sequences(self.matrix + other.matrix, self.length)


def _checked(x: Sequences, what: str) -> Sequences:
    if not isinstance(x, Sequences):
        raise ModelError(f"{what} takes Sequences (sbp.sequences(...), nn.embedding(...) or a layer's result); "
                         f"got {type(x).__name__}")
    return x


def sequences(name: str, m: sp.Expr | int, length: int, features: int) -> Sequences:
    """A batch input of sequences: the m x features MatrixSymbol `name` (one
    row per position; pass `.matrix` to Model's inputs), in sequences of `length`.

    Args:
        name: the input's name.
        m: the rows (all positions): a positive integer Symbol bound at call time, or an int.
        length: L, the rows of one sequence.
        features: d.
    """
    return Sequences(sp.MatrixSymbol(name, m, whole_number("features", features)), whole_number("length", length))


def _head_size(d: object, heads: int, what: str) -> int:
    whole_number(f"{what}'s heads", heads)
    if not isinstance(d, (int, sp.Integer)) or int(d) % heads:
        raise ModelError(f"{what}: {d} features do not split into {heads} heads")
    return int(d) // heads


def causal_attention(q: Sequences, k: Sequences, v: Sequences, heads: int, weights: bool = False,
                     key_bias: sp.MatrixExpr | None = None) -> Sequences | tuple[Sequences, sp.MatrixExpr]:
    """softmax(Q K^T / sqrt(dh), keys s <= t) V per sequence and per head
    (dh = d / heads: head h reads and writes columns h*dh .. h*dh+dh-1).
    Keys after the query are excluded exactly (weight 0, as -inf scores).

    Args:
        q: the queries, Sequences (m x d).
        k: the keys, Sequences of q's length and shape.
        v: the values, Sequences of q's length and shape.
        heads: the number of heads.
        weights: also return the attention weights (the probabilities), an
            m x (heads*L) matrix: row (e, t) and column h*L + s hold query
            t's weight on key s in head h (0 for s > t); PyTorch's
            (n, heads, L, L) weights of MultiheadAttention(...,
            average_attn_weights=False) are its
            `.reshape(n, L, heads, L).transpose(1, 2)`.
        key_bias: an m x 1 column added to every score of key s (row s):
            PyTorch's float key_padding_mask, (n, L) as a column; -inf
            masks the key out (a bool mask's True, sbp.key_padding(mask)).
            A model input: no gradient is taken through it.

    Returns:
        The Sequences of the mixed values, and with `weights` the weights.

    Raises:
        ModelError: q, k, v differ in shape or length, or d is not a multiple of heads.
    """
    out, probabilities = _attend(q, k, v, heads, causal=True, key_bias=key_bias)
    return (out, probabilities) if weights else out


def attention(q: Sequences, k: Sequences, v: Sequences, heads: int, weights: bool = False,
              key_bias: sp.MatrixExpr | None = None) -> Sequences | tuple[Sequences, sp.MatrixExpr]:
    """softmax(Q K^T / sqrt(dh)) V per sequence and per head over every key
    of the sequence (no mask: an encoder's attention, PyTorch's
    MultiheadAttention without attn_mask); as causal_attention otherwise
    (its weights, m x (heads*L), have no zeros but past a shorter last
    sequence's end).

    Args:
        q: the queries, Sequences (m x d).
        k: the keys, Sequences of q's length and shape.
        v: the values, Sequences of q's length and shape.
        heads: the number of heads.
        weights: also return the attention weights (see causal_attention).
        key_bias: an m x 1 column added to key s's scores (see causal_attention).

    Raises:
        ModelError: q, k, v differ in shape or length, or d is not a multiple of heads.
    """
    out, probabilities = _attend(q, k, v, heads, causal=False, key_bias=key_bias)
    return (out, probabilities) if weights else out


def _attend(q: Sequences, k: Sequences, v: Sequences, heads: int, causal: bool,
            key_bias: sp.MatrixExpr | None = None) -> tuple[Sequences, sp.MatrixExpr]:
    """causal_attention's (attention's where not causal) values and weights."""
    what = "causal_attention" if causal else "attention"
    q, k, v = (_checked(s, what) for s in (q, k, v))
    if not q.length == k.length == v.length or not q.matrix.shape == k.matrix.shape == v.matrix.shape:
        raise ModelError(f"{what}'s q, k and v must be sequences of one length and shape")
    dh = _head_size(q.features, heads, what)
    geometry = (q.length, heads) if causal else (q.length, heads, 0)
    # the scale on the queries (on a weight, where q is a product: schedule-free), not on every score
    scores = AttentionScores(q.matrix / sp.sqrt(dh), k.matrix, *geometry)
    if key_bias is not None:
        scores = scores + _key_scores(key_bias, q.matrix.shape[0], heads, geometry)
    probabilities = CausalSoftmax(scores, *geometry)
    return Sequences(AttentionMix(probabilities, v.matrix, *geometry), q.length), probabilities


def _key_scores(key_bias: sp.MatrixExpr, rows: sp.Expr, heads: int, geometry: tuple) -> sp.MatrixExpr:
    """The scores matrix whose entry (e,t),(h,s) is key_bias[(e,s)]: the
    scores op of a 1-column head, ones times each head's copy of the bias
    (no op of its own; the masked entries are the scores' own)."""
    if tuple(key_bias.shape) != (rows, 1):
        raise ModelError(f"a key bias is a column of one entry a position, {rows} x 1; {key_bias} is "
                         f"{key_bias.shape}")
    return AttentionScores(sp.OneMatrix(rows, heads), key_bias * sp.OneMatrix(1, heads), *geometry)


Biases = Sequence["sp.MatrixExpr | None"]


def self_attention(x: Sequences, wq: sp.MatrixExpr, wk: sp.MatrixExpr, wv: sp.MatrixExpr, wo: sp.MatrixExpr,
                   heads: int, biases: Biases | None = None, weights: bool = False, causal: bool = True,
                   key_bias: sp.MatrixExpr | None = None) -> Sequences | tuple[Sequences, sp.MatrixExpr]:
    """Multi-head self-attention: causal_attention(x Wq + bq, x Wk + bk,
    x Wv + bv) Wo + bo (attention(...) where causal=False), with PyTorch's MultiheadAttention's projections
    transposed: Wq, Wk, Wv are in_proj_weight's three d x d blocks of rows
    transposed (slices of one fused parameter: `W[0:d, :].T`, ...), Wo is
    out_proj.weight transposed.

    Args:
        x: the Sequences attended over (m x d).
        wq: the queries' d x d weight.
        wk: the keys' d x d weight.
        wv: the values' d x d weight.
        wo: the output's d x d weight.
        heads: the number of heads.
        biases: (bq, bk, bv, bo), each a 1 x d row or None (no bias there);
            PyTorch's in_proj_bias (a 1 x 3d row b) is b[:, 0:d], b[:, d:2d],
            b[:, 2d:3d], out_proj.bias is bo. None: no biases.
        weights: also return the attention weights (see causal_attention).
        causal: keys s <= t only (a decoder's); False: every key (an encoder's).
        key_bias: an m x 1 column added to key s's scores (see causal_attention).

    Raises:
        ModelError: a weight is not d x d or a bias not 1 x d.
    """
    x = _checked(x, "self_attention")
    d = x.features
    for w in (wq, wk, wv, wo):
        if w.shape != (d, d):
            raise ModelError(f"self_attention's weights are {d} x {d}; {w} is {w.shape}")
    bq, bk, bv, bo = (None,) * 4 if biases is None else tuple(biases)
    for b in (bq, bk, bv, bo):
        if b is not None and b.shape != (1, d):
            raise ModelError(f"self_attention's biases are rows of 1 x {d}; {b} is {b.shape}")
    q, k, v = (Sequences(m, x.length) for m in _projections(x.matrix, (wq, wk, wv), (bq, bk, bv)))
    out, probabilities = _attend(q, k, v, heads, causal, key_bias)
    mixed = Sequences(_affine(out.matrix, wo, bo), out.length)
    return (mixed, probabilities) if weights else mixed


def _projections(x: sp.MatrixExpr, ws: Sequence[sp.MatrixExpr],
                 bs: Sequence[sp.MatrixExpr | None]) -> list[sp.MatrixExpr]:
    """x Wq + bq, x Wk + bk, x Wv + bv. Where the three weights are the
    three d x d blocks of one fused parameter in order (PyTorch's
    in_proj_weight W, 3d x d, as W[0:d, :].T, ...; or a d x 3d W as
    W[:, 0:d], ...), one product x W (m x 3d) and its column slices (views):
    one gemm for Q, K and V, one for the gradient of x and one for the
    fused weight's (the slices' adjoints scatter into one buffer)."""
    d = int(x.shape[1])
    fused = _fused(ws, d)
    if fused is None:
        return [_affine(x, w, b) for w, b in zip(ws, bs)]
    bias = _fused(bs, d) if all(b is not None for b in bs) else None
    product = _affine(x, fused, bias)
    parts = [product[:, i * d:(i + 1) * d] for i in range(3)]
    return parts if bias is not None else [_affine_bias(p, b) for p, b in zip(parts, bs)]


def _fused(ws: Sequence[sp.MatrixExpr | None], d: int) -> sp.MatrixExpr | None:
    """The d x 3d (or 1 x 3d) matrix whose column blocks ws are, in order:
    column slices of one parameter, or row slices of a 3d x d one transposed; else None."""
    parents = set()
    for i, w in enumerate(ws):
        if w is None:
            return None
        transposed = isinstance(w, sp.Transpose)
        piece = w.arg if transposed else w
        if not isinstance(piece, sp.MatrixSlice):
            return None
        taken, whole = (piece.rowslice, piece.colslice) if transposed else (piece.colslice, piece.rowslice)
        rows = int(piece.parent.shape[1] if transposed else piece.parent.shape[0])
        if tuple(taken) != (i * d, (i + 1) * d, 1) or tuple(whole) != (0, rows, 1):
            return None
        parents.add((piece.parent, transposed))
    if len(parents) != 1:
        return None
    ((parent, transposed),) = parents
    fused = parent.T if transposed else parent
    return fused if fused.shape[1] == 3 * d else None


def _affine_bias(product: sp.MatrixExpr, b: sp.MatrixExpr | None) -> sp.MatrixExpr:
    return product if b is None else product + sp.OneMatrix(product.shape[0], 1) * b


def _affine(x: sp.MatrixExpr, w: sp.MatrixExpr, b: sp.MatrixExpr | None) -> sp.MatrixExpr:
    """x w, plus the row b on every row where b is given."""
    product = x * w
    return product if b is None else product + sp.OneMatrix(x.shape[0], 1) * b


class RowNormalize(Standing, sp.MatrixExpr):
    """Each row minus its mean, over the square root of its (biased)
    variance plus eps: one SymPy node (x appears once: written out, x
    would appear three times a layer, and SymPy's tree of a deep model
    grows by that factor per layer); it lowers to ops.normalize's
    normalize_rows, one loop over the rows (its backward another)."""

    def __new__(cls, x: sp.MatrixExpr, eps: sp.Expr) -> RowNormalize:
        return super().__new__(cls, x, sp.sympify(eps))

    @property
    def shape(self) -> tuple:
        return self.args[0].shape

    def _entry(self, i, j, **kwargs):
        return sp.matrices.expressions.matexpr.MatrixElement(self, i, j)


def layer_norm(x: sp.MatrixExpr | Sequences, gamma: sp.MatrixExpr, beta: sp.MatrixExpr,
               eps: float = 1e-5) -> sp.MatrixExpr | Sequences:
    """Each row normalized over its d entries (PyTorch's LayerNorm(d)):
    gamma * (x - mean) / sqrt(var + eps) + beta, var biased; gamma, beta 1 x d.
    On Sequences, per position."""
    if isinstance(x, Sequences):
        return Sequences(_normalized(x.matrix, gamma, beta, eps), x.length)
    return _normalized(x, gamma, beta, eps)


def _normalized(x: sp.MatrixExpr, gamma: sp.MatrixExpr, beta: sp.MatrixExpr, eps: float) -> sp.MatrixExpr:
    rows, d = x.shape
    for p in (gamma, beta):
        if p.shape != (1, d):
            raise ModelError(f"layer_norm's gamma and beta are 1 x {d}; {p} is {p.shape}")
    down = sp.OneMatrix(rows, 1)
    return sp.hadamard_product(RowNormalize(x, eps), down * gamma) + down * beta


def embedding(table: sp.MatrixExpr, ids: Index, length: int) -> Sequences:
    """The rows of `table` (vocabulary x d) at the token ids (an Index of m
    entries: the n x L ids, flattened), as sequences of `length`. Its
    gradient adds each position's adjoint into its token's row (scatter-add)."""
    return Sequences(gather(table, ids), whole_number("length", length))


def add_positions(x: Sequences, table: sp.MatrixExpr, positions: Index) -> Sequences:
    """x plus a learned positional embedding: row t of `table` (L x d) added
    at position t; `positions` is the Index of each row's position
    (position_ids(n, L))."""
    x = _checked(x, "add_positions")
    if table.shape != (x.length, x.features):
        raise ModelError(f"a positional table is {x.length} x {x.features}; {table} is {table.shape}")
    return Sequences(x.matrix + gather(table, positions), x.length)


def position_ids(n: int, length: int) -> np.ndarray:
    """The positions Index of n sequences of `length` rows: 0 .. L-1, n times (for add_positions).

    Args:
        n: the number of sequences.
        length: L.
    """
    return np.tile(np.arange(length, dtype=np.int64), n)


def sequence_starts(n: int, length: int) -> np.ndarray:
    """The Index of each sequence's first row: 0, L, 2L, ..., (n-1)L (for
    first_positions and sequence_mean).

    Args:
        n: the number of sequences.
        length: L.
    """
    return np.arange(n, dtype=np.int64) * whole_number("length", length)


def first_positions(x: Sequences, starts: Index) -> sp.MatrixExpr:
    """Each sequence's first row (n x d: PyTorch's x[:, 0] of (n, L, d));
    `starts` the Index of those rows (sequence_starts(n, L))."""
    return gather(_checked(x, "first_positions").matrix, starts)


def sequence_mean(x: Sequences, starts: Index) -> sp.MatrixExpr:
    """The mean of each sequence's rows (n x d: PyTorch's x.mean(1) of (n,
    L, d)); `starts` the Index of each sequence's first row
    (sequence_starts(n, L)). It is attention with equal weights, the
    softmax of zero scores over every key (1/len of the sequence's rows,
    the shorter last one's too), read at each sequence's first row: the
    attention ops' loops, their gradient a broadcast back over the rows."""
    x = _checked(x, "sequence_mean")
    geometry = (x.length, 1, 0)  # one head, every key
    uniform = CausalSoftmax(sp.ZeroMatrix(x.matrix.shape[0], x.length), *geometry)
    return gather(AttentionMix(uniform, x.matrix, *geometry), starts)


def key_padding(mask: np.ndarray) -> np.ndarray:
    """PyTorch's key_padding_mask (n, L) as the m x 1 key bias column the
    attention adds to each key's scores: -inf where a bool mask is True
    (the key ignored), 0 elsewhere; a float mask's own values.

    Args:
        mask: the (n, L) mask, bool or float (a tensor or an array).
    """
    mask = np.asarray(mask.detach().cpu().numpy() if hasattr(mask, "detach") else mask)
    if mask.ndim != 2:
        raise ModelError(f"a key padding mask is (n, L); got shape {mask.shape}")
    column = np.where(mask, -np.inf, 0.0) if mask.dtype == bool else mask.astype(np.float64)
    return np.ascontiguousarray(column.reshape(-1, 1))
