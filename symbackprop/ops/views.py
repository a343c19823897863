"""transpose and element: views (read through their argument's memory,
never stored); pack: a matrix from 1x1 values, zero elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, ViewRule, plain_grad_fn, register
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter
from symbackprop.ir.construct import element, is_const, matmul, pack, transpose
from symbackprop.ir.interpret import Context
from symbackprop.ir.node import Node
from symbackprop.schedule.kernel import Equation, View, equation

# --- transpose ------------------------------------------------------------------


def _transpose_lowering(lowerer, expr: sp.Transpose | sp.Adjoint) -> Node:
    """A^T; the adjoint, which for real values is the transpose (SymPy's
    applyfunc(Abs) of a 1x1 matrix gives (M*Adjoint(M.T))**(1/2))."""
    return transpose(lowerer.lower(expr.arg))


def _transposed(g: Node) -> Node:
    """g^T; where g is a product A @ B (the gradient of W^T in x @ W^T, as
    torch.nn.Linear stores W), B^T @ A^T: the product written straight in the
    layout W has, with no transposed copy of it. (Only for a derivative: g
    feeds nothing else, so the product is not computed twice.)"""
    if g.op == "matmul":
        return matmul(transpose(g.args[1]), transpose(g.args[0]))
    return transpose(g)


register(OpRecord(
    "transpose",
    vjp=lambda node, g, needed: (_transposed(g),),
    jvp=lambda node, tangents: transpose(tangents[0]) if tangents[0] is not None else None,
    evaluate=lambda node, args, context: args[0].T.copy(),
    grad_fn=plain_grad_fn("Transpose"),
    view=ViewRule(
        strides=lambda inner, node: View(inner.buffer, inner.offset, inner.col_stride, inner.row_stride),
        label=lambda inner, node: inner + "^T",
        symbol=lambda inner, node: sp.Transpose(inner),
    ),
    lowering=((sp.Transpose, _transpose_lowering), (sp.Adjoint, _transpose_lowering)),
    shapes=((sp.Transpose, lambda e, of: of(e.arg)[::-1]), (sp.Adjoint, lambda e, of: of(e.arg)[::-1])),
))


# --- element ----------------------------------------------------------------------


def _element_evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    i, j = node.attrs
    return args[0][i : i + 1, j : j + 1].copy()


def _element_strides(inner: View, node: Node) -> View:
    i, j = node.attrs
    zero = sp.Integer(0)
    return View(inner.buffer, inner.at(sp.Integer(i), sp.Integer(j)), zero, zero)


register(OpRecord(
    "element",
    vjp=lambda node, g, needed: (pack(node.args[0].shape, {node.attrs: g}),),
    jvp=lambda node, tangents: element(tangents[0], *node.attrs) if tangents[0] is not None else None,
    evaluate=_element_evaluate,
    grad_fn=plain_grad_fn("Select"),
    view=ViewRule(
        strides=_element_strides,
        label=lambda inner, node: f"{inner}[{node.attrs[0]},{node.attrs[1]}]",
        symbol=lambda inner, node: inner[node.attrs],
    ),
))


# --- pack -------------------------------------------------------------------------


@dataclass(frozen=True)
class PackKernel:
    out: str
    size: object
    entries: tuple[tuple[int, View | sp.Expr], ...]  # (flat index, where the value is, or the value)
    equations: tuple[Equation, ...]
    kind: str = "pack"

    def reads(self) -> list[str]:
        return [view.buffer for _, view in self.entries if isinstance(view, View)]

    def writes(self) -> list[str]:
        return [self.out]

    title = "packed entries"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """Copies only."""
        return sp.Integer(0), sp.Integer(0)


def _pack_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    positions = node.attrs[0]
    return tuple(element(g, *p) if needed[k] else None for k, p in enumerate(positions))


def _pack_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    entries = {p: t for p, t in zip(node.attrs[0], tangents) if t is not None}
    return pack(node.shape, entries) if entries else None


def _pack_evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    out = np.zeros(context.shape(node))
    for (i, j), value in zip(node.attrs[0], args):
        out[i, j] = value.item()
    return out


def _pack_kernel(sched, node: Node, out: str) -> PackKernel:
    rows, cols = node.shape
    # a constant entry is its value: constants have no buffer
    entries = tuple(
        (i * cols + j, arg.attrs[0] if is_const(arg) else sched.view(arg))
        for (i, j), arg in zip(node.attrs[0], node.args)
    )
    matrix = sp.zeros(rows, cols)
    for (i, j), arg in zip(node.attrs[0], node.args):
        matrix[i, j] = arg.attrs[0] if is_const(arg) else sp.Symbol(sched.label(arg))
    return PackKernel(out, rows * cols, entries, (equation(out, sp.ImmutableMatrix(matrix)),))


def _pack_emit(em: FunctionEmitter, kernel: PackKernel) -> dict:
    zero = sp.Integer(0)
    constant = CheckedPrinter(ScalarPrinter({}, em.real), kernel)
    return {
        "out": em.namer.name(kernel.out),
        "size": em.dim(kernel.size),
        "entries": [
            (str(index), em.access(where, zero, zero) if isinstance(where, View) else constant.doprint(where))
            for index, where in kernel.entries
        ],
    }


register(OpRecord(
    "pack",
    vjp=_pack_vjp,
    jvp=_pack_jvp,
    evaluate=_pack_evaluate,
    kernel=_pack_kernel,
    emit=_pack_emit,
    template="pack_kernel",
    grad_fn=plain_grad_fn("Stack"),
))
