"""base.exprdag's product and total (a fused loop's inlined values built
without SymPy's flatten where it has nothing to combine): the same
expression, argument for argument, as SymPy's Mul and Add, on random
products and sums of symbols, matrix entries, sums, numbers and the cases that must go
through SymPy (like terms, equal factors, a number times one sum, nested
products and sums, infinities)."""

import random

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.exprdag import product, total
from symbackprop.schedule.kernel import shared_xreplace

NAMES = ["x0", "x1", "x9", "x10", "_load3", "_load12", "A", "a", "B_1", "t19"]


def _same(got: sp.Expr, want: sp.Expr) -> None:
    assert type(got) is type(want) and got == want and got.args == want.args, (got, want)


def _atoms(rng: random.Random) -> list[sp.Basic]:
    M = sp.MatrixSymbol("M", 3, 3)
    symbols = [sp.Symbol(n, real=True) for n in NAMES] + [sp.Symbol("c"), sp.Dummy("d"), M[0, 1], M[2, 0]]
    sums = [sp.Add(*rng.sample(symbols, rng.randint(2, 3))) for _ in range(4)]
    sums += [s + 1 for s in sums[:2]]
    numbers = [sp.Integer(-1), sp.Integer(2), sp.Rational(1, 3), sp.Float(0.5), sp.Integer(0), sp.S.One,
               sp.oo, sp.nan]
    other = [sp.exp(symbols[0]), symbols[1] ** 2, sp.sin(symbols[2]), -symbols[3], 2 * symbols[4] * symbols[5]]
    return symbols + sums + numbers + other


def test_products_as_sympy_builds_them():
    rng = random.Random(5)
    atoms = _atoms(rng)
    plain = [a for a in atoms if isinstance(a, (sp.Symbol, sp.Add, MatrixElement))]
    for _ in range(800):
        pool = plain if rng.random() < 0.5 else atoms
        factors = [rng.choice(pool) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.4:
            factors.insert(rng.randint(0, len(factors)), rng.choice([sp.Integer(-1), sp.Integer(3), sp.Float(2.5)]))
        _same(product(factors), sp.Mul(*factors))
    x, s = sp.Symbol("x"), sp.Symbol("y") + 1
    for factors in ([sp.S.One, x], [sp.Integer(-1), x], [x, sp.Float(1.0)], [sp.Integer(2), s], [sp.S.One, x, s],
                    [sp.Integer(0), x], [x], [sp.Integer(-1), sp.Integer(2), x]):
        _same(product(factors), sp.Mul(*factors))


def test_products_of_products_as_sympy_builds_them():
    """A product among the factors (merged as flatten merges it): a sum
    times a negated entry (a determinant's adjoint), x times -y, and the
    cases flatten combines (two numbers, a factor in both, powers)."""
    rng = random.Random(7)
    atoms = _atoms(rng)
    plain = [a for a in atoms if isinstance(a, (sp.Symbol, sp.Add, MatrixElement))]
    numbers = [sp.Integer(-1), sp.Integer(3), sp.Float(2.5), sp.Rational(1, 3)]
    for _ in range(800):
        factors = [rng.choice(plain) for _ in range(rng.randint(0, 3))]
        for _ in range(rng.randint(1, 2)):
            inner = [rng.choice(plain) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.5:
                inner.insert(0, rng.choice(numbers))
            factors.insert(rng.randint(0, len(factors)), sp.Mul(*inner))
        if rng.random() < 0.3:
            factors.insert(rng.randint(0, len(factors)), rng.choice(numbers))
        _same(product(factors), sp.Mul(*factors))


def test_sums_as_sympy_builds_them():
    rng = random.Random(6)
    atoms = _atoms(rng)
    plain = [a for a in atoms if isinstance(a, (sp.Symbol, MatrixElement))]
    for _ in range(800):
        terms = []
        for _ in range(rng.randint(1, 6)):
            pool = plain if rng.random() < 0.7 else atoms
            term = sp.Mul(*[rng.choice(pool) for _ in range(rng.randint(1, 3))])
            if rng.random() < 0.4:
                term = rng.choice([-1, 2, sp.Rational(1, 2), sp.oo]) * term
            terms.append(term)
        _same(total(terms), sp.Add(*terms))


def test_shared_xreplace_as_xreplace():
    """The renaming that uses them gives xreplace's expression (the member
    values of a fused loop: loads and sums put into products and sums)."""
    x, y, z, w = sp.symbols("x y z w", real=True)
    p0, p1, p2, p3 = sp.symbols("p0:4")
    body = p0 * p1 - p2 * p3 + 2 * p0 * p3
    for rule in ({p0: x, p1: y + z, p2: w, p3: x - y},
                 {p0: x, p1: x, p2: y, p3: y},  # powers and cancellation: SymPy's path
                 {p0: sp.Integer(0), p1: y, p2: z, p3: w},
                 {p0: x + y, p1: z, p2: x + y, p3: z}):
        _same(shared_xreplace(body, rule, {}), body.xreplace(rule))
