"""pick and place: one entry a row at a column an Index names (declare.pick).

    pick(A, idx)          out[i] = A[i, idx[i]]                      (m x n -> m x 1)
    place(G, idx; n)      out[i, j] = G[i] if j == idx[i] else 0     (m x 1 -> m x n)

Each is the other's transpose: <place(G, idx), A> = <G, pick(A, idx)>, so
each one's VJP (and JVP, both being linear) is the other, and derivatives
of any order exist. The softmax cross-entropy against class numbers picks
each row's target logit, where the product with one-hot rows read and
wrote m x classes; its gradient's one-hot part is a place.

The C of each is one loop over the rows; the index's range is checked at
the function's entry (index_checks), as a gather's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, attrs_of, plain_grad_fn, register
from symbackprop.declare.pick import Pick
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, worth_threads
from symbackprop.ir.construct import is_const
from symbackprop.ir.node import Node, op_node
from symbackprop.ops.emap import index_leaf
from symbackprop.schedule.kernel import LOOP_I, Equation, View, latex_name

# --- constructors ---------------------------------------------------------------


def pick(array: Node, index: Node) -> Node:
    return op_node("pick", (array, index), (index.shape[0], 1), ())


def place(values: Node, index: Node, columns: object) -> Node:
    return op_node("place", (values, index), (index.shape[0], columns), (columns,))


# --- derivatives: each is the other's transpose -------------------------------------


def _pick_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    array, index = node.args
    return (place(g, index, array.shape[1]) if needed[0] else None, None)


def _pick_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return pick(tangents[0], node.args[1]) if tangents[0] is not None else None


def _place_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (pick(g, node.args[1]) if needed[0] else None, None)


def _place_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return place(tangents[0], node.args[1], node.attrs[0]) if tangents[0] is not None else None


# --- numpy references ---------------------------------------------------------------


def _rows_and_columns(index: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(rows), np.asarray(index).reshape(-1)[:rows].astype(np.int64)


def _eval_pick(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    rows = context.shape(node)[0]
    array = np.broadcast_to(args[0], (rows, context.shape(node.args[0])[1]))
    return array[_rows_and_columns(args[1], rows)].reshape(rows, 1)


def _eval_place(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    rows, columns = context.shape(node)
    out = np.zeros((rows, columns))
    out[_rows_and_columns(args[1], rows)] = np.broadcast_to(args[0], (rows, 1))[:, 0]
    return out


# --- kernel -------------------------------------------------------------------------


@dataclass(frozen=True)
class PickAttrs:
    """What a pick or place kernel does, as its record's `attrs`: the kernel,
    emit and kernel_pick.c.j2 branch on this, never on the op's name.

    gather: each row reads the entry at its index's column into one entry
        (pick: the result is m x 1); else it scatters, writing each row's
        zeros and then its value at that column (place: m x n).
    """

    gather: bool


@dataclass(frozen=True)
class PickKernel:
    """pick or place (`kind`) of `source` (a view, or a constant) at the
    columns of the Index `index`, into the contiguous `out`."""

    kind: str
    out: str
    source: View | None
    constant: sp.Expr | None  # the source's value where it is a constant (an adjoint of 1/m)
    index: str
    rows: object
    columns: object  # the picked matrix's (pick) or the result's (place)
    equations: tuple[Equation, ...]
    index_checks: tuple[tuple[str, object, object], ...]

    def reads(self) -> list[str]:
        return ([self.source.buffer] if self.source is not None else []) + [self.index]

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def title(self) -> str:
        return self.kind

    @property
    def attrs(self) -> PickAttrs:
        return attrs_of(self.kind, PickAttrs)

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): none; it moves m (pick) or m x n (place) numbers."""
        return sp.Integer(0), sp.Integer(0)


def _kernel(sched, node: Node, out: str) -> PickKernel:
    source, index = node.args
    index_buffer = sched.view(index).buffer
    constant = source.attrs[0] if is_const(source) else None
    view = None if constant is not None else sched.view(source)
    label, at = (f"({constant})" if constant is not None else sched.label(source)), sched.label(index)
    if attrs_of(node.op, PickAttrs).gather:
        columns = source.shape[1]
        entry, value = "[i]", f"{label}[i, {at}[i]]"
    else:
        columns = node.attrs[0]
        entry, value = "[i, j]", f"{label}{'' if constant is not None else '[i]'} if j == {at}[i], else 0"
    shown = sp.latex(constant) if constant is not None else latex_name(label)
    latex = rf"{latex_name(out)} = \operatorname{{{node.op}}}({shown}, {latex_name(at)})"
    return PickKernel(node.op, out, view, constant, index_buffer, node.shape[0], columns,
                      (Equation(out + entry, value, latex),), ((index_buffer, index.shape[0], columns),))


def _emit(em: FunctionEmitter, kernel: PickKernel) -> dict:
    column = sp.Symbol("column", integer=True)  # the C's local: the row's index entry
    if kernel.source is None:
        dims = {d: f"(({em.real.c}){c})" for d, c in em.dims.items()}  # real, not integer, division
        read = f"({CheckedPrinter(ScalarPrinter(dims, em.real), kernel).doprint(kernel.constant)})"
    else:
        read = em.access(kernel.source, LOOP_I, column if kernel.attrs.gather else sp.Integer(0))
    columns = em.dim(kernel.columns)
    columns = columns if columns.isidentifier() or columns.isdigit() else f"({columns})"
    return {"m": em.dim(kernel.rows), "n": columns, "out": em.namer.name(kernel.out),
            "index": em.namer.name(kernel.index), "read": read, "parallel": worth_threads(kernel.rows),
            "op": kernel.attrs}


def _lower(lowerer, expr: Pick) -> Node:
    return pick(lowerer.lower(expr.array), index_leaf(lowerer, expr.index))


def _op(name: str, vjp, jvp, evaluate, grad_fn: str, **more) -> None:
    register(OpRecord(name, vjp=vjp, jvp=jvp, evaluate=evaluate, kernel=_kernel, emit=_emit,
                      template="kernel_pick.c.j2", grad_fn=plain_grad_fn(grad_fn), **more))


_op("pick", _pick_vjp, _pick_jvp, _eval_pick, "Pick", attrs=PickAttrs(gather=True), lowering=((Pick, _lower),),
    shapes=((Pick, lambda expr, of: (of(expr.index)[0], sp.Integer(1))),))
_op("place", _place_vjp, _place_jvp, _eval_place, "Place", attrs=PickAttrs(gather=False))
