"""The step before an unrolled run, recognized as the run's step applied to
a zero state. `nn.gru_cell(x, None, ..)` (and `lstm_cell` with no state)
builds its first step without the state's terms: a different graph from
the steps after it, so the walk (loops/unrolled.py) starts the run after
it and the first step stays unrolled C around the loop. Here that step is
checked against the step's own graph with every state zero and the inputs
of one step earlier: where the two are the same function of the same
values, the loop starts from zeros and covers the first step too.

The check compares values, not graphs: each node as a SymPy expression of
an entry (elementwise maps, broadcasts among them, inlined; a product
with a zero factor zero; any other op an opaque function of its
arguments' expressions), so the fused forms that lowering gives the
shorter first step compare equal to the step's. The step-0 inputs are guessed from the shape of the steps'
own inputs (matmul(x_t, W) -> the matmul(?, W) below the first step); a
wrong guess fails the comparison, so a match is exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sympy as sp

from symbackprop.ir.construct import const
from symbackprop.ir.node import Node, placeholder, topological_order

# Nodes below the step before the run, at most, per node of the step: more
# is a history of steps (a probe's), whose values as SymPy grow exponentially.
FIRST_STEP_RATIO = 2
LINEAR = frozenset({"matmul", "transpose", "reshape", "slice", "sum"})  # zero in, zero out
_ANY = object()


def zero_start(before: Sequence[Node], template: Sequence[Node], states: Sequence[Node],
               slots: Sequence[tuple[Node, ...]], slot_leaves: Sequence[Node],
               captures: dict[Node, Node]) -> list[Node] | None:
    """Each slot's step-0 value, where each of `before` (the states' values
    before the run's first step) is `template` (the step's next states over
    the leaves `states`, `slot_leaves` and `captures`) with every state
    zero; None where not."""
    below = topological_order(list(before))
    if len(below) > FIRST_STEP_RATIO * len(topological_order(list(template))):
        return None
    inside = {n for t in slots for n in t}
    bound: list[Node] = []
    for t in slots:
        pattern = _generalized(t[0], t[-1])
        found = [n for n in below if n not in inside and _fits(pattern, n)]
        if len(found) != 1:
            return None
        bound.append(found[0])
    outer = _Keys({})
    env = {**{s: sp.Integer(0) for s in states}, **{leaf: outer.of(v) for leaf, v in zip(slot_leaves, bound)},
           **{c: outer.of(v) for c, v in captures.items()}}
    inner = _Keys(env, outer.opaque)
    for value, next_state in zip(before, template):
        first, step = outer.of(value), inner.of(next_state)
        if first != step and sp.expand(first - step) != 0:
            return None
    return bound


def zero_like(node: Node) -> Node:
    return const(sp.Integer(0), node.shape)


def _generalized(a: Node, b: Node, depth: int = 4) -> object:
    """What two steps' values of an input share: the same node, or the
    same op over generalized arguments, or anything of the shape."""
    if a is b:
        return a
    if depth and a.op == b.op and a.shape == b.shape and len(a.args) == len(b.args) and a.op != "leaf":
        same_attrs = a.attrs == b.attrs
        return (a.op, a.shape, a.attrs if same_attrs else _ANY,
                tuple(_generalized(x, y, depth - 1) for x, y in zip(a.args, b.args)))
    return (_ANY, a.shape, a.op, a.attrs[1] if a.op == "leaf" and b.op == "leaf" else None)


def _fits(pattern: object, node: Node) -> bool:
    if isinstance(pattern, Node):
        return pattern is node
    assert isinstance(pattern, tuple)
    if pattern[0] is _ANY:
        _, shape, op, role = pattern
        return node.shape == shape and (role is None or (node.op == "leaf" and node.attrs[1] == role)) \
            and (node.op == op or op != "leaf")
    op, shape, attrs, args = pattern
    return (node.op == op and node.shape == shape and (attrs is _ANY or node.attrs == attrs)
            and len(node.args) == len(args) and all(_fits(p, a) for p, a in zip(args, node.args)))


class _Keys:
    """Each node's value as a SymPy expression of one entry (see the module's docstring)."""

    def __init__(self, env: dict[Node, sp.Expr], opaque: dict[tuple, Callable] | None = None):
        self.memo: dict[Node, sp.Expr] = dict(env)
        self.opaque = {} if opaque is None else opaque  # shared: the same op is the same function

    def of(self, root: Node) -> sp.Expr:
        for node in topological_order([root]):
            if node not in self.memo:
                self.memo[node] = self._key(node)
        return self.memo[root]

    def _key(self, node: Node) -> sp.Expr:
        args = [self.memo[a] for a in node.args]
        if node.op == "map" and len(node.attrs) == 1:
            body = node.attrs[0]
            return body.xreplace({placeholder(k): v for k, v in enumerate(args)}) if args else body
        if node.op in LINEAR and any(a == 0 for a in args):
            return sp.Integer(0)
        if node.op == "leaf":
            return sp.Symbol(f"leaf_{node.attrs[0]}_{id(node)}")
        head = (node.op, node.shape, node.attrs)
        fn = self.opaque.setdefault(head, sp.Function(f"op{len(self.opaque)}_{node.op}"))
        return fn(*args)
