"""Scalar functions beyond C's plain libm, one record each.

A record says everything symbackprop knows about one SymPy function class:
how an application prints in C (a libm call, an inline expression, or a
call of a helper function that the module defines when a kernel calls it,
its C in templates/), and its numpy reference for the C-free interpreter
(symbackprop.ir.interpret). The derivative is SymPy's own (`fdiff`): loggamma
-> polygamma(0, x), polygamma(n, x) -> polygamma(n + 1, x), gamma -> gamma
* polygamma(0, x); sigmoid and softplus define theirs (symbackprop.base.stable),
stop_gradient its 0; DERIVATIVES holds those that are not SymPy's (acosh,
floor, ceiling, sign).

The printer (cprint.IEEEPrinter), the interpreter and the module template
(through codegen.CModule.function_helpers) read these records; adding a function is
one record here (and its helper's template, if it has one).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import mpmath
import numpy as np
import sympy as sp
from sympy.codegen.cfunctions import expm1, log1p

from symbackprop.base.stable import sigmoid, softplus
from symbackprop.errors import ModelError

# the printer (cprint.IEEEPrinter) and the application, e.g. lgamma(x)
CText = Callable[[Any, sp.Expr], str]


@dataclass(frozen=True)
class CHelper:
    """C functions a module defines (static) when one of its kernels calls
    them; `template` (in templates/) holds their definitions for the
    module's real type (`m.real_c`)."""

    names: tuple[str, ...]  # the functions a kernel may call (float modules: each + "f")
    template: str
    internal: tuple[str, ...] = ()  # functions of the template that only its own functions call

    def c_names(self) -> frozenset[str]:
        """The names a kernel may call, in double and float modules."""
        return frozenset(n + suffix for n in self.names for suffix in ("", "f"))

    def defined(self) -> frozenset[str]:
        """Every name its template may define."""
        return self.c_names() | frozenset(self.internal)


@dataclass(frozen=True)
class ScalarFunction:
    """One scalar function: its SymPy class, its C, its numpy reference."""

    sympy_class: type
    c: CText  # the C text of an application
    numpy: Callable[..., np.ndarray]  # the interpreter's reference, elementwise on float64 arrays
    lambdify_names: tuple[str, ...]  # the names sp.lambdify prints for it
    helper: CHelper | None = None  # the module's C function its text calls, if any


def _suffix(printer: Any) -> str:
    return "f" if printer.real.name == "float32" else ""


def libm(name: str) -> CText:
    """A C99 math function, with an f in float modules (lgammaf)."""

    def text(printer: Any, expr: sp.Expr) -> str:
        return f"{name}{_suffix(printer)}({', '.join(printer._print(a) for a in expr.args)})"

    return text


# --- inline forms that never overflow ---------------------------------------


def _sigmoid_c(printer: Any, expr: sp.Expr) -> str:
    """(z >= 0 ? 1 : e) / (1 + e) with e = exp(-|z|) <= 1: no overflow
    (the compiler computes e once: -fno-math-errno); NaN stays NaN."""
    z = expr.args[0]
    e = printer._print(sp.exp(-sp.Abs(z)))
    one = printer._one()
    return f"((({printer._print(z)}) >= 0 ? {one} : {e}) / ({one} + {e}))"


def _softplus_c(printer: Any, expr: sp.Expr) -> str:
    """max(z, 0) + log1p(exp(-|z|)): no overflow; NaN stays NaN."""
    z = expr.args[0]
    x = printer._print(z)
    tail = printer._print(log1p(sp.exp(-sp.Abs(z))))
    return f"((({x}) > 0 ? ({x}) : {printer._print(sp.Float(0.0))}) + {tail})"


def _sigmoid_numpy(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))  # never exp of a positive number, as the C
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def _softplus_numpy(z: np.ndarray) -> np.ndarray:
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


def _exp_c(printer: Any, expr: sp.Expr) -> str:
    """float: the runtime header's exp (templates/exp.c.j2), which vectorizes
    with no slow path: libmvec's expf leaves its vector code for every result
    that underflows (17 ms instead of 1 for a million exps of a softmax).
    double: libm's exp (libmvec's, where built with it), faster there: its
    slow path is only beyond |x| > 708."""
    if printer.real.name == "float32":
        return f"{printer.real.helper_prefix}_exp({printer._print(expr.args[0])})"
    return libm("exp")(printer, expr)


# --- stop_gradient --------------------------------------------------------------


class stop_gradient(sp.Function):
    """Its argument's value, with derivative 0 (JAX's lax.stop_gradient,
    PyTorch's detach): what is under it is a constant to every derivative,
    reverse and forward, first and higher order. Numbers and nested
    applications fold: stop_gradient(2) is 2."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_Number or isinstance(x, stop_gradient):
            return x
        return None

    def fdiff(self, argindex=1):
        return sp.S.Zero

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _eval_is_finite(self):
        return self.args[0].is_finite

    def _eval_is_integer(self):
        return self.args[0].is_integer


def _stop_gradient_c(printer: Any, expr: sp.Expr) -> str:
    return f"({printer._print(expr.args[0])})"


# --- the gamma family ---------------------------------------------------------

POLYGAMMA = CHelper(("symbackprop_polygamma",), "fn_polygamma.c.j2", internal=("symbackprop_polygamma_positive",))


def _polygamma_c(printer: Any, expr: sp.Expr) -> str:
    """polygamma(n, x) for a literal order n >= 0 (digamma is n = 0)."""
    n, x = expr.args
    if not (n.is_Integer and n >= 0):
        raise ModelError(f"polygamma's order must be a literal integer >= 0 to print as C: {expr}")
    return f"symbackprop_polygamma{_suffix(printer)}({int(n)}, {printer._print(x)})"


def _lgamma_scalar(x: float) -> float:
    """C's lgamma: log|gamma(x)|, +inf at the poles."""
    try:
        return math.lgamma(x)
    except (ValueError, OverflowError):
        return math.inf


def _tgamma_scalar(x: float) -> float:
    """C's tgamma: +-inf at +-0, NaN at negative integers and -inf."""
    if x == 0:
        return math.copysign(math.inf, x)
    try:
        return math.gamma(x)
    except ValueError:
        return math.nan
    except OverflowError:
        return math.inf if x > 0 else 0.0


def polygamma_pole(n: int, x: float) -> float:
    """The C helper's value at a pole x = 0, -1, -2, ... (or at -inf): the
    limit where both sides agree (+inf for odd n), the one-sided limit at a
    signed zero for even n, NaN otherwise."""
    if math.isinf(x):
        return math.nan
    if n % 2 == 1:
        return math.inf
    if x == 0:
        return math.inf if math.copysign(1.0, x) < 0 else -math.inf
    return math.nan


def polygamma_scalar(n: int, x: float) -> float:
    """polygamma(n, x) to float64 by mpmath (120-bit working precision,
    then rounded once), with the C helper's conventions at poles."""
    n = int(n)
    if n < 0 or math.isnan(x):
        return math.nan
    if x == math.inf:
        return math.inf if n == 0 else 0.0
    if x <= 0 and (math.isinf(x) or x == math.floor(x)):
        return polygamma_pole(n, x)
    with mpmath.workprec(120):
        return float(mpmath.psi(n, mpmath.mpf(x)))


def _elementwise(scalar: Callable[..., float]) -> Callable[..., np.ndarray]:
    vectorized = np.vectorize(scalar, otypes=[np.float64])
    return lambda *args: vectorized(*args)


# --- the records ---------------------------------------------------------------

FUNCTIONS: tuple[ScalarFunction, ...] = (
    ScalarFunction(sigmoid, _sigmoid_c, _sigmoid_numpy, ("sigmoid",)),
    ScalarFunction(softplus, _softplus_c, _softplus_numpy, ("softplus",)),
    ScalarFunction(stop_gradient, _stop_gradient_c, lambda x: np.array(x, dtype=np.float64), ("stop_gradient",)),
    ScalarFunction(sp.exp, _exp_c, np.exp, ("exp",)),
    ScalarFunction(log1p, libm("log1p"), np.log1p, ("log1p",)),
    ScalarFunction(expm1, libm("expm1"), np.expm1, ("expm1",)),
    ScalarFunction(sp.loggamma, libm("lgamma"), _elementwise(_lgamma_scalar), ("lgamma", "loggamma")),
    ScalarFunction(sp.gamma, libm("tgamma"), _elementwise(_tgamma_scalar), ("gamma", "tgamma")),
    ScalarFunction(sp.polygamma, _polygamma_c, _elementwise(polygamma_scalar), ("polygamma",), POLYGAMMA),
)

_BY_CLASS: dict[type, ScalarFunction] = {f.sympy_class: f for f in FUNCTIONS}

# Derivatives that are not SymPy's fdiff, by SymPy class: PyTorch's
# formula where SymPy's has a narrower domain, so that outside the
# function's domain (a NaN value) the gradient is PyTorch's too. acosh:
# SymPy's 1/(sqrt(x - 1) sqrt(x + 1)) is NaN for x <= -1 where torch's
# 1/sqrt(x^2 - 1) is finite (inf at -1); both are the same number for x > 1.
#
# floor, ceiling and sign: a step's, 0 (PyTorch's, at the jumps too) and NaN
# at NaN as every kink's (docs/compile_and_call.md): DiracDelta(x), which
# prints as that (cprint), where SymPy's is unevaluated (floor, ceiling, and
# sign of an argument not known to be real).
DERIVATIVES: dict[type, Callable[[sp.Expr], sp.Expr]] = {
    sp.acosh: lambda x: 1 / sp.sqrt(x**2 - 1),
    sp.floor: sp.DiracDelta,
    sp.ceiling: sp.DiracDelta,
    sp.sign: sp.DiracDelta,
}


def derivative(function: sp.Function, index: int) -> sp.Expr | None:
    """The derivative of an application by its argument `index` (from 1)
    where DERIVATIVES has its own, else None (SymPy's fdiff is the rule)."""
    rule = DERIVATIVES.get(type(function))
    return None if rule is None or index != 1 else rule(function.args[0])


def has_own_derivative(function: sp.Basic) -> bool:
    """Whether DERIVATIVES holds the derivative of the application's class."""
    return type(function) in DERIVATIVES


def scalar_function(cls: type) -> ScalarFunction | None:
    """The record of a SymPy function class, None for plain libm ones."""
    return _BY_CLASS.get(cls)


def _step_derivative(x: np.ndarray) -> np.ndarray:
    """DiracDelta as the C prints it (cprint): 0, NaN at NaN."""
    return np.where(np.isnan(x), x, 0.0)


def numpy_namespace() -> dict[str, Callable[..., np.ndarray]]:
    """name -> numpy reference, for sp.lambdify's modules."""
    return {"DiracDelta": _step_derivative, **{name: f.numpy for f in FUNCTIONS for name in f.lambdify_names}}


HELPERS: tuple[CHelper, ...] = tuple(dict.fromkeys(f.helper for f in FUNCTIONS if f.helper is not None))

# every C name a helper may define: no user name may take one (compiler's CNamer)
HELPER_C_NAMES: frozenset[str] = frozenset().union(*(h.defined() for h in HELPERS))

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def helpers_called(texts: Iterable[str]) -> tuple[CHelper, ...]:
    """The helpers whose functions the C texts call, in a fixed order."""
    used = set()
    for text in texts:
        used.update(_IDENTIFIER.findall(text))
    return tuple(h for h in HELPERS if h.c_names() & used)


__all__ = [
    "DERIVATIVES",
    "FUNCTIONS",
    "HELPERS",
    "HELPER_C_NAMES",
    "CHelper",
    "ScalarFunction",
    "derivative",
    "has_own_derivative",
    "helpers_called",
    "libm",
    "numpy_namespace",
    "polygamma_pole",
    "polygamma_scalar",
    "scalar_function",
    "stop_gradient",
]
