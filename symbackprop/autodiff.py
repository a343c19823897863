"""Differentiation over the tensor DAG: reverse mode (vjp) and forward mode
(jvp), which composed give Hessian-vector products.

One registry, RULES, holds for each op its vector-Jacobian rule and its
Jacobian-vector rule, declared together below. A VJP rule gets the node, the
adjoint of its value (same shape) and which arguments need one, and returns
one adjoint per argument (None where none is needed). A JVP rule gets the
node and the tangent of each argument (None for zero) and returns the
node's tangent (None for zero). Rules build graph nodes, never closures, so
derivatives are scheduled, emitted and read like the forward pass.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import sympy as sp

from .errors import ModelError
from .ir import (
    Node,
    binding_width,
    broadcast,
    const,
    element,
    emap,
    is_const,
    let_symbol,
    map_,
    matmul,
    pack,
    placeholder,
    reduce_sum,
    row_placeholder,
    topological_order,
    transpose,
)
from .messages import short

VjpRule = Callable[[Node, Node, Sequence[bool]], tuple[Node | None, ...]]
JvpRule = Callable[[Node, Sequence[Node | None]], Node | None]


@dataclass(frozen=True)
class OpRules:
    vjp: VjpRule
    jvp: JvpRule


RULES: dict[str, OpRules] = {}


def rules(op: str, vjp: VjpRule, jvp: JvpRule) -> None:
    RULES[op] = OpRules(vjp, jvp)


def _rules_of(node: Node) -> OpRules:
    found = RULES.get(node.op)
    if found is None:
        raise ModelError(f"no derivative rules for op {node.op!r}")
    return found


def unbroadcast(adjoint: Node, shape: tuple) -> Node:
    """Sum an adjoint over the axes its argument was broadcast along."""
    for axis in (0, 1):
        if shape[axis] == 1 and adjoint.shape[axis] != 1:
            adjoint = reduce_sum(adjoint, axis)
    return adjoint


def local_derivative(node: Node, index: int) -> Node:
    """d node / d arg[index], elementwise.

    Where the derivative is a function of the node's own value alone
    (tanh' = 1 - tanh^2, exp' = exp), it is computed from that value, which
    costs no buffer. Otherwise it is a forward-time value of the node's
    arguments, which the scheduler computes in the node's own loop with one
    CSE over both (the sigmoid's exp serves the sigmoid and its derivative).
    """
    body = node.attrs[0]
    # factor_terms undoes SymPy's distribution of constants (2*(a+b) -> 2*a+2*b)
    # so that the derivative shares subexpressions with the body under CSE
    derivative = sp.factor_terms(sp.diff(body, placeholder(index)))
    if derivative.has(sp.Derivative, sp.Subs):
        raise ModelError(f"no derivative known for {short(body.xreplace(_readable(node)))}")
    if len(node.args) == 1 and not body.is_Atom:
        value = sp.Symbol("_value", real=True)
        of_value = derivative.subs(body, value)
        if of_value.free_symbols == {value}:
            return map_(of_value.xreplace({value: placeholder(0)}), [node], node.shape)
    return map_(derivative, node.args, node.shape)


def _readable(node: Node) -> dict:
    """Placeholders as the user's names where the argument is a leaf, else x<i>."""
    return {placeholder(i): sp.Symbol(arg.attrs[0] if arg.op == "leaf" else f"x{i}") for i, arg in enumerate(node.args)}


def _map_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    adjoints: list[Node | None] = []
    for index, arg in enumerate(node.args):
        if not needed[index]:
            adjoints.append(None)
            continue
        product = map_(placeholder(0) * placeholder(1), [g, local_derivative(node, index)])
        adjoints.append(unbroadcast(product, arg.shape))
    return tuple(adjoints)


def _matmul_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    a, b = node.args
    grad_a = matmul(g, transpose(b)) if needed[0] else None
    grad_b = matmul(transpose(a), g) if needed[1] else None
    return grad_a, grad_b


def _transpose_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (transpose(g),)


def _sum_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (broadcast(g, node.args[0].shape),)


def _logsumexp_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # d lse / d z = softmax(z) = exp(z - lse), scaled by the broadcast adjoint
    (z,) = node.args
    body = sp.exp(placeholder(0) - placeholder(1)) * placeholder(2)
    return (map_(body, [z, node, g], z.shape),)


def _extreme_mask(node: Node) -> Node:
    """1 where an entry is its row's (column's) extreme, divided by the
    number of such entries: ties split the gradient evenly (as JAX)."""
    (z,) = node.args
    hit = map_(sp.Piecewise((1, sp.Eq(placeholder(0), placeholder(1))), (0, True)), [z, node], z.shape)
    count = reduce_sum(hit, node.attrs[0])
    return map_(placeholder(0) / placeholder(1), [hit, count], z.shape)


def _extreme_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (map_(placeholder(0) * placeholder(1), [_extreme_mask(node), g], node.args[0].shape),)


def _extreme_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    if tangents[0] is None:
        return None
    weighted = map_(placeholder(0) * placeholder(1), [_extreme_mask(node), tangents[0]], node.args[0].shape)
    return reduce_sum(weighted, node.attrs[0])


def _is_variable(symbol: sp.Basic) -> bool:
    """An argument column (_e<p>_<l>) or a local value (_v<k>) of an emap body:
    what its derivatives are taken with respect to (not dimensions)."""
    return isinstance(symbol, sp.Symbol) and symbol.name[:2] in ("_e", "_v")


def _fresh_lets(lets: tuple) -> Iterator[sp.Symbol]:
    taken = [int(sym.name[2:]) for sym, _ in lets]
    return (let_symbol(k) for k in itertools.count(max(taken, default=-1) + 1))


def _emap_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    """Reverse mode over the body's program: each local value's adjoint
    becomes one more local value, and each argument's adjoint is one more
    emap over the same examples, written (added) where the argument was read.
    The adjoint rows g are read where the node wrote its outputs."""
    bodies, bindings, loops, target, lets = node.attrs
    seed = len(node.args)  # g joins as the last argument, bound like the target
    contributions: dict[sp.Symbol, list[sp.Expr]] = {}

    def propagate(expr: sp.Expr, adjoint: sp.Expr) -> None:
        for symbol in sorted(filter(_is_variable, expr.free_symbols), key=str):
            partial = sp.diff(expr, symbol)
            if partial != 0:
                contributions.setdefault(symbol, []).append(adjoint * partial)

    for column, body in enumerate(bodies):
        propagate(body, row_placeholder(seed, column))
    program = list(lets)
    fresh = _fresh_lets(lets)
    for symbol, expr in reversed(lets):
        terms = contributions.pop(symbol, None)
        if terms:
            adjoint = next(fresh)
            program.append((adjoint, sp.Add(*terms)))
            propagate(expr, adjoint)
    adjoints: list[Node | None] = []
    for p, arg in enumerate(node.args):
        if not needed[p] or bindings[p][0] == "index":
            adjoints.append(None)
            continue
        columns = [sp.Add(*contributions.get(row_placeholder(p, col), []))
                   for col in range(binding_width(arg, bindings[p]))]
        adjoints.append(emap(columns, node.args + (g,), bindings + (target,), loops, bindings[p], arg.shape, program))
    return tuple(adjoints)


def _emap_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """Forward mode over the body's program: a tangent local value beside
    each local value that depends on a tangent argument."""
    bodies, bindings, loops, target, lets = node.attrs
    args, extra_bindings = list(node.args), list(bindings)
    tangent_of: dict[sp.Symbol, sp.Expr] = {}
    for p, tangent in enumerate(tangents):
        if tangent is not None and bindings[p][0] != "index":
            for col in range(binding_width(node.args[p], bindings[p])):
                tangent_of[row_placeholder(p, col)] = row_placeholder(len(args), col)
            args.append(tangent)
            extra_bindings.append(bindings[p])
    if not tangent_of:
        return None

    def differential(expr: sp.Expr) -> sp.Expr:
        return sp.Add(*[sp.diff(expr, s) * tangent_of[s] for s in sorted(expr.free_symbols, key=str) if s in tangent_of])

    program = list(lets)
    fresh = _fresh_lets(lets)
    for symbol, expr in lets:
        d = differential(expr)
        if d != 0:
            tangent_of[symbol] = next(fresh)
            program.append((tangent_of[symbol], d))
    return emap([differential(body) for body in bodies], args, extra_bindings, loops, target, node.shape, program)


def _element_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (pack(node.args[0].shape, {node.attrs: g}),)


def _pack_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    positions = node.attrs[0]
    return tuple(element(g, *p) if needed[k] else None for k, p in enumerate(positions))


def add_all(terms: list[Node]) -> Node:
    if len(terms) == 1:
        return terms[0]
    return map_(sp.Add(*[placeholder(i) for i in range(len(terms))]), terms, terms[0].shape)


def _map_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    terms = [
        map_(placeholder(0) * placeholder(1), [local_derivative(node, index), tangent], node.shape)
        for index, tangent in enumerate(tangents)
        if tangent is not None
    ]
    return add_all(terms) if terms else None


def _matmul_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    (a, b), (ta, tb) = node.args, tangents
    terms = ([matmul(ta, b)] if ta is not None else []) + ([matmul(a, tb)] if tb is not None else [])
    return add_all(terms) if terms else None


def _transpose_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return transpose(tangents[0]) if tangents[0] is not None else None


def _sum_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return reduce_sum(tangents[0], node.attrs[0]) if tangents[0] is not None else None


def _logsumexp_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    # d lse = sum(softmax(z) * dz) over the reduced axis
    (z,), (tz,) = node.args, tangents
    if tz is None:
        return None
    weighted = map_(sp.exp(placeholder(0) - placeholder(1)) * placeholder(2), [z, node, tz], z.shape)
    return reduce_sum(weighted, node.attrs[0])


def _element_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return element(tangents[0], *node.attrs) if tangents[0] is not None else None


def _pack_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    entries = {p: t for p, t in zip(node.attrs[0], tangents) if t is not None}
    return pack(node.shape, entries) if entries else None


rules("map", _map_vjp, _map_jvp)
rules("matmul", _matmul_vjp, _matmul_jvp)
rules("transpose", _transpose_vjp, _transpose_jvp)
rules("sum", _sum_vjp, _sum_jvp)
rules("logsumexp", _logsumexp_vjp, _logsumexp_jvp)
rules("element", _element_vjp, _element_jvp)
rules("max", _extreme_vjp, _extreme_jvp)
rules("min", _extreme_vjp, _extreme_jvp)
rules("emap", _emap_vjp, _emap_jvp)
rules("pack", _pack_vjp, _pack_jvp)


def vjp(roots: Sequence[tuple[Node, Node]], wrt: Sequence[Node]) -> tuple[list[Node], dict[Node, tuple]]:
    """Gradients of sum(seed * root) over (root, seed) pairs w.r.t. `wrt`.

    Returns the gradient nodes (a zero constant where a leaf does not reach
    a root) and, for naming, where each backward node comes from:
    ("adjoint", x) for the adjoint of x, ("part", x) for one term of it,
    ("local", y, k) for the elementwise derivative of map y with respect to
    its k-th argument.
    """
    order = topological_order([root for root, _ in roots])
    reaches = depends_on(order, set(wrt))
    contributions: dict[Node, list[Node]] = {}
    for root, seed in roots:
        contributions.setdefault(root, []).append(seed)
    adjoint_of: dict[Node, Node] = {}
    part_of: dict[Node, Node] = {}  # a term of an adjoint (for naming) -> whose
    adjoints: dict[Node, Node] = {}
    for node in reversed(order):
        if node not in contributions or not reaches[node]:
            continue
        g = adjoints[node] = add_all(contributions.pop(node))
        adjoint_of.setdefault(g, node)
        if not node.args:
            continue
        needed = [reaches[arg] for arg in node.args]
        arg_adjoints = _rules_of(node).vjp(node, g, needed)
        assert len(arg_adjoints) == len(node.args), f"{node.op} rule returned wrong arity"
        for arg, adjoint in zip(node.args, arg_adjoints):
            if adjoint is None or not reaches[arg] or (is_const(adjoint) and adjoint.attrs[0] == 0):
                continue
            assert adjoint.shape == arg.shape, f"{node.op} rule: adjoint shape {adjoint.shape} != {arg.shape}"
            contributions.setdefault(arg, []).append(adjoint)
            part_of.setdefault(adjoint, arg)
    grads = [adjoints.get(leaf, const(0, leaf.shape)) for leaf in wrt]
    origins: dict[Node, tuple] = {g: ("adjoint", node) for g, node in adjoint_of.items()}
    for part, node in part_of.items():
        origins.setdefault(part, ("part", node))
    for node in order:
        if node.op == "map" and node in adjoints:
            for index, arg in enumerate(node.args):
                if reaches[arg]:
                    origins.setdefault(local_derivative(node, index), ("local", node, index))
    return grads, origins


def depends_on(order: list[Node], wrt: set[Node]) -> dict[Node, bool]:
    """For each node of a topological order: whether a node of wrt is it or feeds it."""
    reaches: dict[Node, bool] = {}
    for node in order:
        reaches[node] = node in wrt or any(reaches[a] for a in node.args)
    return reaches


def jvp(roots: Sequence[Node], tangents: dict[Node, Node]) -> list[Node]:
    """Tangents of `roots` given tangents of some leaves (forward mode).

    A root that no tangent reaches gets a zero constant.
    """
    tangent_of: dict[Node, Node | None] = {}
    for node in topological_order(roots):
        if node in tangents:
            tangent_of[node] = tangents[node]
        elif not node.args:
            tangent_of[node] = None
        else:
            arg_tangents = [tangent_of[arg] for arg in node.args]
            tangent_of[node] = None if all(t is None for t in arg_tangents) else _rules_of(node).jvp(node, arg_tangents)
    return [tangent_of[root] or const(0, root.shape) for root in roots]
