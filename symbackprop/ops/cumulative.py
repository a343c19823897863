"""Ops that run along one axis and keep the shape: the cumulative sum
(sbp.cumsum), the shift (sbp.shift), and the kernel every such op shares:
one call of the module's C helper of the op's name per row or column
(templates/reduce.c.j2), which walks the entries. A reversed walk is the
same helper from the last entry, with negative strides. A node's attrs are
(axis, reverse, *more): `more` is passed to the helper after its strides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import GradFnName, JvpRule, OpRecord, VjpRule, plain_grad_fn, register
from symbackprop.declare.tensor import Cumsum, Shift
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter
from symbackprop.ir.construct import is_const
from symbackprop.ir.node import Node, Shape, op_node
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Equation, View, latex_name


@dataclass(frozen=True)
class AxisKernel:
    """`kind` (an op) of `src` (rows x cols, or a constant read at every
    entry) along `axis`, into the contiguous `out` of the same shape."""

    kind: str
    out: str
    src: View | sp.Expr
    shape: Shape
    axis: int
    reverse: bool
    equations: tuple[Equation, ...]
    more: tuple = ()  # the helper's further arguments (the node's attrs after axis and reverse)

    def reads(self) -> list[str]:
        return [self.src.buffer] if isinstance(self.src, View) else []

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def title(self) -> str:
        return {"cumsum": "cumulative sum", "shift": "shift"}.get(self.kind, self.kind)

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): one an entry."""
        return sp.Integer(0), sp.sympify(self.shape[0]) * self.shape[1]


def axis_op(name: str, vjp: VjpRule, jvp: JvpRule, evaluate: Callable[..., np.ndarray],
            text: str, latex: str, grad_fn: GradFnName, **more: object) -> OpRecord:
    """Register an op along one axis whose kernel is an AxisKernel; its
    node's attrs are (axis, reverse, *more), and evaluate(x, *attrs) is its
    numpy reference. text, latex: what it computes, with {arg}, {what}
    ("down each column" / "along each row"), {index}, {term}, {cmp} (<= or
    >=, reversed) and {more[0]}, ... `more`: other fields of its record."""

    def kernel(sched, node: Node, out: str) -> AxisKernel:
        (src,) = node.args
        axis, reverse, *extra = node.attrs
        label = str(src.attrs[0]) if is_const(src) else sched.label(src)
        words = {"arg": label, "what": ("down each column" if axis == 0 else "along each row")
                 + (", from the end" if reverse else ""), "index": "i" if axis == 0 else "j",
                 "cmp": r"\ge" if reverse else r"\le", "more": extra}
        words["term"] = rf"\left({latex_name(label)}\right)_{{ij}}"
        equation = Equation(out, text.format(**words), f"{latex_name(out)} = {latex.format(**words)}")
        where = src.attrs[0] if is_const(src) else sched.view(src)
        return AxisKernel(name, out, where, node.shape, axis, reverse, (equation,), tuple(extra))

    return register(OpRecord(
        name, vjp=vjp, jvp=jvp, evaluate=lambda node, args, context: evaluate(args[0], *node.attrs),
        kernel=kernel, emit=_emit, template="axis_kernel", grad_fn=grad_fn, helper=True, **more,  # type: ignore[arg-type]
    ))


def contiguous(buffer: str, shape: Shape) -> View:
    """The row-major view of all of `buffer`, of `shape` (a vector's unit stride only)."""
    rows, cols = shape
    return View(buffer, sp.Integer(0), sp.sympify(cols) if rows != 1 else sp.Integer(0),
                sp.Integer(1) if cols != 1 else sp.Integer(0))


# The reductions whose helper has a _rows variant (reduce.c.j2): many short
# rows eight at a time, a row in each lane of a vector. A loop over the
# rows calls it once a block of ROWS_BLOCK rows (blocks share out threads).
ROWS_HELPERS = frozenset({"max", "min", "extreme_tie"})
ROWS_BLOCK = 64


def rows_at_once(outer_len: object) -> bool:
    """Whether a loop over `outer_len` rows calls a _rows helper: a
    dimension, or a fixed count of eight rows or more (fewer fill no vector)."""
    count = sp.sympify(outer_len)
    return not isinstance(count, sp.Integer) or int(count) >= 8


def rows_fields(em: FunctionEmitter, outer: sp.Symbol, outer_len: object, first: str, rest: str, out: str) -> dict:
    """The reduce_kernel fields of a _rows helper's call a block of rows:
    `first` (the block's first row, as C, with its comma), how many rows,
    then `rest` (the entries' count, stride and the rows' stride, and any
    more), then the block's first output."""
    bound = em.dim(outer_len)
    count = f"{bound} - {outer} < {ROWS_BLOCK} ? {bound} - {outer} : {ROWS_BLOCK}"
    return {"rows": f"{first}{count}, {rest}, {em.namer.name(out)} + {outer}", "rows_block": ROWS_BLOCK}


def axis_walk(em: FunctionEmitter, shape: Shape, axis: int,
              reverse: bool = False) -> tuple[Callable[[View], tuple[str, str]], tuple[str, str] | None, str]:
    """How one helper call per row (axis 1) or column (axis 0) of a matrix
    of `shape` reads a view: (walk, loop, count). walk(view): the row's
    (column's) first entry and the stride along it, as C; reversed, the
    last entry and the stride negated. loop: (variable, bound) of the loop
    over the rows (columns), None for one. count: the entries of each."""
    rows, cols = shape
    outer_len, inner_len = (cols, rows) if axis == 0 else (rows, cols)
    outer = LOOP_J if axis == 0 else LOOP_I
    looped = em.dim(outer_len) != "1"

    def walk(view: View) -> tuple[str, str]:
        strides = (view.col_stride, view.row_stride) if axis == 0 else (view.row_stride, view.col_stride)
        outer_stride, inner_stride = strides
        start = view.offset + (outer * outer_stride if looped else 0)
        step = sp.sympify(inner_stride)
        if reverse:
            start, step = start + (sp.sympify(inner_len) - 1) * step, -step
        start = sp.expand(start)
        pointer = em.namer.name(view.buffer) + ("" if start == 0 else f" + {em.index.doprint(start)}")
        return pointer, em.index.doprint(step) if inner_len != 1 else "1"

    return walk, ((str(outer), em.dim(outer_len)) if looped else None), em.dim(inner_len)


def _emit(em: FunctionEmitter, kernel: AxisKernel) -> dict:
    """One helper call per row (axis 1) or column (axis 0): (first entry
    read, count, stride, first entry written, stride, *more: an integer, or
    a real number printed as a C constant); a reversed walk starts at the
    last entries, its strides negated. A constant source is a compound
    literal read with stride 0."""
    walk, loop, count = axis_walk(em, kernel.shape, kernel.axis, kernel.reverse)
    if isinstance(kernel.src, View):
        src, src_step = walk(kernel.src)
    else:
        constant = CheckedPrinter(ScalarPrinter({}, em.real), kernel).doprint(kernel.src)
        src, src_step = f"&(const {em.real.c}){{{constant}}}", "0"
    dst, dst_step = walk(contiguous(kernel.out, kernel.shape))
    printer = CheckedPrinter(ScalarPrinter({}, em.real), kernel)
    more = "".join(f", {int(v)}" if isinstance(v, (int, sp.Integer)) else f", {printer.doprint(v)}"
                   for v in kernel.more)
    return {"loop": loop, "args": f"{src}, {count}, {src_step}, {dst}, {dst_step}{more}"}


def _along(x: np.ndarray, axis: int, reverse: bool, running: Callable[[np.ndarray, int], np.ndarray]) -> np.ndarray:
    """`running` (np.cumsum, np.cumprod) along axis, from the end when reverse."""
    if reverse:
        return np.flip(running(np.flip(x, axis), axis), axis)
    return running(x, axis)


# --- cumsum -----------------------------------------------------------------------


def cumsum(a: Node, axis: int, reverse: bool = False) -> Node:
    """The running sum of `a` along `axis` (from the end when reverse)."""
    if a.shape[axis] == 1:
        return a
    return op_node("cumsum", (a,), a.shape, (axis, bool(reverse)))


def _cumsum_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    axis, reverse = node.attrs  # entry k feeds the sums k.. (or ..k): the adjoint sums from the other end
    return (cumsum(g, axis, not reverse),)


def _cumsum_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return cumsum(tangents[0], *node.attrs) if tangents[0] is not None else None


def _lower_cumsum(lowerer, expr: Cumsum) -> Node:
    return cumsum(lowerer.lower(expr.arg), expr.axis, expr.reverse)


axis_op("cumsum", _cumsum_vjp, _cumsum_jvp, lambda x, axis, reverse: _along(x, axis, reverse, np.cumsum),
        "running sum of {arg} {what}", r"\sum_{{{index}' {cmp} {index}}} {term}", plain_grad_fn("Cumsum"),
        lowering=((Cumsum, _lower_cumsum),), shapes=((Cumsum, lambda e, of: of(e.arg)),))


# --- shift ------------------------------------------------------------------------


def shift(a: Node, k: int, axis: int, fill: sp.Expr | int = 0) -> Node:
    """`a` moved k entries along `axis` (toward the end when k > 0), `fill`
    where nothing moves in; attrs (axis, reverse, |k|, fill): a negative k
    is the same walk from the end (reverse)."""
    if k == 0:
        return a
    if is_const(a) and sp.sympify(a.attrs[0]) == sp.sympify(fill):
        return a  # a constant moved over itself
    return op_node("shift", (a,), a.shape, (axis, k < 0, abs(int(k)), sp.sympify(fill)))


def _shift_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    axis, reverse, k, _ = node.attrs  # entry i came from i - k: its adjoint moves back, 0 where none came
    return (shift(g, k if reverse else -k, axis),)


def _shift_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    axis, reverse, k, _ = node.attrs  # the fill is a constant: its tangent is 0
    return shift(tangents[0], -k if reverse else k, axis) if tangents[0] is not None else None


def _shifted(x: np.ndarray, axis: int, reverse: bool, k: int, fill: sp.Expr) -> np.ndarray:
    def forward(v: np.ndarray, ax: int) -> np.ndarray:
        out = np.full_like(v, float(fill))
        n = v.shape[ax]
        if k < n:
            src = [slice(None)] * v.ndim
            dst = [slice(None)] * v.ndim
            src[ax], dst[ax] = slice(0, n - k), slice(k, n)
            out[tuple(dst)] = v[tuple(src)]
        return out

    return _along(np.asarray(x, dtype=float), axis, reverse, forward)


def _lower_shift(lowerer, expr: Shift) -> Node:
    return shift(lowerer.lower(expr.arg), expr.k, expr.axis, expr.fill)


axis_op("shift", _shift_vjp, _shift_jvp, _shifted,
        "{arg} moved {more[0]} entries {what}, {more[1]} where none moves in",
        r"\left({arg}\right)_{{{index} - {more[0]}}} \text{{ ({more[1]} before the first, {what})}}",
        lambda node: ("Shift", list(node.args)),
        lowering=((Shift, _lower_shift),), shapes=((Shift, lambda e, of: of(e.arg)),))
