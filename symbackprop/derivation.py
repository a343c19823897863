"""The derivation file: the backward pass as math, for code review.

Lists each step of the gradient function in execution order (forward steps,
then the adjoint equations of the backward pass) in LaTeX, and the forward
values the backward pass keeps with the memory they take.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .codegen import REAL_TYPES, template_environment
from .schedule import FunctionSchedule, kernel_reads, kernel_writes


@dataclass(frozen=True)
class KeptValue:
    name: str
    shape: str
    bytes: str


@dataclass(frozen=True)
class Derivation:
    model_name: str
    real: str
    forward: tuple  # Equations up to the loss
    backward: tuple  # Equations after it
    kept: tuple[KeptValue, ...]
    kept_bytes: str
    inputs_read: tuple[str, ...]
    forward_work_bytes: str
    gradient_work_bytes: str
    ops: tuple[tuple[str, int, int], ...]  # (function, scalar ops before CSE, after)


def _bytes(count: sp.Expr, itemsize: int) -> str:
    return str(sp.expand(sp.sympify(count) * itemsize))


def split_at_loss(fn: FunctionSchedule) -> int:
    """Index of the first backward kernel: the one after the loss is written."""
    for index, kernel in enumerate(fn.kernels):
        if "loss" in kernel_writes(kernel):
            return index + 1
    return len(fn.kernels)


def derive(model_name: str, forward: FunctionSchedule, gradient: FunctionSchedule, dtype: str, leaf_names: list[str]) -> Derivation:
    itemsize = 8 if REAL_TYPES[dtype].c == "double" else 4
    split = split_at_loss(gradient)
    before, after = gradient.kernels[:split], gradient.kernels[split:]
    written_before = {b for k in before for b in kernel_writes(k)}
    read_after = [b for k in after for b in kernel_reads(k)]
    slots = {slot.name: slot for slot in gradient.slots}
    kept_names = [b for b in dict.fromkeys(read_after) if b in written_before and b in slots]
    kept = tuple(
        KeptValue(b, f"{slots[b].shape[0]} x {slots[b].shape[1]}", _bytes(sp.sympify(slots[b].shape[0]) * slots[b].shape[1], itemsize))
        for b in kept_names
    )
    total = sum((sp.sympify(slots[b].shape[0]) * slots[b].shape[1] for b in kept_names), sp.Integer(0))
    return Derivation(
        model_name=model_name,
        real=dtype,
        forward=tuple(e for k in before for e in k.equations),
        backward=tuple(e for k in after for e in k.equations),
        kept=kept,
        kept_bytes=_bytes(total, itemsize),
        inputs_read=tuple(b for b in dict.fromkeys(read_after) if b in leaf_names),
        forward_work_bytes=_bytes(forward.work_size, itemsize),
        gradient_work_bytes=_bytes(gradient.work_size, itemsize),
        ops=tuple((fn.name, *fn.op_counts) for fn in (forward, gradient)),
    )


def render_derivation(derivation: Derivation) -> str:
    return template_environment().get_template("derivation.md.j2").render(d=derivation)
