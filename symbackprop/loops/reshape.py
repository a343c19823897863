"""The rows of a batched scan's sequences and outputs, regrouped: a
"reshape" view reads a row-major matrix as another shape with as many
entries (the same memory). A batched scan (declare.scan's `batch=B`) reads
its (T*B) x D sequence as T rows of B*D entries (step t's B x D block is
contiguous), so its loop is the unbatched scan's, rows of B*D entries in
place of D; its T x (B*O) outputs are read back as (T*B) x O."""

from __future__ import annotations

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, ViewRule, is_view, plain_grad_fn, register
from symbackprop.ir.construct import const, is_const, placeholder
from symbackprop.ir.interpret import Context
from symbackprop.ir.node import Node, op_node
from symbackprop.loops.declare import entries
from symbackprop.schedule.kernel import View


def reshape(node: Node, shape: tuple) -> Node:
    """`node`'s entries, row-major, as a matrix of `shape` (as many entries).
    A constant stays a constant; a view (a transpose: not row-major in
    memory) is first copied into its own buffer."""
    if tuple(node.shape) == tuple(shape):
        return node
    change = sp.expand(entries(node.shape) - entries(shape))  # symbolic with blocks(N, B) * B: unchecked
    if change.is_Number and change != 0:
        raise AssertionError(f"reshape: {node.shape} -> {shape} changes the number of entries")
    if is_const(node):
        return const(node.attrs[0], shape)
    if node.op == "reshape":
        node = node.args[0]
        if tuple(node.shape) == tuple(shape):
            return node
    elif is_view(node.op):
        node = op_node("map", (node,), node.shape, (placeholder(0),))  # a copy, row-major
    return op_node("reshape", (node,), tuple(shape))


def _strides(inner: View, node: Node) -> View:
    """Row-major strides over the argument's memory, which must be row-major."""
    rows, cols = node.shape
    arg_rows, arg_cols = node.args[0].shape
    zero, one = sp.Integer(0), sp.Integer(1)
    want = (sp.sympify(arg_cols) if arg_rows != 1 else zero, one if arg_cols != 1 else zero)
    if (sp.sympify(inner.row_stride), sp.sympify(inner.col_stride)) != want and entries(node.shape) != 1:
        raise AssertionError(f"reshape: the argument's view {inner} is not row-major")
    return View(inner.buffer, inner.offset, sp.sympify(cols) if rows != 1 else zero, one if cols != 1 else zero)


def _evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    rows, cols = (int(sp.sympify(d).subs(context.dims)) for d in node.shape)
    return np.ascontiguousarray(args[0]).reshape(rows, cols).copy()


register(OpRecord(
    "reshape",
    vjp=lambda node, g, needed: (reshape(g, node.args[0].shape),),
    jvp=lambda node, tangents: reshape(tangents[0], node.shape) if tangents[0] is not None else None,
    evaluate=_evaluate,
    grad_fn=plain_grad_fn("Reshape"),
    view=ViewRule(
        strides=_strides,
        label=lambda inner, node: f"{inner} as {node.shape[0]} x {node.shape[1]}",
        symbol=lambda inner, node: sp.MatrixSymbol(f"{inner}_reshaped", *node.shape),
    ),
))
