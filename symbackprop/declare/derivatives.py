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

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.declare.standing import Standing
from symbackprop.errors import ModelError
from symbackprop.messages import described, short


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


def _leaf(wrt: object, what: str) -> sp.Symbol | sp.MatrixSymbol:
    if getattr(wrt, "is_index", False):
        raise ModelError(f"{what} is taken with respect to the Index {wrt}: row numbers have no derivative")
    if not isinstance(wrt, (sp.Symbol, sp.MatrixSymbol)):
        raise ModelError(f"{what} is taken with respect to an input or param of the model (a Symbol or "
                         f"MatrixSymbol); got {short(repr(wrt))} of type {type(wrt).__name__}")
    return wrt


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
        """The leaf it is differentiated with respect to."""
        return self.args[1]

    def _entry(self, i, j, **kwargs):
        return MatrixElement(self, i, j)


class Grad(_Derivative):
    """The gradient of sum(cotangent * expr) with respect to the leaf
    `wrt`, of wrt's shape. Build one with `grad`."""

    def __new__(cls, expr: sp.Basic, wrt: sp.Basic, cotangent: sp.Basic) -> Grad:
        """Build the Grad (unchecked: `grad` checks).

        Args:
            expr: the differentiated expression.
            wrt: the Symbol or MatrixSymbol it is differentiated with respect to.
            cotangent: the weights of expr's entries, of expr's shape.
        """
        return super().__new__(cls, expr, wrt, cotangent)

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

    def __new__(cls, expr: sp.Basic, wrt: sp.Basic, direction: sp.Basic) -> Jvp:
        """Build the Jvp (unchecked: `jvp` checks).

        Args:
            expr: the differentiated expression.
            wrt: the Symbol or MatrixSymbol that moves.
            direction: how it moves, of wrt's shape.
        """
        return super().__new__(cls, expr, wrt, direction)

    @property
    def direction(self) -> sp.Basic:
        """The tangent of wrt."""
        return self.args[2]

    @property
    def shape(self) -> tuple:
        """The shape of expr."""
        return _shape(self.expr)


def grad(expr: sp.Basic, wrt: sp.Symbol | sp.MatrixSymbol, cotangent: sp.Basic | None = None) -> sp.Basic:
    """The gradient of `expr` with respect to the input or param `wrt`, as
    an expression of the model: use it in the loss or an output, or
    differentiate it again (``grad(nn.sum_all(grad(e, x)), x)``). It is
    derived by the compiler's reverse mode on the model's own graph, so its
    values are shared with the forward pass (one CSE, one C function).

    Args:
        expr: a scalar expression or 1x1 matrix; a matrix with `cotangent`.
        wrt: a Symbol or MatrixSymbol declared as an input or param of the
            model (checked when the model is compiled).
        cotangent: for a matrix `expr`, the weights of its entries (of its
            shape): the result is then the vector-Jacobian product, the
            gradient of sum(cotangent * expr). For a scalar, a scalar
            factor (default 1).

    Returns:
        A matrix expression of wrt's shape; a scalar for a Symbol `wrt`.

    Raises:
        ModelError: `wrt` is not a Symbol or MatrixSymbol (or is an Index),
            `expr` is a matrix and no cotangent is given, or the cotangent's
            shape is not expr's. When the model is compiled: `wrt` is not
            one of its inputs or params, or an op under `expr` cannot be
            differentiated twice (named).
    """
    expr = _expression(expr, "the expression of grad")
    wrt = _leaf(wrt, "grad")
    shape = _shape(expr)
    if cotangent is None:
        if shape != (1, 1):
            raise ModelError(f"grad of a non-scalar expression needs a cotangent of its shape (the weights of its "
                             f"entries), or reduce it first (nn.sum_all): {described(expr)}")
        cotangent = sp.Integer(1)
    cotangent = _expression(cotangent, "the cotangent of grad")
    _same_shape(cotangent, shape, "the cotangent of grad", lambda: f"the expression {short(expr)}")
    return _scalar_if_1x1(Grad(expr, wrt, cotangent), isinstance(wrt, sp.Symbol))


def jvp(expr: sp.Basic, wrt: sp.Symbol | sp.MatrixSymbol, direction: sp.Basic) -> sp.Basic:
    """The Jacobian of `expr` with respect to `wrt` times `direction` (forward
    mode), as an expression of the model. ``jvp(grad(f, w), w, v)`` is the
    Hessian of f times v.

    Args:
        expr: a scalar or matrix expression.
        wrt: a Symbol or MatrixSymbol declared as an input or param of the model.
        direction: the tangent of wrt, of its shape (an expression of the
            model: an input, a param, or computed).

    Returns:
        An expression of expr's shape (a scalar for a scalar expr).

    Raises:
        ModelError: `wrt` is not a Symbol or MatrixSymbol (or is an Index),
            or `direction`'s shape is not wrt's. When the model is compiled:
            `wrt` is not one of its inputs or params, or an op under `expr`
            cannot be differentiated twice (named).
    """
    expr = _expression(expr, "the expression of jvp")
    wrt = _leaf(wrt, "jvp")
    direction = _expression(direction, "the direction of jvp")
    _same_shape(direction, _shape(wrt), "the direction of jvp", lambda: f"{wrt}")
    return _scalar_if_1x1(Jvp(expr, wrt, direction), not isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)))
