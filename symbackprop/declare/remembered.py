"""Matrix expressions that remember their shape and sort key, each found
without recursion.

SymPy computes a composite matrix expression's shape from its arguments'
every time it is asked (a sum's is its first term's, a Hadamard product's
its first factor's, an elementwise function's its argument's), and its sort
key (by which a sum orders its terms) from its arguments' sort keys, kept
only in a cache of the last 1,000 calls. The state of an unrolled recurrent
network (a GRU's h' = (1 - z) * m + z * h) or of a residual chain is such a
node over the previous step's, so one look at the last step's shape (as
every operator and loss applied to it takes) or sort key (as every sum it
enters takes) walked down every step, one Python frame a level: a 300-step
GRU was a RecursionError in nn.mse, and each step cost a walk down all the
steps before it.

Here a node computes each once and keeps it. The first look at a node
whose value is not known yet finds, by an iterative walk, the nodes below
it whose values are not known either and computes them bottom-up, each by
SymPy's own rule over arguments already known (and hashes each on the way:
SymPy hashes a node on first use, recursing into arguments not yet
hashed): constant depth, each node once. The values are SymPy's own (both
are functions of the arguments), so nothing else changes. `install()`
applies this to every matrix expression's sort key and to the shape of
SymPy's composite classes; symbackprop's own ops whose shape is read from
an argument's are decorated with `remember_shape`.

A Lambda's sort key (an elementwise function's, by which a sum orders
terms that differ in their activations) is taken with its bound variables
renamed in order. SymPy's holds the variables' Dummy indices, which count
every Dummy the process has made: a term's place in a sum, and so the
generated C's names and order, followed which activation the process had
made first (symbackprop.nn keeps one Lambda an activation), maybe for an
earlier model, and not the model alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import sympy as sp
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction
from sympy.matrices.expressions.blockmatrix import BlockDiagMatrix
from sympy.matrices.expressions.diagonal import DiagonalMatrix, DiagonalOf
from sympy.matrices.expressions.kronecker import KroneckerProduct
from sympy.matrices.expressions.permutation import MatrixPermute

SHAPE, SORT_KEY, DOIT = "_sbp_shape", "_sbp_sort_key", "_sbp_doit"  # where a node keeps them (its __dict__)
REMEMBERED = {"doit": DOIT, "_eval_transpose": "_sbp_transpose"}  # methods remembered, and where

# SymPy's classes whose shape is read from their arguments' shapes
SYMPY_COMPOSITES = (sp.MatAdd, sp.MatMul, sp.HadamardProduct, sp.HadamardPower, ElementwiseApplyFunction,
                    sp.Transpose, sp.Adjoint, sp.MatPow, sp.Inverse, KroneckerProduct, MatrixPermute,
                    DiagonalMatrix, DiagonalOf, BlockDiagMatrix)
# a matrix expression's (MatrixExpr is an Expr), before install(); without its cache, which compares
# a new node with equal ones it holds, as deep as they are equal
SYMPY_SORT_KEY = getattr(sp.Expr.sort_key, "__wrapped__", sp.Expr.sort_key)
SYMPY_LAMBDA_SORT_KEY = getattr(sp.Lambda.sort_key, "rule", sp.Lambda.sort_key)

# a class's own sort key over its arguments', where not SymPy's (declare/sums.py's sums of sums)
SORT_KEY_RULES: dict[type, Callable[[Any], Any]] = {}

C = TypeVar("C", bound=type)


def settle(node: Any, pending: Callable[[Any], bool], compute: Callable[[Any], None]) -> None:
    """compute(n) for node and each matrix expression below it that is
    `pending`, arguments first, each once; iterative."""
    stack = [node]
    while stack:
        top = stack[-1]
        if not pending(top):
            stack.pop()
            continue
        below = [arg for arg in top.args if isinstance(arg, sp.MatrixExpr) and pending(arg)]
        if below:
            stack.extend(below)
            continue
        hash(top)  # its arguments are hashed: constant depth
        compute(top)
        stack.pop()


def _shape_rule(node: Any) -> Callable[[Any], Any] | None:
    """The class's own shape rule, where node's class remembers its shape."""
    found = getattr(type(node), "shape", None)
    return getattr(getattr(found, "fget", None), "rule", None)


def _shape_pending(node: Any) -> bool:
    return _shape_rule(node) is not None and SHAPE not in node.__dict__


def _keep_shape(node: Any) -> None:
    node.__dict__[SHAPE] = _shape_rule(node)(node)  # type: ignore[misc]


def remembered_shape(node: Any) -> Any:
    """node's shape, kept on it (computed with every pending one below it)."""
    if SHAPE not in node.__dict__:
        settle(node, _shape_pending, _keep_shape)
    return node.__dict__[SHAPE]


def remember_shape(cls: C) -> C:
    """cls, with its own `shape` property remembered (see the module's docstring)."""
    rule = cls.__dict__["shape"].fget

    def shape(self: Any) -> Any:
        return remembered_shape(self)

    shape.rule = rule  # type: ignore[attr-defined]
    shape.__doc__ = rule.__doc__
    cls.shape = property(shape)  # type: ignore[attr-defined]
    return cls


def _sort_key_pending(node: Any) -> bool:
    return SORT_KEY not in node.__dict__


def _keep_sort_key(node: Any) -> None:
    node.__dict__[SORT_KEY] = SORT_KEY_RULES.get(type(node), SYMPY_SORT_KEY)(node)


def remembered_sort_key(self: Any, order: Any = None) -> Any:
    """SymPy's sort key of a matrix expression; the default order's kept on it."""
    if order is not None:
        return SYMPY_SORT_KEY(self, order)
    if SORT_KEY not in self.__dict__:
        settle(self, _sort_key_pending, _keep_sort_key)
    return self.__dict__[SORT_KEY]


def lambda_sort_key(self: sp.Lambda, order: Any = None) -> Any:
    """SymPy's sort key of the Lambda with its variables renamed _0, _1, ...
    (SymPy's canonical names, which no free symbol of it has; with their
    assumptions): the same for the same function, whichever Dummies it was
    written with. The default order's is kept on it."""
    if order is None and SORT_KEY in self.__dict__:
        return self.__dict__[SORT_KEY]
    renamed = {v: sp.Symbol(c.name, **v.assumptions0) for v, c in self.canonical_variables.items()}
    key = SYMPY_LAMBDA_SORT_KEY(self.xreplace(renamed), order)
    if order is None:
        self.__dict__[SORT_KEY] = key
    return key


lambda_sort_key.rule = SYMPY_LAMBDA_SORT_KEY  # type: ignore[attr-defined]


def _method_rule(node: Any, name: str) -> Callable[..., Any] | None:
    """SymPy's method `name` of node's class, where the class remembers it."""
    return getattr(getattr(type(node), name, None), "rule", None)


def _method_pending(name: str, node: Any) -> bool:
    return _method_rule(node, name) is not None and REMEMBERED[name] not in node.__dict__


def _keep_method(name: str, node: Any) -> None:
    found = node.__dict__[REMEMBERED[name]] = _method_rule(node, name)(node)  # type: ignore[misc]
    if name == "doit" and found is not node and hasattr(found, "__dict__"):
        found.__dict__.setdefault(DOIT, found)  # SymPy's doit is idempotent: done, it stands


def remember_method(cls: type, name: str) -> None:
    """cls's method `name` (its own or inherited), the result of its plain
    call (doit: deep, without other hints) remembered on each node."""
    rule = getattr(getattr(cls, name), "rule", getattr(cls, name))
    pending, keep = partial(_method_pending, name), partial(_keep_method, name)

    def method(self: Any, **hints: Any) -> Any:
        if hints and hints != {"deep": True}:
            return rule(self, **hints)
        if REMEMBERED[name] not in self.__dict__:
            settle(self, pending, keep)
        return self.__dict__[REMEMBERED[name]]

    method.rule = rule  # type: ignore[attr-defined]
    method.__doc__ = rule.__doc__
    setattr(cls, name, method)


def install() -> None:
    """Matrix expressions remember their sort keys, and SymPy's composites
    their shapes, deep doits and transposes; a Lambda's sort key does not
    depend on its variables' Dummy indices (idempotent)."""
    for cls in SYMPY_COMPOSITES:
        if getattr(cls.__dict__["shape"].fget, "rule", None) is None:
            remember_shape(cls)
        for name in REMEMBERED:
            if hasattr(cls, name) and getattr(cls.__dict__.get(name), "rule", None) is None:
                remember_method(cls, name)
    sp.MatrixExpr.sort_key = remembered_sort_key
    sp.Lambda.sort_key = lambda_sort_key


install()
