"""The ops of attention (symbackprop.declare.attention, docs/attention.md),
causal as written below; an op whose geometry is (L, H, 0) reads every
key of the sequence instead (the bounds "s <= t" become "s < len_e",
"t >= s" every t: an encoder's attention, no mask).

Rows are positions: m rows, sequence e its rows e*L .. e*L + len_e - 1
(len_e = L but for a shorter last sequence). Q, K, V are m x d, a head h
their columns h*dh .. h*dh + dh - 1; a scores matrix is m x (H*L), head h
its columns h*L + s (s the key's position). The ops, all with attrs (L, H) (causal) or (L, H, 0):

    attention_scores(A, B)  S[(e,t),(h,s)] = A[(e,t),h] . B[(e,s),h] for s <= t, 0 for s > t
    attention_mix(P, V)     O[(e,t),h] = sum_{s<=t} P[(e,t),(h,s)] V[(e,s),h]
    attention_mix_t(P, V)   O[(e,s),h] = sum_{t>=s} P[(e,t),(h,s)] V[(e,t),h]
    causal_softmax(S)       P[(e,t),(h,s)] = exp(S - max) / sum over s <= t; 0 for s > t
    softmax_vjp(P, D)       P * (D - sum_{s'<=t} P*D) for s <= t, 0 for s > t (P a causal softmax)

The three products are one trilinear form <G, scores(A, B)> over the
causal triangle (key s <= query t) read three ways, so each one's VJP is
made of the other two (and gradients of gradients exist). The triangle is
all attention reads (the softmax's weights above it are 0), so its C never
computes the masked half. The softmax's VJP, P * (G - sum_s P*G), is an op
of its own (one loop over each row and head, where the elementwise maps
and per-head sums it is made of took four passes over m x H*L); its own
derivatives are made of itself and of the per-head sums and broadcasts
of ops.conv (channel_sum, channel_broadcast over H blocks of L columns).
A masked entry has P = 0 exactly, so no gradient reaches it.

The C of each is a loop nest over the sequences and heads
(kernel_attention.c.j2), its bounds numbers but the positions', never
unrolled over positions; its inner loops run along contiguous entries and
vectorize.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, attrs_of, plain_grad_fn, register
from symbackprop.declare import attention as declared
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, min_rows_for_threads, worth_threads
from symbackprop.ir.construct import is_const, map_
from symbackprop.ir.node import Node, op_node, placeholder
from symbackprop.ops.conv import Operand, bilinear_jvp, channel_broadcast, channel_sum, kernel_operands
from symbackprop.schedule.kernel import Equation, latex_name

A0, A1, A2, A3, A4 = (placeholder(i) for i in range(5))

# --- constructors ---------------------------------------------------------------


def _node(op: str, args: tuple[Node, ...], geometry: tuple) -> Node:
    length, heads, causal = declared.attention_geometry(geometry)
    geometry = (length, heads) if causal else (length, heads, 0)  # one spelling of each: CSE sees equal nodes
    return op_node(op, args, declared.sequence_shape(op, geometry, [a.shape for a in args]), geometry)


def attention_scores(a: Node, b: Node, geometry: tuple) -> Node:
    return _node("attention_scores", (a, b), geometry)


def attention_mix(p: Node, v: Node, geometry: tuple) -> Node:
    return _node("attention_mix", (p, v), geometry)


def attention_mix_t(p: Node, v: Node, geometry: tuple) -> Node:
    return _node("attention_mix_t", (p, v), geometry)


def causal_softmax(s: Node, geometry: tuple) -> Node:
    return _node("causal_softmax", (s,), geometry)


def softmax_vjp(p: Node, d: Node, geometry: tuple) -> Node:
    return _node("softmax_vjp", (p, d), geometry)


# --- derivatives ------------------------------------------------------------------
# <G, scores(A, B)> = <mix(G, B), A> = <mix_t(G, A), B>; <G, mix(P, V)> =
# <scores(G, V), P> = <mix_t(P, G), V>; <G, mix_t(P, V)> = <scores(V, G), P> = <mix(P, G), V>.


def _scores_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    a, b = node.args
    return (attention_mix(g, b, node.attrs) if needed[0] else None,
            attention_mix_t(g, a, node.attrs) if needed[1] else None)


def _mix_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    p, v = node.args
    return (attention_scores(g, v, node.attrs) if needed[0] else None,
            attention_mix_t(p, g, node.attrs) if needed[1] else None)


def _mix_t_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    p, v = node.args
    return (attention_scores(v, g, node.attrs) if needed[0] else None,
            attention_mix(p, g, node.attrs) if needed[1] else None)


def _softmax_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # the softmax's VJP (g an adjoint) and JVP (a tangent): the same linear map (it is symmetric)
    return (softmax_vjp(node, g, node.attrs),)


def _softmax_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return softmax_vjp(node, tangents[0], node.attrs) if tangents[0] is not None else None


def _head_sums(a: Node, b: Node, geometry: tuple) -> Node:
    """sum over each head's keys of a*b, broadcast back over the keys."""
    length, heads, _ = declared.attention_geometry(geometry)
    return channel_broadcast(channel_sum(map_(A0 * A1, [a, b]), (heads, length)), (heads, length))


def _softmax_vjp_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # out = P*(D - s), s = heads' sums of P*D: d/dD is the same map of P; d/dP is
    # G*(D - s) - D * heads' sums of G*P
    p, d = node.args
    wrt_p = map_(A0 * (A1 - A2) - A1 * A3, [g, d, _head_sums(p, d, node.attrs), _head_sums(g, p, node.attrs)])
    return (wrt_p if needed[0] else None, softmax_vjp(p, g, node.attrs) if needed[1] else None)


def _softmax_vjp_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    p, d = node.args
    dp, dd = tangents
    parts = [] if dd is None else [softmax_vjp(p, dd, node.attrs)]
    if dp is not None:
        parts.append(map_(A0 * (A1 - A2) - A3 * A4, [dp, d, _head_sums(p, d, node.attrs), p,
                                                     _head_sums(dp, d, node.attrs)]))
    return None if not parts else parts[0] if len(parts) == 1 else map_(A0 + A1, parts)


# --- numpy references ---------------------------------------------------------------


def _blocks(a: np.ndarray, rows: int, length: int, heads: int, width: int) -> np.ndarray:
    """m x (heads*width) rows as (sequences, L, heads, width), zero past the last position."""
    a = np.broadcast_to(a, (rows, heads * width))
    count = -(-rows // length)
    padded = np.zeros((count * length, heads * width))
    padded[:rows] = a
    return padded.reshape(count, length, heads, width)


def _rows(a: np.ndarray, rows: int) -> np.ndarray:
    """(sequences, L, ...) back to the m x (...) matrix."""
    return a.reshape(a.shape[0] * a.shape[1], -1)[:rows]


def _heads(node: Node, context) -> tuple[int, int, int, int]:
    """(m, L, H, dh) of an op whose last argument is m x d."""
    length, heads, _ = declared.attention_geometry(node.attrs)
    return context.shape(node)[0], length, heads, node.args[-1].shape[1] // heads


def _allowed(node: Node, rows: int) -> np.ndarray:
    """[e, t, s]: whether query t of sequence e reads key s: a key of the
    sequence (the last one may be shorter), at or before t where causal."""
    length, _, causal = declared.attention_geometry(node.attrs)
    count = -(-rows // length)
    keys = np.ones((count, length, length))
    keys[-1, :, rows - (count - 1) * length:] = 0
    return keys * np.tril(np.ones((length, length))) if causal else keys


def _eval_scores(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    length, heads, _ = declared.attention_geometry(node.attrs)
    m, dh = context.shape(node)[0], node.args[0].shape[1] // heads
    a, b = (_blocks(x, m, length, heads, dh) for x in args)
    return _rows(np.einsum("ethk,eshk,ets->eths", a, b, _allowed(node, m)), m)


def _eval_mix(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    m, length, heads, dh = _heads(node, context)
    p, v = _blocks(args[0], m, length, heads, length), _blocks(args[1], m, length, heads, dh)
    return _rows(np.einsum("eths,eshk,ets->ethk", p, v, _allowed(node, m)), m)


def _eval_mix_t(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    m, length, heads, dh = _heads(node, context)
    p, v = _blocks(args[0], m, length, heads, length), _blocks(args[1], m, length, heads, dh)
    return _rows(np.einsum("eths,ethk,ets->eshk", p, v, _allowed(node, m)), m)


def _eval_softmax(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    length, heads, _ = declared.attention_geometry(node.attrs)
    m = context.shape(node)[0]
    s = _blocks(args[0], m, length, heads, length)
    allowed = _allowed(node, m).astype(bool)[:, :, None, :]
    s = np.where(allowed, s, -np.inf)
    e = np.exp(s - s.max(axis=3, keepdims=True))
    return _rows(e / e.sum(axis=3, keepdims=True), m)


def _eval_softmax_vjp(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    length, heads, _ = declared.attention_geometry(node.attrs)
    m = context.shape(node)[0]
    p, d = (_blocks(a, m, length, heads, length) * _allowed(node, m)[:, :, None, :] for a in args)
    return _rows(p * (d - (p * d).sum(axis=3, keepdims=True)), m)


# --- kernels ------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionAttrs:
    """What an attention op's kernel does, as its record's `attrs`: the
    kernel, emit and kernel_attention.c.j2 branch on these, never on the
    op's name.

    product: a product over the causal triangle (in a BLAS build, a call
        of the runtime's causal helpers): "scores", A B^T onto the
        triangle, or "mix", tril(P) V (each head's weights times its rows).
        None: a pass along each head's row of scores (scores in, scores
        out: no head width).
    transposed: a mix with the weights transposed, tril(P)^T V: it sums
        over the queries t >= s.
    workspace: its loops first copy a head's keys, transposed, into the
        kernel's workspace (which the sequences share: one thread).
    row: a row pass: "softmax" (exp(s - max), normalized) or
        "softmax_jacobian" (P * (D - sum_s P*D): the softmax's Jacobian,
        symmetric, times D).
    row_work: a row pass's (multiply-adds, other operations) a key.
    """

    product: str | None
    transposed: bool = False
    workspace: bool = False
    row: str | None = None
    row_work: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class AttentionKernel:
    """One attention op (`kind`) of `args` (buffers, or constants) into `out`."""

    kind: str
    out: str
    args: tuple[tuple[str | None, sp.Expr | None], ...]
    rows: object  # the positions, m
    geometry: tuple  # (L, H, dh): dh the head's width (0 for the softmax)
    equations: tuple[Equation, ...]
    labels: tuple[str, ...]  # the arguments', for the loops' comments
    block: str | None = None  # the scores' workspace of L*dh: one (sequence, head)'s keys, transposed
    strides: tuple[tuple[int, int], ...] = ()  # a product's arguments' (offset, row stride); () contiguous
    causal: bool = True  # keys s <= t only; else every key of the sequence

    def reads(self) -> list[str]:
        return [buffer for buffer, _ in self.args if buffer is not None] + ([self.block] if self.block else [])

    def writes(self) -> list[str]:
        return [self.out] + ([self.block] if self.block else [])

    @property
    def title(self) -> str:
        return self.kind.replace("_", " ")

    @property
    def attrs(self) -> AttentionAttrs:
        return attrs_of(self.kind, AttentionAttrs)

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): the causal triangle, (L+1)/2 keys a query, or all L."""
        length, heads, dh = self.geometry
        keys = sp.sympify(self.rows) * heads * (sp.Rational(length + 1, 2) if self.causal else length)
        if self.attrs.product is None:
            madds, other = self.attrs.row_work
            return madds * keys, other * keys
        return keys * dh, sp.Integer(0)


# What each comment says: (the entry written, its value); {0}, {1} the arguments' labels.
_MATH = {
    "attention_scores": ("[(e,t),(h,s)]", "sum_k {0}[(e,t),h*dh+k] * {1}[(e,s),h*dh+k] for s <= t, 0 for s > t"),
    "attention_mix": ("[(e,t),h*dh+k]", "sum_{{s<=t}} {0}[(e,t),(h,s)] * {1}[(e,s),h*dh+k]"),
    "attention_mix_t": ("[(e,s),h*dh+k]", "sum_{{t>=s}} {0}[(e,t),(h,s)] * {1}[(e,t),h*dh+k]"),
    "causal_softmax": ("[(e,t),(h,s)]", "exp({0}[(e,t),(h,s)] - max_{{s'<=t}} {0}[(e,t),(h,s')]) / "
                       "sum_{{s'<=t}} exp(...) for s <= t, 0 for s > t (the causal mask)"),
    "softmax_vjp": ("[(e,t),(h,s)]", "{0}[(e,t),(h,s)] * ({1}[(e,t),(h,s)] - sum_{{s'<=t}} {0}[(e,t),(h,s')] * "
                    "{1}[(e,t),(h,s')]) for s <= t, 0 for s > t"),
}
# The same without the mask: every key s of the sequence (s < len, the last sequence's length).
_MATH_ALL_KEYS = {
    "attention_scores": ("[(e,t),(h,s)]", "sum_k {0}[(e,t),h*dh+k] * {1}[(e,s),h*dh+k] for every key s"),
    "attention_mix": ("[(e,t),h*dh+k]", "sum_s {0}[(e,t),(h,s)] * {1}[(e,s),h*dh+k]"),
    "attention_mix_t": ("[(e,s),h*dh+k]", "sum_t {0}[(e,t),(h,s)] * {1}[(e,t),h*dh+k]"),
    "causal_softmax": ("[(e,t),(h,s)]", "exp({0}[(e,t),(h,s)] - max_{{s'}} {0}[(e,t),(h,s')]) / "
                       "sum_{{s'}} exp(...) over every key (no mask)"),
    "softmax_vjp": ("[(e,t),(h,s)]", "{0}[(e,t),(h,s)] * ({1}[(e,t),(h,s)] - sum_{{s'}} {0}[(e,t),(h,s')] * "
                    "{1}[(e,t),(h,s')]) over every key"),
}


def _strided_operands(sched, node: Node) -> tuple[list, list[str], tuple[tuple[int, int], ...]]:
    """A product's arguments as kernel_operands reads them, but each may be
    a view of rows of a wider matrix (a column slice: Q, K and V of one
    fused product, m x 3d): its buffer, offset and row stride, numbers."""
    args: list[tuple[str | None, sp.Expr | None]] = []
    labels, strides = [], []
    for arg in node.args:
        rows, cols = arg.shape
        view = None if is_const(arg) else sched.view(arg)
        if view is None or view.col_stride != (1 if cols != 1 else 0) or rows == 1 or \
                not (sp.sympify(view.offset).is_Integer and sp.sympify(view.row_stride).is_Integer):
            (one,), (label,) = kernel_operands(sched, op_node(node.op, (arg,), node.shape, node.attrs))
            args.append(one)
            labels.append(label)
            strides.append((0, int(cols)))
            continue
        args.append((view.buffer, None))
        labels.append(sched.label(arg))
        strides.append((int(view.offset), int(view.row_stride)))
    return args, labels, tuple(strides)


def _kernel(sched, node: Node, out: str) -> AttentionKernel:
    length, heads, causal = declared.attention_geometry(node.attrs)
    attrs = attrs_of(node.op, AttentionAttrs)
    if attrs.product is None:
        args, labels = kernel_operands(sched, node)
        strides: tuple[tuple[int, int], ...] = ()
    else:
        args, labels, strides = _strided_operands(sched, node)
    dh = 0 if attrs.product is None else node.args[-1].shape[1] // heads  # a row pass: scores in, scores out
    entry, value = (part.format(*labels) for part in (_MATH if causal else _MATH_ALL_KEYS)[node.op])
    value += f" (rows (e,t) = e*{length}+t, {heads} heads" + (f" of {dh} columns)" if dh else ")")
    latex = rf"{latex_name(out)} = \operatorname{{{node.op.replace('_', '-')}}}({', '.join(latex_name(s) for s in labels)})"
    block = sched.claim_scratch(f"{out}_block", (length, dh)) if attrs.workspace else None
    return AttentionKernel(node.op, out, tuple(args), node.shape[0], (length, heads, dh),
                           (Equation(out + entry, value, latex),), tuple(labels), block, strides, causal)


def _emit(em: FunctionEmitter, kernel: AttentionKernel) -> dict:
    printer = CheckedPrinter(ScalarPrinter({}, em.real), kernel)
    length, heads, dh = kernel.geometry
    strides = kernel.strides or ((0, 0),) * len(kernel.args)  # a row pass: contiguous scores (no lda, ldb)
    args = [Operand(em.namer.name(b) if not at else f"({em.namer.name(b)} + {at})") if b is not None
            else Operand(None, printer.doprint(v)) for (b, v), (at, _) in zip(kernel.args, strides)]
    return {"m": em.dim(kernel.rows), "out": em.namer.name(kernel.out), "a": args[0],
            "b": args[1] if len(args) > 1 else None, "L": length, "H": heads, "DH": dh,
            "lda": strides[0][1], "ldb": strides[-1][1],
            "a_label": kernel.labels[0], "b_label": kernel.labels[-1],
            "block": em.namer.name(kernel.block) if kernel.block is not None else None,
            "op": kernel.attrs, "parallel": worth_threads(kernel.rows),  # over the sequences: two at least, and enough work
            "causal": kernel.causal,
            "min_rows": max(length + 1, min_rows_for_threads(_head_keys(kernel) * max(dh, 4))),
            "exp": printer.doprint(sp.exp(sp.Symbol("val", real=True) - sp.Symbol("top", real=True)))}


def _head_keys(kernel: AttentionKernel) -> int:
    """The keys a query reads in all heads, on average (as the parallel threshold counts them)."""
    length, heads, _ = kernel.geometry
    return heads * (length + 1) // 2 if kernel.causal else heads * length


def _lower(lowerer, expr: declared.SequenceOp) -> Node:
    return _node(expr.op, tuple(lowerer.lower(o) for o in expr.operands), expr.geometry)


def _shape(expr: declared.SequenceOp, of) -> tuple:
    return declared.sequence_shape(expr.op, expr.geometry, [of(o) for o in expr.operands])


def _op(name: str, attrs: AttentionAttrs, vjp, jvp, evaluate, grad_fn: str, lowers: type | None = None) -> None:
    more = {"lowering": ((lowers, _lower),), "shapes": ((lowers, _shape),)} if lowers is not None else {}
    register(OpRecord(name, vjp=vjp, jvp=jvp, evaluate=evaluate, kernel=_kernel, emit=_emit,
                      template="kernel_attention.c.j2", grad_fn=plain_grad_fn(grad_fn), attrs=attrs,
                      **more))  # type: ignore[arg-type]


_op("attention_scores", AttentionAttrs("scores", workspace=True), _scores_vjp, bilinear_jvp(attention_scores),
    _eval_scores, "AttentionScores", declared.AttentionScores)
_op("attention_mix", AttentionAttrs("mix"), _mix_vjp, bilinear_jvp(attention_mix), _eval_mix, "AttentionMix",
    declared.AttentionMix)
_op("attention_mix_t", AttentionAttrs("mix", transposed=True), _mix_t_vjp, bilinear_jvp(attention_mix_t),
    _eval_mix_t, "AttentionMixT")
_op("causal_softmax", AttentionAttrs(None, row="softmax", row_work=(0, 3)), _softmax_vjp, _softmax_jvp,
    _eval_softmax, "CausalSoftmax", declared.CausalSoftmax)
_op("softmax_vjp", AttentionAttrs(None, row="softmax_jacobian", row_work=(1, 2)), _softmax_vjp_vjp,
    _softmax_vjp_jvp, _eval_softmax_vjp, "SoftmaxVjp")

