"""Common subexpressions over the hash-consed DAG: every distinct
subexpression used more than once becomes a temporary, in one walk.

SymPy's `cse` does the same and more (opt_cse also looks for common
subsets of sums' and products' arguments, and breaks ties between a sum
and its negation by sort keys): that was about 0.5 ms of CPU per operation
of the C, most of a large model's Python compile time. Here each distinct
subexpression is visited a fixed number of times, and a temporary's users
are rebuilt without SymPy's flattening (their arguments were canonical
already; a temporary's symbol only stands in for one of them).

What SymPy's opt_cse did is kept (see _rewritten): a product and its
negation (-a*b beside a*b) share one temporary, and products (sums) with
two or more arguments in common share a temporary for those.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import sympy as sp
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import BooleanFunction
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.exprdag import rebuild

# An argument read by more sums (or products) than this is not a reason to
# compare them for common parts (see _share_parts).
MAX_SHARERS = 64


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
    reads = _rewritten(_distinct(exprs, lets))
    order, uses = _walk(exprs, lets, reads)
    done: dict[sp.Basic, sp.Basic] = {}
    temps: list[tuple[sp.Symbol, sp.Basic]] = []
    # Two nodes can rebuild to one value (lets equal once their reads are
    # temporaries): each keeps its own temporary. GCC's value numbering merges
    # them (bundle_adjustment's loop calls sincos once either way), and naming
    # the second as the first renames what is built on it, which reorders the
    # printed terms after it: W6J float64 took 5% longer so (4517b64).
    for node in order:
        if node in lets:
            value = done[lets[node]]
            named = not _is_copy(value)
        elif node in reads:  # a product or sum over a shared part of it (SymPy flattens it: a temporary's symbol stays)
            func, args = reads[node]
            value = func(*(done[a] for a in args))
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


def _walk(exprs: list[sp.Basic], lets: Mapping[sp.Symbol, sp.Basic], rewritten: dict) -> tuple[list, dict]:
    """(each distinct subexpression once, what it reads first; how many
    distinct users (or outputs) read each). A let reads its value; a
    rewritten sum or product, its new arguments."""

    def reads(node: sp.Basic) -> tuple:
        if node in lets:
            return (lets[node],)
        if node in rewritten:
            return rewritten[node][1]
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
    return order, uses


def _distinct(exprs: list[sp.Basic], lets: Mapping[sp.Symbol, sp.Basic]) -> list[sp.Basic]:
    """Every distinct subexpression (through the lets) of exprs, once, in
    a fixed order (a set's order would follow string hashes)."""
    seen: set[sp.Basic] = set()
    order: list[sp.Basic] = []
    stack = list(reversed(exprs))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        if node in lets:
            stack.append(lets[node])
        elif _walked(node):
            stack.extend(a for a in reversed(node.args) if a not in seen)
    return order


def _rewritten(nodes: list[sp.Basic]) -> dict[sp.Basic, tuple[type, tuple]]:
    """Sums and products rewritten over a part they share (what SymPy's
    opt_cse did, in bounded time): node -> its new arguments. A negated
    product reads the product where that is there too (-a*b beside a*b);
    two products (or sums) with two or more arguments in common read a new
    one of those (a*b*c and a*b*d: a*b), which becomes a temporary."""
    present = set(nodes)
    rewritten: dict[sp.Basic, tuple[type, tuple]] = {}
    for node in nodes:
        if node.is_Mul and len(node.args) > 2 and node.args[0] is sp.S.NegativeOne:
            positive = sp.Mul._from_args(node.args[1:])
            if positive in present:
                rewritten[node] = (sp.Mul, (sp.S.NegativeOne, positive))
    sums = {frozenset(n.args): n for n in nodes if n.is_Add}
    for node in nodes:  # a sum whose negation came first reads it (-a + b beside a - b)
        if node.is_Add and node not in rewritten:
            negation = sums.get(frozenset(_negated(t) for t in node.args))
            if negation is not None and negation is not node and negation not in rewritten:
                rewritten[node] = (sp.Mul, (sp.S.NegativeOne, negation))
    for kind in (sp.Mul, sp.Add):
        funcs = [n for n in nodes if isinstance(n, kind) and n not in rewritten and n.is_commutative]
        rewritten.update(_share_parts(kind, funcs, present))
    return rewritten


def _share_parts(kind: type, funcs: list[sp.Basic], present: set) -> dict[sp.Basic, tuple[type, tuple]]:
    """SymPy's match_common_args over `funcs` (all sums or all products),
    each compared only with those sharing an argument read by at most
    MAX_SHARERS of them (a bound on the work: a factor common to every
    product, as a gradient's seed, is not a reason to compare them all)."""
    argsets = [dict.fromkeys(f.args) for f in funcs]
    index: dict[sp.Basic, list[int]] = {}
    for i, argset in enumerate(argsets):
        if len(argset) >= 2:
            for arg in argset:
                index.setdefault(arg, []).append(i)
    changed: set[int] = set()
    new: dict[sp.Basic, tuple[type, tuple]] = {}
    for i in range(len(funcs)):
        if len(argsets[i]) < 2:
            continue
        counts: dict[int, int] = {}
        for arg in argsets[i]:
            sharers = index.get(arg, ())
            if len(sharers) <= MAX_SHARERS:
                for j in sharers:
                    if j > i:
                        counts[j] = counts.get(j, 0) + 1
        candidates = sorted((j for j, c in counts.items() if c >= 2), key=lambda j: (-counts[j], j))
        for n, j in enumerate(candidates):
            common = [a for a in argsets[i] if a in argsets[j]]
            if len(common) < 2:
                continue
            part = funcs[i] if len(common) == len(argsets[i]) else kind(*common)
            if not isinstance(part, kind) or _is_copy(part):  # 2*(a + b) is distributed; -x is no work
                continue
            if part not in present and part not in new:
                new[part] = (kind, tuple(common))
            # the later candidates holding all of it read it too (as SymPy's)
            holders = [i, j] + [k for k in candidates[n + 1:] if all(a in argsets[k] for a in common)]
            for k in holders:
                if not _same(part, funcs[k]):  # (a part never reads itself)
                    argsets[k] = _replaced(argsets[k], common, part)
                    index.setdefault(part, []).append(k)
                    changed.add(k)
    new.update({funcs[i]: (kind, tuple(argsets[i])) for i in sorted(changed)})
    return new


def _same(a: sp.Basic, b: sp.Basic) -> bool:
    """a == b, its hashes (cached) compared first: SymPy's == compares the
    trees, as deep as they are alike."""
    return a is b or (hash(a) == hash(b) and a == b)


def _negated(term: sp.Basic) -> sp.Basic:
    """-term, as SymPy would build it, without its flattening: a product's
    coefficient negated, a number negated, anything else times -1."""
    if term.is_Number:
        return -term
    if term.is_Mul and term.args[0].is_Number:
        coeff, rest = -term.args[0], term.args[1:]
        if coeff is sp.S.One:
            return rest[0] if len(rest) == 1 else sp.Mul._from_args(rest)
        return sp.Mul._from_args((coeff, *rest))
    return sp.Mul._from_args((sp.S.NegativeOne, *(term.args if term.is_Mul else (term,))))


def _replaced(argset: dict, common: list, part: sp.Basic) -> dict:
    # a set: `in` a list compared by ==, which SymPy does structurally, as deep as the
    # trees are alike (a chain's links differ only at its bottom: quadratic in its length)
    dropped = set(common)
    kept = dict.fromkeys(a for a in argset if a not in dropped)
    kept[part] = None
    return kept


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
    if isinstance(node, sp.Function) and not isinstance(node, sp.Piecewise) and all(n.is_Symbol for n in changed):
        # as it stands: tanh's evaluation asks whether its argument is finite, which walks
        # the whole argument (a chain of tanh renamed here: a third of its compile)
        return node.func(*args, evaluate=False)
    return rebuild(node, args)


__all__ = ["dag_cse", "temporary_names"]
