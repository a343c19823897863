"""base.scalar: the derivatives of one expression by all its symbols in one
sweep (reverse mode) and its differential (forward mode) equal sp.diff's,
checked on random expressions at random points, with and without naming
the shared adjoints and tangents as local values."""

import random

import pytest
import sympy as sp

from symbackprop.base.scalar import backward, forward
from symbackprop.base.stable import sigmoid, softplus
from symbackprop.declare.select import where

XS = sp.symbols("x0:4", real=True)


def random_expr(depth: int, rng: random.Random) -> sp.Expr:
    if depth == 0:
        return rng.choice([*XS, sp.Integer(rng.randint(1, 3)), sp.Rational(1, 2)])
    a, b = random_expr(depth - 1, rng), random_expr(depth - 1, rng)
    return rng.choice(
        [
            a + b,
            a * b,
            a - 3 * b,
            2 * (a + b),
            a**2,
            a**3,
            1 / (2 + a**2),
            sp.sqrt(1 + a**2),
            (1 + a**2) ** sp.tanh(b),
            sp.exp(a),
            sp.tanh(a),
            sp.sin(a),
            sigmoid(a),
            softplus(a),
            sp.log(1 + a**2),
            sp.Max(a, b),
            sp.Abs(a),
            sp.Piecewise((a, b > 0), (a**2, True)),
        ]
    )


class Program:
    """Local values as `let` makes them, and their inlining."""

    def __init__(self, prefix: str):
        self.prefix, self.lets = prefix, []

    def let(self, value: sp.Expr) -> sp.Symbol:
        symbol = sp.Symbol(f"{self.prefix}{len(self.lets)}")
        self.lets.append((symbol, value))
        return symbol

    def inline(self, expr: sp.Expr) -> sp.Expr:
        for symbol, value in reversed(self.lets):
            expr = expr.xreplace({symbol: value})
        return expr


def close(want: sp.Expr, have: sp.Expr, point: dict) -> bool:
    a, b = complex(want.subs(point).evalf()), complex(have.subs(point).evalf())
    return abs(a - b) <= 1e-9 * (1 + abs(a)) or not abs(a) < 1e100  # overflowed: nothing to compare


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("named", [False, True])
def test_sweeps_equal_sympy_diff(seed, named):
    rng = random.Random(seed)
    g = sp.Symbol("g")
    tangents = {x: sp.Symbol(f"d{x}") for x in XS}
    for _ in range(25):
        expr = random_expr(rng.randint(1, 4), rng)
        adjoints, tangent_lets = Program("_t"), Program("_f")
        found = backward(expr, g, XS.__contains__, *([adjoints.let] if named else []))
        differential = forward(expr, tangents, *([tangent_lets.let] if named else []))
        point = {x: rng.uniform(-2, 2) for x in XS} | {g: 1.3} | {t: rng.uniform(-1, 1) for t in tangents.values()}
        for x in XS:
            assert close(g * sp.diff(expr, x), adjoints.inline(found.get(x, sp.Integer(0))), point), (expr, x)
        want = sum(sp.diff(expr, x) * tangents[x] for x in XS)
        assert close(want, tangent_lets.inline(differential), point), expr


def test_wide_sum_shares_its_adjoint():
    """llsq's body (s - sum k_j t^j)^2: every coefficient's derivative is
    the one shared adjoint of the sum times t^j."""
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols("k0:40", real=True)
    expr = (s - sum(kj * t**j for j, kj in enumerate(k))) ** 2
    program = Program("_t")
    found = backward(expr, sp.Integer(1), lambda v: v in k or v == t, program.let)
    # the sum, and the sum's adjoint 2*(sum) as a multiple of it (kept whole)
    assert [value for _, value in program.lets][1:] == [2 * program.lets[0][0]]
    shared = program.lets[1][0]
    for j, kj in enumerate(k):
        assert found[kj] == -shared * t**j  # the terms are -k_j t^j
        assert sp.expand(program.inline(found[kj]) - sp.diff(expr, kj)) == 0
    assert sp.expand(program.inline(found[t]) - sp.diff(expr, t)) == 0


def test_coefficient_stays_outside_a_sum():
    """d (a + b)^2 / da is 2*(a + b), not 2*a + 2*b: it shares a + b with
    the expression under CSE."""
    a, b = sp.symbols("a b", real=True)
    found = backward((a + b) ** 2, sp.Integer(1), {a, b}.__contains__)
    assert found[a].args and (a + b) in found[a].args


def test_piecewise_derivative_is_sympys_select_of_branch_derivatives():
    """A Piecewise (built as `where` builds it, not refolded) differentiated
    in both sweeps: SymPy's derivative at points in each branch; a symbol
    only in a condition gets no derivative; equal branch derivatives give one."""
    a, b, g = XS[0], XS[1], sp.Symbol("g")
    pw = where(a > b, a**2 * b, where(a < -1, sp.sin(a), b * sp.exp(a)))
    expr = pw * a + 1
    found = backward(expr, g, XS.__contains__)
    differential = forward(expr, {a: sp.Integer(1)})
    for point in ({a: 1.5, b: 0.3, g: 1.0}, {a: -1.5, b: 0.3, g: 1.0}, {a: 0.1, b: 0.3, g: 1.0}):
        assert close(sp.diff(expr, a), found[a], point)
        assert close(sp.diff(expr, b), found[b], point)
        assert close(sp.diff(expr, a), differential, point)
    same = where(a > b, a + 1, a - 2)
    assert backward(same, g, XS.__contains__) == {a: g}
