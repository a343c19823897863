"""Sizes in the generated C, checked: every element count a call relies on
(its arrays' rows x columns, its workspace) is a polynomial in the
dimensions, which a caller may pass as large as INT64_MAX. Printed as plain
C arithmetic it would wrap around, and a program that sizes its buffers
from F_work_len or F_shape_out would get a small buffer for a large call.

`checked` prints one size in the saturating arithmetic of the runtime
header (symbackprop_size_add, _sub, _mul, _div: a result above
SYMBACKPROP_SIZE_MAX, which is base.abi.SIZE_LIMIT, stays above it). A
function's `size_check` is the sum of all its sizes printed so: where it
is above the limit the function returns base.abi.SIZE_DOES_NOT_FIT (and its
work_len 0, its shape functions that status) before it computes anything,
and every size the plain C then computes is below the limit (the sizes'
terms are products of dimensions with positive coefficients; the limit,
2^59, leaves a factor 16 below INT64_MAX for the few subtracted ones).
A function of fixed sizes is checked here, at generation (`fixed_size`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import sympy as sp

from symbackprop.base.abi import SIZE_LIMIT
from symbackprop.errors import ModelError

LIMIT_MACRO = "SYMBACKPROP_SIZE_MAX"


def total(sizes: Iterable[object]) -> sp.Expr:
    """The sum of sizes (SymPy expressions or ints), expanded."""
    return sp.expand(sum((sp.sympify(s) for s in sizes), sp.Integer(0)))


def checked(expr: object, name: Callable[[sp.Expr], str]) -> str:
    """A size as saturating C: `name` prints a dimension (a Symbol) or a
    function of them it does not take apart (ceildiv, blocks)."""
    return _checked(sp.sympify(expr), name)


def _checked(expr: sp.Expr, name: Callable[[sp.Expr], str]) -> str:
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Add:
        plus = [t for t in expr.args if not t.could_extract_minus_sign()]
        minus = [-t for t in expr.args if t.could_extract_minus_sign()]
        text = _fold("symbackprop_size_add", [_checked(t, name) for t in plus] or ["0"])
        if minus:
            text = f"symbackprop_size_sub({text}, {_fold('symbackprop_size_add', [_checked(t, name) for t in minus])})"
        return text
    if expr.is_Mul:
        return _fold("symbackprop_size_mul", [_checked(f, name) for f in expr.args])
    if expr.is_Pow and expr.exp.is_Integer and expr.exp > 0:
        return _fold("symbackprop_size_mul", [_checked(expr.base, name)] * int(expr.exp))
    if isinstance(expr, (sp.Min, sp.Max)):
        which = "symbackprop_size_min" if isinstance(expr, sp.Min) else "symbackprop_size_max"
        return _fold(which, [_checked(a, name) for a in expr.args])
    if type(expr).__name__ in ("ceildiv", "blocks"):  # loops.declare: n/k, rounded up or exact
        n, k = (_checked(a, name) for a in expr.args)
        if type(expr).__name__ == "ceildiv":
            return f"symbackprop_size_ceildiv({n}, {k})"
        return f"symbackprop_size_div({n}, {k})"
    if expr.is_Symbol:
        return name(expr)
    raise ModelError(f"a size, {expr}, is not a sum of products of dimensions")


def _fold(function: str, terms: list[str]) -> str:
    text = terms[0]
    for term in terms[1:]:
        text = f"{function}({text}, {term})"
    return text


def fixed_size(expr: object, what: str) -> None:
    """A size with no dimension in it must fit at generation.

    Raises:
        ModelError: it is above base.abi.SIZE_LIMIT (names what and both numbers).
    """
    value = sp.sympify(expr)
    if value.is_Integer and int(value) > SIZE_LIMIT:
        raise ModelError(f"{what} needs {int(value)} entries of arrays and workspace, over the limit of "
                         f"{SIZE_LIMIT} (2^59) a generated function holds")


@dataclass(frozen=True)
class SizeFunction:
    """One function's sizes summed, as a C function of its dimensions:
    every place that checks them (the function, its work_len, its shape
    functions, the functions that wrap it, train_epoch) calls it, so a
    model edit that changes a size changes this one line."""

    name: str
    params: str  # "int64_t n, int64_t m"
    body: str  # checked C (see `checked`)


F = TypeVar("F", bound=Any)  # a codegen.CFunction: its name, dims and size_check


def shared_size_checks(functions: Sequence[F], name: Callable[[str], str]) -> tuple[list[F], tuple[SizeFunction, ...]]:
    """The functions with each size check replaced by a call of a
    SizeFunction, one for each distinct check, named after the first
    function that has it; `name` makes a C name unique in the module."""
    made: dict[str, SizeFunction] = {}
    calling: list[F] = []
    for fn in functions:
        if not fn.size_check:
            calling.append(fn)
            continue
        dims = [d for d in fn.dims if re.search(rf"\b{re.escape(d)}\b", fn.size_check)]
        if fn.size_check not in made:
            made[fn.size_check] = SizeFunction(name(f"{fn.name}_size"), ", ".join(f"int64_t {d}" for d in dims),
                                               fn.size_check)
        calling.append(replace(fn, size_check=f"{made[fn.size_check].name}({', '.join(dims)})"))
    return calling, tuple(made.values())


__all__ = ["LIMIT_MACRO", "SizeFunction", "checked", "fixed_size", "shared_size_checks", "total"]
