"""Derivatives of one scalar expression by many symbols at once, over the
expression as a DAG: reverse mode (an adjoint per distinct subexpression,
one sweep from the root) and forward mode (a tangent per subexpression).

sp.diff by each symbol walks the whole expression once per symbol:
quadratic in a wide body (llsq's polynomial of 128 terms, by each of its
129 columns; an LSTM step's maps of 200 arguments). Here each
subexpression is visited once, and an adjoint or tangent that several
arguments use can be named (`let`: a shared local value of the caller's
program) instead of written out again.

The local rules are SymPy's own (those of Add, Mul, Pow, and a function's
fdiff, as in their _eval_derivative), so the derivatives are sp.diff's,
grouped by subexpression. Anything else (Piecewise, Abs, Max, ...) is
differentiated whole by sp.diff (a Piecewise by its rule without the
constructor's refolding: _diff_whole); such parts are small.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import sympy as sp
from sympy.core.exprtools import _keep_coeff
from sympy.core.function import ArgumentIndexError
from sympy.functions.elementary.piecewise import ExprCondPair

from symbackprop.base.exprdag import post_order, walk_args
from symbackprop.base.functions import derivative as own_derivative
from symbackprop.base.functions import has_own_derivative

Let = Callable[[sp.Expr], sp.Expr]


def _inline(value: sp.Expr) -> sp.Expr:
    return value


def backward(expr: sp.Expr, seed: sp.Expr, wanted: Callable[[sp.Basic], bool], let: Let = _inline) -> dict[sp.Basic, sp.Expr]:
    """seed * d expr / d s for each symbol s of expr that `wanted` accepts
    (those with a zero derivative left out), in the order the sweep reaches
    them. An adjoint that several arguments of a subexpression use is
    passed through `let` first (which may name it)."""
    order = post_order(expr)
    holds = _holds(order, wanted)
    terms: dict[sp.Basic, list[sp.Expr]] = {expr: [seed]}
    found: dict[sp.Basic, sp.Expr] = {}
    for sub in reversed(order):
        adjoint = sp.Add(*terms.pop(sub, ()))
        if adjoint == 0 or not holds[sub]:
            continue
        if not walk_args(sub):
            found[sub] = adjoint
            continue
        local = _local(sub, holds)
        if local is None:  # no rule of its own: the whole of it by each symbol under it (_diff_whole)
            local = _diff_whole(sub, sorted(filter(wanted, sub.free_symbols), key=str))
        if len(local) > 1 and not adjoint.is_Atom:
            adjoint = _let_kept(adjoint, let)
        for arg, derivative in local:
            if derivative != 0:
                terms.setdefault(arg, []).append(_product(adjoint, derivative))
    return found


def partials(expr: sp.Expr, symbols: list[sp.Symbol]) -> list[sp.Expr]:
    """d expr / d s for each of `symbols`, in order (0 where expr does not
    depend on s), from one reverse sweep."""
    found = backward(expr, sp.Integer(1), set(symbols).__contains__)
    return [found.get(symbol, sp.Integer(0)) for symbol in symbols]


def forward(expr: sp.Expr, tangent_of: Mapping[sp.Basic, sp.Expr], let: Let = _inline) -> sp.Expr:
    """The differential of expr: the sum over its symbols s of
    d expr / d s * tangent_of[s] (symbols without a tangent held constant).
    A tangent that several subexpressions use is passed through `let`."""
    order = post_order(expr)
    holds = _holds(order, tangent_of.__contains__)
    uses: dict[sp.Basic, int] = {}
    for sub in order:
        for arg in set(walk_args(sub)):
            uses[arg] = uses.get(arg, 0) + 1
    tangent: dict[sp.Basic, sp.Expr] = {}
    for sub in order:
        if not holds[sub]:
            continue
        if not walk_args(sub):
            tangent[sub] = tangent_of[sub]
            continue
        local = _local(sub, holds)
        if local is None:
            local = _diff_whole(sub, sorted(sub.free_symbols & tangent_of.keys(), key=str))
        value = sp.Add(*[_product(derivative, tangent[arg]) for arg, derivative in local if derivative != 0 and arg in tangent])
        if value != 0:
            tangent[sub] = let(value) if uses.get(sub, 0) > 1 and not value.is_Atom else value
    return tangent.get(expr, sp.Integer(0))


def _let_kept(value: sp.Expr, let: Let) -> sp.Expr:
    """let(value); a coefficient times a sum as two values, the sum and
    its multiple: 2*(a + b) rebuilt by a later substitution would become
    2*a + 2*b, which no longer shares a + b with the expression."""
    coeff, rest = value.as_coeff_Mul()
    if coeff != 1 and rest.is_Add:
        return let(_keep_coeff(coeff, let(rest)))
    return let(value)


def _holds(order: list[sp.Basic], wanted: Callable[[sp.Basic], bool]) -> dict[sp.Basic, bool]:
    """For each subexpression: whether a wanted symbol is it or under it."""
    holds: dict[sp.Basic, bool] = {}
    for sub in order:
        args = walk_args(sub)
        holds[sub] = any(holds[a] for a in args) if args else bool(wanted(sub))
    return holds


def _local(sub: sp.Basic, holds: Mapping[sp.Basic, bool]) -> list[tuple[sp.Basic, sp.Expr]] | None:
    """(argument, d sub / d argument) for the arguments that hold a wanted
    symbol, by SymPy's rule for sub's kind; None for a kind without one here."""
    args = sub.args
    if sub.is_Add:
        return [(a, sp.Integer(1)) for a in args if holds[a]]
    if sub.is_Mul:  # the product of the others, as Mul._eval_derivative
        return [(a, sp.Mul(*args[:i], *args[i + 1 :])) for i, a in enumerate(args) if holds[a]]
    if sub.is_Pow:  # Pow._eval_derivative: self * (dexp log(base) + dbase exp / base)
        base, exp = args
        local = [(base, _product(exp, sub / base))] if holds[base] else []
        return local + ([(exp, _product(sub, sp.log(base)))] if holds[exp] else [])
    if isinstance(sub, sp.Function) and (type(sub)._eval_derivative is sp.Function._eval_derivative
                                         or has_own_derivative(sub)):  # sign: ours, not its DiracDelta
        return [(a, _fdiff(sub, i + 1)) for i, a in enumerate(args) if holds[a]]
    return None


def _diff_whole(sub: sp.Basic, symbols: list[sp.Symbol]) -> list[tuple[sp.Basic, sp.Expr]]:
    """(symbol, d sub / d symbol) for a kind without a rule here: sp.diff's,
    except a Piecewise, whose derivative (the select of its branches'
    derivatives, the conditions held, as Piecewise._eval_derivative) is
    built as it stands, each branch differentiated by every symbol in one
    reverse sweep: sp.diff by each symbol walked a branch as a tree (a
    rotation's small-angle select in bundle adjustment's Jacobian: most of
    declaring it), and SymPy's rule rebuilds the select through the
    constructor, which folds its conditions again (8% of a saddle point's
    compile). Branches of one derivative give that derivative, as the
    constructor would."""
    if not isinstance(sub, sp.Piecewise):
        return [(symbol, sp.diff(sub, symbol)) for symbol in symbols]
    branches = [(partials(value, symbols), cond) for value, cond in sub.args]
    local = []
    for k, symbol in enumerate(symbols):
        pairs = [(derivatives[k], cond) for derivatives, cond in branches]
        if all(d == pairs[0][0] for d, _ in pairs):
            local.append((symbol, pairs[0][0]))
        else:
            local.append((symbol, sp.Basic.__new__(sp.Piecewise, *(sp.Tuple.__new__(ExprCondPair, d, c) for d, c in pairs))))
    return local


def _fdiff(function: sp.Function, index: int) -> sp.Expr:
    """As Function._eval_derivative: the function's own rule, else SymPy's
    unevaluated form (which the callers refuse); a rule of
    base.functions.DERIVATIVES first (PyTorch's formula beyond the domain)."""
    own = own_derivative(function, index)
    if own is not None:
        return own
    try:
        return function.fdiff(index)
    except ArgumentIndexError:
        return sp.Function.fdiff(function, index)


def _product(*factors: sp.Expr) -> sp.Expr:
    """The product, with its numeric coefficient kept outside a sum
    (SymPy distributes 2*(a + b) into 2*a + 2*b, which no longer shares
    a + b with the expression under CSE)."""
    coeff, rest = sp.Integer(1), []
    for factor in factors:
        c, r = factor.as_coeff_Mul()
        coeff *= c
        rest.append(r)
    return _keep_coeff(coeff, sp.Mul(*rest))


__all__ = ["backward", "forward", "partials"]
