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

`install()` also keeps SymPy's MatMul canonicalization from inverting
explicit matrices: its `combine_powers` rule, to cancel `X * X**-1`, asks
each square factor for its inverse, and a compound factor holding an
explicit matrix (`(A * M).T`) answers by Gaussian elimination with
`simplify` on the symbolic entries (89 of the 94 s of declaring GradBench's
hand tracking with `*`). A product with such a factor is left uncombined:
the same value, which the lowering multiplies as it stands.
"""

from __future__ import annotations

from typing import Any

import sympy as sp
from sympy.core.basic import Basic
from sympy.core.operations import AssocOp
from sympy.matrices.expressions import matmul
from sympy.strategies import do_one, exhaust, typed

SYMPY_DOIT = sp.ImmutableDenseMatrix.doit  # SymPy's own (MatrixBase.doit), before install()
SYMPY_COMBINE_POWERS = matmul.combine_powers


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


# What SymPy's inverse() of a matrix expression recurses into (MatMul
# inverts each factor, Transpose its argument, ...); any other class (a sum,
# an element-wise function) answers with an unevaluated Inverse at once.
INVERTED_THROUGH = (sp.MatMul, sp.Transpose, sp.MatPow, sp.Inverse, sp.Adjoint)


def holds_explicit(expr: Any) -> bool:
    """Whether inverting a matrix expression would invert an explicit
    matrix: one reached through the classes SymPy's inverse() recurses
    into (their entries, and anything below a sum, are not walked)."""
    stack, seen = [expr], set()
    while stack:
        e = stack.pop()
        if isinstance(e, sp.MatrixBase):
            return True
        if isinstance(e, INVERTED_THROUGH) and e not in seen:
            seen.add(e)
            stack.extend(e.args)
    return False


def _combine_powers(mul: sp.MatMul) -> sp.MatMul:
    """SymPy's combine_powers, but for a product with a compound factor
    holding an explicit matrix, which it would try to invert."""
    if any(not isinstance(a, sp.MatrixBase) and holds_explicit(a) for a in mul.args):
        return mul
    return SYMPY_COMBINE_POWERS(mul)


def install() -> None:
    """Make ImmutableDenseMatrix.doit walk the entries' DAG, and MatMul's
    canonicalization not invert explicit matrices (the module's docstring)."""
    sp.ImmutableDenseMatrix.doit = _doit
    rules = tuple(_combine_powers if rule is SYMPY_COMBINE_POWERS else rule for rule in matmul.rules)
    matmul.rules = rules
    matmul.canonicalize = exhaust(typed({sp.MatMul: do_one(*rules)}))


install()
