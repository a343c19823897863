"""sp.count_ops(expr), each distinct subexpression counted once.

sp.count_ops walks its expression as a tree: a fused loop's value, whose
members' values are substituted into each other, shares subexpressions
without bound, and counting it took most of an LSTM step's schedule (and
of a determinant by minors'). The count is a sum over the terms the walk
visits of what each adds, and what a term adds and which terms it visits
next depend on that term alone; so here the same walk is made over the
DAG, with the count of each distinct term kept. The rules are sp.count_ops'
own (SymPy 1.12 to 1.14), term for term; tests/compiled/test_opcount.py checks the
two agree.
"""

from __future__ import annotations

from collections.abc import Iterable

import sympy as sp
from sympy.concrete.summations import Sum
from sympy.core.function import Derivative
from sympy.core.function import _coeff_isneg as coeff_isneg  # the test sp.count_ops applies
from sympy.core.operations import LatticeOp
from sympy.integrals.integrals import Integral
from sympy.simplify.radsimp import fraction

_COUNTED = (Derivative, Integral, Sum)


def _product(a: sp.Basic) -> tuple[int, list[sp.Basic]] | None:
    """_step's result for `a`, a symbol or a product of symbols and sums
    (times -1: a NEG; a MUL between each two factors; the sums visited, the
    symbols add 0), without its general rules (fraction, the coefficient's
    sign, each factor's own step); None for anything else. Such products
    and their sums are most of a determinant's or a matrix product's
    values: the general rules were most of their count. (-1 times one sum
    takes the general path: its count is not the sum's.)"""
    if a.is_Symbol:
        return 0, []
    if not a.is_Mul:
        return None
    factors = a.args
    if factors[0] is sp.S.NegativeOne:
        factors = factors[1:]
    visits = []
    for f in factors:
        if type(f) is sp.Add:
            visits.append(f)
        elif not f.is_Symbol:
            return None
    if len(factors) == 1 and visits:
        return None
    return len(a.args) - 1, visits


def _step(a: sp.Basic) -> tuple[int, list[sp.Basic]]:
    """What sp.count_ops adds for the term `a` and the terms it visits next
    (its loop body, with each operation symbol's coefficient summed)."""
    direct = _product(a)
    if direct is not None:
        return direct
    ops = 0
    if a.is_Rational:
        if a is not sp.S.One:
            return int(a.p < 0) + int(a.q != 1), []
    elif a.is_Mul or a.is_MatMul:
        if coeff_isneg(a):
            ops += 1
            a = a.as_two_terms()[1] if a.args[0] is sp.S.NegativeOne else -a
        n, d = _fraction(a)
        if n.is_Integer:
            return ops + 1 + int(bool(n < 0)), [d]
        if d is not sp.S.One:
            return ops + 1, ([] if d.is_Integer else [d]) + [n]
    elif a.is_Add or a.is_MatAdd:
        terms = list(a.args)
        negative = [coeff_isneg(t) for t in terms]
        ops += len(terms) - 1  # an ADD or a SUB between terms
        if all(negative):
            ops += 1  # -x - y: a NEG besides the SUB
        visits = []
        for t, neg in zip(terms, negative):
            direct = _product(t)
            if direct is None:
                visits.append(_negated(t) if neg else t)
            else:  # a negated term's NEG is the SUB counted above
                ops += direct[0] - 1 if neg else direct[0]
                visits += direct[1]
        return ops, visits
    if a.is_Pow and a.exp is sp.S.NegativeOne:
        return ops + 1, [a.base]
    if a == sp.S.Exp1:
        return ops + 1, []
    if a.is_Pow and a.base == sp.S.Exp1:
        return ops + 1, [a.exp]
    if a.is_Mul or isinstance(a, LatticeOp):
        ops += len(a.args) - 1
    elif a.args and (a.is_Pow or a.is_Function or isinstance(a, _COUNTED)):
        ops += 1
    return ops, ([] if a.is_Symbol else list(a.args))


def _negated(term: sp.Basic) -> sp.Basic:
    """-term; a product of -1 and factors as Mul.__neg__ makes it (those
    factors), without its as_coeff_mul (the negations were a third of
    counting a determinant's gradient)."""
    if term.is_Mul and term.args[0] is sp.S.NegativeOne:
        return sp.Mul._from_args(term.args[1:], term.is_commutative)
    return -term


def _fraction(a: sp.Basic) -> tuple[sp.Basic, sp.Basic]:
    """fraction(a), without rebuilding a product that has no denominator:
    fraction remakes every product as Mul(*numerator), a flattening of all
    its factors, and that was most of the count on a determinant's gradient."""
    if a.is_Mul and not any(_in_denominator(t) for t in a.args):
        return a, sp.S.One
    return fraction(a)


def _in_denominator(term: sp.Basic) -> bool:
    """Whether fraction could put some of the factor `term` below the line
    (a power whose exponent is not known positive, a non-integer Rational)."""
    if term.is_commutative and (term.is_Pow or isinstance(term, sp.exp)):
        return not term.as_base_exp()[1].is_positive
    return bool(term.is_Rational and not term.is_Integer)


def exceeds(expr: sp.Basic, limit: int) -> bool:
    """count_ops(expr) > limit, walking expr as a tree only until its
    count passes limit (each term adds a count >= 0, so a partial sum past
    limit settles it): where only a threshold matters, a value shared
    without bound (a determinant's gradient) is not counted in full."""
    return exceeds_all((expr,), limit)


def exceeds_all(exprs: Iterable[sp.Basic], limit: int) -> bool:
    """sum(count_ops(e) for e in exprs) > limit, as `exceeds`: the walk
    stops once the partial sum passes limit (a wide per-example body's 231
    values, shown in comments only up to a few dozen operations)."""
    total = 0
    for expr in exprs:
        if not isinstance(expr, sp.Expr) or expr.is_Relational:
            total += count_ops(expr)
            if total > limit:
                return True
            continue
        stack = [expr]
        while stack:
            own, visits = _step(stack.pop())
            total += own
            if total > limit:
                return True
            stack.extend(visits)
    return False


def count_ops(expr: sp.Basic, total: dict[sp.Basic, int] | None = None) -> int:
    """sp.count_ops(expr) (an int), in time linear in expr's distinct terms.
    `total` (each term's count, which depends on that term alone) may be
    shared between calls: see count_all."""
    if not isinstance(expr, sp.Expr) or expr.is_Relational:
        return int(sp.count_ops(expr))
    total = {} if total is None else total
    nexts: dict[sp.Basic, tuple[int, list[sp.Basic]]] = {}
    stack = [expr]
    while stack:  # post-order, without recursion: bodies may be deep
        a = stack[-1]
        if a in total:
            stack.pop()
            continue
        if a not in nexts:
            nexts[a] = _step(a)
            stack.extend(b for b in nexts[a][1] if b not in total)
            continue
        stack.pop()
        own, visits = nexts.pop(a)
        total[a] = own + sum(total[b] for b in visits)
    return total[expr]


def count_all(exprs: Iterable[sp.Basic]) -> int:
    """sum(count_ops(e) for e in exprs), each distinct term visited once over
    all of them: a fused loop's values share their members' values (a
    determinant's 500 minors, each counted alone, took 0.6 s)."""
    total: dict[sp.Basic, int] = {}
    return sum(count_ops(e, total) for e in exprs)
