"""Common subexpressions over the hash-consed DAG: every distinct
subexpression used more than once becomes a temporary, in one walk.

SymPy's `cse` does the same and more (opt_cse also looks for common
subsets of sums' and products' arguments, and breaks ties between a sum
and its negation by sort keys): that was about 0.5 ms of CPU per operation
of the C, most of a large model's Python compile time. Here each distinct
subexpression is visited a fixed number of times, and a temporary's users
are rebuilt without SymPy's flattening (their arguments were canonical
already; a temporary's symbol only stands in for one of them).

What SymPy's opt_cse did that is kept: a product and its negation
(-a*b beside a*b) share one temporary, the negation reading it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import sympy as sp
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import BooleanFunction
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.ir.exprdag import rebuild


def temporary_names(prefix: str = "x") -> Iterator[sp.Symbol]:
    """x0, x1, ...: the names of a kernel's temporaries (real)."""
    return sp.numbered_symbols(prefix, real=True)


def dag_cse(exprs: list[sp.Basic], lets: Mapping[sp.Symbol, sp.Basic] | None = None,
            names: Iterable[sp.Symbol] | None = None) -> tuple[list[tuple[sp.Symbol, sp.Basic]], list[sp.Basic]]:
    """(temporaries as (name, value), each after what it uses; exprs over
    them). `lets` are named values the exprs (and other lets) read by their
    symbols: each becomes a temporary where it is read (an atom, or an
    atom's negation, is substituted instead). Temporaries are named from
    `names` (x0, x1, ...) in the order they are computed."""
    lets = dict(lets or {})
    names = iter(names if names is not None else temporary_names())
    order, uses, negation_of = _walk(exprs, lets)
    done: dict[sp.Basic, sp.Basic] = {}
    temps: list[tuple[sp.Symbol, sp.Basic]] = []
    for node in order:
        if node in lets:
            value = done[lets[node]]
            named = not _is_copy(value)
        elif node in negation_of:
            value = sp.Mul(sp.S.NegativeOne, done[negation_of[node]])
            named = uses[node] > 1
        else:
            args = node.args if _walked(node) else ()
            value = _rebuilt(node, [done[a] for a in args]) if args else node
            named = uses[node] > 1 and _may_be_temporary(node)
        if named:
            symbol = next(names)
            temps.append((symbol, value))
            value = symbol
        done[node] = value
    return temps, [done[e] for e in exprs]


def _walk(exprs: list[sp.Basic], lets: Mapping[sp.Symbol, sp.Basic]) -> tuple[list, dict, dict]:
    """(each distinct subexpression once, what it reads first; how many
    distinct users (or outputs) read each; a negated product -> the product,
    where the product is there too)."""
    nodes = _distinct(exprs, lets)
    negation_of = {}
    for node in nodes:
        if node.is_Mul and len(node.args) > 2 and node.args[0] is sp.S.NegativeOne:
            positive = sp.Mul._from_args(node.args[1:])
            if positive in nodes:
                negation_of[node] = positive

    def reads(node: sp.Basic) -> tuple:
        if node in lets:
            return (lets[node],)
        if node in negation_of:
            return (negation_of[node],)
        return node.args if _walked(node) else ()

    order: list[sp.Basic] = []
    uses: dict[sp.Basic, int] = {}
    seen: set[sp.Basic] = set()
    for expr in exprs:
        uses[expr] = uses.get(expr, 0) + 1
        stack: list[tuple[sp.Basic, bool]] = [(expr, False)]
        while stack:
            node, ready = stack.pop()
            if ready:
                order.append(node)
            elif node not in seen:
                seen.add(node)
                stack.append((node, True))
                args = reads(node)
                for arg in set(args):
                    uses[arg] = uses.get(arg, 0) + 1
                stack.extend((a, False) for a in reversed(args) if a not in seen)
    return order, uses, negation_of


def _distinct(exprs: list[sp.Basic], lets: Mapping[sp.Symbol, sp.Basic]) -> set[sp.Basic]:
    """Every distinct subexpression (through the lets) of exprs."""
    seen: set[sp.Basic] = set()
    stack = list(exprs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in lets:
            stack.append(lets[node])
        elif _walked(node):
            stack.extend(a for a in node.args if a not in seen)
    return seen


def _walked(node: sp.Basic) -> bool:
    """Whether the walk looks inside: not a matrix element or a matrix
    (leaves of the scalar code)."""
    return bool(node.args) and not isinstance(node, (MatrixElement, sp.MatrixExpr))


def _may_be_temporary(node: sp.Basic) -> bool:
    """A value or condition with arguments: not a Piecewise's branch pair
    nor a negated atom (printed as -x where it is read)."""
    if not _walked(node) or isinstance(node, ExprCondPair) or _is_copy(node):
        return False
    return isinstance(node, (sp.Expr, Relational, BooleanFunction))


def _is_copy(value: sp.Basic) -> bool:
    """An atom or an atom's negation: substituted where read, never named."""
    if value.is_Atom or isinstance(value, MatrixElement):
        return True
    return value.is_Mul and len(value.args) == 2 and value.args[0] is sp.S.NegativeOne and value.args[1].is_Atom


def _rebuilt(node: sp.Basic, args: list[sp.Basic]) -> sp.Basic:
    """node over new arguments. A sum or product keeps its arguments' order
    and is not flattened again: each new argument is a temporary's symbol
    standing for the canonical argument it replaces (SymPy's flattening was
    most of the cost of a CSE's rebuilding). A let's value substituted
    (a number, -x) is flattened in."""
    changed = [n for n, a in zip(args, node.args) if n is not a]
    if not changed:
        return node
    if (node.is_Add or node.is_Mul) and all(n.is_Symbol for n in changed):
        return node.func._from_args(args, node.is_commutative)
    return rebuild(node, args)


__all__ = ["dag_cse", "temporary_names"]
