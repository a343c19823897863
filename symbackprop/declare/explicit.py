"""SymPy's doit of an explicit matrix, each distinct entry subexpression once.

`X * M`, of a MatrixSymbol X and an explicit `sp.Matrix` M, is SymPy's
`MatMul(X, M).doit()`, which calls `M.doit()`, and that rebuilds every
entry as a tree: a subexpression shared by several entries, or several
times inside one, is rebuilt once per path to it. The entries of a product
of explicit matrices share each other's entries (a chain of k 4x4 bone
transforms, as GradBench's hand tracking builds, reaches each entry of the
first through 4^k paths), so `X * M`, `-(X * M)` and every later operator
on an expression holding M took time exponential in the chain's length
(minutes at 15 bones) where the distinct subexpressions are a few hundred.

`install()` makes SymPy's `ImmutableDenseMatrix.doit` (the class a
matrix expression holds an explicit matrix as) do the same work over the
entries' DAG: a subexpression whose class keeps SymPy's generic doit
(`Basic.doit`: rebuild from the arguments' doit; `AssocOp.doit`: the same,
evaluated: Add, Mul, Max, ...) is rebuilt once from its arguments' results,
any other (Piecewise, Derivative, Integral, an atom, ...) by its own doit.
The result is SymPy's, entry for entry: doit is a function of the
expression, so the same subexpression gives the same result wherever it
stands. The walk is iterative (no recursion limit on deep entries).
"""

from __future__ import annotations

from typing import Any

import sympy as sp
from sympy.core.basic import Basic
from sympy.core.operations import AssocOp

SYMPY_DOIT = sp.ImmutableDenseMatrix.doit  # SymPy's own (MatrixBase.doit), before install()


def dag_doit(exprs: list[Any], hints: dict[str, Any]) -> dict[Any, Any]:
    """expr -> expr.doit(**hints) for each of `exprs` and every
    subexpression it shares, each distinct one computed once."""
    done: dict[Any, Any] = {}
    stack: list[tuple[Any, bool]] = [(e, False) for e in exprs]
    while stack:
        expr, ready = stack.pop()
        if expr in done:
            continue
        if not isinstance(expr, Basic) or not expr.args:
            done[expr] = expr.doit(**hints) if isinstance(expr, Basic) else expr
            continue
        generic = type(expr).doit
        if generic is not Basic.doit and generic is not AssocOp.doit:
            done[expr] = expr.doit(**hints)  # its own rule, as SymPy runs it
            continue
        if not ready:
            stack.append((expr, True))
            stack.extend((a, False) for a in expr.args if a not in done)
            continue
        args = [done[a] if isinstance(a, Basic) else a for a in expr.args]
        done[expr] = expr.func(*args, evaluate=True) if generic is AssocOp.doit else expr.func(*args)
    return done


def _doit(self: sp.ImmutableDenseMatrix, **hints: Any) -> sp.ImmutableDenseMatrix:
    """SymPy's MatrixBase.doit (each entry's doit), over the entries' DAG."""
    if not hints.get("deep", True):
        return SYMPY_DOIT(self, **hints)
    done = dag_doit(list(self), hints)
    return self.applyfunc(lambda entry: done[entry])


def install() -> None:
    """Make ImmutableDenseMatrix.doit walk the entries' DAG (see the module's docstring)."""
    sp.ImmutableDenseMatrix.doit = _doit


install()
