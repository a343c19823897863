"""The derivative of a max or min over one axis (ops/reduce.py): an
entry equal to its row's (column's) extreme takes the adjoint divided by
how many do (ties share it evenly, as JAX and torch.amin), the others 0.

    extreme_spread(g, z, m)   out[i, j] = hit[i, j] / count[i] * g[i]         (z's shape)
    extreme_mean(t, z, m)     out[i]    = sum_j hit[i, j] / count[i] * t[i, j]  (m's shape)

(axis 1 shown; axis 0 walks the columns.) m is z's extreme, hit[i, j] is
1 where z[i, j] equals it, 0 elsewhere, and NaN where either is NaN, and
count[i] its sum: a row with a NaN (whose extreme is NaN) is NaN
throughout. The spread is the VJP, the mean the JVP. Each is linear in
its first argument and the other's transpose, so each is the other's VJP
and its own JVP; z and m only choose entries (their derivatives are 0).

Each kernel is one helper call a row (templates/reduce.c.j2) that counts
the row's hits, then writes (sums) its shares: the mask, its row sums, the
division and the product were four passes over z, each storing N x K.
extreme_tie calls its _rows helper once a block of rows instead: short
rows (k-means' ten distances a point) eight at a time, a row in each lane.

Where z is a map over pairs (k-means' distances), through_extreme, called
by the emap's VJP rule, takes the map's derivative at each row's extreme
pair alone, through the position extreme_tie finds (one pass a row), and
at every pair only in the rows with ties or a NaN (a guarded loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, VjpRule, plain_grad_fn, register
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, worth_threads
from symbackprop.ir.construct import const, emap, is_const, map_, row_placeholder, transpose
from symbackprop.ir.node import Node, Shape, op_node, placeholder
from symbackprop.ops.cumulative import axis_walk, contiguous, rows_at_once, rows_fields
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Equation, View, latex_name

A0, A1 = placeholder(0), placeholder(1)

# --- constructors ---------------------------------------------------------------


def _is_zero(node: Node) -> bool:
    return is_const(node) and sp.sympify(node.attrs[0]) == 0


def extreme_spread(g: Node, z: Node, extreme: Node, axis: int) -> Node:
    """g (the adjoint of z's max or min `extreme` over `axis`) shared among
    the entries of z equal to it: z's shape."""
    if _is_zero(g):
        return const(0, z.shape)
    return op_node("extreme_spread", (g, z, extreme), z.shape, (axis,))


def extreme_mean(t: Node, z: Node, extreme: Node, axis: int) -> Node:
    """The mean of t over the entries of z equal to `extreme` (z's max or
    min over `axis`): the extreme's shape."""
    if _is_zero(t):
        return const(0, extreme.shape)
    over_pairs = _mean_over_pairs(t, z, extreme, axis)
    if over_pairs is not None:
        return over_pairs
    return op_node("extreme_mean", (t, z, extreme), extreme.shape, (axis,))


def extreme_tie(z: Node, extreme: Node, axis: int) -> Node:
    """Of each row's (axis 1; column's, axis 0) entries equal to its
    extreme, as a column of one number a row (column): where one entry is,
    its position (0 or more); where several are, minus their count (-2 or
    less); where the row has a NaN, -1. through_extreme reads the position
    through an index, the count in a share."""
    return op_node("extreme_tie", (z, extreme), (z.shape[1 - axis], 1), (axis,))


# --- derivatives: linear in the first argument, each the other's transpose ------


def _spread_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    _, z, extreme = node.args
    return (extreme_mean(g, z, extreme, node.attrs[0]) if needed[0] else None, None, None)


def _spread_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    _, z, extreme = node.args
    return extreme_spread(tangents[0], z, extreme, node.attrs[0]) if tangents[0] is not None else None


def _mean_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    _, z, extreme = node.args
    return (extreme_spread(g, z, extreme, node.attrs[0]) if needed[0] else None, None, None)


def _mean_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    _, z, extreme = node.args
    return extreme_mean(tangents[0], z, extreme, node.attrs[0]) if tangents[0] is not None else None


# --- numpy reference ------------------------------------------------------------


def shares(z: np.ndarray, extreme: np.ndarray, axis: int) -> np.ndarray:
    """hit / count: each entry's share of its row's (column's) adjoint."""
    with np.errstate(all="ignore"):
        hit = np.where(np.isnan(z) | np.isnan(extreme), z + extreme, (z == extreme).astype(z.dtype))
        return hit / hit.sum(axis=axis, keepdims=True)


def _eval_spread(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    g, z, extreme = args
    with np.errstate(all="ignore"):
        return shares(z, extreme, node.attrs[0]) * g


def _eval_mean(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    t, z, extreme = args
    with np.errstate(all="ignore"):
        return (shares(z, extreme, node.attrs[0]) * t).sum(axis=node.attrs[0], keepdims=True)


def _eval_tie(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    z, extreme = args
    axis = node.attrs[0]
    nan = np.isnan(z).any(axis=axis) | np.isnan(extreme).reshape(-1)
    hit = z == extreme
    count, first = hit.sum(axis=axis), np.argmax(hit, axis=axis)
    return np.where(nan, -1, np.where(count == 1, first, -count)).astype(z.dtype).reshape(-1, 1)


# --- through a map over pairs ------------------------------------------------------


def through_extreme(node: Node, g: Node, needed: Sequence[bool], vjp: VjpRule) -> tuple[Node | None, ...] | None:
    """The VJP of a map over pairs (an emap's two loops, z[i, k] its body
    at row i of some arguments and row k of others) whose adjoint `g` is
    the spread of its max or min over k (or i), as k-means' cost, without
    the body's derivative at every pair: a row (column) whose extreme is
    one entry adds it at that pair alone, the other loop's rows read
    through its index (a gather, and their adjoint a scatter-add); a row
    with ties, or a NaN, at every pair, its share folded into the body, in
    a loop over the pairs that skips every other row (a guard). `vjp` is
    the emap's own rule. None where `g` is not such a spread or the map
    reads a row another way (a cell, a gather by the reduced loop)."""
    if g.op != "extreme_spread" or g.args[1] is not node or node.attrs[3] != ("cell",):
        return None
    bodies, bindings, loops, _, lets = node.attrs
    seed, _, extreme = g.args
    axis = g.attrs[0]
    keep, count = 1 - axis, len(node.args)
    picked = _at_first(bindings, count, keep)
    if picked is None:
        return None
    tie = extreme_tie(node, extreme, axis)
    column = _column(axis)
    single, several = _guards(tie)
    one = emap(bodies, node.args + (tie, single), picked + (("index",), ("guard", 0)), (loops[keep],), ("row", 0),
               (loops[keep], 1), lets)
    at_extremes = vjp(one, column(seed), list(needed) + [False] * 2)
    z, m, code, adjoint = (row_placeholder(count + k, 0) for k in range(4))
    share = sp.Piecewise((-adjoint / code, sp.Eq(z, m)), (0, True))  # as extreme_spread's: NaN with a NaN
    guarded = emap([body * share for body in bodies], node.args + (node, column(extreme), tie, column(seed), several),
                   bindings + (("cell",), ("row", keep), ("row", keep), ("row", keep), ("guard", keep)), loops,
                   ("cell",), node.shape, lets)
    at_ties = vjp(guarded, const(1, node.shape), list(needed) + [False] * 5)
    return tuple(_plus(a, b) for a, b in zip(at_extremes[:count], at_ties[:count]))


def _mean_over_pairs(t: Node, z: Node, extreme: Node, axis: int) -> Node | None:
    """extreme_mean of a map over pairs t (a tangent of z, in forward
    mode) as through_extreme takes the VJP: t at each row's extreme pair
    alone where one entry is the extreme, t's mean over the tied pairs
    where several are (or a NaN), in a guarded loop over the pairs that
    adds into the row. None where t is not such a map."""
    if t.op != "emap" or t.attrs[3] != ("cell",) or t.shape != z.shape:
        return None
    bodies, bindings, loops, _, lets = t.attrs
    keep, count = 1 - axis, len(t.args)
    picked = _at_first(bindings, count, keep)
    if picked is None:
        return None
    tie = extreme_tie(z, extreme, axis)
    single, several = _guards(tie)
    one = emap(bodies, t.args + (tie, single), picked + (("index",), ("guard", 0)), (loops[keep],), ("row", 0),
               (loops[keep], 1), lets)
    entry, m, code = (row_placeholder(count + k, 0) for k in range(3))
    share = sp.Piecewise((-1 / code, sp.Eq(entry, m)), (0, True))  # NaN with a NaN
    ties = emap([body * share for body in bodies], t.args + (z, _column(axis)(extreme), tie, several),
                bindings + (("cell",), ("row", keep), ("row", keep), ("guard", keep)), loops, ("row", keep),
                (loops[keep], 1), lets)
    total = map_(A0 + A1, [one, ties], (loops[keep], 1))
    return total if axis == 1 else transpose(total)


def _column(axis: int):
    """A row's (axis 1) or column's (axis 0) values of an extreme, as a column."""
    return (lambda v: v) if axis == 1 else transpose


def _guards(tie: Node) -> tuple[Node, Node]:
    """The guards of the rows of one extreme and of several (a row with a
    NaN is one of several: its code is -1)."""
    single, several = (map_(sp.Piecewise((1, condition), (0, True)), [tie], tie.shape)
                       for condition in (A0 >= 0, A0 < 0))
    return single, several


def _at_first(bindings: tuple, first: int, keep: int) -> tuple | None:
    """The bindings of a map over loop `keep` alone that reads the rows of
    the other loop at index `first` (an argument), or None where one
    cannot (a cell, a gather by the other loop, a guard)."""
    picked = []
    for binding in bindings:
        kind = binding[0]
        if kind in ("whole", "index"):
            picked.append(binding)
        elif kind == "row":
            picked.append(("row", 0) if binding[1] == keep else ("gather", first, 0))
        elif kind == "gather" and binding[2] == keep:
            picked.append(("gather", binding[1], 0))
        else:
            return None
    return tuple(picked)


def _plus(a: Node | None, b: Node | None) -> Node | None:
    if a is None or b is None:
        return a if b is None else b
    return map_(A0 + A1, [a, b], a.shape)


def _tie_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (None, None)  # constant between ties: its derivative is 0


def _tie_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return None


# --- kernel ---------------------------------------------------------------------


@dataclass(frozen=True)
class ExtremeKernel:
    """`kind` (extreme_spread, extreme_mean or extreme_tie) of `values` (a
    View, a constant read at every entry, or None: extreme_tie) over the
    ties of `src` (z, `shape`) with `extreme` along `axis`, into the
    contiguous `out`."""

    kind: str
    out: str
    values: View | sp.Expr | None
    src: View
    extreme: View
    shape: Shape
    axis: int
    equations: tuple[Equation, ...]

    def reads(self) -> list[str]:
        return [self.src.buffer, self.extreme.buffer] + ([self.values.buffer] if isinstance(self.values, View) else [])

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def title(self) -> str:
        return {"extreme_spread": "an extreme's adjoint shared among its ties",
                "extreme_mean": "the mean over an extreme's ties"}.get(self.kind, "an extreme's ties")

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): two passes over z (count, then share)."""
        return sp.Integer(0), 2 * sp.sympify(self.shape[0]) * self.shape[1]


def _describe(sched, node: Node) -> tuple[str, str]:
    """What a kernel computes, in words and as LaTeX."""
    z, extreme = node.args[-2:]
    ties = (f"the entries of {sched.label(z)} equal to {sched.label(extreme)} "
            + ("down each column" if node.attrs[0] == 0 else "along each row"))
    if node.op == "extreme_tie":
        return f"the position of the one of {ties}, or minus their count", r"\mathrm{tie}(z, m)"
    values = node.args[0]
    label = str(values.attrs[0]) if is_const(values) else sched.label(values)
    if node.op == "extreme_spread":
        return f"{label} shared evenly among {ties}, 0 elsewhere", r"\frac{[z = m]}{\sum [z = m]}\, g"
    return f"mean of {label} over {ties}", r"\sum \frac{[z = m]}{\sum [z = m]}\, t"


def _kernel(sched, node: Node, out: str) -> ExtremeKernel:
    *values, z, extreme = node.args
    text, latex = _describe(sched, node)
    equation = Equation(out, text, f"{latex_name(out)} = {latex}")
    where = None if not values else values[0].attrs[0] if is_const(values[0]) else sched.view(values[0])
    return ExtremeKernel(node.op, out, where, sched.view(z), sched.view(extreme), z.shape, node.attrs[0],
                         (equation,))


def _emit(em: FunctionEmitter, kernel: ExtremeKernel) -> dict:
    """One helper call per row (column): z's entries, their extreme, the
    spread's adjoint (a number) or the mean's values (entries), and the
    (extreme_tie: neither)."""
    walk, loop, count = axis_walk(em, kernel.shape, kernel.axis)
    outer = (LOOP_J if kernel.axis == 0 else LOOP_I) if loop else sp.Integer(0)
    src, src_step = walk(kernel.src)
    extreme = em.access(kernel.extreme, *((sp.Integer(0), outer) if kernel.axis == 0 else (outer, sp.Integer(0))))
    printer = CheckedPrinter(ScalarPrinter({}, em.real), kernel)
    if kernel.kind == "extreme_spread":
        g = (em.access(kernel.values, *((sp.Integer(0), outer) if kernel.axis == 0 else (outer, sp.Integer(0))))
             if isinstance(kernel.values, View) else printer.doprint(kernel.values))
        dst, dst_step = walk(contiguous(kernel.out, kernel.shape))
        return {"loop": loop, "args": f"{src}, {count}, {src_step}, {extreme}, {g}, {dst}, {dst_step}"}
    args = f"{src}, {count}, {src_step}, {extreme}"
    if isinstance(kernel.values, View):
        args += ", {}, {}".format(*walk(kernel.values))
    elif kernel.values is not None:
        args += f", &(const {em.real.c}){{{printer.doprint(kernel.values)}}}, 0"
    outer_len = kernel.shape[1] if kernel.axis == 0 else kernel.shape[0]
    fields = {
        "columns": None,
        "loop": loop,
        "parallel": loop is not None and worth_threads(outer_len),
        "out": f"{em.namer.name(kernel.out)}[{outer if loop else 0}]",
        "args": args,
    }
    if kernel.kind == "extreme_tie" and loop and rows_at_once(outer_len):  # a _rows call a block (cumulative.py)
        row_stride, m_stride = ((kernel.src.row_stride, kernel.extreme.row_stride) if kernel.axis == 1
                                else (kernel.src.col_stride, kernel.extreme.col_stride))
        m_start = sp.expand(kernel.extreme.offset + outer * m_stride)
        m = em.namer.name(kernel.extreme.buffer) + ("" if m_start == 0 else f" + {em.index.doprint(m_start)}")
        fields.update(rows_fields(em, outer, outer_len, f"{src}, ",
                                  f"{count}, {src_step}, {em.index.doprint(sp.sympify(row_stride))}, {m}, "
                                  f"{em.index.doprint(sp.sympify(m_stride))}", kernel.out))
    return fields


register(OpRecord("extreme_spread", vjp=_spread_vjp, jvp=_spread_jvp, evaluate=_eval_spread, kernel=_kernel,
                  emit=_emit, template="axis_kernel", grad_fn=plain_grad_fn("ExtremeSpread"), helper=True))
register(OpRecord("extreme_mean", vjp=_mean_vjp, jvp=_mean_jvp, evaluate=_eval_mean, kernel=_kernel,
                  emit=_emit, template="reduce_kernel", grad_fn=plain_grad_fn("ExtremeMean"), helper=True))
register(OpRecord("extreme_tie", vjp=_tie_vjp, jvp=_tie_jvp, evaluate=_eval_tie, kernel=_kernel,
                  emit=_emit, template="reduce_kernel", grad_fn=plain_grad_fn("ExtremeTie"), helper=True))
