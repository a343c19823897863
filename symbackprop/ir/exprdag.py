"""Walks over SymPy expressions as DAGs: each distinct subexpression is
visited once, with explicit stacks (SymPy's own walks, xreplace among them,
visit a shared subexpression once per path: exponential for a determinant
by minors, and recursive).

A large or deep scalar expression is cut into parts (Splitter) that
become separate graph nodes, and a deep map body into more lets
(shallow_program), so that differentiating, simplifying and printing each
part costs what that part costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterator, Sequence

import sympy as sp
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import BooleanFunction
from sympy.matrices.expressions.matexpr import MatrixElement

# The deepest a part (a node's body, a let) may be: a Horner polynomial of
# degree 127 is 255 levels deep, and its derivative by sp.diff took 24 s.
MAX_BODY_DEPTH = 12
# A scalar expression with more distinct subexpressions than this is split
# at the shared ones (small ones stay one body, as they always were).
MAX_BODY_PARTS = 80


def is_value(expr: sp.Basic) -> bool:
    """A scalar operation (not a condition, a Piecewise branch, a matrix or
    its element): may be a part."""
    return isinstance(expr, sp.Expr) and bool(_args(expr)) and not isinstance(
        expr, (Relational, BooleanFunction, ExprCondPair, sp.MatrixExpr))


def _args(expr: sp.Basic) -> tuple:
    """The arguments a walk visits: none for a matrix element (a leaf of
    the scalar expression) or a matrix."""
    return () if isinstance(expr, (MatrixElement, sp.MatrixExpr)) else expr.args


def rebuild(expr: sp.Basic, args: list) -> sp.Basic:
    """expr over new arguments (expr itself when they are the same). A
    Piecewise and its pairs are rebuilt as they stand: SymPy's constructor
    folds a Piecewise found anywhere under a condition, an inner loop's
    step among them (under a matrix element), out into the condition."""
    if all(n is a for n, a in zip(args, expr.args)):
        return expr
    if isinstance(expr, ExprCondPair):
        return sp.Tuple.__new__(ExprCondPair, *args)
    if isinstance(expr, sp.Piecewise):
        return sp.Basic.__new__(sp.Piecewise, *args)
    return built(expr.func, args)


def built(func: Callable, args: Sequence[sp.Basic]) -> sp.Basic:
    """func(*args): a product or sum by product or total (SymPy's, without
    its flatten where that has nothing to combine)."""
    return product(args) if func is sp.Mul else total(args) if func is sp.Add else func(*args)


def shared_xreplace(expr: sp.Basic, rule: dict, done: dict) -> sp.Basic:
    """expr.xreplace(rule), each distinct subexpression rebuilt once over
    the calls that share `done`; selects, relations, Abs and sign as they
    stand (_AS_IT_STANDS), and so an applied function (tanh, exp, ...) whose
    new arguments hold no number to fold; products and sums by built, the
    rest by SymPy's constructors. (tanh's evaluation asks whether its
    argument is finite, which expands the whole argument: a fused loop's
    values, built by substituting each member into the next, took
    quadratic time in a chain of tanh, 26 s for 1,000 links.)"""
    if expr in rule:
        return rule[expr]
    result = done.get(expr)
    if result is None:
        args = tuple(shared_xreplace(a, rule, done) if isinstance(a, sp.Basic) else a for a in expr.args)
        changed = any(new is not old for new, old in zip(args, expr.args))
        result = done[expr] = (expr if not changed else expr.func(*args, evaluate=False)
                               if isinstance(expr, _AS_IT_STANDS) or (isinstance(expr, sp.Function) and not any(
                                   isinstance(a, sp.Number) for a in args)) else built(expr.func, args))
    return result


# Renamed as they stand (their evaluation only repeats the loads' own, and
# over large arguments it was most of the comments' time, of the fused
# loops' member values and of saddle's lowering (Piecewise's collapse,
# through relations rebuilt with SymPy's assumptions; Abs's signsimp);
# their order of arguments is what they print): the rest is rebuilt as
# xreplace does (an Or orders its arguments by name).
_AS_IT_STANDS = (sp.Piecewise, sp.Rel, sp.Abs, sp.sign)


_ARGS_ORDER = functools.cmp_to_key(sp.Basic.compare)  # SymPy's canonical order of a Mul's or Add's arguments
_LEAVES = (sp.Symbol, MatrixElement)  # a scalar's leaves: a product has nothing to combine among distinct ones


def product(factors: Sequence[sp.Basic]) -> sp.Expr:
    """Mul(*factors), built directly where SymPy's flatten has nothing to
    combine: at most one number (finite, nonzero, first or anywhere) and at
    least two other factors, each a commutative symbol, a matrix entry or a
    sum, no two equal (or a number other than 1 and one symbol or entry).
    Then flatten only sorts them (the number first), and that is the
    product it returns; anything else (a power to gather, a product to
    merge, a number times one sum, which SymPy distributes) is SymPy's
    Mul. A product among the factors counts as its factors (flatten merges
    it). A fused loop's inlined values are such products of loads and sums
    (a determinant by minors at ell=9: 7,000 of them, 40% of its fused
    loops' member values' time in Mul.flatten)."""
    coeff = None
    rest = []
    for f in _merged(factors):
        if f.is_Number:
            if coeff is not None or not f.is_finite or f.is_zero:
                return sp.Mul(*factors)
            coeff = f
        elif (isinstance(f, _LEAVES) and f.is_commutative) or type(f) is sp.Add:
            rest.append(f)
        else:
            return sp.Mul(*factors)
    if len(rest) == 1 and coeff not in (None, sp.S.One) and type(rest[0]) is not sp.Add:  # -x: a number and a leaf
        return sp.Mul._exec_constructor_postprocessors(sp.Mul._from_args((coeff, rest[0]), True))
    if len(rest) < 2 or len(set(rest)) != len(rest):
        return sp.Mul(*factors)
    rest.sort(key=_ARGS_ORDER)
    if coeff is not None and coeff is not sp.S.One:
        rest.insert(0, coeff)
    return sp.Mul._exec_constructor_postprocessors(sp.Mul._from_args(rest, True))


def _merged(factors: Sequence[sp.Basic]) -> Iterator[sp.Basic]:
    """The factors, a commutative product among them by its own factors (as
    flatten merges it: the sum and the negated entry of a determinant's
    adjoint, x times -y)."""
    for f in factors:
        if type(f) is sp.Mul and f.is_commutative:
            yield from f.args
        else:
            yield f


def total(terms: Sequence[sp.Basic]) -> sp.Expr:
    """Add(*terms), built directly where SymPy's flatten has nothing to
    combine: two or more terms, each a commutative symbol, matrix entry or product (a
    finite number, if any, first), no two alike but for that number. Then
    flatten only sorts them, and that is the sum it returns; anything else
    (a number, a sum to flatten, like terms) is SymPy's Add."""
    seen = set()
    for t in terms:
        if isinstance(t, _LEAVES):
            alike = (t,)
        elif type(t) is sp.Mul:
            alike = t.args
            if alike[0].is_Number:
                if not alike[0].is_finite:
                    return sp.Add(*terms)
                alike = alike[1:]
        else:
            return sp.Add(*terms)
        if alike in seen or not t.is_commutative:
            return sp.Add(*terms)
        seen.add(alike)
    if len(seen) < 2:
        return sp.Add(*terms)
    return sp.Add._exec_constructor_postprocessors(sp.Add._from_args(sorted(terms, key=_ARGS_ORDER), True))


def post_order(expr: sp.Basic, skip: Container[sp.Basic] = ()) -> list[sp.Basic]:
    """Each distinct subexpression once, arguments before their users; not
    those in `skip`, nor what is only under them."""
    order: list[sp.Basic] = []
    seen: set[sp.Basic] = {s for s in (expr,) if s in skip}
    stack: list[tuple[sp.Basic, bool]] = [(expr, False)]
    while stack:
        sub, ready = stack.pop()
        if ready:
            order.append(sub)
        elif sub not in seen and sub not in skip:
            seen.add(sub)
            stack.append((sub, True))
            stack.extend((a, False) for a in reversed(_args(sub)) if a not in seen)
    return order


class Splitter:
    """Cuts expressions into parts: the shared subexpressions of a large one
    (more than MAX_BODY_PARTS distinct subexpressions) and enough others
    that no part is deeper than MAX_BODY_DEPTH; small, shallow expressions
    stay whole. One splitter cuts several expressions (a program's lets)
    consistently: a subexpression is cut, and rebuilt, once."""

    def __init__(self, name: Callable[[sp.Basic], sp.Basic]):
        self.name = name  # the symbol that stands for a part, given the subexpression
        self.done: dict[sp.Basic, sp.Basic] = {}  # subexpression -> its rebuilt form, or its part's symbol
        self.height: dict[sp.Basic, int] = {}  # of the rebuilt form (0 for a part's symbol)

    def __call__(self, expr: sp.Basic) -> tuple[list[tuple[sp.Basic, sp.Basic, sp.Basic]], sp.Basic]:
        """(parts as (subexpression, its symbol, its body), arguments first; expr rebuilt)."""
        order = post_order(expr, self.done)
        uses: dict[sp.Basic, int] = {}
        for sub in order:
            for arg in set(_args(sub)):
                uses[arg] = uses.get(arg, 0) + 1
        large = sum(1 for sub in order if _args(sub)) > MAX_BODY_PARTS
        parts = []
        for sub in order:
            args = [self.done[a] for a in _args(sub)]
            rebuilt = rebuild(sub, args) if _args(sub) else sub
            height = 1 + max((self.height[a] for a in _args(sub)), default=-1)
            if sub is not expr and is_value(sub) and (height >= MAX_BODY_DEPTH or (large and uses.get(sub, 0) > 1)):
                symbol = self.name(sub)
                parts.append((sub, symbol, rebuilt))
                rebuilt, height = symbol, 0
            self.done[sub], self.height[sub] = rebuilt, height
        return parts, self.done[expr]


def substitute(exprs: list[sp.Basic], rule: dict) -> list[sp.Basic]:
    """[e.xreplace(rule) for e in exprs], each distinct subexpression rebuilt
    once over all of them (xreplace rebuilds a shared one once per path, and
    each rebuild of a product or sum flattens and sorts its arguments again:
    most of a large CSE's renaming, and 1.7 s of bundle adjustment's
    lowering, whose Jacobian bodies share most of their terms)."""
    done: dict[sp.Basic, sp.Basic] = {}
    stack: list[tuple[sp.Basic, bool]] = [(e, False) for e in reversed(exprs)]
    while stack:
        sub, ready = stack.pop()
        if sub in done:
            continue
        if sub in rule or not sub.args:
            done[sub] = rule.get(sub, sub)
        elif ready:
            args = [done[a] for a in sub.args]
            done[sub] = sub if all(n is a for n, a in zip(args, sub.args)) else built(sub.func, args)
        else:
            stack.append((sub, True))
            stack.extend((a, False) for a in sub.args if a not in done)
    return [done[e] for e in exprs]


def shallow_program(lets: list, bodies: list, symbols: Iterator[sp.Symbol]) -> tuple[list, list]:
    """The program (lets, bodies) with its deep or shared parts made lets
    of their own (named from `symbols`), in order."""
    program: list[tuple[sp.Symbol, sp.Expr]] = []
    splitter = Splitter(lambda _: next(symbols))

    def cut(expr: sp.Basic) -> sp.Basic:
        parts, rebuilt = splitter(expr)
        program.extend((symbol, body) for _, symbol, body in parts)
        return rebuilt

    for symbol, expr in lets:
        program.append((symbol, cut(expr)))
    return program, [cut(b) for b in bodies]


__all__ = ["MAX_BODY_DEPTH", "MAX_BODY_PARTS", "Splitter", "is_value", "post_order", "shallow_program", "substitute"]
