"""Shared helpers of the tests: a numpy evaluator of SymPy model
expressions (an oracle that shares no code with symbackprop), random data
for a model's leaves, a gradient check against central differences, and a
count of the Python calls a piece of code makes. (C programs: c_driver.py;
numpy losses of the examples: oracles.py; models for the diff tests:
diff_models.py.)"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from functools import reduce
from typing import Any

import numpy as np
import sympy as sp
from oracles import central_differences
from sympy.codegen.cfunctions import expm1
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.stable import sigmoid, softplus

_UNARY = {
    sp.exp: np.exp,
    sp.log: np.log,
    sp.sin: np.sin,
    sp.cos: np.cos,
    sp.tan: np.tan,
    sp.tanh: np.tanh,
    sp.sinh: np.sinh,
    sp.cosh: np.cosh,
    sp.atan: np.arctan,
    sp.Abs: np.abs,
    # SymPy writes Abs(exp(x)) as exp(re(x)) for a symbol not declared real;
    # every array here is real
    sp.re: np.real,
    sp.im: np.imag,
    # nn.sigmoid and nn.softplus (symbackprop.base.stable), in numpy's own stable forms
    sigmoid: lambda z: np.exp(-np.logaddexp(0.0, -z)),
    softplus: lambda z: np.logaddexp(0.0, z),
    expm1: np.expm1,
}


class Evaluator:
    """Evaluates SymPy scalar and matrix expressions with numpy, elementwise
    for scalar bodies. Records how close any Abs/Max/Min argument came to
    its kink (`kink`), where derivatives and finite differences part."""

    def __init__(self, values: Mapping[str, Any], dims: Mapping[sp.Symbol, int]):
        self.values = values
        self.dims = dims
        self.bound: dict[sp.Symbol, Any] = {}  # applyfunc variables
        self.kink = math.inf

    def __call__(self, expr: sp.Basic) -> Any:
        if isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)):
            return self.matrix(expr)
        return self.scalar(expr)

    def size(self, d: Any) -> int:
        return int(sp.sympify(d).xreplace(dict(self.dims)))

    def matrix(self, expr: sp.Basic) -> np.ndarray:
        if isinstance(expr, sp.MatrixBase):
            return np.array([[self.scalar(e) for e in row] for row in expr.tolist()], dtype=float)
        if isinstance(expr, sp.MatrixSymbol):
            return np.asarray(self.values[expr.name], dtype=float)
        if isinstance(expr, (sp.OneMatrix, sp.ZeroMatrix, sp.Identity)):
            rows, cols = (self.size(d) for d in expr.shape)
            fill = {sp.OneMatrix: np.ones, sp.ZeroMatrix: np.zeros}.get(type(expr))
            return fill((rows, cols)) if fill else np.eye(rows)
        if isinstance(expr, sp.MatAdd):
            return reduce(np.add, [np.asarray(self(a)) for a in expr.args])
        if isinstance(expr, sp.MatMul):
            coeff, factors = expr.as_coeff_matrices()
            return self.scalar(coeff) * reduce(np.matmul, [self.matrix(f) for f in factors])
        if isinstance(expr, sp.HadamardProduct):
            return reduce(np.multiply, [self.matrix(a) for a in expr.args])
        if isinstance(expr, sp.HadamardPower):
            return np.power(self.matrix(expr.base), self.scalar(expr.exp))
        if isinstance(expr, (sp.Transpose, sp.Adjoint)):  # real values
            return self.matrix(expr.arg).T
        if isinstance(expr, sp.MatPow):  # 1x1: any power; else a whole one (A*A*...)
            base, exponent = self.matrix(expr.base), self.scalar(expr.exp)
            return np.power(base, exponent) if base.shape == (1, 1) else np.linalg.matrix_power(base, int(exponent))
        if isinstance(expr, ElementwiseApplyFunction):
            var = sp.Dummy("v")
            self.bound[var] = self.matrix(expr.expr)
            try:
                return np.broadcast_to(self.scalar(expr.function(var)), self.bound[var].shape).copy()
            finally:
                del self.bound[var]
        raise NotImplementedError(f"evaluator: {type(expr).__name__}")

    def scalar(self, expr: sp.Basic) -> Any:
        if expr in self.bound:
            return self.bound[expr]
        if expr in self.dims:
            return float(self.dims[expr])
        if isinstance(expr, sp.Symbol):
            return np.asarray(self.values[expr.name], dtype=float).reshape(())[()]
        if isinstance(expr, MatrixElement):
            parent, i, j = expr.args
            return self.matrix(parent)[int(i), int(j)]
        if expr.is_Number or expr.is_NumberSymbol:
            return float(expr)
        args = [self.scalar(a) for a in expr.args]
        if isinstance(expr, sp.Add):
            return reduce(np.add, args)
        if isinstance(expr, sp.Mul):
            return reduce(np.multiply, args)
        if isinstance(expr, sp.Pow):
            return np.power(args[0], args[1])
        if isinstance(expr, (sp.Max, sp.Min)):
            self._near_kink(np.abs(args[0] - args[1]) if len(args) == 2 else math.inf)
            return reduce(np.maximum if isinstance(expr, sp.Max) else np.minimum, args)
        if isinstance(expr, sp.Abs):
            self._near_kink(np.abs(args[0]))
        function = _UNARY.get(type(expr))
        if function is None:
            raise NotImplementedError(f"evaluator: {type(expr).__name__}")
        return function(*args)

    def _near_kink(self, distance: Any) -> None:
        self.kink = min(self.kink, float(np.min(distance)))


def evaluate(expr: sp.Basic, values: Mapping[str, Any], dims: Mapping[sp.Symbol, int]) -> Any:
    """expr with numpy: leaves from `values` (by name), dimensions from `dims`."""
    return Evaluator(values, dims)(expr)


def leaf_shape(leaf: sp.Basic, dims: Mapping[sp.Symbol, int]) -> tuple[int, int]:
    if isinstance(leaf, sp.MatrixSymbol):
        return tuple(int(sp.sympify(d).xreplace(dict(dims))) for d in leaf.shape)
    return (1, 1)


def random_data(model, rng: np.random.Generator, dims: Mapping[sp.Symbol, int], scale: float = 0.5) -> dict[str, Any]:
    """Uniform values in [-scale, scale] for every leaf: arrays for
    MatrixSymbols, floats for Symbols."""
    data: dict[str, Any] = {}
    for leaf in model.inputs + model.params:
        if isinstance(leaf, sp.MatrixSymbol):
            data[leaf.name] = rng.uniform(-scale, scale, leaf_shape(leaf, dims))
        else:
            data[leaf.name] = float(rng.uniform(-scale, scale))
    return data


def reference_loss(model, dims: Mapping[sp.Symbol, int]):
    """data -> float: the model's loss by the numpy evaluator."""

    def loss(data: Mapping[str, Any]) -> float:
        return float(np.asarray(evaluate(model.loss, data, dims)).reshape(-1)[0])

    return loss


def assert_gradients_match(module, model, data: Mapping[str, Any], dims: Mapping[sp.Symbol, int],
                           rtol: float = 1e-6) -> None:
    """value_and_grad agrees with the numpy evaluator (loss) and with central
    differences of it (every differentiated leaf, entry by entry)."""
    reference = reference_loss(model, dims)
    expected_loss = reference(data)
    loss, grads = module.value_and_grad(**data)
    assert math.isclose(loss, expected_loss, rel_tol=1e-9, abs_tol=1e-9), (loss, expected_loss)
    for leaf in model.differentiated:
        numeric = central_differences(reference, data, leaf.name)
        actual = np.asarray(grads[leaf.name], dtype=float)
        assert actual.shape == numeric.shape or numeric.shape == (), (leaf.name, actual.shape, numeric.shape)
        scale = 1.0 + float(np.abs(numeric).max()) + 1e-3 * abs(expected_loss)
        error = float(np.abs(actual - numeric).max())
        assert error <= rtol * scale, f"d loss / d {leaf.name}: {actual} != finite differences {numeric}"


def count_calls(build: Callable[[], Any], name: str | None = None) -> int:
    """How many Python functions (of that name, if given) run while build() runs."""
    count = [0]

    def profile(frame, event, arg):
        if event == "call" and (name is None or frame.f_code.co_name == name):
            count[0] += 1

    sys.setprofile(profile)
    try:
        build()
    finally:
        sys.setprofile(None)
    return count[0]
