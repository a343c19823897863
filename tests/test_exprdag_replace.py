"""exprdag.replace_shared: xreplace over expressions that share subexpressions,
each rebuilt once."""

import sympy as sp

from symbackprop.ir.exprdag import replace_shared


def test_same_as_xreplace_on_shared_bodies():
    x, y, z, w = sp.symbols("x y z w", real=True)
    A = sp.MatrixSymbol("A", 3, 3)
    shared = sp.exp(x * y) + sp.Piecewise((x / y, sp.Ne(y, 0)), (x, True))
    bodies = [shared * z, sp.sin(shared) + A[1, 2] * x, shared**2 - A[0, 0], sp.Integer(3)]
    rule = {x: w + 1, A[1, 2]: z**2, y: sp.Integer(2)}
    assert replace_shared(bodies, rule) == [b.xreplace(rule) for b in bodies]


def test_a_body_that_is_itself_replaced_and_nothing_to_replace():
    x, y = sp.symbols("x y")
    assert replace_shared([x, x + y], {x: y}) == [y, 2 * y]
    body = sp.cos(x) * y
    assert replace_shared([body], {})[0] is body  # unchanged: the same object


def test_a_chain_of_doublings_is_rebuilt_once_per_link():
    """t(k+1) = f(t(k), t(k)): 2**60 paths through 60 links, which
    xreplace would walk; the oracle is the chain built from y directly."""
    x, y = sp.symbols("x y", real=True)

    def chain(start: sp.Expr) -> sp.Expr:
        t = start
        for _ in range(60):
            t = sp.Function("f")(t, t)
        return t

    assert replace_shared([chain(x)], {x: y}) == [chain(y)]
