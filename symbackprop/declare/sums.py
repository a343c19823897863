"""A sum that another term of a new sum is computed from stays a node of
its own in that sum: a residual chain's step `h + f(h)` is a sum of two
terms, the sum before and the new one, not one sum of every earlier term.

SymPy's MatAdd canonicalization flattens a sum among a sum's terms into
them, then groups like terms and sorts over all of them: each step of a
residual chain re-sorted every earlier term, and the sort key of its sum
listed them all, so a chain declared in time quadratic in its length
(3 s of CPU at 300 steps). Here a sum among the terms is kept whole where
another term contains it (it is a matrix argument down from that term)
and none of its terms is like another term: then no like terms are lost
(a term that contains the whole sum, strictly larger than any of its
terms, is like none of them), and the sum is SymPy's but for its
nesting. Otherwise it is flattened a level and its own sums looked at in
turn, so like terms combine as in SymPy: `(A + B) + A` is `2*A + B`,
`(h + f(h)) - h` is `f(h)`, `h - h` is 0. Only a kept sum's first
`LIKE_TERMS_LOOKED` terms are compared (else each step of
`h = h + f(h) + g(x)` would look at every earlier term again): `h + x`
of a 100-step chain from x is a sum of h and x, not of 2*x and the rest.

Whether a term contains the sum is found by a walk down the term's matrix
arguments that does not go below a node no taller than the sum (one that
cannot contain it). A term that holds the sum only through a scalar
(trace(h) * A) is not looked into: the sum is flattened there as SymPy
does. Three of SymPy's ways that went down every step of such sums are
changed with it: a kept sum's sort key counts the terms of the sums it
keeps, as a flat sum's counts its own (Python compares two keys down
their first shared terms: two steps' keys differ at once, as they did
flat); the rules' results are compared by hash first (SymPy's == goes
down first terms too); `2*h` and `-h` distribute over the flat terms, as
they did. Lowering takes a sum's kept sums first, where regrouping a
flat sum put the earlier sum (ops/elementwise.py): the same nodes and C.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import islice
from typing import Any

import sympy as sp
from sympy.matrices.expressions import matadd, matmul
from sympy.strategies.rl import flatten as sympy_flatten

from symbackprop.declare.remembered import SORT_KEY_RULES, SYMPY_SORT_KEY, settle

HEIGHT = "_sbp_height"  # where a node keeps its height (its __dict__)
FLAT_COUNT = "_sbp_flat_count"  # where a sum keeps its number of terms as SymPy flattens it
LIKE = "_sbp_like"  # where a term keeps its like key (see _like_key)
LIKE_TERMS_LOOKED = 64  # a kept sum's terms compared with the other terms' (see the module's docstring)


def _matrix_args(node: Any) -> list[Any]:
    return [arg for arg in node.args if isinstance(arg, sp.MatrixExpr)]


def _height_pending(node: Any) -> bool:
    return HEIGHT not in node.__dict__


def _keep_height(node: Any) -> None:
    node.__dict__[HEIGHT] = 1 + max((arg.__dict__[HEIGHT] for arg in _matrix_args(node)), default=-1)


def height(node: sp.MatrixExpr) -> int:
    """The longest path of matrix arguments down from node (0 at a
    leaf), kept on it; iterative (see remembered.settle)."""
    if HEIGHT not in node.__dict__:
        settle(node, _height_pending, _keep_height)
    return node.__dict__[HEIGHT]


def contains(term: sp.MatrixExpr, whole: sp.MatrixExpr) -> bool:
    """Whether whole is a matrix argument down from term (term itself
    excluded), walking only nodes taller than whole."""
    floor = height(whole)
    if height(term) <= floor:
        return False
    stack, seen = [term], {id(term)}
    while stack:
        for arg in _matrix_args(stack.pop()):
            if arg is whole or (hash(arg) == hash(whole) and arg == whole):
                return True
            if id(arg) not in seen and height(arg) > floor:
                seen.add(id(arg))
                stack.append(arg)
    return False


def _like_key(term: Any) -> Any:
    """What SymPy groups a sum's terms by: its matrix less its scalar
    factor (kept on it); every explicit matrix alike (SymPy adds them up)."""
    if isinstance(term, sp.MatrixBase):
        return sp.MatrixBase
    found = term.__dict__.get(LIKE)
    if found is None:
        found = term.__dict__[LIKE] = matadd.matrix_of(term)
    return found


def _terms(whole: sp.MatAdd) -> Iterator[Any]:
    """The terms of whole as SymPy flattens it: down its sums."""
    stack = [whole]
    while stack:
        for arg in reversed(stack.pop().args):
            if arg.__class__ is whole.__class__:
                stack.append(arg)
            else:
                yield arg


def _keys(arg: Any, cls: type) -> list[Any]:
    """The like keys of a term, or of a sum's first LIKE_TERMS_LOOKED terms."""
    terms = islice(_terms(arg), LIKE_TERMS_LOOKED) if arg.__class__ is cls else (arg,)
    return [_like_key(t) for t in terms]


def flatten_unless_inside(expr: sp.MatAdd) -> sp.MatAdd:
    """SymPy's flatten of a sum's sums among its terms, each (and each sum
    in it, in turn) kept whole where another term contains it and none of
    its terms is like another's (see the module's docstring)."""
    cls = expr.__class__
    if not any(arg.__class__ is cls for arg in expr.args):
        return expr
    keys = Counter(key for arg in expr.args for key in _keys(arg, cls))
    done: list[Any] = []
    todo = list(reversed(expr.args))  # last first: the terms stay in their order
    while todo:
        arg = todo.pop()
        if arg.__class__ is not cls:
            done.append(arg)
            continue
        own = _keys(arg, cls)
        keys.subtract(own)
        if not any(keys[key] > 0 for key in own) and any(contains(other, arg) for other in done + todo):
            keys.update(own)
            done.append(arg)
        else:  # SymPy's flatten, a level: its sums are looked at in turn
            keys.update(key for sub in arg.args for key in _keys(sub, cls))
            todo.extend(reversed(arg.args))
    return sp.Basic.__new__(cls, *done)


def flat_count(node: Any) -> int:
    """How many terms a sum has flattened as SymPy would (1 for a term)."""
    if not isinstance(node, sp.MatAdd):
        return 1
    return node.__dict__.get(FLAT_COUNT, len(node.args))


def sum_sort_key(node: sp.MatAdd) -> Any:
    """SymPy's sort key of a sum, but that a sum keeping sums counts
    their terms, as its flat sum's key counts its own (it comes first in
    a comparison): two steps of a residual chain then compare as they did
    flat, at once, not down every step (Python's comparison of two keys
    recurses down the first terms they share)."""
    key = SYMPY_SORT_KEY(node)
    count = sum(flat_count(arg) for arg in node.args)
    if count == len(node.args):
        return key
    node.__dict__[FLAT_COUNT] = count
    class_key, (_, args), exponent, coefficient = key
    return class_key, (count, args), exponent, coefficient


def _differs(new: Any, old: Any) -> bool:
    """new != old, compared by hash first: SymPy's == of two sums goes
    down their first terms, a frame a level (down a residual chain's
    sums when a rule's result keeps one of old's terms' sum)."""
    return new is not old and (hash(new) != hash(old) or new != old)


def canonical_sum(expr: Any) -> Any:
    """SymPy's MatAdd canonicalization (exhaust(condition(is a MatAdd,
    do_one(*rules)))), with flatten_unless_inside for its flatten and
    _differs for its comparisons."""
    while isinstance(expr, sp.MatAdd):
        for rule in SUM_RULES:
            new = rule(expr)
            if _differs(new, expr):
                break
        else:
            return expr
        expr = new
    return expr


def distribute_monom(mul: sp.MatMul) -> Any:
    """SymPy's 2*(A + B) -> 2*A + 2*B, over a sum's terms as SymPy
    flattens it (sorted, as its flat sum's), not recursing down its kept
    sums: as SymPy distributes over a flat sum, so -h is as it was."""
    args = mul.args
    if len(args) != 2 or not any(arg.is_MatAdd for arg in args) or not any(arg.is_Rational for arg in args):
        return mul
    total = args[0] if args[0].is_MatAdd else args[1]
    nested = any(arg.__class__ is total.__class__ for arg in total.args)
    terms = sorted(_terms(total), key=sp.default_sort_key) if nested else total.args
    return sp.MatAdd(*[sp.MatMul(*(term if arg is total else arg for arg in args)).doit() for term in terms])


SUM_RULES = tuple(flatten_unless_inside if rule is sympy_flatten else rule for rule in matadd.rules)


def install() -> None:
    """SymPy's MatAdd canonicalization (its doit, and evaluate=True) as
    canonical_sum, and its MatMul's distribute_monom as ours (idempotent)."""
    if matadd.canonicalize is canonical_sum:
        return
    SORT_KEY_RULES[sp.MatAdd] = sum_sort_key
    if matadd.rules == SUM_RULES:
        raise RuntimeError("SymPy's MatAdd rules have no flatten to replace")  # a SymPy of another layout
    if matmul.distribute_monom not in matmul.rules:
        raise RuntimeError("SymPy's MatMul rules have no distribute_monom to replace")
    matadd.canonicalize = canonical_sum
    matmul.rules = tuple(distribute_monom if rule is matmul.distribute_monom else rule for rule in matmul.rules)
    matmul.canonicalize = matmul.exhaust(matmul.typed({sp.MatMul: matmul.do_one(*matmul.rules)}))


install()
