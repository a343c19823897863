"""What symbackprop's own SymPy classes share: they stand as they are under
doit; and the matrix products, sums and elementwise functions that nn's
layers build, which also remember their shape and sort key."""

from __future__ import annotations

from typing import Any

import sympy as sp
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction

from symbackprop.declare import (  # noqa: F401  (installed on import)
    explicit,  # an explicit matrix's doit over its entries' DAG
    remembered,  # matrix expressions remember their shape, sort key, doit and transpose
    sums,  # a sum another term is computed from stays a node of its own (a residual chain's step)
)


class Standing:
    """A declaration of symbackprop's own (a map, a gather, a loop, a layer's
    op): doit leaves it as it stands. SymPy calls doit, deep, on the
    arguments of every matrix product and sum it builds (x * W, A + B,
    nn.sum_all), and Basic's doit rebuilds every argument below, a shared
    one once per path: declaring transformer_lm took 4 s, 80% of it in
    doit; through a loop's step, the rebuild also folded a Piecewise under
    a condition out into the outer step. Lowering reads an op's arguments
    as they were given. (First among the bases: its doit is the one.)"""

    __slots__ = ()

    def doit(self, **hints: Any) -> Any:
        return self


class Layered:
    """A matrix product or an elementwise function as nn's layers build it
    (the x*W of x*W + ones*b, tanh of that): SymPy's own class in every
    respect (lowering, printing, hash, its place among a sum's terms) but
    that doit does not go below it (it is built canonical: doit would
    rebuild it as it is). SymPy calls doit, deep, on the operands of every
    `x * W`: declaring 100 tanh layers took 17.6 s, 250 were a
    RecursionError. Its shape and sort key are remembered, as every
    matrix expression's (declare/remembered.py).

    Only nodes SymPy never merges into their parent are Layered (a
    product inside a sum, an elementwise function): a sum or product of
    SymPy's own class merges those of its class among its arguments, so
    `linear(x, W, b) + h*U` is one sum of three terms, as before."""

    __slots__ = ()
    sympy_class: Any = sp.Basic  # the SymPy class it is

    @classmethod
    def class_key(cls) -> Any:
        """SymPy's class's: a sum sorts this among its terms as SymPy's own."""
        return cls.sympy_class.class_key()

    def __hash__(self) -> int:
        """SymPy's class's hash (Basic's hash names the class): sets of
        expressions iterate as they did."""
        node: Any = self  # a Basic (the other base)
        found = node._mhash
        if found is None:
            found = node._mhash = hash((self.sympy_class.__name__,) + node._hashable_content())
        return found


class LayerProduct(Layered, Standing, sp.MatMul):
    """sp.MatMul, as a layer's x*W (see Layered)."""

    sympy_class = sp.MatMul


class LayerApply(Layered, ElementwiseApplyFunction):
    """ElementwiseApplyFunction, as a layer's activation (see Layered)."""

    sympy_class = ElementwiseApplyFunction

    def doit(self, **hints: Any) -> Any:
        """SymPy's doit, not deep: f(g(x)) of two elementwise functions as one."""
        done = ElementwiseApplyFunction.doit(self, deep=False)
        return self if done is self else layered(done)


_LAYERED = {sp.MatMul: LayerProduct, ElementwiseApplyFunction: LayerApply}


def layered(expr: Any) -> Any:
    """expr (as SymPy built it, canonical) as a Layered node of its class;
    expr itself where it is of another class."""
    cls = _LAYERED.get(type(expr))
    return expr if cls is None else cls(*expr.args)
