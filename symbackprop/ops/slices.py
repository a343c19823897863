"""slice: SymPy's MatrixSlice (A[r0:r1:rs, c0:c1:cs]) of any matrix of a
model, a view (read through its argument's memory at an offset and wider
strides, never stored: a product of a slice of a fused weight reads the
weight in place); and its adjoint, slice_scatter: a matrix of the parent's
shape, zero but at the sliced entries, which hold the slice's adjoint (the
gradient of each slice of a fused weight lands in its own rows).

A node's attrs are (r0, rs, c0, cs): the first row and column taken and
the steps between them; its shape is the slice's. slice_scatter's are the
same, its shape the parent's. A slice_scatter may also take several adjoints (the
attrs then four per argument): the gradients of disjoint slices of one
parent (the Q, K and V of a fused weight) scattered into one buffer, which
is zeroed once and only where they leave entries uncovered
(merge_scatters, from the sum of their adjoints).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, ViewRule, plain_grad_fn, register
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, is_const
from symbackprop.ir.interpret import Context
from symbackprop.ir.lower import shape_of
from symbackprop.ir.node import Node, Shape, op_node
from symbackprop.messages import short
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Equation, View, latex_name

Steps = tuple[int, int, int, int]  # (r0, rs, c0, cs)


def slice_view(a: Node, steps: Steps, shape: Shape) -> Node:
    """Rows r0, r0 + rs, ... and columns c0, c0 + cs, ... of `a`, `shape` of them."""
    if tuple(shape) == tuple(a.shape) and steps == (0, 1, 0, 1):
        return a
    if is_const(a):
        return const(a.attrs[0], shape)
    return op_node("slice", (a,), shape, tuple(steps))


def slice_scatter(g: Node, steps: Steps, shape: Shape) -> Node:
    """A zero matrix of `shape` with g at the entries slice_view(., steps) reads."""
    if tuple(shape) == tuple(g.shape) and steps == (0, 1, 0, 1):
        return g
    return op_node("slice_scatter", (g,), shape, tuple(steps))


def parts(node: Node) -> list[Steps]:
    """Each argument's steps of a slice_scatter (four attrs an argument)."""
    a = tuple(node.attrs)
    return [(a[i], a[i + 1], a[i + 2], a[i + 3]) for i in range(0, len(a), 4)]


def _indices(start: int, step: int, count: object) -> set[int] | None:
    """The indices a slice takes along a dimension, None where its count is bound at call time."""
    number = sp.sympify(count)
    return set(range(start, start + step * int(number), step)) if number.is_Integer else None


def _disjoint(a: tuple[Steps, Shape], b: tuple[Steps, Shape]) -> bool:
    """Whether two slices of one parent share no entry: their rows or their columns are disjoint."""
    (ar0, ars, ac0, acs), ashape = a
    (br0, brs, bc0, bcs), bshape = b
    for first, second in (((ar0, ars, ashape[0]), (br0, brs, bshape[0])), ((ac0, acs, ashape[1]), (bc0, bcs, bshape[1]))):
        x, y = _indices(*first), _indices(*second)
        if x is not None and y is not None and not x & y:
            return True
    return False


def merge_scatters(terms: list[Node]) -> list[Node]:
    """The slice_scatters among `terms` (a sum's terms) of one parent's shape
    whose slices are disjoint, as one slice_scatter of all their arguments:
    one buffer, zeroed at most once, not a zeroed parent per slice and a sum."""
    scatters = [t for t in terms if t.op == "slice_scatter"]
    if len(scatters) < 2 or any(t.shape != scatters[0].shape for t in scatters):
        return terms
    pieces = [(steps, arg.shape) for t in scatters for steps, arg in zip(parts(t), t.args)]
    if any(not _disjoint(a, b) for i, a in enumerate(pieces) for b in pieces[i + 1:]):
        return terms
    merged = op_node("slice_scatter", tuple(a for t in scatters for a in t.args), scatters[0].shape,
                     tuple(x for t in scatters for x in t.attrs))
    return [merged] + [t for t in terms if t.op != "slice_scatter"]


def _covers(node: Node) -> bool:
    """Whether a slice_scatter's disjoint slices cover its whole shape (no zero to write)."""
    taken = sum((sp.sympify(a.shape[0]) * sp.sympify(a.shape[1]) for a in node.args), sp.Integer(0))
    return len(node.args) > 1 and sp.expand(taken - sp.sympify(node.shape[0]) * sp.sympify(node.shape[1])) == 0


def _picked(steps: Steps, shape: tuple[int, int]) -> tuple[slice, slice]:
    r0, rs, c0, cs = steps
    return slice(r0, r0 + rs * shape[0], rs), slice(c0, c0 + cs * shape[1], cs)


def _slice_evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0][_picked(node.attrs, context.shape(node))].copy()


def _scatter_evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    out = np.zeros(context.shape(node))
    for steps, arg, value in zip(parts(node), node.args, args):
        out[_picked(steps, context.shape(arg))] = np.broadcast_to(value, context.shape(arg))
    return out


def _strides(inner: View, node: Node) -> View:
    r0, rs, c0, cs = node.attrs
    rows, cols = node.shape
    zero = sp.Integer(0)
    return View(inner.buffer, inner.at(sp.Integer(r0), sp.Integer(c0)),
                inner.row_stride * rs if rows != 1 else zero, inner.col_stride * cs if cols != 1 else zero)


def _label(steps: Steps, shape: Shape) -> str:
    """[r0:r1:rs, c0:c1:cs] as Python writes it (a step of 1 left out)."""
    def part(start: int, step: int, count: object) -> str:
        stop = sp.sympify(start) + step * sp.sympify(count)
        return f"{start}:{stop}" + (f":{step}" if step != 1 else "")
    r0, rs, c0, cs = steps
    return f"[{part(r0, rs, shape[0])}, {part(c0, cs, shape[1])}]"


def _bound(value: sp.Basic, expr: sp.MatrixSlice, what: str) -> int:
    if not sp.sympify(value).is_Integer:
        raise ModelError(f"a slice's {what} must be a number; {value} in {short(expr)}")
    return int(value)


def _lower_slice(lowerer, expr: sp.MatrixSlice) -> Node:
    """parent[r0:r1:rs, c0:c1:cs]: the starts and steps numbers; along a
    dimension bound at call time (a batch), all of it (X[:, 1:3] of a batch
    X) or a fixed number of entries (X[0:2, :]), which every call then
    needs (the binder and the C check that n >= 2): no call can make a
    slice read past its parent."""
    parent = lowerer.lower(expr.parent)
    for start, stop, step in (expr.rowslice, expr.colslice):
        if step != 1 and sp.sympify((stop - start) % step).is_Integer and (stop - start) % step:
            raise ModelError(f"a slice's step {step} does not divide its length {stop - start} in {short(expr)}: "
                             f"SymPy counts {(stop - start) // step} where Python counts {-(-(stop - start) // step)}; "
                             "write the stop as start + step * count")
    (r0, _, rs), (c0, _, cs) = expr.rowslice, expr.colslice
    steps = (_bound(r0, expr, "start"), _bound(rs, expr, "step"), _bound(c0, expr, "start"), _bound(cs, expr, "step"))
    for (start, stop, step), size, what in zip((expr.rowslice, expr.colslice), parent.shape, ("rows", "columns")):
        if not isinstance(size, sp.Symbol) or (start == 0 and stop == size and step == 1):
            continue
        count = sp.sympify((stop - start) / step)  # (a whole number of steps: checked above)
        if not count.is_Integer:
            raise ModelError(f"{short(expr)} takes {what} {start}:{stop}:{step} of {size}, which is bound at call time: "
                             f"a call with fewer {what} would read past them; slice a matrix of fixed {what}, "
                             f"take a fixed number of them or all {size} of them")
        last = int(start) + int(step) * (int(count) - 1)  # a fixed part of a size bound at call time: a need of every call
        why = f"the model takes {what} {start}:{stop}:{step} of {short(expr.parent)}"
        lowerer.need_at_least(size, max(int(start), last) + 1, why)
    return slice_view(parent, steps, shape_of(expr))


register(OpRecord(
    "slice",
    vjp=lambda node, g, needed: (slice_scatter(g, node.attrs, node.args[0].shape),),
    jvp=lambda node, tangents: slice_view(tangents[0], node.attrs, node.shape) if tangents[0] is not None else None,
    evaluate=_slice_evaluate,
    grad_fn=plain_grad_fn("Slice"),
    view=ViewRule(
        strides=_strides,
        label=lambda inner, node: inner + _label(node.attrs, node.shape),
        symbol=lambda inner, node: sp.MatrixSymbol(f"{inner}_slice", *node.shape),
    ),
    lowering=((sp.MatrixSlice, _lower_slice),),
))


# --- slice_scatter: the adjoint ---------------------------------------------------


@dataclass(frozen=True)
class ScatterKernel:
    """out (rows x cols, contiguous) = 0 but at the sliced entries, which are
    the arguments' (one slice each, disjoint); `fill`: some entry is no
    slice's (zeroed first)."""

    out: str
    shape: Shape
    g: tuple[View | sp.Expr, ...]  # where each argument is, or its value where it is a constant
    g_shape: tuple[Shape, ...]
    steps: tuple[Steps, ...]
    fill: bool
    equations: tuple[Equation, ...]
    kind: str = "slice_scatter"
    title = "a slice's adjoint into its parent's shape"

    def reads(self) -> list[str]:
        return [g.buffer for g in self.g if isinstance(g, View)]

    def writes(self) -> list[str]:
        return [self.out]

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """Copies only."""
        return sp.Integer(0), sp.Integer(0)


def _scatter_kernel(sched, node: Node, out: str) -> ScatterKernel:
    pieces, written = [], []
    for steps, g in zip(parts(node), node.args):
        label, where = str(g.attrs[0]) if is_const(g) else sched.label(g), _label(steps, g.shape)
        pieces.append(f"{label} at {where}")
        written.append(rf"\operatorname{{scatter}}_{{{where}}}\left({latex_name(label)}\right)")
    fill = not _covers(node)
    text = (f"0 ({node.shape[0]} x {node.shape[1]}), " if fill else "") + ", ".join(pieces)
    latex = rf"{latex_name(out)} = " + " + ".join(written)
    sources = tuple(g.attrs[0] if is_const(g) else sched.view(g) for g in node.args)  # a constant has no buffer
    return ScatterKernel(out, node.shape, sources, tuple(g.shape for g in node.args), tuple(parts(node)), fill,
                         (Equation(out, text, latex),))


STACKED_MIN = 4  # copies of one shape into evenly spaced rows: from this many, one loop over a table of them


def _scatter_emit(em: FunctionEmitter, kernel: ScatterKernel) -> dict:
    """A copy loop per argument, but one loop over a table of pointers for
    a run of arguments that land at evenly spaced rows (a recurrence's
    per-step inputs stacked into its sequence): GCC's time grows with loops."""
    rows, cols = (sp.sympify(d) for d in kernel.shape)
    pieces = list(zip(kernel.steps, kernel.g, kernel.g_shape))
    copies, k = [], 0
    while k < len(pieces):
        run = _stacked_run(pieces, k) if rows != 1 else 1
        copies.append(_stacked_copy(em, kernel, pieces[k:k + run], cols) if run >= STACKED_MIN
                      else _copy(em, kernel, *pieces[k], rows, cols))
        k += run if run >= STACKED_MIN else 1
    return {"out": em.namer.name(kernel.out), "size": em.dim(rows * cols), "fill": kernel.fill, "copies": copies}


def _copy(em: FunctionEmitter, kernel: ScatterKernel, steps: Steps, g: View | sp.Expr, g_shape: Shape,
          rows: sp.Expr, cols: sp.Expr) -> dict:
    r0, rs, c0, cs = steps
    zero = sp.Integer(0)
    target = View(kernel.out, r0 * cols + c0 if rows != 1 else sp.Integer(c0),
                  rs * cols if g_shape[0] != 1 else zero, sp.Integer(cs) if g_shape[1] != 1 else zero)
    return {"rows": em.dim(g_shape[0]), "cols": em.dim(g_shape[1]), "dst": em.access(target, LOOP_I, LOOP_J),
            "src": em.access(g, LOOP_I, LOOP_J) if isinstance(g, View)
            else CheckedPrinter(ScalarPrinter({}, em.real), kernel).doprint(g), "table": ()}


Piece = tuple[Steps, View | sp.Expr, Shape]  # an argument's steps, where it is (or its value), its shape


def _stacked_run(pieces: list[Piece], k: int) -> int:
    """How many pieces from the k-th are one shape, read alike from their
    own buffers and written at rows r0, r0 + d, r0 + 2d, ... (d != 0)."""
    (steps, g, shape), count = pieces[k], 1
    if not isinstance(g, View) or k + 1 == len(pieces):
        return 1
    delta = pieces[k + 1][0][0] - steps[0]
    for later_steps, later, later_shape in pieces[k + 1:]:
        if (not isinstance(later, View) or later_shape != shape or later_steps[1:] != steps[1:]
                or later_steps[0] != steps[0] + count * delta or delta == 0
                or (later.offset, later.row_stride, later.col_stride) != (g.offset, g.row_stride, g.col_stride)):
            break
        count += 1
    return count


def _stacked_copy(em: FunctionEmitter, kernel: ScatterKernel, run: list[Piece], cols: sp.Expr) -> dict:
    """The fields of one copy loop over `run`'s sources (a table, `stacked`,
    indexed by `at`): the first piece's copy shifted by `at` steps."""
    (steps, g, shape), sources = run[0], [g.buffer for _, g, _ in run if isinstance(g, View)]
    first = _copy(em, kernel, steps, g, shape, sp.Integer(2), cols)  # (rows != 1: the run moves by rows)
    out, source = em.namer.name(kernel.out), em.namer.name(sources[0])
    shift = em.dim((run[1][0][0] - run[0][0][0]) * cols)
    moved = "at" if shift == "1" else (f"({shift})*at" if any(c in shift for c in " +-") else f"{shift}*at")
    at = first["dst"][len(out) + 1:-1]
    names = [em.namer.name(buffer) for buffer in sources]
    return {**first, "dst": f"{out}[{moved if at == '0' else f'{at} + {moved}'}]",
            "src": "stacked[at]" + first["src"][len(source):], "count": len(run),
            "table": [", ".join(names[i:i + 8]) for i in range(0, len(names), 8)]}


def _scatter_vjp(node: Node, g: Node, needed) -> tuple[Node, ...]:
    return tuple(slice_view(g, steps, arg.shape) for steps, arg in zip(parts(node), node.args))


def _scatter_jvp(node: Node, tangents) -> Node | None:
    if all(t is None for t in tangents):
        return None
    args = tuple(const(0, arg.shape) if t is None else t for t, arg in zip(tangents, node.args))
    return op_node("slice_scatter", args, node.shape, tuple(node.attrs))


register(OpRecord(
    "slice_scatter",
    vjp=_scatter_vjp,
    jvp=_scatter_jvp,
    evaluate=_scatter_evaluate,
    kernel=_scatter_kernel,
    emit=_scatter_emit,
    template="slice_scatter_kernel",
    grad_fn=plain_grad_fn("SliceScatter"),
    merge_terms=merge_scatters,
))
