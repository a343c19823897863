"""Activations: elementwise ones (sigmoid, relu, gelu, ...), each one
Lambda applied to every entry, and softmax and log_softmax along an axis.
sigmoid and softplus are the functions of symbackprop.base.stable, which
is also what 1/(1 + exp(-z)) and log(1 + exp(z)) written by hand compile
to. Public through symbackprop.nn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import sympy as sp
from sympy.codegen.cfunctions import expm1
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction

from symbackprop.base import stable
from symbackprop.declare.standing import layered
from symbackprop.declare.tensor import Softmax
from symbackprop.errors import ModelError

# What the elementwise helpers take and return: a scalar expression, a matrix
# expression, or an explicit sympy.Matrix.
Operand: TypeAlias = sp.Expr | sp.MatrixExpr | sp.MatrixBase


_FUNCTIONS: dict[Any, sp.Lambda] = {}  # an activation's Lambda, by its key (see _elementwise)


def _function(fn: Callable[[sp.Expr], sp.Expr], key: Any) -> sp.Lambda:
    """Lambda(v, fn(v)), built once per key: SymPy's evaluation of fn(v)
    (tanh's looks for an imaginary factor) was a third of a tanh layer's
    declaration."""
    try:
        found = _FUNCTIONS.get(key)
    except TypeError:  # an unhashable parameter: not kept
        key = found = None
    if found is None:
        v = sp.Dummy("v", real=True)
        found = sp.Lambda(v, fn(v))
        if key is not None and len(_FUNCTIONS) < 256:
            _FUNCTIONS[key] = found
    return found


def _elementwise(x, fn, key: Any = None):
    """fn applied to each entry of x; `key` names fn with its parameters
    (fn itself where it is a module's function, not a new lambda)."""
    if isinstance(x, sp.MatrixExpr):
        if x.shape == (1, 1):  # SymPy would call fn on the 1x1 matrix itself
            return sp.ImmutableMatrix([[fn(x[0, 0])]])
        return layered(ElementwiseApplyFunction(_function(fn, fn if key is None else key), x))
    if isinstance(x, sp.MatrixBase):
        return x.applyfunc(fn)
    return fn(x)


def sigmoid(x: Operand) -> Operand:
    """1 / (1 + exp(-x)), elementwise, computed without overflow at any x
    (its derivative s*(1 - s), from its value, as PyTorch).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, stable.sigmoid)


def tanh(x: Operand) -> Operand:
    """tanh(x), elementwise.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, sp.tanh)


def relu(x: Operand) -> Operand:
    """max(x, 0), elementwise; its derivative at exactly 0 is taken as 0.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: sp.Max(v, 0), "relu")


def softplus(x: Operand) -> Operand:
    """log(1 + exp(x)), elementwise, computed as max(x, 0) + log1p(exp(-|x|))
    (no overflow: softplus(800) = 800); its derivative is sigmoid(x).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, stable.softplus)


def log_sigmoid(x: Operand) -> Operand:
    """log(sigmoid(x)) = -softplus(-x), elementwise (PyTorch's logsigmoid):
    -800 at x = -800, where log of the computed sigmoid would be -inf.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: -stable.softplus(-v), "log_sigmoid")


def silu(x: Operand) -> Operand:
    """x * sigmoid(x), elementwise (PyTorch's silu, also called swish).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: v * stable.sigmoid(v), "silu")


def log_softmax(z: sp.MatrixExpr, axis: int = 1) -> sp.MatrixExpr:
    """(z - max) - log(sum(exp(z - max))) along `axis`, as PyTorch's: never
    z - logsumexp(z), where a large z loses the log of the sum. Its
    gradient is g - softmax(z) * sum(g).

    Args:
        z: a matrix expression, one row per example.
        axis: 1 (the default): along each row; 0: down each column.

    Returns:
        A matrix expression of z's shape.

    Raises:
        ModelError: axis is neither 0 nor 1.
    """
    return Softmax(z, axis, log=True)


def softmax(z: sp.MatrixExpr, axis: int = 1) -> sp.MatrixExpr:
    """exp(z - max) / sum(exp(z - max)) along `axis`: rows (axis 1) or
    columns (axis 0) summing to 1, as PyTorch's (a row with +inf or NaN is
    NaN throughout).

    Args:
        z: a matrix expression, one row per example.
        axis: 1 (the default): each row; 0: each column.

    Returns:
        A matrix expression of z's shape.

    Raises:
        ModelError: axis is neither 0 nor 1.
    """
    return Softmax(z, axis)



LEAKY_SLOPE = sp.Rational(1, 100)  # PyTorch's default negative slope


def leaky_relu(x: Operand, slope: sp.Expr | float = LEAKY_SLOPE) -> Operand:
    """x where x > 0, else slope*x, elementwise; the derivative at 0 is slope
    (as PyTorch).

    Args:
        x: a scalar expression, a matrix expression or a Matrix.
        slope: the slope for negative x.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: sp.Piecewise((v, v > 0), (slope * v, True)), ("leaky_relu", slope))


def elu(x: Operand, alpha: sp.Expr | float = 1) -> Operand:
    """x where x > 0, else alpha*(exp(x) - 1), elementwise; the derivative at
    0 is alpha.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.
        alpha: the scale of the negative part.

    Returns:
        An expression of x's shape.
    """
    return _elementwise(x, lambda v: sp.Piecewise((v, v > 0), (alpha * expm1(v), True)), ("elu", alpha))


GELU_APPROXIMATIONS = ("none", "tanh")  # torch.nn.functional.gelu's names


def gelu(x: Operand, approximate: str = "none") -> Operand:
    """The Gaussian error linear unit x * Phi(x), elementwise, as PyTorch's
    torch.nn.functional.gelu(x, approximate=...) computes it:

    - "none" (the default, as PyTorch's): exact, x/2 * (1 + erf(x / sqrt(2)))
      (erf is C99's);
    - "tanh": x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), which is
      up to 1.8e-4 from the exact value.

    Args:
        x: a scalar expression, a matrix expression or a Matrix.
        approximate: "none" or "tanh".

    Returns:
        An expression of x's shape.

    Raises:
        ModelError: approximate is neither "none" nor "tanh".
    """
    if approximate == "none":
        return _elementwise(x, lambda v: v / 2 * (1 + sp.erf(v / sp.sqrt(2))), "gelu")
    if approximate == "tanh":
        c = sp.sqrt(2 / sp.pi)
        return _elementwise(x, lambda v: v / 2 * (1 + sp.tanh(c * (v + sp.Rational(44715, 1000000) * v**3))),
                           "gelu_tanh")
    raise ModelError(f"gelu's approximate must be one of {list(GELU_APPROXIMATIONS)}; got {approximate!r}")
