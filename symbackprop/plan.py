"""What the compiler plans between a model and its C text: one
FunctionPlan per C function (its schedule, extra arguments and what each
output means), gathered in a Plan. Plain data: the stages after planning
(epoch, the ABI spec, the graph printer) read it without importing the
compiler that makes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: the fields hold values of the stages before
    from symbackprop.ir.lower import Lowered
    from symbackprop.ir.node import Node
    from symbackprop.schedule.naming import Naming
    from symbackprop.schedule.scheduler import FunctionSchedule


# What compile() builds unless told otherwise.
DEFAULT_FUNCTIONS = ("forward", "value_and_grad")


@dataclass(frozen=True)
class FunctionPlan:
    """One C function: its schedule, its array arguments beyond the model's
    leaves, and what each output argument means to the caller."""

    kind: str
    schedule: FunctionSchedule
    extra_inputs: tuple[tuple[str, Node], ...]  # (argument name, leaf node)
    returns: tuple[tuple[str, str, str], ...]  # (output argument, group, key), e.g. ("grad_W1", "grads", "W1")
    of_output: str | None = None  # vjp: the output it is for
    inplace: frozenset[str] = frozenset()  # inputs the function overwrites (train_step)
    extra_roles: tuple[tuple[str, str, str], ...] = ()  # (argument, role, key): ("tangent_W1", "tangent", "W1")
    shared: bool = False  # forward and value_and_grad: one schedule, which forward leaves at its split
    # train_step: the value_and_grad it calls first for the loss and the gradient (its schedule
    # is then the optimizer's update alone, reading each gradient as a leaf of that name)
    calls: FunctionPlan | None = None

    @property
    def function_name(self) -> str:
        """Its C name without the module prefix."""
        return self.kind if self.shared else self.schedule.name


@dataclass(frozen=True)
class Plan:
    """Everything between the model and its C text, for inspection."""

    lowered: Lowered
    functions: tuple[FunctionPlan, ...]
    wrt: tuple[str, ...]
    naming: Naming

    def function(self, kind: str, output: str | None = None) -> FunctionPlan:
        for fn in self.functions:
            if fn.kind == kind and fn.of_output == output:
                return fn
        raise KeyError((kind, output))


__all__ = ["FunctionPlan", "Plan"]
