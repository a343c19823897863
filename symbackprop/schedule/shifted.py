"""Shifts read inside elementwise loops: a vector moved k entries
(ops/cumulative.py, "shift") whose every user is an elementwise map of
its shape is not copied into a buffer of its own; each loop reads its
argument at i - k instead (a ShiftedView), and the loop is split where the
moved entries run out: the first k entries (or the last |k|) read the
fill, the rest read the argument straight, a plain strided loop the
compiler vectorizes.

Where the argument is computed in the same loop (schedule.fusion), the
loop computes it again at i - k: its value there is
Piecewise((value at i - k, inside(k)), (fill, True)), `inside(k)` a guard
symbol the C prints as the test that i - k is inside the vector (true in
the loop's middle part, where the guard is dropped)."""

from __future__ import annotations

import functools
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


def foldable(order: Iterable[Node], users: Mapping[Node, list[Node]], results: set[Node]) -> set[Node]:
    """The shift nodes every user of which is an elementwise map of the
    shift's shape (fused in a loop along the vector): they are read in
    those loops, never stored. (Not a result, and not of a constant: a
    constant's shift has its own kernel.)"""
    return {node for node in order
            if node.op == "shift" and node not in results and _moved_along_vector(node)
            and not is_const(node.args[0]) and users.get(node)
            and all(u.op == "map" and u.shape == node.shape for u in users[node])}


def moved_view(source: View, k: int, fill: sp.Expr, length: sp.Expr) -> ShiftedView:
    """`source` read k entries back (along the loop's vector)."""
    return ShiftedView(source.buffer, source.offset, source.row_stride, source.col_stride, k, fill, length)


def offset_label(source: str, k: int, axis: int) -> str:
    """"t5[i-1]": a label and the entry read, k back along `axis`."""
    index = "i" if axis == 0 else "j"
    return f"{source}[{index}{'-' if k > 0 else '+'}{abs(k)}]" if k else source


@functools.cache
def inside(k: int) -> sp.Symbol:
    """The guard symbol of entry i - k: true where it is inside the vector."""
    return sp.Symbol(f"_inside{k}" if k >= 0 else f"_inside_m{-k}", integer=True)


def guard_text(k: int, var: str, length: str) -> str:
    """The C test that entry `var` - k is inside a vector of `length`."""
    return f"{var} >= {k}" if k > 0 else f"{var} + {-k} < {length}"
