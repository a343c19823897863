"""A gradient check, as torch.autograd.gradcheck and jax.test_util.check_grads
do it: for random directions v, one per draw and argument, the directional
derivative <grad, v> from the gradient under test against the central
difference (f(x + h v) - f(x - h v)) / 2h of the loss alone. Two loss
evaluations per direction, whatever the argument's size.

`CompiledModule.check_grads` (derivatives.py) runs it on a module's
value_and_grad and forward; `symbackprop demo` prints its report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from symbackprop.errors import GradientCheckError


@dataclass(frozen=True)
class ArgumentCheck:
    """The worst direction of one argument.

    Attributes:
        analytic: <grad, v> from the gradient under test.
        numeric: the central difference along v.
        abs_error: |analytic - numeric|.
        rel_error: abs_error / max(|analytic|, |numeric|) (0 where both are 0).
        step: the step h.
    """

    analytic: float
    numeric: float
    abs_error: float
    rel_error: float
    step: float


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
        """The largest relative error over every argument (0 for none)."""
        return max((a.rel_error for a in self.arguments.values()), default=0.0)

    def __str__(self) -> str:
        lines = [f"gradient check, {self.directions} random direction(s) per argument (central differences):"]
        for name, a in self.arguments.items():
            lines.append(f"  {name}: relative error {a.rel_error:.2e} (<grad, v> = {a.analytic:.10g}, "
                         f"difference {a.numeric:.10g}, h = {a.step:.1e})")
        return "\n".join(lines)


def default_step(dtype: np.dtype, x: np.ndarray) -> float:
    """eps^(1/3) of the dtype, scaled by the argument's largest entry: the
    step that balances truncation (h^2) against rounding (eps/h)."""
    scale = max(1.0, float(np.abs(x).max())) if x.size else 1.0
    return float(np.finfo(dtype).eps) ** (1 / 3) * scale


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
            plus = loss({**arrays, name: (x + h * v).astype(dtype)})
            minus = loss({**arrays, name: (x - h * v).astype(dtype)})
            numeric = (float(plus) - float(minus)) / (2 * h)
            analytic = float(np.sum(g * v))
            error = abs(analytic - numeric)
            scale = max(abs(analytic), abs(numeric))
            check = ArgumentCheck(analytic, numeric, error, error / scale if scale > 0 else 0.0, h)
            if worst is None or check.rel_error > worst.rel_error:
                worst = check
        if worst is not None:
            checks[name] = worst
    return GradCheckReport(checks, directions)


def enforce(report: GradCheckReport, rtol: float | None, atol: float | None) -> None:
    """Raise when an argument's error exceeds atol + rtol * |numeric| (a
    tolerance not given is 0; neither given: no check).

    Raises:
        GradientCheckError: naming each argument that failed.
    """
    if rtol is None and atol is None:
        return
    rtol, atol = rtol or 0.0, atol or 0.0
    failed = [f"{name}: <grad, v> = {a.analytic:.12g} but the central difference is {a.numeric:.12g} "
              f"(error {a.abs_error:.2e} > atol + rtol * |difference| = {atol + rtol * abs(a.numeric):.2e})"
              for name, a in report.arguments.items() if a.abs_error > atol + rtol * abs(a.numeric)]
    if failed:
        raise GradientCheckError("the gradient disagrees with central differences along a random direction: "
                                 + "; ".join(failed))


__all__ = ["ArgumentCheck", "GradCheckReport", "check_gradient", "default_step", "enforce"]
