"""The C text of the functions whose IEEE behaviour SymPy's C99 printer
gets wrong or that it does not know: Max, Min, Heaviside, sign, DiracDelta
and Piecewise propagate NaN (C's fmax returns the other argument, and a
comparison with NaN is false, which would silently choose a branch). The
functions with a record in symbackprop.base.functions (sigmoid, softplus,
lgamma, polygamma, ...) print as their records say.
"""

from __future__ import annotations

from typing import Any

import sympy as sp
from sympy.core.exprtools import decompose_power
from sympy.core.relational import Relational
from sympy.core.sorting import default_sort_key
from sympy.logic.boolalg import BooleanFunction
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import PRECEDENCE, precedence

from symbackprop.base.functions import scalar_function


def ordered_terms(expr: sp.Add) -> list[sp.Expr]:
    """expr.as_ordered_terms(): SymPy's print order of a sum's terms (by
    their monomials, lex, in the order of default_sort_key of their bases),
    without its evalf of each term's rational coefficient (complex() of a
    SymPy number: 60% of the ordering's time, which was most of printing a
    large kernel's time)."""
    add_args = sorted(expr.args, key=lambda t: not isinstance(t, (sp.Number, sp.NumberSymbol)))
    if len(add_args) == 2 and isinstance(add_args[0], (sp.Number, sp.NumberSymbol)) and add_args[1].is_Mul:
        # SymPy's special case: 1 - 2*x stays in that order
        return expr.as_ordered_terms()
    gens: set = set()
    terms = []
    for term in expr.args:
        found = _symbol_monomial(term)
        if found is None:
            found = _monomial(term)
            if found is None:
                return expr.as_ordered_terms()
        gens.update(found[1])
        terms.append((term, *found))
    ranked = sorted(gens, key=_name) if all(type(g) is sp.Symbol for g in gens) else sorted(gens, key=default_sort_key)
    rank = {g: n for n, g in enumerate(ranked)}

    def coefficient(value: complex) -> tuple:
        return ((bool(value.imag), value.imag), (value.real, value.imag))

    if all(e == 1 for _, _, powers in terms for e in powers.values()):
        # the exponents' lex order, each 0 or 1: the term that has the first
        # generator where they differ first, a term whose generators begin
        # another's after it (the ranks, ascending, and a stop above them all)
        def square_free(entry: tuple) -> tuple:
            _, value, powers = entry
            return (*sorted(rank[g] for g in powers), len(ranked)), (), coefficient(value)

        return [term for term, _, _ in sorted(terms, key=square_free)]

    def key(entry: tuple) -> tuple:
        _, value, powers = entry
        return tuple(-powers.get(g, 0) for g in ranked), (), coefficient(value)

    return [term for term, _, _ in sorted(terms, key=key)]


def _name(symbol: sp.Symbol) -> str:
    return symbol.name


def signed_symbols(term: sp.Expr) -> tuple[bool, tuple[sp.Symbol, ...]] | None:
    """(negative, factors) of a symbol, or a product of symbols or of minus
    one and symbols (most of a large kernel's terms); None for anything
    else. Read off the args, without SymPy's as_coeff_Mul or rebuilding."""
    if type(term) is sp.Symbol:
        return False, (term,)
    if not term.is_Mul:
        return None
    args = term.args
    negative = args[0] is sp.S.NegativeOne
    factors = args[1:] if negative else args
    if not all(type(f) is sp.Symbol for f in factors):
        return None
    return negative, factors


def _symbol_monomial(term: sp.Expr) -> tuple[complex, dict] | None:
    """A signed product of symbols as _monomial sees it (None otherwise), without its work."""
    found = signed_symbols(term)
    if found is None:
        return None
    negative, factors = found
    return complex(-1.0 if negative else 1.0), dict.fromkeys(factors, 1)


def _monomial(term: sp.Expr) -> tuple[complex, dict] | None:
    """A term's numeric coefficient and its generators' exponents, as
    as_ordered_terms sees them; None where it is not commutative."""
    coeff, rest = term.as_coeff_Mul()
    value = complex(float(coeff)) if isinstance(coeff, (sp.Rational, sp.Float)) else complex(coeff)
    powers = {}
    for factor in (sp.Mul.make_args(rest) if rest is not sp.S.One else ()):
        if factor.is_number:
            try:
                value *= complex(factor)
                continue
            except (TypeError, ValueError):
                pass
        if not factor.is_commutative:
            return None
        base, exp = decompose_power(factor)
        powers[base] = exp
    return value, powers


class OrderedTerms:
    """For a SymPy printer (C, str, LaTeX): a sum's terms in the order SymPy
    prints them, sooner (see ordered_terms; the comments' equations and the
    derivation's LaTeX ordered their sums by as_ordered_terms too)."""

    order: Any

    def _as_ordered_terms(self, expr: Any, order: Any = None) -> list:
        if expr.is_Add and (order or self.order) in (None, "lex"):
            return ordered_terms(expr)
        return super()._as_ordered_terms(expr, order)  # type: ignore[misc]


class IEEEPrinter(OrderedTerms, C99CodePrinter):
    """C99 with NaN in, NaN out; `real` (set by the subclass) names the
    module's real type (its .name is "float64" or "float32"; its .c, the C
    text of the type, may be a macro)."""

    real: Any

    def _print(self, expr: Any, **kwargs: Any) -> str:
        """A function with a record (base.functions) prints as it says."""
        record = scalar_function(type(expr))
        if record is not None:
            return record.c(self, expr)
        return super()._print(expr, **kwargs)

    def _print_Pow(self, expr: sp.Pow) -> str:
        """x**(1/3) through pow, never C's cbrt: the value and its derivative
        come from one definition of the power, NaN for x < 0 (as torch.pow
        and numpy's). cbrt was finite there while the derivative, x**(-2/3)/3,
        printed as pow and was NaN; x**(2/3) was NaN with a finite derivative,
        x**(-1/3), printed as 1/cbrt. (SymPy's cbrt(x) is this same power;
        the real cube root is real_root(x, 3).)"""
        if expr.exp == sp.Rational(1, 3):
            suffix = self._get_func_suffix(sp.codegen.ast.real)
            return f"{self._ns}pow{suffix}({self._print(expr.base)}, {self._print(expr.exp)})"
        return super()._print_Pow(expr)

    def _print_Mul(self, expr: sp.Mul, **kwargs: Any) -> str:
        text = self._product_text(expr)
        return text if text is not None else super()._print_Mul(expr, **kwargs)

    def _product_text(self, expr: sp.Expr) -> str | None:
        """A symbol, or a product of symbols or of minus one and symbols
        (most of a large kernel's terms), as SymPy prints it, without its
        work (it rebuilds the product without its sign, a new Mul, and
        sorts the factors by sort_key: a Symbol's is its name); None for
        anything else."""
        found = signed_symbols(expr)
        if found is None:
            return None
        negative, factors = found
        return ("-" if negative else "") + "*".join([self._print_Symbol(f) for f in sorted(factors, key=_name)])

    def _signed_sum_text(self, expr: sp.Expr) -> str | None:
        """A symbol, a signed product of symbols (_product_text) or a sum of
        them, as _print_Add prints it, each term read once (signed_symbols);
        None for anything else. The terms' order is ordered_terms' for
        square-free monomials (a product's symbols are distinct): by their
        generators' names, ascending, a term whose names begin another's
        first; where two generators share a name, None (ordered_terms ranks
        them)."""
        if type(expr) is not sp.Add:
            return self._product_text(expr)
        if self.order not in (None, "lex"):
            return None
        terms = []
        gens: set = set()
        for term in expr.args:
            found = signed_symbols(term)
            if found is None:
                return None
            negative, unordered = found
            factors = sorted(unordered, key=_name)
            gens.update(factors)
            terms.append(([(0, f.name) for f in factors] + [(1,)], negative, factors))
        if len({g.name for g in gens}) != len(gens):
            return None
        terms.sort(key=lambda entry: entry[0])  # distinct monomials: distinct keys
        parts = []
        for _, negative, factors in terms:
            parts += ["-" if negative else "+", "*".join([self._print_Symbol(f) for f in factors])]
        sign = parts.pop(0)
        return ("" if sign == "+" else sign) + " ".join(parts)

    def _print_Add(self, expr: sp.Add, order: Any = None) -> str:
        """StrPrinter's sum, its terms that _product_text knows printed by it
        (such a term needs no parentheses in a sum; its sign is its text's)."""
        if (order or self.order) not in (None, "lex"):
            return super()._print_Add(expr, order=order)
        text = self._signed_sum_text(expr)
        if text is not None:
            return text
        parts = []
        for term in ordered_terms(expr):
            text = self._product_text(term)
            if text is None:
                text = self._print(term)
                negative = text.startswith("-") and not term.is_Add
                if negative:
                    text = text[1:]
                if precedence(term) < PRECEDENCE["Add"] or term.is_Add:
                    text = f"({text})"
            else:
                negative = text.startswith("-")
                text = text[1:] if negative else text
            parts += ["-" if negative else "+", text]
        sign = parts.pop(0)
        return ("" if sign == "+" else sign) + " ".join(parts)

    def _handle_UnevaluatedExpr(self, expr: Any) -> Any:
        """SymPy's rewrite of re(UnevaluatedExpr(x)), only where there is an
        re to rewrite: its replace walks and rebuilds every expression
        printed (a third of printing a large kernel)."""
        return expr if isinstance(expr, sp.Basic) and not expr.has(sp.re) else super()._handle_UnevaluatedExpr(expr)

    def _one(self) -> str:
        return self._print(sp.Float(1.0))

    def _print_Heaviside(self, expr: sp.Expr) -> str:
        # relu's kink: the derivative at exactly 0 is taken as 0 (as PyTorch);
        # NaN stays NaN (a comparison with NaN is false: it would give 0)
        x = self._print(expr.args[0])
        return f"(isnan({x}) ? ({x}) : ({x}) > 0 ? {self._one()} : {self._print(sp.Float(0.0))})"

    def _print_sign(self, expr: sp.Expr) -> str:
        x = self._print(expr.args[0])
        return f"(isnan({x}) ? ({x}) : ({x} > 0) - ({x} < 0))"

    def _print_Max(self, expr: sp.Expr) -> str:
        return self._extreme(expr, ">")

    def _print_Min(self, expr: sp.Expr) -> str:
        return self._extreme(expr, "<")

    def _extreme(self, expr: sp.Expr, op: str) -> str:
        """NaN if any argument is NaN (as numpy's maximum and torch.maximum):
        C's fmax/fmin return the other argument. Two arguments as one select
        (it vectorizes); more with fmax/fmin, behind a test for NaN."""
        args = [self._print(a) for a in expr.args]
        if len(args) == 2:
            a, b = args
            nan_a = "" if expr.args[0].is_Number else f" || isnan({a})"
            return f"((({a}) {op} ({b}){nan_a}) ? ({a}) : ({b}))"
        call = "fmax" if op == ">" else "fmin"
        call += "f" if self.real.name == "float32" else ""
        text = args[0]
        for b in args[1:]:
            text = f"{call}({text}, {b})"
        tested = [t for t, arg in zip(args, expr.args) if not arg.is_Number]
        return f"(({' || '.join(f'isnan({a})' for a in tested)}) ? ({' + '.join(tested)}) : {text})"

    def _print_Piecewise(self, expr: sp.Piecewise) -> str:
        """One line: (c1 ? e1 : (c2 ? e2 : e3)); the last branch needs no test.
        NaN where a condition reads a NaN: every comparison with NaN is
        false, which would choose the default branch silently."""
        text = None
        for value, condition in reversed(expr.args):
            if text is None or condition == sp.true:
                text = f"({self._print(value)})"
            else:
                text = f"(({self._print(condition)}) ? ({self._print(value)}) : {text})"
        if text is None or expr.args[-1].cond != sp.true:
            raise ValueError(f"Piecewise without a default branch: {expr}")
        return self._nan_if_read(set().union(*(c.free_symbols for _, c in expr.args[:-1])), text)

    def _nan_if_read(self, read: set, text: str) -> str:
        """text, or NaN (their sum) where one of the real symbols read is NaN."""
        tested = [self._print(s) for s in sorted(read, key=str) if not s.is_integer]
        if not tested:
            return text
        return f"(({' || '.join(f'isnan({t})' for t in tested)}) ? ({' + '.join(tested)}) : {text})"

    def doprint(self, expr: Any, assign_to: Any = None) -> Any:
        """A condition computed on its own (CSE makes `x0 = z > 0` a
        temporary) is NaN where it reads a NaN, so that the Piecewise that
        tests it sees the NaN (see _print_Piecewise). A signed product of
        symbols, or a sum of them (most of a large kernel's statements),
        prints directly: CodePrinter.doprint's walks (the rewrite of
        re(UnevaluatedExpr), the code's indentation) leave its text as it is."""
        if assign_to is None and isinstance(expr, sp.Expr):
            text = self._signed_sum_text(expr)
            if text is not None:
                return text
        text = super().doprint(expr, assign_to)
        if assign_to is None and isinstance(expr, (Relational, BooleanFunction)):
            return self._nan_if_read(expr.free_symbols, text)
        return text

    def _print_DiracDelta(self, expr: sp.Expr) -> str:
        # a step's derivative: 0 (as PyTorch's), NaN at NaN
        x = self._print(expr.args[0])
        return f"(isnan({x}) ? ({x}) : {self._print(sp.Float(0.0))})"
