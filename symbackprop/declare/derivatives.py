"""Derivatives as model-building operations: ``grad`` and ``jvp`` inside a
model, their results used in the loss and differentiated again.

Each is an unevaluated SymPy node. Lowering (symbackprop.diff.nested)
lowers the differentiated expression with the model's other expressions
and replaces the node by the IR that reverse mode (``grad``) or forward mode
(``jvp``) builds over it: ordinary nodes, shared with the forward pass
(hash-consed), which the compiler then differentiates again like any other.
So a loss that holds a gradient is one graph, one CSE and one C function::

    u = mlp(x)                                    # n x 1, x an input (n x 1)
    du = sbp.grad(nn.sum_all(u), x)               # u'(x) at each row
    d2u = sbp.grad(nn.sum_all(du), x)             # u''(x)
    loss = nn.mean_all((d2u + f).applyfunc(lambda v: v**2))
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TypeAlias

import sympy as sp
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.exprdag import substitute
from symbackprop.base.functions import stop_gradient as stopped
from symbackprop.base.scalar import partials
from symbackprop.declare.standing import Standing, layered
from symbackprop.errors import ModelError
from symbackprop.messages import described, short

# What grad and jvp differentiate: an expression, or a function of the point.
Differentiated: TypeAlias = sp.Basic | Callable[[sp.Basic], sp.Basic]


def _expression(value: object, what: str) -> sp.Basic:
    """A SymPy scalar or matrix expression (a plain number becomes one)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return sp.sympify(value)
    if isinstance(value, sp.MatrixBase):
        return sp.ImmutableMatrix(value)
    if isinstance(value, (sp.Expr, sp.MatrixExpr)):
        return value
    raise ModelError(f"{what} must be a SymPy scalar or matrix expression; got {short(repr(value))} "
                     f"of type {type(value).__name__}")


def _shape(expr: sp.Basic) -> tuple:
    return tuple(expr.shape) if isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)) else (1, 1)


def _is_leaf(wrt: object) -> bool:
    return isinstance(wrt, (sp.Symbol, sp.MatrixSymbol)) and not getattr(wrt, "is_index", False)


def _point(wrt: object, what: str) -> sp.Basic:
    """wrt as a point to differentiate at: a leaf, or a scalar or matrix
    expression (not an Index: row numbers have no derivative)."""
    if getattr(wrt, "is_index", False):
        raise ModelError(f"{what} is taken with respect to the Index {wrt}: row numbers have no derivative")
    if isinstance(wrt, sp.MatrixBase):
        return sp.ImmutableMatrix(wrt)
    if isinstance(wrt, (sp.Expr, sp.MatrixExpr)) and not wrt.is_number:
        return wrt
    raise ModelError(f"{what} is taken with respect to an input, a param or an expression of them; got "
                     f"{short(repr(wrt))} of type {type(wrt).__name__}")


def _fresh(point: sp.Basic) -> sp.Symbol | sp.MatrixSymbol:
    """A symbol of grad's own, of the point's shape, that stands for it."""
    if isinstance(point, (sp.MatrixExpr, sp.MatrixBase)):
        return sp.MatrixSymbol(sp.Dummy("at"), *point.shape)
    return sp.Dummy("at", real=True)


def _subexpressions(expr: sp.Basic) -> set[sp.Basic]:
    """Each distinct subexpression of expr, walked once (SymPy's own walks
    go down a shared one once per path), a MatrixSymbol not below its name."""
    seen: set[sp.Basic] = set()
    stack = [expr]
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.add(sub)
            if not isinstance(sub, sp.MatrixSymbol):
                stack.extend(a for a in sub.args if isinstance(a, sp.Basic) and a not in seen)
    return seen


def _model_leaves(point: sp.Basic) -> set[sp.Basic]:
    """The symbols a point is computed from: its inputs and params, not
    dimensions, nor the bound variables of elementwise functions (nn's
    activations share theirs)."""
    found = _subexpressions(point)
    leaves = {a for a in found if isinstance(a, (sp.Symbol, sp.MatrixSymbol)) and not isinstance(a, sp.Dummy)}
    dims = {d for m in leaves if isinstance(m, sp.MatrixSymbol) for d in sp.sympify(m.shape).free_symbols}
    bound = {v for f in found if isinstance(f, sp.Lambda) for v in f.variables}
    return leaves - dims - bound


def _at(expr: Differentiated, wrt: object, what: str) -> tuple[sp.Basic, sp.Basic, sp.Basic]:
    """(the expression, the symbol it is differentiated by, the point that
    symbol stands for). A leaf `wrt` of a given expression is itself; for a
    function, or an expression `wrt` (an intermediate), a symbol of grad's
    own stands for the point where expr uses it, and only those uses move."""
    if callable(expr) and not isinstance(expr, sp.Basic):
        point = _point(wrt, what)
        fresh = _fresh(point)
        return _expression(expr(fresh), f"the value of the function given to {what}"), fresh, point
    expr = _expression(expr, f"the expression of {what}")
    if _is_leaf(wrt):
        return expr, wrt, wrt
    point = _point(wrt, what)
    fresh = _fresh(point)
    (moved,) = substitute([expr], {point: fresh})
    held = _subexpressions(moved)
    if fresh not in held:
        raise ModelError(f"{what} is taken at {short(point)}, which {short(expr)} does not hold as written (SymPy "
                         f"merges a sum or product into a larger one): pass a function of the point, "
                         f"sbp.{what}(lambda v: f(v), point)")
    left = held & _model_leaves(point)
    if left:
        raise ModelError(f"{what} is taken at {short(point)}, but {short(expr)} also reads "
                         f"{', '.join(sorted(map(str, left)))} other than through it (or holds it merged into a larger "
                         f"sum or product): pass a function of the point, sbp.{what}(lambda v: f(v), point)")
    return moved, fresh, point


def _scalar_if_1x1(node: sp.MatrixExpr, scalar: bool) -> sp.Basic:
    """The 1x1 node's entry where the result is a scalar (a Symbol's
    gradient, a scalar's tangent), so that it mixes with scalars."""
    return MatrixElement(node, 0, 0) if scalar else node


def _same_shape(given: sp.Basic, shape: tuple, what: str, of: Callable[[], str]) -> None:
    """`of()` names what `given` is checked against, built only to raise."""
    if _shape(given) != shape:
        raise ModelError(f"{what} has shape {_shape(given)} but {of()} has shape {shape}: {described(given)}")


class _Derivative(Standing, sp.MatrixExpr):
    """What Grad and Jvp share: args (expr, wrt, seed), entries by index."""

    @property
    def expr(self) -> sp.Basic:
        """The differentiated expression."""
        return self.args[0]

    @property
    def wrt(self) -> sp.Basic:
        """The leaf it is differentiated with respect to: an input or param,
        or a symbol of grad's own that stands for the point `at`."""
        return self.args[1]

    @property
    def at(self) -> sp.Basic:
        """Where wrt is: wrt itself for an input or param; else the
        expression whose value the symbol wrt stands for."""
        return self.args[3]

    @property
    def at_point(self) -> bool:
        """Whether wrt is grad's own symbol for a point (not a leaf of the model)."""
        return self.args[3] != self.args[1]

    def _entry(self, i, j, **kwargs):
        return MatrixElement(self, i, j)


class Grad(_Derivative):
    """The gradient of sum(cotangent * expr) with respect to the leaf
    `wrt`, of wrt's shape. Build one with `grad`."""

    def __new__(cls, expr: sp.Basic, wrt: sp.Basic, cotangent: sp.Basic, at: sp.Basic | None = None) -> Grad:
        """Build the Grad (unchecked: `grad` checks).

        Args:
            expr: the differentiated expression.
            wrt: the Symbol or MatrixSymbol it is differentiated with respect to.
            cotangent: the weights of expr's entries, of expr's shape.
            at: the value wrt stands for (default: wrt itself, a leaf).
        """
        return super().__new__(cls, expr, wrt, cotangent, wrt if at is None else at)

    @property
    def cotangent(self) -> sp.Basic:
        """The weights of the expression's entries (1 for a scalar)."""
        return self.args[2]

    @property
    def shape(self) -> tuple:
        """The shape of wrt."""
        return _shape(self.wrt)


class Jvp(_Derivative):
    """The directional derivative of expr along `direction` (a tangent of
    the leaf `wrt`), of expr's shape. Build one with `jvp`."""

    def __new__(cls, expr: sp.Basic, wrt: sp.Basic, direction: sp.Basic, at: sp.Basic | None = None) -> Jvp:
        """Build the Jvp (unchecked: `jvp` checks).

        Args:
            expr: the differentiated expression.
            wrt: the Symbol or MatrixSymbol that moves.
            direction: how it moves, of wrt's shape.
            at: the value wrt stands for (default: wrt itself, a leaf).
        """
        return super().__new__(cls, expr, wrt, direction, wrt if at is None else at)

    @property
    def direction(self) -> sp.Basic:
        """The tangent of wrt."""
        return self.args[2]

    @property
    def shape(self) -> tuple:
        """The shape of expr."""
        return _shape(self.expr)


def grad(expr: Differentiated, wrt: sp.Basic, cotangent: sp.Basic | None = None) -> sp.Basic:
    """The gradient of `expr` with respect to `wrt`, as an expression of the
    model: use it in the loss or an output, or differentiate it again
    (``grad(nn.sum_all(grad(e, x)), x)``). It is derived by the compiler's
    reverse mode on the model's own graph, so its values are shared with
    the forward pass (one CSE, one C function).

    Args:
        expr: a scalar expression or 1x1 matrix; a matrix with `cotangent`.
            Or a function of one argument (a symbol of wrt's shape) that
            returns one: the gradient is then that function's, at wrt, and
            only the argument moves (``grad(lambda q: f(q, p(x)), x)``
            holds p(x) fixed, as JAX's ``jax.grad(f)(x)``).
        wrt: an input or param of the model (a Symbol or MatrixSymbol,
            checked when the model is compiled), or an expression of them
            (an intermediate, ``eps*x + (1 - eps)*y``): its uses in expr
            move, what it is computed from does not.
        cotangent: for a matrix `expr`, the weights of its entries (of its
            shape): the result is then the vector-Jacobian product, the
            gradient of sum(cotangent * expr). For a scalar, a scalar
            factor (default 1).

    Returns:
        A matrix expression of wrt's shape; a scalar for a scalar `wrt`.

    Raises:
        ModelError: `wrt` is an Index or not an expression, an
            intermediate `wrt` is not found in `expr` as written, or
            `expr` also reads what `wrt` is computed from (pass a function
            then), `expr` is a matrix and no cotangent is given, or the
            cotangent's shape is not expr's. When the model is compiled:
            `wrt` is not one of its inputs or params, or an op under `expr`
            cannot be differentiated twice (named).
    """
    expr, leaf, point = _at(expr, wrt, "grad")
    shape = _shape(expr)
    if cotangent is None:
        if shape != (1, 1):
            raise ModelError(f"grad of a non-scalar expression needs a cotangent of its shape (the weights of its "
                             f"entries), or reduce it first (nn.sum_all): {described(expr)}")
        cotangent = sp.Integer(1)
    cotangent = _expression(cotangent, "the cotangent of grad")
    _same_shape(cotangent, shape, "the cotangent of grad", lambda: f"the expression {short(expr)}")
    return _scalar_if_1x1(Grad(expr, leaf, cotangent, point), isinstance(leaf, sp.Symbol))


def jvp(expr: Differentiated, wrt: sp.Basic, direction: sp.Basic) -> sp.Basic:
    """The Jacobian of `expr` with respect to `wrt` times `direction` (forward
    mode), as an expression of the model. ``jvp(grad(f, w), w, v)`` is the
    Hessian of f times v.

    Args:
        expr: a scalar or matrix expression, or a function of one argument
            (a symbol of wrt's shape) that returns one (as grad's).
        wrt: an input or param of the model, or an expression of them (as grad's).
        direction: the tangent of wrt, of its shape (an expression of the
            model: an input, a param, or computed).

    Returns:
        An expression of expr's shape (a scalar for a scalar expr).

    Raises:
        ModelError: as grad's for `expr` and `wrt`, or `direction`'s shape
            is not wrt's. When the model is compiled: `wrt` is not one of its
            inputs or params, or an op under `expr` cannot be differentiated
            twice (named).
    """
    expr, leaf, point = _at(expr, wrt, "jvp")
    direction = _expression(direction, "the direction of jvp")
    _same_shape(direction, _shape(leaf), "the direction of jvp", lambda: f"{short(point)}")
    return _scalar_if_1x1(Jvp(expr, leaf, direction, point), not isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)))


_V = sp.Dummy("v", real=True)
_STOPPED = sp.Lambda(_V, stopped(_V))


def stop_gradient(x: sp.Basic) -> sp.Basic:
    """x's value, as a constant to every derivative (JAX's
    ``lax.stop_gradient``, PyTorch's ``detach``): the loss's gradient,
    ``mod.jvp``, ``hvp`` and ``sbp.grad``/``sbp.jvp`` inside the model see
    no dependence through it, and the generated C computes no derivative
    of what is under it. A saddle's envelope gradient
    ``grad(f(x, stop_gradient(y_star(x))), x)``; a target network's value.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape and value (elementwise ``stop_gradient``).

    Raises:
        ModelError: x is not a SymPy expression or a number.
    """
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return sp.sympify(x)
    if isinstance(x, sp.MatrixBase):
        return sp.ImmutableMatrix(x).applyfunc(stopped)
    if isinstance(x, sp.MatrixExpr):
        return layered(ElementwiseApplyFunction(_STOPPED, x))
    if isinstance(x, sp.Expr):
        return stopped(x)
    raise ModelError(f"stop_gradient takes a SymPy scalar or matrix expression; got {short(repr(x))} "
                     f"of type {type(x).__name__}")


def _post_order(exprs: list[sp.Basic]) -> list[sp.Basic]:
    """Each distinct subexpression of exprs once, arguments before their
    users (a MatrixSymbol not below its name), without recursion."""
    order: list[sp.Basic] = []
    seen: set[sp.Basic] = set()
    stack: list[tuple[sp.Basic, bool]] = [(e, False) for e in reversed(exprs)]
    while stack:
        sub, ready = stack.pop()
        if ready:
            order.append(sub)
        elif sub not in seen:
            seen.add(sub)
            stack.append((sub, True))
            if not isinstance(sub, sp.MatrixSymbol):
                stack.extend((a, False) for a in reversed(sub.args) if isinstance(a, sp.Basic) and a not in seen)
    return order


def in_body(entries: list[sp.Basic], bound: set[sp.Symbol]) -> list[sp.Basic]:
    """A map's body with each grad and jvp that reads the body's own symbols
    (`bound`: one example's) written out: the derivative of its scalar
    expression by its Symbol, symbolically (the body is one example's
    scalars; the model's graph has no node for them). The others, of the
    model's values alone, stay: they lower with the model.

    Raises:
        ModelError: one that reads the body's symbols is not of a scalar
            expression with respect to a scalar.
    """
    written: dict[sp.Basic, sp.Basic] = {}
    for sub in _post_order(entries):
        if isinstance(sub, MatrixElement) and isinstance(sub.parent, _Derivative):
            parts = substitute(list(sub.parent.args), written) if written else list(sub.parent.args)
            if _subexpressions(sp.Tuple(*parts)) & bound:
                written[sub] = _written_out(sub.parent, parts)
    return substitute(entries, written) if written else entries


def _written_out(derivative: _Derivative, parts: list[sp.Basic]) -> sp.Expr:
    """A scalar grad's or jvp's value from its (expr, wrt, seed, at), written out."""
    expr, wrt, seed, at = parts
    expr, seed = (e[0, 0] if isinstance(e, sp.MatrixBase) and e.shape == (1, 1) else e for e in (expr, seed))
    if not (isinstance(wrt, sp.Symbol) and isinstance(expr, sp.Expr) and isinstance(seed, sp.Expr)):
        kind = "grad" if isinstance(derivative, Grad) else "jvp"
        raise ModelError(f"inside a map's body, {kind} takes a scalar expression with respect to a scalar; got "
                         f"{kind} of {short(expr)} with respect to {short(at)}")
    (slope,) = partials(expr, [wrt])
    value = slope * seed
    return value.xreplace({wrt: at}) if wrt != at else value
