"""opcount.count_ops (a walk over distinct terms) against sp.count_ops (a
walk over the tree): the same number on every form the rules tell apart,
and on random expressions that share subexpressions."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import sympy as sp

from symbackprop.base.stable import sigmoid, softplus
from symbackprop.schedule.opcount import count_all, count_ops, exceeds, exceeds_all

x, y, z = sp.symbols("x y z", real=True)
f = sp.Function("f")

FORMS = [
    x, sp.Integer(1), sp.Integer(-3), sp.Rational(-1, 3), sp.Rational(2, 5), sp.pi, sp.E, sp.Float(2.5),
    -x, x - y, -x - y, -x + y, x + y + z, 2 * x, -2 * x, x / y, -x / y, 1 / x, 2 / x, -3 / (x * y), x / 3,
    x**2, x**-2, x**sp.Rational(1, 2), sp.sqrt(x + 1), sp.exp(x), sp.E**x, sp.exp(-x) / (1 + sp.exp(-x)),
    sp.log(1 + sp.exp(x)), sp.Max(x, y, 0), sp.Min(x, 1), sp.Abs(x - y), sp.sin(x) * sp.cos(y), f(x, y),
    sigmoid(x) * (1 - sigmoid(x)), softplus(-x), sp.tanh(x) ** 2 - 1, sp.Piecewise((x, x > 0), (-x, True)),
    sp.Derivative(f(x), x), (x - y) ** -1 * (y - z) ** -3, -(x + y) / (x - y), sp.Mul(-1, x, y, evaluate=False),
    # sums of monomials (counted without visiting their factors: opcount._monomial)
    x * y - y * z - x * y * z, -x * y - z, -x - y * z, -x * y * z - y * x, x * y * z + y, -x * y * (y + z) + x,
    sp.Mul(-1, x, evaluate=False) + y, -x * y, x * y * z,
    x * (y + z), -x * (y + z), x * y * (x + z) - z * (x - y), sp.Mul(-1, x + y, evaluate=False),
    sp.Mul(-1, x + y, evaluate=False) + z, x * (y + z) * (x + y * z) - (y - z) * (x + z), x * (y + 1) - z,
]


@pytest.mark.parametrize("expr", FORMS, ids=[str(e) for e in FORMS])
def test_each_form_counts_as_sympy(expr):
    assert count_ops(expr) == sp.count_ops(expr)


def _random_expr(rng: random.Random, size: int) -> sp.Expr:
    """An expression of `size` steps, each combining earlier ones (so terms are shared)."""
    pool: list[sp.Expr] = [x, y, z, sp.Rational(rng.randint(-5, 5), rng.randint(1, 4))]
    unary = [sp.exp, sp.log, sp.sin, sp.tanh, sp.sqrt, sigmoid, lambda a: -a, lambda a: 1 / a, lambda a: a**2,
             lambda a: a ** sp.Rational(-3, 2), lambda a: sp.E**a]
    binary = [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a / b,
              lambda a, b: -a * b / 3, lambda a, b: sp.Max(a, b), lambda a, b: a * b - 2 * a]
    for _ in range(size):
        if rng.random() < 0.4:
            new = rng.choice(unary)(rng.choice(pool))
        else:
            new = rng.choice(binary)(rng.choice(pool), rng.choice(pool))
        pool.append(new)
    return sp.Add(*pool[-3:])


@pytest.mark.parametrize("seed", range(40))
def test_random_shared_expressions_count_as_sympy(seed):
    expr = _random_expr(random.Random(seed), 14)
    assert count_ops(expr) == sp.count_ops(expr)


def test_shared_terms_counted_as_often_as_they_occur():
    """A term used twice counts twice (it is the tree's count), yet the walk
    visits it once: 40 levels of doubling, 2**40 leaves as a tree."""
    e = x
    for _ in range(40):
        e = sp.sin(e) * sp.cos(e)
    # per level: sin, cos, one MUL, each counted once per copy of the level above
    assert count_ops(e) == 3 * (2**40 - 1)


def test_products_without_a_denominator_are_not_rebuilt(monkeypatch):
    """fraction rebuilds a product from its factors (SymPy flattens and sorts
    them again); count_ops calls it only where a factor may go below the
    line, so a determinant by minors (sums of products, no division) costs
    one step per distinct term and the count is still SymPy's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package
    from benchmarks.gradbench.det import det_by_minors
    from symbackprop.schedule import opcount

    calls = []
    real = opcount.fraction
    monkeypatch.setattr(opcount, "fraction", lambda e: calls.append(e) or real(e))
    A = sp.Matrix(5, 5, lambda i, j: sp.Symbol(f"a{i}{j}", real=True))
    det = det_by_minors(lambda i, j: A[i, j], 5, lambda a, b: a + b, sp.Integer(0))
    with_division = det / (A[0, 0] * A[1, 1]) - 3 * det / 2
    assert count_ops(det) == sp.count_ops(det)
    assert calls == []
    assert count_ops(with_division) == sp.count_ops(with_division)
    assert len(calls) > 0


@pytest.mark.parametrize("seed", range(20))
def test_exceeds_agrees_with_sympys_count_at_every_threshold(seed):
    expr = _random_expr(random.Random(seed), 10)
    total = sp.count_ops(expr)
    for limit in (0, total // 2, total - 1, total, total + 1):
        assert exceeds(expr, limit) == (total > limit), limit


@pytest.mark.parametrize("seed", range(10))
def test_exceeds_all_agrees_with_the_sum_of_sympys_counts(seed):
    """Over several expressions (a relation among them: SymPy's own count)."""
    rng = random.Random(seed)
    exprs = [_random_expr(rng, 6) for _ in range(rng.randint(1, 5))] + [sp.Lt(x, y + 1)]
    total = sum(sp.count_ops(e) for e in exprs)
    for limit in (0, total // 3, total - 1, total, total + 1):
        assert exceeds_all(exprs, limit) == (total > limit), limit
    assert not exceeds_all([], 0)


def test_exceeds_stops_early_on_a_tree_too_large_to_walk():
    """2**60 leaves as a tree: a full walk would not end."""
    e = x
    for _ in range(60):
        e = sp.sin(e) * sp.cos(e)
    assert exceeds(e, 120) and not exceeds(x + y, 120)
    assert exceeds_all([x + y, e], 120)  # the second, after a small first


@pytest.mark.parametrize("seed", range(10))
def test_values_sharing_terms_count_together_as_each_alone(seed):
    """count_all shares one memo over values that share terms (a fused
    loop's members): the same sum as counting each value by sp.count_ops."""
    rng = random.Random(seed)
    base = _random_expr(rng, 10)
    values = [base, base * y + 1, sp.exp(base) - base / 2, _random_expr(rng, 6) + base]
    assert count_all(values) == sum(sp.count_ops(v) for v in values)
