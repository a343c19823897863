"""Reverse-mode differentiation over the tensor DAG.

One registry, VJP_RULES, holds one vector-Jacobian rule per op. A rule gets
the node and the adjoint of its value (an upstream gradient node of the same
shape) and returns one adjoint node per argument (None where that argument
needs none). Rules build graph nodes, never closures, so the backward pass
can be scheduled, emitted and read like the forward one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import sympy as sp

from .errors import ModelError
from .ir import (
    Node,
    broadcast,
    const,
    element,
    is_const,
    map_,
    matmul,
    pack,
    placeholder,
    reduce_sum,
    topological_order,
    transpose,
)

Rule = Callable[[Node, Node, Sequence[bool]], tuple[Node | None, ...]]
VJP_RULES: dict[str, Rule] = {}


def vjp_rule(op: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        VJP_RULES[op] = rule
        return rule

    return register


def unbroadcast(adjoint: Node, shape: tuple) -> Node:
    """Sum an adjoint over the axes its argument was broadcast along."""
    for axis in (0, 1):
        if shape[axis] == 1 and adjoint.shape[axis] != 1:
            adjoint = reduce_sum(adjoint, axis)
    return adjoint


def local_derivative(node: Node, index: int) -> Node:
    """d node / d arg[index], elementwise: a forward-time value that the
    scheduler computes in the same loop as the node itself (shared CSE)."""
    body = node.attrs[0]
    # factor_terms undoes SymPy's distribution of constants (2*(a+b) -> 2*a+2*b)
    # so that the derivative shares subexpressions with the body under CSE
    derivative = sp.factor_terms(sp.diff(body, placeholder(index)))
    if derivative.has(sp.Derivative, sp.Subs):
        raise ModelError(f"no derivative known for {body.xreplace(_readable(node))}")
    return map_(derivative, node.args, node.shape)


def _readable(node: Node) -> dict:
    return {placeholder(i): sp.Symbol(f"x{i}") for i in range(len(node.args))}


@vjp_rule("map")
def _map_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    adjoints: list[Node | None] = []
    for index, arg in enumerate(node.args):
        if not needed[index]:
            adjoints.append(None)
            continue
        product = map_(placeholder(0) * placeholder(1), [g, local_derivative(node, index)])
        adjoints.append(unbroadcast(product, arg.shape))
    return tuple(adjoints)


@vjp_rule("matmul")
def _matmul_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    a, b = node.args
    grad_a = matmul(g, transpose(b)) if needed[0] else None
    grad_b = matmul(transpose(a), g) if needed[1] else None
    return grad_a, grad_b


@vjp_rule("transpose")
def _transpose_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (transpose(g),)


@vjp_rule("sum")
def _sum_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (broadcast(g, node.args[0].shape),)


@vjp_rule("logsumexp")
def _logsumexp_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # d lse / d z = softmax(z) = exp(z - lse), scaled by the broadcast adjoint
    (z,) = node.args
    body = sp.exp(placeholder(0) - placeholder(1)) * placeholder(2)
    return (map_(body, [z, node, g], z.shape),)


@vjp_rule("element")
def _element_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (pack(node.args[0].shape, {node.attrs: g}),)


@vjp_rule("pack")
def _pack_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    positions = node.attrs[0]
    return tuple(element(g, *p) if needed[k] else None for k, p in enumerate(positions))


def add_all(terms: list[Node]) -> Node:
    if len(terms) == 1:
        return terms[0]
    return map_(sp.Add(*[placeholder(i) for i in range(len(terms))]), terms, terms[0].shape)


def vjp(roots: Sequence[tuple[Node, Node]], wrt: Sequence[Node]) -> tuple[list[Node], dict[Node, Node]]:
    """Gradients of sum(seed * root) over (root, seed) pairs w.r.t. `wrt`.

    Returns the gradient nodes (a zero constant where a leaf does not reach
    a root) and, for naming, where each backward node comes from:
    ("adjoint", x) for the adjoint of x, ("local", y, k) for the elementwise
    derivative of map y with respect to its k-th argument.
    """
    order = topological_order([root for root, _ in roots])
    reaches = _depends_on(order, set(wrt))
    contributions: dict[Node, list[Node]] = {}
    for root, seed in roots:
        contributions.setdefault(root, []).append(seed)
    adjoint_of: dict[Node, Node] = {}
    adjoints: dict[Node, Node] = {}
    for node in reversed(order):
        if node not in contributions or not reaches[node]:
            continue
        g = adjoints[node] = add_all(contributions.pop(node))
        adjoint_of.setdefault(g, node)
        if not node.args:
            continue
        rule = VJP_RULES.get(node.op)
        if rule is None:
            raise ModelError(f"no vector-Jacobian rule for op {node.op!r}")
        needed = [reaches[arg] for arg in node.args]
        arg_adjoints = rule(node, g, needed)
        assert len(arg_adjoints) == len(node.args), f"{node.op} rule returned wrong arity"
        for arg, adjoint in zip(node.args, arg_adjoints):
            if adjoint is None or not reaches[arg] or (is_const(adjoint) and adjoint.attrs[0] == 0):
                continue
            assert adjoint.shape == arg.shape, f"{node.op} rule: adjoint shape {adjoint.shape} != {arg.shape}"
            contributions.setdefault(arg, []).append(adjoint)
    grads = [adjoints.get(leaf, const(0, leaf.shape)) for leaf in wrt]
    origins: dict[Node, tuple] = {g: ("adjoint", node) for g, node in adjoint_of.items()}
    for node in order:
        if node.op == "map" and node in adjoints:
            for index, arg in enumerate(node.args):
                if reaches[arg]:
                    origins.setdefault(local_derivative(node, index), ("local", node, index))
    return grads, origins


def _depends_on(order: list[Node], wrt: set[Node]) -> dict[Node, bool]:
    reaches: dict[Node, bool] = {}
    for node in order:
        reaches[node] = node in wrt or any(reaches[a] for a in node.args)
    return reaches
