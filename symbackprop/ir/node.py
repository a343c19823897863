"""The nodes of the IR: a DAG of tensor ops, hash-consed (building the same
op on the same arguments twice returns the same object, so shared
subgraphs are shared nodes), and its topological order. Every value is a
2-D tensor (rows, cols); a scalar is 1x1. Dimensions are ints or SymPy
Symbols (bound from the arrays at call time)."""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Iterable
from typing import TypeAlias

import sympy as sp

from symbackprop.errors import ModelError

Dim: TypeAlias = int | sp.Symbol
Shape: TypeAlias = tuple[Dim, Dim]
SCALAR: Shape = (1, 1)


class Node:
    """One op applied to argument nodes. Build with the functions below."""

    __slots__ = ("__weakref__", "args", "attrs", "op", "shape")
    op: str
    args: tuple[Node, ...]
    shape: Shape
    attrs: tuple

    def __repr__(self) -> str:
        return f"Node({self.op}, shape={self.shape}, attrs={self.attrs}, nargs={len(self.args)})"


# Hash-consing: each (op, args, shape, attrs) built while its node is alive
# gives that node. Weak values, so that a node lives only as long as a graph,
# plan or module uses it: a long session that compiles many models (or one
# model many times) does not keep every node ever built.
_INTERNED: weakref.WeakValueDictionary[tuple, Node] = weakref.WeakValueDictionary()


@atexit.register
def _drop_interned() -> None:
    """At exit, the table itself goes (with it, its entries' callbacks):
    a node freed while the interpreter shuts down would have its key
    hashed, and a SymPy Float's hash imports (mpmath) once imports are
    gone ("Exception ignored ... Python is likely shutting down")."""
    global _INTERNED
    _INTERNED = weakref.WeakValueDictionary()


class ShapeMismatch(ModelError):
    """Operands of an op have incompatible shapes. Lowering re-raises it as
    a ModelError that names the user's subexpression."""


def _node(op: str, args: tuple[Node, ...], shape: Shape, attrs: tuple = ()) -> Node:
    key = (op, args, shape, attrs)
    node = _INTERNED.get(key)
    if node is None:
        node = Node()
        node.op, node.args, node.shape, node.attrs = op, args, shape, attrs
        _INTERNED[key] = node
    return node


def op_node(op: str, args: Iterable[Node], shape: Shape, attrs: tuple = ()) -> Node:
    """The node of a registered op (symbackprop.ops): its family's
    constructor checks the arguments and folds what it can first."""
    return _node(op, tuple(args), shape, attrs)


@functools.cache  # a Symbol is immutable; making one costs more than the lookup
def placeholder(index: int) -> sp.Symbol:
    """The symbol that stands for a map's index-th argument in its body."""
    return sp.Symbol(f"_a{index}", real=True)


def topological_order(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from roots, arguments before users, in a fixed
    order (depth-first, arguments left to right): never by set or id order."""
    order: list[Node] = []
    seen: set[Node] = set()
    for root in roots:
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, index = stack.pop()
            if node in seen:
                continue
            if index < len(node.args):
                stack.append((node, index + 1))
                stack.append((node.args[index], 0))
            else:
                seen.add(node)
                order.append(node)
    return order
