"""Elementwise functions with stable C forms, and the exact rewrites that
turn hand-written SymPy (1/(1 + exp(-z)), log(1 + exp(z))) into them.

Written in exp, these overflow: exp(-z) is inf below z = -709 (float64) or
-88 (float32), and the quotient of two infinities is NaN. The functions
below print as forms that never evaluate exp of a positive number (see
codegen.ScalarPrinter), and their derivatives are again such functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import sympy as sp
from sympy.codegen.cfunctions import log1p


class _ExpForm(sp.Function):
    """A function of one argument written in exp (`_exp_form`, its value
    at a number: exact for rationals, mpmath, without overflow, for
    floats), 0 at -oo, `_at_infinity` at oo; real where its argument is."""

    nargs = 1
    _at_infinity: sp.Expr

    @staticmethod
    def _exp_form(z: sp.Expr) -> sp.Expr:
        raise NotImplementedError

    @classmethod
    def eval(cls, z):
        if z is sp.nan:
            return sp.nan
        if z is sp.oo:
            return cls._at_infinity
        if z is sp.S.NegativeInfinity:
            return sp.S.Zero
        if z.is_Number:
            return cls._exp_form(z)
        return None

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _eval_rewrite_as_exp(self, z, **kwargs):
        return self._exp_form(z)

    def _eval_evalf(self, prec):
        return self.rewrite(sp.exp)._eval_evalf(prec)


class sigmoid(_ExpForm):
    """1 / (1 + exp(-z)); its derivative s*(1 - s), a function of its value."""

    nargs = 1
    _at_infinity = sp.S.One

    @staticmethod
    def _exp_form(z: sp.Expr) -> sp.Expr:
        return 1 / (1 + sp.exp(-z))

    def fdiff(self, argindex=1):
        return self * (1 - self)

    def _eval_is_positive(self):
        return True if self.args[0].is_finite and self.args[0].is_real else None


class softplus(_ExpForm):
    """log(1 + exp(z)); its derivative sigmoid(z)."""

    nargs = 1
    _at_infinity = sp.oo

    @staticmethod
    def _exp_form(z: sp.Expr) -> sp.Expr:
        return sp.log(1 + sp.exp(z))

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_rewrite_as_log(self, z, **kwargs):
        return self._exp_form(z)


def _is_one(x: sp.Basic) -> bool:
    """Exactly 1: the integer, or a Float equal to it (1.0)."""
    return bool(x.is_Number and x.is_finite and sp.Rational(x) == 1)


def _other_than_one(expr: sp.Basic) -> sp.Basic | None:
    """b where expr is exactly 1 + b (1 or 1.0), else None."""
    if isinstance(expr, sp.Add) and len(expr.args) == 2:
        first, second = expr.args
        if _is_one(first):
            return second
        if _is_one(second):
            return first
    return None


def _exp_argument_of_one_plus(expr: sp.Basic) -> sp.Expr | None:
    """u where expr is exactly 1 + exp(u), else None."""
    other = _other_than_one(expr)
    return other.args[0] if isinstance(other, sp.exp) else None


def _tanh_of_quotient(factors: list) -> sp.Expr | None:
    """(exp(u) - exp(-u)) / (exp(u) + exp(-u)) -> tanh(u) (the rest kept)."""
    for k, factor in enumerate(factors):
        if not (isinstance(factor, sp.Pow) and factor.exp == -1 and isinstance(factor.base, sp.Add)):
            continue
        terms = factor.base.args
        if len(terms) != 2 or not all(isinstance(t, sp.exp) for t in terms) or terms[0].args[0] != -terms[1].args[0]:
            continue
        for u in (terms[0].args[0], terms[1].args[0]):
            numerator = sp.exp(u) - sp.exp(-u)
            if numerator in factors:
                rest = [f for i, f in enumerate(factors) if i != k]
                rest.remove(numerator)
                return sp.Mul(sp.tanh(u), *rest)
    return None


def _rewrite_pow(expr: sp.Pow) -> sp.Expr | None:
    """(1 + exp(u))**-k -> sigmoid(-u)**k for a positive integer k."""
    base, power = expr.args
    u = _exp_argument_of_one_plus(base)
    if u is not None and power.is_Integer and power < 0:
        return sigmoid(-u) ** (-power)
    return None


def _sigmoid_power(factor: sp.Basic) -> tuple[sp.Expr, sp.Expr] | None:
    """(w, k) where factor is sigmoid(w)**k for a positive integer k."""
    if isinstance(factor, sigmoid):
        return factor.args[0], sp.S.One
    if isinstance(factor, sp.Pow) and isinstance(factor.base, sigmoid) and factor.exp.is_Integer and factor.exp > 0:
        return factor.base.args[0], factor.exp
    return None


def _rewrite_mul(expr: sp.Mul) -> sp.Expr | None:
    """exp(-w) * sigmoid(w)**k -> sigmoid(-w) * sigmoid(w)**(k - 1): with
    the power rule below it, exp(u)/(1 + exp(u)) becomes sigmoid(u) and
    exp(-z)/(1 + exp(-z))**2 sigmoid(z)*sigmoid(-z) (the rest kept)."""
    factors = list(expr.args)
    quotient = _tanh_of_quotient(factors)
    if quotient is not None:
        return quotient
    for k, factor in enumerate(factors):
        found = _sigmoid_power(factor)
        if found is None or sp.exp(-found[0]) not in factors:
            continue
        w, power = found
        rest = [f for i, f in enumerate(factors) if i != k]
        rest.remove(sp.exp(-w))
        return sp.Mul(sigmoid(-w), sigmoid(w) ** (power - 1), *rest)
    return None


def _rewrite_log(expr: sp.log) -> sp.Expr | None:
    """log(1 + exp(u)) -> softplus(u); log(sigmoid(u)) -> -softplus(-u);
    log(1 - sigmoid(u)) -> -softplus(u)."""
    arg = expr.args[0]
    u = _exp_argument_of_one_plus(arg)
    if u is not None:
        return softplus(u)
    if isinstance(arg, sigmoid):
        return -softplus(-arg.args[0])
    other = _other_than_one(arg)
    if isinstance(other, sp.Mul) and other.args[0] == -1 and len(other.args) == 2 and isinstance(other.args[1], sigmoid):
        return -softplus(other.args[1].args[0])
    return None


def _rewrite_log1p(expr: log1p) -> sp.Expr | None:
    """log1p(exp(u)) -> softplus(u)."""
    arg = expr.args[0]
    return softplus(arg.args[0]) if isinstance(arg, sp.exp) else None


def _rewrite_node(expr: sp.Basic) -> sp.Basic:
    if isinstance(expr, sp.Pow):
        found = _rewrite_pow(expr)
    elif isinstance(expr, sp.Mul):
        found = _rewrite_mul(expr)
    elif isinstance(expr, sp.log):
        found = _rewrite_log(expr)
    elif isinstance(expr, log1p):
        found = _rewrite_log1p(expr)
    else:
        found = None
    return expr if found is None else found


def stabilize(expr: sp.Expr) -> sp.Expr:
    """expr with the exact overflow-prone forms replaced, innermost first:
    1/(1 + exp(u)) by sigmoid(-u), exp(u)/(1 + exp(u)) by sigmoid(u),
    log(1 + exp(u)) and log1p(exp(u)) by softplus(u), log(sigmoid(u)) by
    -softplus(-u), (exp(u) - exp(-u))/(exp(u) + exp(-u)) by tanh(u).

    Only these exact shapes are matched (1 + exp(u), nothing else added),
    so the value is the same real number; only its floating-point
    evaluation changes. Walks the expression without recursion, each
    distinct subexpression once, so deep bodies cost no Python stack.
    """
    done: dict[sp.Basic, sp.Basic] = {}
    stack: list[tuple[sp.Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if node in done:
            continue
        if node.is_Atom or not node.args:
            done[node] = node
        elif not expanded:
            stack.append((node, True))
            stack.extend((a, False) for a in node.args if a not in done)
        else:
            args = tuple(done[a] for a in node.args)
            rebuilt = node.func(*args) if args != node.args else node
            done[node] = _rewrite_node(rebuilt)
    return done[expr]


def _contains(expr: sp.Basic, types: tuple) -> bool:
    """Whether a subexpression of expr is of one of the types (no recursion)."""
    stack = [expr]
    while stack:
        sub = stack.pop()
        if isinstance(sub, types):
            return True
        stack.extend(sub.args)
    return False


@functools.lru_cache(maxsize=4096)  # map_ asks it of every body it builds, mostly the same few
def _divides_or_logs(expr: sp.Basic) -> bool:
    """Whether expr holds a log or a negative power (no recursion)."""
    stack = [expr]
    while stack:
        sub = stack.pop()
        if isinstance(sub, (sp.log, log1p)) or (isinstance(sub, sp.Pow) and sub.exp.is_negative):
            return True
        stack.extend(sub.args)
    return False


# how many levels of elementwise arguments fuse_across looks through, and
# how many nodes of argument bodies it puts in, in all (the forms it
# rewrites are small; wide bodies put in at every level made an LSTM
# step's compile grow steeply with its depth)
FUSE_DEPTH = 3
FUSE_MAX_NODES = 200


@functools.lru_cache(maxsize=4096)
def _size(expr: sp.Basic) -> int:
    """expr's nodes counted as a tree, up to FUSE_MAX_NODES + 1."""
    count = 0
    for count, _ in enumerate(sp.preorder_traversal(expr), 1):
        if count > FUSE_MAX_NODES:
            break
    return count


def fuse_across(body: sp.Expr, args: tuple, shape: tuple, placeholder: Callable[[int], sp.Symbol]) -> tuple | None:
    """(body, args) with the bodies of the elementwise arguments (maps of
    the same shape, FUSE_DEPTH levels down at most) put in, where that lets
    stabilize rewrite a form split across them: log(1 - p) of p =
    sigmoid(z), written as matrix operations (ones - p, then log), is
    -softplus(z) (-40 at z = 40, where log(1 - p) is -inf). None where
    nothing is gained. `args` are ir.Node objects (ir imports this module).
    """
    if not args or not _divides_or_logs(body):
        return None
    kept: list = []
    budget = [FUSE_MAX_NODES]

    def inline(expr: sp.Expr, nodes: tuple, depth: int) -> sp.Expr:
        subs = {}
        for i, node in enumerate(nodes):
            if (depth < FUSE_DEPTH and node.op == "map" and node.args and node.shape == shape
                    and _size(node.attrs[0]) <= budget[0]):
                budget[0] -= _size(node.attrs[0])
                subs[placeholder(i)] = inline(node.attrs[0], node.args, depth + 1)
                continue
            if node not in kept:
                kept.append(node)
            subs[placeholder(i)] = sp.Symbol(f"_fused{kept.index(node)}", real=True)
        return expr.xreplace(subs)

    composed = inline(body, args, 0)
    if not _contains(composed, (sp.exp, sigmoid)):
        return None
    stabilized = stabilize(composed)
    if stabilized == composed:
        return None
    back = {sp.Symbol(f"_fused{k}", real=True): placeholder(k) for k in range(len(kept))}
    return stabilized.xreplace(back), tuple(kept)
