"""exprdag.substitute (xreplace over several expressions, each distinct
subexpression rebuilt once) against SymPy's xreplace."""

from __future__ import annotations

import random

import sympy as sp

from symbackprop.ir.exprdag import substitute

x, y, z, w = sp.symbols("x y z w", real=True)


class Pair(sp.Function):
    """A function of two arguments that counts how often it is built."""

    built = 0

    def __new__(cls, *args, **kwargs):
        Pair.built += 1
        return super().__new__(cls, *args, **kwargs)


def _pool(rng: random.Random, size: int) -> list[sp.Expr]:
    pool: list[sp.Expr] = [x, y, z, sp.Integer(2)]
    ops = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a - 3 * b, lambda a, b: a / b,
           lambda a, b: sp.exp(a) * b, lambda a, b: Pair(a, b), lambda a, b: sp.Max(a, b)]
    for _ in range(size):
        pool.append(rng.choice(ops)(rng.choice(pool), rng.choice(pool)))
    return pool


def test_agrees_with_xreplace_on_shared_expressions():
    for seed in range(30):
        pool = _pool(random.Random(seed), 12)
        exprs = pool[-4:]
        rng = random.Random(seed + 100)
        rule = {rng.choice(pool[:-4]): s for s in (w, -w, sp.Integer(5))}
        assert substitute(exprs, rule) == [e.xreplace(rule) for e in exprs]


def test_an_expression_in_the_rule_is_replaced_whole():
    inner = x * y
    assert substitute([inner + z, sp.sin(inner)], {inner: w}) == [w + z, sp.sin(w)]
    assert substitute([x + 1], {}) == [x + 1]


def test_each_distinct_subexpression_is_rebuilt_once():
    """16 levels of doubling: a tree of 2**16 paths, 16 distinct terms;
    xreplace would rebuild each term once per path to it."""
    e = x
    for _ in range(16):
        e = Pair(e, e)
    other = Pair(e, y)
    Pair.built = 0
    new_e, new_other = substitute([e, other], {x: z})
    assert Pair.built == 17
    assert new_other.args == (new_e, y) and new_e.free_symbols == {z}
