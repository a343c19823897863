"""Lowering sbp.grad and sbp.jvp (symbackprop.declare.derivatives): the
differentiated expression is lowered with the model's other expressions
(one memo: its nodes are the forward pass's), then reverse or forward mode
runs over that subgraph. The result is ordinary IR nodes, hash-consed with
the rest, which the pipeline's own differentiation differentiates again:
second order needs no op of its own, only that every op the rules emit has
rules itself (a scan's backward pass gets them in loops/again.py). Where
one has none (prod's product of the others) its rule raises a ModelError that names it.

The records below are lowering rules only: no node has their tags.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from symbackprop.base.registry import extend
from symbackprop.declare.derivatives import Grad, Jvp
from symbackprop.diff.autodiff import jvp, vjp
from symbackprop.errors import ModelError
from symbackprop.ir.construct import leaf
from symbackprop.ir.lower import Lowerer, shape_of
from symbackprop.ir.node import Node, op_node, topological_order
from symbackprop.messages import short


def _target(lowerer: Lowerer, expr: Grad | Jvp, what: Callable[[], str]) -> tuple[Node, Node | None]:
    """The node differentiated by, and the point's node or None. For an
    input or param, its leaf. For a point (grad's own symbol for an
    intermediate, or the argument of a function given to grad), a leaf of
    its own bound to that symbol, which `_at_point` replaces by the point's
    node once differentiated: the adjoint is the sum over the symbol's uses
    only, not over every use of the point's value (which hash-consing
    shares). `what` names the derivative for the message, built only to
    raise (SymPy prints a shared subexpression once per path: a nested
    jvp's text doubled per level, 2 s at depth 8, on every call)."""
    if expr.at_point:
        point = lowerer.lower(expr.at)
        name = getattr(expr.wrt, "name", expr.wrt)  # a Dummy, or a MatrixSymbol named by one
        index = getattr(expr.wrt.args[0] if isinstance(expr.wrt, sp.MatrixSymbol) else expr.wrt, "dummy_index", 0)
        stand_in = lowerer.leaves[expr.wrt] = leaf(f"\0point {name} {index}", point.shape, "point")
        return stand_in, point
    node = lowerer.leaves.get(expr.wrt)
    if node is None or node.op != "leaf":
        raise ModelError(f"{what()} is taken with respect to {expr.wrt}, which is not an input or param of the model "
                         "(declare it in inputs or params, or pass the expression it is of: sbp.grad(e, x) "
                         "differentiates the uses of an expression x in e)")
    return node, None


def _at_point(result: Node, stand_in: Node, point: Node | None) -> Node:
    """result's graph with the point's node in place of its stand-in: the
    derivative reads the point's value, shared with the forward pass."""
    if point is None:
        return result
    memo = {stand_in: point}
    for node in topological_order([result]):
        if node not in memo:
            args = tuple(memo.get(a, a) for a in node.args)
            memo[node] = node if args == node.args else op_node(node.op, args, node.shape, node.attrs)
    return memo[result]


def _mismatch(what: str, given: Node, want: Node, expr) -> ModelError:
    return ModelError(f"{what} has shape {given.shape} but must have shape {want.shape} in {short(expr)}")


def lower_grad(lowerer: Lowerer, expr: Grad) -> Node:
    """The adjoint of wrt, seeded with the cotangent at expr."""
    target, point = _target(lowerer, expr, lambda: f"grad of {short(expr.expr)}")
    root = lowerer.lower(expr.expr)
    seed = lowerer.lower(expr.cotangent)
    if seed.shape != root.shape:
        raise _mismatch("the cotangent of grad", seed, root, expr)
    (gradient,), _ = vjp([(root, seed)], [target])
    return _at_point(gradient, target, point)


def lower_jvp(lowerer: Lowerer, expr: Jvp) -> Node:
    """The tangent of expr, wrt moving along the direction."""
    target, point = _target(lowerer, expr, lambda: f"jvp of {short(expr.expr)}")
    root = lowerer.lower(expr.expr)
    direction = lowerer.lower(expr.direction)
    if direction.shape != target.shape:
        raise _mismatch("the direction of jvp", direction, target, expr)
    (tangent,) = jvp([root], {target: direction})
    return _at_point(tangent, target, point)


extend("grad", lowering=((Grad, lower_grad),), shapes=((Grad, lambda e, of: shape_of(e.wrt)),))
extend("jvp", lowering=((Jvp, lower_jvp),), shapes=((Jvp, lambda e, of: of(e.expr)),))
