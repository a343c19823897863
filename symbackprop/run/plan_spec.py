"""The ABI spec (abi.py) of a planned module: what each generated C
function takes and returns, read off its Plan. The runtime stores the spec
in the memo and runs from it; abi.py itself is plain data that imports no
stage."""

from __future__ import annotations

from typing import Any

import sympy as sp

from symbackprop.base.abi import ArgSpec, FunctionSpec, ModuleSpec, ReturnSpec, Shape
from symbackprop.declare.model import Model, leaf_name
from symbackprop.emit.epoch import try_epoch_plan
from symbackprop.plan import FunctionPlan, Plan


def _dim(d: Any) -> int | str:
    return str(d) if isinstance(d, sp.Symbol) else int(d)


def _shape(shape: tuple) -> Shape:
    return tuple(_dim(d) for d in shape)


def scalar_names(model: Model) -> set[str]:
    """Names passed and returned as numbers: Symbol leaves, the loss, and
    outputs given as scalar (non-matrix) expressions."""
    names = {leaf_name(s) for s in model.inputs + model.params if isinstance(s, sp.Symbol)}
    names.add("loss")
    names |= {n for n, e in model.outputs.items() if not isinstance(e, (sp.MatrixExpr, sp.MatrixBase))}
    return names


def function_spec(fn: FunctionPlan, plan: Plan, scalars: set[str]) -> FunctionSpec:
    """The spec of one planned function."""
    roles = {arg: (role, key) for arg, role, key in fn.extra_roles}
    if fn.kind == "vjp":
        roles[fn.extra_inputs[0][0]] = ("seed", fn.of_output or "")
    inputs = [ArgSpec(n, _shape(node.shape), n in scalars, node.attrs[1] == "index") for n, node in plan.lowered.leaves.items()]
    for name, node in fn.extra_inputs:
        role, key = roles.get(name, ("extra", name))
        # a number where one is meant: hyperparameters, scalar leaves' tangents, and the
        # seed of any output of shape (1, 1) (a float, 0-d, (1,) or (1, 1), as its vjp's default 1)
        scalar = role == "hyper" or (node.shape == (1, 1) and (key in scalars or role == "seed"))
        inputs.append(ArgSpec(name, _shape(node.shape), scalar, False, role, key))
    bounds: dict[str, list] = {}
    called = fn.calls.schedule if fn.calls is not None else None  # a train step's value_and_grad
    for kernel in fn.schedule.kernels + (called.kernels if called is not None else ()):
        for name, _, bound in getattr(kernel, "index_checks", ()):
            if _dim(bound) not in bounds.setdefault(name, []):
                bounds[name].append(_dim(bound))
    nodes = {**(dict(called.results) if called is not None else {}), **dict(fn.schedule.results)}
    outputs = tuple(ReturnSpec(out, group, key, _shape(nodes[out].shape), key in scalars) for out, group, key in fn.returns)
    batch: str | None = None
    data: tuple[str, ...] = ()
    if fn.kind == "train_step":
        epoch = try_epoch_plan(plan.lowered, fn)
        if epoch is not None:
            batch, data = str(epoch.batch), epoch.data
    return FunctionSpec(fn.kind, fn.of_output, fn.function_name, tuple(str(d) for d in plan.lowered.dims),
                        tuple(inputs), outputs, tuple((k, tuple(v)) for k, v in bounds.items()),
                        tuple(sorted(fn.inplace)), batch, data, plan.lowered.minimums)


def module_spec(plan: Plan, model: Model, dtype: str, prefix: str) -> ModuleSpec:
    """The spec of a planned module (the one function that makes one)."""
    scalars = scalar_names(model)
    lowered = plan.lowered
    outputs = tuple((n, _shape(node.shape), n in scalars) for n, node in lowered.outputs.items())
    has_loss = model.has_loss
    return ModuleSpec(prefix, dtype, tuple(str(d) for d in lowered.dims), tuple(lowered.leaves), outputs,
                      _shape(lowered.loss.shape), has_loss, tuple(plan.wrt),
                      tuple(function_spec(fn, plan, scalars) for fn in plan.functions))


__all__ = ["function_spec", "module_spec", "scalar_names"]
