"""exprdag.substitute (xreplace over several expressions, each distinct
subexpression rebuilt once) against SymPy's xreplace."""

from __future__ import annotations

import random

import sympy as sp

from symbackprop.base.exprdag import substitute

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


def test_same_as_xreplace_on_shared_bodies():
    x, y, z, w = sp.symbols("x y z w", real=True)
    A = sp.MatrixSymbol("A", 3, 3)
    shared = sp.exp(x * y) + sp.Piecewise((x / y, sp.Ne(y, 0)), (x, True))
    bodies = [shared * z, sp.sin(shared) + A[1, 2] * x, shared**2 - A[0, 0], sp.Integer(3)]
    rule = {x: w + 1, A[1, 2]: z**2, y: sp.Integer(2)}
    assert substitute(bodies, rule) == [b.xreplace(rule) for b in bodies]


def test_a_body_that_is_itself_replaced_and_nothing_to_replace():
    x, y = sp.symbols("x y")
    assert substitute([x, x + y], {x: y}) == [y, 2 * y]
    body = sp.cos(x) * y
    assert substitute([body], {})[0] is body  # unchanged: the same object


def test_a_chain_of_doublings_is_rebuilt_once_per_link():
    """t(k+1) = f(t(k), t(k)): 2**60 paths through 60 links, which
    xreplace would walk; the oracle is the chain built from y directly."""
    x, y = sp.symbols("x y", real=True)

    def chain(start: sp.Expr) -> sp.Expr:
        t = start
        for _ in range(60):
            t = sp.Function("f")(t, t)
        return t

    assert substitute([chain(x)], {x: y}) == [chain(y)]
