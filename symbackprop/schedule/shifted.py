"""Shifts read inside elementwise loops: a vector moved k entries
(ops/cumulative.py, "shift") whose every user is a fused elementwise loop
is not copied into a buffer of its own; each loop reads its argument at
i - k instead (a ShiftedView), and the loop is split where the moved
entries run out: the first k entries (or the last |k|) read the fill, the
rest read the argument straight, a plain strided loop the compiler
vectorizes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sympy as sp

from symbackprop.ir.construct import is_const
from symbackprop.ir.node import Node
from symbackprop.schedule.kernel import View


@dataclass(frozen=True)
class ShiftedView(View):
    """Entry i (along the vector) reads the argument's entry i - k, or
    `fill` where i - k is outside [0, length)."""

    k: int = 0
    fill: sp.Expr = sp.Integer(0)  # noqa: RUF009 (a SymPy Integer is immutable)
    length: sp.Expr = sp.Integer(1)  # noqa: RUF009


def _moved_along_vector(node: Node) -> bool:
    """A shift along the one axis of a vector longer than one entry."""
    axis = node.attrs[0]
    return node.shape[1 - axis] == 1 and node.shape[axis] != 1


def signed_k(node: Node) -> int:
    _, reverse, k, _ = node.attrs
    return -k if reverse else k


def foldable(order: Iterable[Node], users: Mapping[Node, list[Node]], fused: set[Node], results: set[Node]) -> set[Node]:
    """The shift nodes every user of which is a fused elementwise node
    (`fused`): they are read in those loops, never stored. (Not a result,
    and not of a constant: a constant's shift has its own kernel.)"""
    return {node for node in order
            if node.op == "shift" and node not in results and _moved_along_vector(node)
            and not is_const(node.args[0]) and users.get(node) and all(u in fused for u in users[node])}


def shifted_view(source: View, node: Node) -> ShiftedView:
    """How a loop over `node` reads it: its argument's view, moved."""
    axis = node.attrs[0]
    return ShiftedView(source.buffer, source.offset, source.row_stride, source.col_stride, signed_k(node),
                       node.attrs[3], node.shape[axis])


def shifted_label(source: str, node: Node) -> str:
    """"t5[i-1]": the argument's label and the entry read."""
    k = signed_k(node)
    index = "i" if node.attrs[0] == 0 else "j"
    return f"{source}[{index}{'-' if k > 0 else '+'}{abs(k)}]"
