"""Differentiation over the tensor DAG: reverse mode (vjp) and forward mode
(jvp), which composed give Hessian-vector products.

Each op's vector-Jacobian and Jacobian-vector rules are fields of its
record (symbackprop.ops), declared beside the rest of the op; here are the
drivers and the helpers rules share. A VJP rule gets the node, the
adjoint of its value (same shape) and which arguments need one, and returns
one adjoint per argument (None where none is needed). A JVP rule gets the
node and the tangent of each argument (None for zero) and returns the
node's tangent (None for zero). Rules build graph nodes, never closures, so
derivatives are scheduled, emitted and read like the forward pass.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence

import sympy as sp

from symbackprop.base.registry import records, rule
from symbackprop.base.scalar import forward, partials
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, is_const, map_, pack, reduce_sum
from symbackprop.ir.node import Node, placeholder, topological_order
from symbackprop.messages import short


def unbroadcast(adjoint: Node, shape: tuple) -> Node:
    """Sum an adjoint over the axes its argument was broadcast along."""
    for axis in (0, 1):
        if shape[axis] == 1 and adjoint.shape[axis] != 1:
            adjoint = reduce_sum(adjoint, axis)
    return adjoint


# The local derivatives of each map, once: the map's rule and the naming of
# the vjp's nodes both ask. Weak both ways, so they live as long as the graph.
_LOCAL: weakref.WeakKeyDictionary[Node, dict[int, weakref.ref[Node]]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=4096)
def _partials(body: sp.Expr, count: int) -> tuple[sp.Expr, ...]:
    """d body / d placeholder(i) for each i < count, all at once (one sweep
    over the body), by body: many maps share one (det ell=9: 493 maps, 7
    bodies)."""
    return tuple(partials(body, [placeholder(i) for i in range(count)]))


@functools.lru_cache(maxsize=1024)
def _second_partials(body: sp.Expr, count: int, given: tuple[int, ...]) -> tuple[sp.Expr, ...]:
    """d s / d placeholder(i) for each i < count, of s = body's directional
    derivative along placeholders count, count + 1, ... for the arguments
    `given` (one forward and one reverse sweep, for every i at once)."""
    directional = forward(body, {placeholder(j): placeholder(count + n) for n, j in enumerate(given)})
    return tuple(partials(directional, [placeholder(i) for i in range(count)]))


def local_derivative(node: Node, index: int) -> Node:
    """d node / d arg[index], elementwise.

    Where the derivative is a function of the node's own value alone
    (tanh' = 1 - tanh^2, exp' = exp), it is computed from that value, which
    costs no buffer. Otherwise it is a forward-time value of the node's
    arguments, which the scheduler computes in the node's own loop with one
    CSE over both (the sigmoid's exp serves the sigmoid and its derivative).
    """
    known = _LOCAL.setdefault(node, {})
    cached = known[index]() if index in known else None
    if cached is None:
        cached = _local_derivative(node, index)
        known[index] = weakref.ref(cached)
    return cached


def _local_derivative(node: Node, index: int) -> Node:
    body = node.attrs[0]
    derivative = _partials(body, len(node.args))[index]
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


def add_all(terms: list[Node]) -> Node:
    terms = _merge_packs(terms)
    for record in records():  # ops that sum their adjoints in fewer terms (slice_scatter)
        if record.merge_terms is not None and any(t.op == record.name for t in terms):
            terms = record.merge_terms(terms)
    if len(terms) == 1:
        return terms[0]
    return map_(sp.Add(*[placeholder(i) for i in range(len(terms))]), terms, terms[0].shape)


def _merge_packs(terms: list[Node]) -> list[Node]:
    """The packs among `terms` (the adjoints of a matrix's elements, one
    entry each) as one pack of all their entries: one kernel that writes
    each entry once, not a zeroed matrix per element and a sum of them."""
    packs = [t for t in terms if t.op == "pack"]
    if len(packs) < 2:
        return terms
    entries: dict[tuple[int, int], list[Node]] = {}
    for term in packs:
        for position, entry in zip(term.attrs[0], term.args):
            entries.setdefault(position, []).append(entry)
    merged = pack(packs[0].shape, {p: add_all(e) for p, e in entries.items()})
    return [merged] + [t for t in terms if t.op != "pack"]


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
        arg_adjoints = rule(node.op, "vjp")(node, g, needed)
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


def jvp(roots: Sequence[Node], tangents: dict[Node, Node],
        locals_of: Mapping[Node, tuple[Node, int]] | None = None) -> list[Node]:
    """Tangents of `roots` given tangents of some leaves (forward mode).

    `locals_of` names the local derivatives among the roots' nodes (d y /
    d arg_k of a map y, as the vjp's origins give them: {node: (y, k)});
    their tangents are then second derivatives of y's body from one sweep
    (`tangent_of_local`), not a map of their own derivatives each.
    A root that no tangent reaches gets a zero constant.
    """
    locals_of = locals_of or {}
    # the arguments of those maps first: a local derivative may not read them
    # all (d(a b)/da = b), yet its tangent is built from all of theirs
    first = [arg for y, _ in locals_of.values() for arg in y.args]
    tangent_of: dict[Node, Node | None] = {}
    for node in topological_order([*first, *roots]):
        if node in tangents:
            tangent_of[node] = tangents[node]
        elif not node.args:
            tangent_of[node] = None
        elif node in locals_of and _second_order(*locals_of[node], tangent_of):
            y, index = locals_of[node]
            tangent_of[node] = tangent_of_local(y, index, [tangent_of[arg] for arg in y.args])
        else:
            arg_tangents = [tangent_of[arg] for arg in node.args]
            tangent_of[node] = None if all(t is None for t in arg_tangents) else rule(node.op, "jvp")(node, arg_tangents)
    return [tangent_of[root] or const(0, root.shape) for root in roots]


def _second_order(y: Node, index: int, tangent_of: Mapping[Node, Node | None]) -> bool:
    """Whether the tangent of d y / d arg_index is tangent_of_local's: y
    has several arguments (one argument's derivative is often of y's value
    alone, tanh' = 1 - tanh^2, cheaper by the map rule), none of them is a
    tangent (the sweep tells the two apart), a tangent reaches one, and
    each one's tangent is known (not so where an argument is itself a local
    derivative not yet reached: a loss that holds a gradient)."""
    args = set(y.args)
    if len(args) < 2 or not args <= tangent_of.keys():
        return False
    return any(tangent_of[a] is not None for a in args) and not any(tangent_of[a] in args for a in args)


def tangent_of_local(y: Node, index: int, arg_tangents: Sequence[Node | None]) -> Node | None:
    """The tangent of d y / d arg_index for a map y: d s / d arg_index, where
    s = sum_j (d y / d arg_j) * tangent_j is y's directional derivative, over
    y's arguments and their tangents. Every index of one map shares s and
    one sweep over its body (`_second_partials`): differentiating each d y / d arg_k
    by each argument built k^2 second-derivative maps (an explicit bone
    chain's maps have 10-50 arguments)."""
    given = [j for j, t in enumerate(arg_tangents) if t is not None]
    moving = [t for t in arg_tangents if t is not None]
    if not given:
        return None
    count = len(y.args)
    derivative = _second_partials(y.attrs[0], count, tuple(given))[index]
    if derivative.has(sp.Derivative, sp.Subs):
        raise ModelError(f"no second derivative known for {short(y.attrs[0].xreplace(_readable(y)))}")
    if derivative == 0:
        return None
    return map_(derivative, [*y.args, *moving], y.shape)
