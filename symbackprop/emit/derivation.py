"""The derivation file: the backward pass as math, for code review.

Lists each step of the gradient function in execution order (forward steps,
then the adjoint equations of the backward pass) in LaTeX, and the forward
values the backward pass keeps with the memory they take.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from symbackprop.emit.codegen import REAL_TYPES, template_environment
from symbackprop.emit.templatecache import html
from symbackprop.emit.wrap import wrap_markdown_equations
from symbackprop.schedule.kernel import Kernel, kernel_reads, kernel_writes
from symbackprop.schedule.scheduler import FunctionSchedule

if TYPE_CHECKING:  # only for annotations
    from symbackprop.plan import Plan


@dataclass(frozen=True)
class KeptValue:
    """A forward value the backward pass keeps, as the derivation file lists it.

    Args:
        name: the buffer's name.
        shape: its shape as text, "rows x cols".
        bytes: its size in bytes, an expression as text.
    """

    name: str
    shape: str
    bytes: str


@dataclass(frozen=True)
class Derivation:
    """What the derivation file shows (see derive), as the template gets it.

    Args:
        model_name: the model's name.
        real: the dtype, "float64" or "float32".
        forward: the Equations up to the loss.
        backward: the Equations after it.
        kept: the forward values the backward pass reads.
        kept_bytes: their total size in bytes, as text.
        inputs_read: the leaves the backward pass reads.
        forward_work_bytes: the workspace of forward, as text.
        gradient_work_bytes: the workspace of value_and_grad, as text.
        ops: (function, scalar ops before CSE, after) for both functions.
        forward_work, backward_work: each kernel's work, in order.
        forward_total, backward_total: their sums, as text.
    """

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
    forward_work: tuple[KernelWork, ...] = ()  # each kernel's scalar operations, up to the loss
    backward_work: tuple[KernelWork, ...] = ()  # and after it
    forward_total: str = ""
    backward_total: str = ""


def split_at_loss(fn: FunctionSchedule) -> int:
    """Index of the first backward kernel: the one after the loss is written.

    Args:
        fn: a gradient function's schedule.

    Returns:
        That index; the number of kernels when none writes the loss.
    """
    if fn.split is not None:  # one schedule for forward and gradient: where forward stops
        return fn.split
    for index, kernel in enumerate(fn.kernels):
        if "loss" in kernel_writes(kernel):
            return index + 1
    return len(fn.kernels)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes, as expressions in the symbolic dimensions.

    Args:
        kept: (name, shape, bytes) of each forward value the backward pass reads.
        kept_bytes: their total.
        forward_work_bytes: the workspace of a prediction-only forward pass.
        gradient_work_bytes: the workspace of value_and_grad.
    """

    kept: tuple[tuple[str, tuple, sp.Expr], ...]  # forward values the backward pass reads: (name, shape, bytes)
    kept_bytes: sp.Expr
    forward_work_bytes: sp.Expr  # the workspace of a prediction-only forward pass
    gradient_work_bytes: sp.Expr  # the workspace of value_and_grad

    def sizes(self) -> dict[str, sp.Expr]:
        """The three sizes a module reports (CompiledModule.memory), by name."""
        return {
            "kept_for_backward": self.kept_bytes,
            "prediction": self.forward_work_bytes,
            "value_and_grad": self.gradient_work_bytes,
        }


def memory_plan(forward: FunctionSchedule, gradient: FunctionSchedule, itemsize: int) -> MemoryPlan:
    """What the buffer plans of the two functions hold.

    Args:
        forward: the forward function's schedule.
        gradient: the value_and_grad function's schedule.
        itemsize: bytes per number (8 for float64, 4 for float32).

    Returns:
        The MemoryPlan.
    """
    split = split_at_loss(gradient)
    written_before = {b for k in gradient.kernels[:split] for b in kernel_writes(k)}
    read_after = dict.fromkeys(b for k in gradient.kernels[split:] for b in kernel_reads(k))
    slots = {slot.name: slot for slot in gradient.slots}
    kept = tuple(
        (b, slots[b].shape, sp.expand(sp.sympify(slots[b].shape[0]) * slots[b].shape[1] * itemsize))
        for b in read_after
        if b in written_before and b in slots
    )
    forward_work, gradient_work = forward.work_size, gradient.work_size
    if forward is gradient and gradient.split is not None:
        # one shared function: each public one keeps the results it does not
        # return in its workspace (forward the gradients, value_and_grad the outputs)
        def sizes(names: Iterable[str]) -> sp.Expr:
            shapes = dict(gradient.results)
            return sum((sp.sympify(shapes[n].shape[0]) * shapes[n].shape[1] for n in names), sp.Integer(0))

        names = [n for n, _ in gradient.results]
        head = gradient.written_before_split
        forward_work = gradient.head_work_size + sizes(n for n in names if n not in gradient.first and n in head)
        gradient_work = gradient_work + sizes(n for n in names if n in gradient.first and n != "loss")
    return MemoryPlan(
        kept=kept,
        kept_bytes=sp.expand(sum((k[2] for k in kept), sp.Integer(0))),
        forward_work_bytes=sp.expand(forward_work * itemsize),
        gradient_work_bytes=sp.expand(gradient_work * itemsize),
    )


@dataclass(frozen=True)
class KernelWork:
    """What one kernel computes, counted, for the derivation file.

    Args:
        step: the value it writes (its first equation's left side).
        what: the kind of kernel, in words.
        work: its scalar operations, as text in the dimensions (a product's
            multiply-adds counted apart from other operations).
    """

    step: str
    what: str
    work: str


def _work_text(madds: sp.Expr, ops: sp.Expr) -> str:
    parts = [_counted(madds, "multiply-add")] if madds != 0 else []
    parts += [_counted(ops, "operation")] if ops != 0 or not parts else []
    return ", ".join(parts)


def _counted(count: sp.Expr, noun: str) -> str:
    count = sp.expand(count)
    return f"{count} {noun}{'' if count == 1 else 's'}"


def kernel_work(kernels: Iterable[Kernel]) -> tuple[tuple[KernelWork, ...], str]:
    """Each kernel's work and the total, as the derivation file shows them.

    Args:
        kernels: kernels of a FunctionSchedule, in order.

    Returns:
        (a KernelWork per kernel that runs something, the total as text);
        see each kernel's work().
    """
    rows, total = [], (sp.Integer(0), sp.Integer(0))
    for kernel in kernels:
        madds, ops = kernel.work()
        total = (total[0] + madds, total[1] + ops)
        equations = getattr(kernel, "equations", ())
        if not equations and madds == 0 and ops == 0:
            continue  # runs nothing (a scan's outputs, which its loop wrote)
        step = ", ".join(dict.fromkeys(e.lhs for e in equations)) or "?"
        what = kernel.title
        rows.append(KernelWork(step, what, _work_text(madds, ops)))
    return tuple(rows), _work_text(*total)


def itemsize_of(dtype: str) -> int:
    """Bytes per number of a module dtype.

    Args:
        dtype: "float64" or "float32".

    Returns:
        8 or 4.

    Raises:
        KeyError: dtype is not one of them.
    """
    return 8 if REAL_TYPES[dtype].c == "double" else 4


def derive(
    model_name: str, forward: FunctionSchedule, gradient: FunctionSchedule, dtype: str, leaf_names: list[str]
) -> Derivation:
    """The backward pass as math, for the derivation file.

    Args:
        model_name: the model's name.
        forward: the forward function's schedule.
        gradient: the value_and_grad function's schedule.
        dtype: "float64" or "float32".
        leaf_names: the model's inputs and parameters.

    Returns:
        The Derivation, ready for render_derivation.

    Raises:
        KeyError: dtype is not one of "float64" and "float32".
    """
    memory = memory_plan(forward, gradient, itemsize_of(dtype))
    split = split_at_loss(gradient)
    before, after = gradient.kernels[:split], gradient.kernels[split:]
    read_after = [b for k in after for b in kernel_reads(k)]
    forward_rows, forward_total = kernel_work(before)
    backward_rows, backward_total = kernel_work(after)
    return Derivation(
        model_name=model_name,
        real=dtype,
        forward=tuple(e for k in before for e in k.equations),
        backward=tuple(e for k in after for e in k.equations),
        kept=tuple(KeptValue(name, f"{shape[0]} x {shape[1]}", str(size)) for name, shape, size in memory.kept),
        kept_bytes=str(memory.kept_bytes),
        inputs_read=tuple(b for b in dict.fromkeys(read_after) if b in leaf_names),
        forward_work_bytes=str(memory.forward_work_bytes),
        gradient_work_bytes=str(memory.gradient_work_bytes),
        ops=tuple((fn.name, *fn.op_counts) for fn in ((forward,) if forward is gradient else (forward, gradient))),
        forward_work=forward_rows,
        backward_work=backward_rows,
        forward_total=forward_total,
        backward_total=backward_total,
    )


def plan_derivation(plan: Plan, model_name: str, dtype: str) -> Derivation | None:
    """The derivation of a plan's gradient function (see derive).

    Args:
        plan: the plan of a module's functions.
        model_name: the model's name.
        dtype: "float64" or "float32".

    Returns:
        The Derivation; None when the plan lacks forward or value_and_grad
        (a model without a loss).
    """
    kinds = {fn.kind for fn in plan.functions}
    if not {"forward", "value_and_grad"} <= kinds:
        return None
    forward, gradient = plan.function("forward").schedule, plan.function("value_and_grad").schedule
    return derive(model_name, forward, gradient, dtype, list(plan.lowered.leaves))


def render_derivation_html(derivation: Derivation) -> str:
    """The derivation's equations and kept values as an HTML fragment (for
    Jupyter, whose MathJax typesets the $$...$$ in it); every name escaped.

    Args:
        derivation: what derive returned.

    Returns:
        The text of the template derivation.html.j2.
    """
    environment = html(template_environment())
    return environment.get_template("derivation.html.j2").render(d=derivation)


def render_derivation(derivation: Derivation) -> str:
    """The derivation file's Markdown text.

    Args:
        derivation: what derive returned.

    Returns:
        The text of the template derivation.md.j2.
    """
    return wrap_markdown_equations(template_environment().get_template("derivation.md.j2").render(d=derivation))
