"""The pipeline from a Model to generated C: lower, differentiate, schedule,
emit. Each stage is a plain function of the previous stage's value."""

from __future__ import annotations

from dataclasses import dataclass

from ._version import __version__
from .autodiff import vjp
from .cnames import CNamer, comment_text, sanitize
from .codegen import REAL_TYPES, CModule, Emitted, emit_function, render
from .derivation import derive, render_derivation
from .errors import ModelError
from .ir import SCALAR, Lowered, const, lower
from .model import Model, leaf_name
from .schedule import FunctionSchedule, Naming, schedule


@dataclass(frozen=True)
class Plan:
    """Everything between the model and its C text, for inspection."""

    lowered: Lowered
    functions: tuple[FunctionSchedule, ...]
    grad_names: dict[str, str]  # leaf name -> gradient output name
    naming: Naming


def plan(model: Model) -> Plan:
    """Lower the model, differentiate its loss and schedule both functions."""
    lowered = lower(model)
    forward_results = [("loss", lowered.loss)] + list(lowered.outputs.items())
    wrt = [lowered.leaves[leaf_name(s)] for s in model.differentiated]
    grads, origins = vjp([(lowered.loss, const(1, SCALAR))], wrt)
    naming = Naming(lowered.leaves, forward_results, origins)
    grad_names = {leaf_name(s): naming.claim("grad_" + leaf_name(s)) for s in model.differentiated}
    grad_results = [("loss", lowered.loss)] + [(grad_names[leaf_name(s)], g) for s, g in zip(model.differentiated, grads)]
    leaves = list(lowered.leaves.values())
    functions = (
        schedule("forward", forward_results, naming, leaves),
        schedule("value_and_grad", grad_results, naming, leaves),
    )
    return Plan(lowered, functions, grad_names, naming)


SUMMARIES = {
    "forward": "Forward pass: the loss and the named outputs.",
    "value_and_grad": "The loss and its gradient with respect to each parameter (reverse mode).",
}


def generate(model: Model, dtype: str = "float64") -> tuple[Emitted, Plan]:
    """C source, header and cffi declarations for the model."""
    if dtype not in REAL_TYPES:
        raise ModelError(f"dtype must be one of {sorted(REAL_TYPES)}; got {dtype!r}")
    real = REAL_TYPES[dtype]
    the_plan = plan(model)
    lowered = the_plan.lowered
    prefix = sanitize(model.name).lower()
    namer = CNamer(frozenset({prefix}))
    dims = {d: namer.name(str(d)) for d in lowered.dims}
    inputs = [(name, node.shape) for name, node in lowered.leaves.items()]
    functions = []
    for fn in the_plan.functions:
        outputs = [(name, node.shape) for name, node in fn.results]
        functions.append(emit_function(fn, namer, dims, real, inputs, outputs, SUMMARIES[fn.name], prefix))
    module = CModule(
        prefix=prefix,
        guard=f"{prefix.upper()}_H",
        model_name=comment_text(model.name),
        real=real.name,
        real_c=real.c,
        functions=tuple(functions),
        version=__version__,
    )
    source, header, cdef = render(module)
    forward, gradient = the_plan.functions
    derivation = render_derivation(derive(model.name, forward, gradient, dtype, list(lowered.leaves)))
    return Emitted(prefix, source, header, cdef, derivation, module), the_plan


__all__ = ["Plan", "generate", "plan"]
