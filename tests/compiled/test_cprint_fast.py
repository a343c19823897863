"""The printer's direct paths for symbols, products of symbols and their
sums (base.cprint: _product_text, the square-free key of ordered_terms):
the same text as SymPy's own C99 printer and the same order as SymPy's
as_ordered_terms, on random sums of products (the terms of a large
kernel), and the general path kept for anything else."""

import random

import sympy as sp
from sympy.printing.c import C99CodePrinter

from symbackprop.base.cprint import ordered_terms
from symbackprop.emit.codegen import FLOAT64, ScalarPrinter

# names whose order by name differs from a naive one (x10 before x9, capitals first, underscores)
NAMES = ["x0", "x1", "x9", "x10", "x11", "_load3", "_load12", "A", "a", "B_1", "b", "t19", "g0", "zz"]


def _symbols() -> list[sp.Symbol]:
    return [sp.Symbol(n, real=True) for n in NAMES]


def _random_sum(rng: random.Random, symbols: list[sp.Symbol]) -> sp.Expr:
    terms = []
    for _ in range(rng.randint(2, 9)):
        factors = rng.sample(symbols, rng.randint(1, 4))
        term = sp.Mul(*factors)
        terms.append(-term if rng.random() < 0.5 else term)
    return sp.Add(*terms)


def test_sums_of_products_print_as_sympy_does():
    rng = random.Random(17)
    symbols = _symbols()
    ours, sympys = ScalarPrinter({}, FLOAT64), C99CodePrinter()
    for _ in range(400):
        expr = _random_sum(rng, symbols)
        assert ordered_terms(expr) == expr.as_ordered_terms(), expr
        assert ours.doprint(expr) == sympys.doprint(expr), expr
        product = sp.Mul(*rng.sample(symbols, rng.randint(2, 5)))
        for e in (product, -product, -rng.choice(symbols)):
            assert ours.doprint(e) == sympys.doprint(e), e


def test_other_terms_take_the_general_path():
    x, y, z = sp.symbols("x y z", real=True)
    cases = [2 * x * y - z, x ** 2 * y - 3 * z + 1, x * (y + z) - y * z, -x * (y - z) + x ** 3,
             sp.Rational(1, 3) * x - y / z, x * y + x ** 2 * y ** 2 - z]
    ours, sympys = ScalarPrinter({}, FLOAT64), C99CodePrinter()
    for expr in cases:
        assert ordered_terms(expr) == expr.as_ordered_terms(), expr
        if not expr.has(sp.Pow):  # (ours prints integer powers as products)
            assert ours.doprint(expr) == sympys.doprint(expr), expr


def test_symbols_print_as_their_c_text():
    x, y = sp.symbols("x y", real=True)
    printer = ScalarPrinter({x: "in[3]", y: "w[i + 1]"}, FLOAT64)
    assert printer.doprint(-x * y + x) == "-in[3]*w[i + 1] + in[3]"  # (as main printed it)
    assert printer.doprint(-y) == "-w[i + 1]"
