"""A gradient check, as torch.autograd.gradcheck and jax.test_util.check_grads
do it: for random directions v, one per draw and argument, the directional
derivative <grad, v> from the gradient under test against central
differences of the loss alone, and it fails by default.

The error model. Each difference is taken over the step actually made: the
shifted arguments are rounded to the dtype, so the displacement is
x(+) - x(-) (exact in float64), not 2 h v; the gradient under test is
projected on that same displacement. Two central differences, at h and h/2,
are extrapolated (Richardson: (4 e(h/2) - e(h)) / 3 of the error e), which
removes the h^2 truncation term; where the two differences still disagree
by more than the rounding can explain, the step is shortened. What the differences cannot resolve is the
rounding of the loss itself, about eps * |loss| / h; that `noise` is added
to the tolerance, so a check fails only where the disagreement exceeds
atol + rtol * max(|<grad, v>|, |difference|) + noise. A NaN or inf in the
gradient, the loss or a difference fails whatever the tolerance.

`CompiledModule.check_grads` (derivatives.py) runs it on a module's
value_and_grad and forward; `symbackprop demo` prints its report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from symbackprop.errors import GradientCheckError

# (rtol, atol) by dtype when the caller gives none: the float64 pair is the
# README's rtol=1e-6; float32's is JAX's check_grads default
DEFAULT_TOLERANCE = {np.dtype(np.float64): (1e-6, 1e-9), np.dtype(np.float32): (2e-3, 2e-3)}

# the loss's rounding as a multiple of eps * |loss| (a forward pass rounds
# many times; measured on correct gradients: at most 2.5 ulps, so 8 leaves
# a margin)
_ROUNDING_ULPS = 8.0


@dataclass(frozen=True)
class ArgumentCheck:
    """The worst direction of one argument.

    Attributes:
        analytic: <grad, v> from the gradient under test.
        numeric: <grad, v> as the extrapolated central differences see it.
        abs_error: |analytic - numeric| (inf where either is not finite).
        rel_error: abs_error / max(|analytic|, |numeric|) (0 where both
            are 0, inf where either is not finite).
        step: the step h.
        noise: what the differences cannot resolve (the loss's rounding
            over the step), added to the tolerance.
    """

    analytic: float
    numeric: float
    abs_error: float
    rel_error: float
    step: float
    noise: float = 0.0

    @property
    def finite(self) -> bool:
        """Whether the gradient and the differences are finite."""
        return math.isfinite(self.analytic) and math.isfinite(self.numeric)

    def allowed(self, rtol: float, atol: float) -> float:
        """The error allowed: atol + rtol * max(|analytic|, |numeric|) + noise."""
        return atol + rtol * max(abs(self.analytic), abs(self.numeric)) + self.noise

    def passes(self, rtol: float, atol: float) -> bool:
        """Finite, and within `allowed`."""
        return self.finite and self.abs_error <= self.allowed(rtol, atol)


@dataclass(frozen=True)
class GradCheckReport:
    """The worst direction per argument (`arguments`), and over all (`worst`).

    Attributes:
        arguments: {argument name: its ArgumentCheck}.
        directions: the random directions drawn per argument.
    """

    arguments: dict[str, ArgumentCheck]
    directions: int

    @property
    def worst(self) -> float:
        """The largest relative error over every argument (0 for none; inf
        where a gradient or a difference is not finite)."""
        return max((a.rel_error for a in self.arguments.values()), default=0.0)

    def __str__(self) -> str:
        lines = [f"gradient check, {self.directions} random direction(s) per argument (central differences):"]
        for name, a in self.arguments.items():
            lines.append(f"  {name}: relative error {a.rel_error:.2e} (<grad, v> = {a.analytic:.10g}, "
                         f"difference {a.numeric:.10g}, h = {a.step:.1e})")
        return "\n".join(lines)


def default_step(dtype: np.dtype, x: np.ndarray) -> float:
    """eps^(1/5) of the dtype, scaled by the argument's largest entry: the
    step that balances the extrapolated differences' truncation (h^4)
    against rounding (eps/h)."""
    finite = np.abs(x[np.isfinite(x)]) if x.size else x
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    return float(np.finfo(dtype).eps) ** (1 / 5) * scale


def default_tolerance(dtype: np.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """(rtol, atol): each one given, or the dtype's default (DEFAULT_TOLERANCE)."""
    base_rtol, base_atol = DEFAULT_TOLERANCE.get(np.dtype(dtype), DEFAULT_TOLERANCE[np.dtype(np.float32)])
    return (base_rtol if rtol is None else float(rtol)), (base_atol if atol is None else float(atol))


def _difference(loss: Callable[[dict[str, Any]], float], arrays: Mapping[str, Any], name: str, x: np.ndarray,
                step: np.ndarray, g: np.ndarray, dtype: np.dtype) -> tuple[float, float, float]:
    """(numeric - analytic, over the step made, per unit h; the larger
    |loss| of the two; the analytic part) for x +- step rounded to dtype."""
    plus, minus = (x + step).astype(dtype), (x - step).astype(dtype)
    moved = plus.astype(np.float64) - minus.astype(np.float64)
    up, down = float(loss({**arrays, name: plus})), float(loss({**arrays, name: minus}))
    analytic = float(np.sum(g * moved))
    return (up - down) - analytic, max(abs(up), abs(down)), analytic


def _direction(loss: Callable[[dict[str, Any]], float], arrays: Mapping[str, Any], name: str, x: np.ndarray,
               g: np.ndarray, v: np.ndarray, h: float, dtype: np.dtype) -> ArgumentCheck:
    """One direction's check: Richardson over the differences at h and h/2;
    where the two disagree by more than the rounding noise (the truncation
    is not small yet: a step too long for the function's curvature), the
    step is divided by 4, up to 3 times."""
    analytic = float(np.sum(g * v))
    eps = float(np.finfo(dtype).eps)
    for _ in range(4):
        wide, size_wide, _ = _difference(loss, arrays, name, x, h * v, g, dtype)
        narrow, size_narrow, _ = _difference(loss, arrays, name, x, h / 2 * v, g, dtype)
        noise = _ROUNDING_ULPS * eps * max(size_wide, size_narrow) * 1.5 / h
        truncation = abs(narrow / h - wide / (2 * h))
        if not truncation > noise:  # also where not finite: a NaN stays a NaN at any step
            break
        h /= 4
    error = (4 * narrow / h - wide / (2 * h)) / 3  # the errors per unit of <grad, v>, extrapolated
    numeric = analytic + error
    if not (math.isfinite(analytic) and math.isfinite(numeric)):
        return ArgumentCheck(analytic, numeric, math.inf, math.inf, h, 0.0)
    scale = max(abs(analytic), abs(numeric))
    return ArgumentCheck(analytic, numeric, abs(error), abs(error) / scale if scale > 0 else 0.0, h, noise)


def _worse(a: ArgumentCheck | None, b: ArgumentCheck) -> ArgumentCheck:
    """The worse of two checks: not finite first, then the larger error beyond its noise."""
    if a is None:
        return b
    key = lambda c: (not c.finite, c.abs_error - c.noise, c.rel_error)  # noqa: E731
    return b if key(b) > key(a) else a


def check_gradient(
    loss: Callable[[dict[str, Any]], float],
    grads: Mapping[str, Any],
    arrays: Mapping[str, Any],
    dtype: np.dtype,
    directions: int = 2,
    step: float | None = None,
    seed: int = 0,
) -> GradCheckReport:
    """Check each gradient in `grads` (of an argument in `arrays`) along
    random directions.

    Args:
        loss: the loss of a dict of every argument.
        grads: the gradient under test, by argument name.
        arrays: the point: every argument by name.
        dtype: the arguments' dtype (for the step, and the shifted copies).
        directions: random directions drawn per argument.
        step: the step h; None: `default_step`.
        seed: the seed of the directions.

    Returns:
        The GradCheckReport.
    """
    rng = np.random.default_rng(seed)
    checks = {}
    for name, grad in grads.items():
        if name not in arrays:  # a named output's gradient: not an argument to move
            continue
        x = np.asarray(arrays[name], dtype=dtype)
        g = np.asarray(grad, dtype=np.float64).reshape(x.shape)
        h = default_step(dtype, x) if step is None else step
        worst = None
        for _ in range(directions):
            v = rng.standard_normal(x.shape)
            v /= max(float(np.linalg.norm(v)), 1e-300)
            worst = _worse(worst, _direction(loss, arrays, name, x, g, v, h, dtype))
        if worst is not None:
            checks[name] = worst
    return GradCheckReport(checks, directions)


def enforce(report: GradCheckReport, rtol: float, atol: float) -> None:
    """Raise when an argument's gradient or differences are not finite, or
    its error exceeds atol + rtol * max(|analytic|, |numeric|) + noise.

    Raises:
        GradientCheckError: naming each argument that failed.
    """
    failed = []
    for name, a in report.arguments.items():
        if not a.finite:
            failed.append(f"{name}: <grad, v> = {a.analytic:.12g} and the central difference is {a.numeric:.12g} "
                          "(not finite)")
        elif not a.passes(rtol, atol):
            failed.append(f"{name}: <grad, v> = {a.analytic:.12g} but the central difference is {a.numeric:.12g} "
                          f"(error {a.abs_error:.2e} > atol + rtol * scale + noise = {a.allowed(rtol, atol):.2e})")
    if failed:
        raise GradientCheckError("the gradient disagrees with central differences along a random direction: "
                                 + "; ".join(failed))


__all__ = ["DEFAULT_TOLERANCE", "ArgumentCheck", "GradCheckReport", "check_gradient", "default_step",
           "default_tolerance", "enforce"]
