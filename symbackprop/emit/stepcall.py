"""A train step that calls value_and_grad: the forward and backward passes
are C of one function, and the step adds the optimizer's update.

The step's own schedule is the update alone, reading each gradient as an
array of value_and_grad's output name (pipeline's train_step). Its C
declares those arrays in its workspace after its own buffers, calls the
module's value_and_grad with them (and the step's loss, and the rest of
the workspace), and returns the call's status where it is not 0: the call
checks the arguments and writes nothing when they fail, as the step did.
"""

from __future__ import annotations

from dataclasses import replace

from symbackprop.emit.codegen import CFunction


def _size(shape: tuple[str, ...]) -> str:
    return "*".join(d if d.isidentifier() or d.isdigit() else f"({d})" for d in shape)


def _plus(base: str, size: str) -> str:
    return base if size in ("", "0") else f"{base} + {size}"


def calling_step(step: CFunction, callee: CFunction) -> CFunction:
    """`step` (emitted from the update's schedule, with the loss among its
    outputs) as a function that first calls `callee` (value_and_grad)."""
    own = step.work_size
    where = "work" if own == "0" else f"work + {own}" if own.isidentifier() or own.isdigit() else f"work + ({own})"
    pointers: list[tuple[str, str, str]] = []
    args: list[str] = []
    sizes: list[str] = []
    names = {p.name: p.cname for p in step.params}
    for p in callee.params:
        if p.role == "output" and p.name == "loss":
            args.append(names["loss"])
        elif p.role == "output":
            pointers.append((p.cname, where, " x ".join(p.shape)))
            args.append(p.cname)
            where, size = p.cname, _size(p.shape)
            where = _plus(where, size)
            sizes.append(size)
        elif p.role == "work":
            args.append(where)
        else:
            args.append(names.get(p.name, p.cname))
    dims = ", ".join(p.cname for p in callee.params if p.role == "dim")
    work = " + ".join([*(s for s in [own] if s != "0"), *sizes, f"{callee.name}_work_len({dims})"])
    passed = set(args)
    return replace(step, call=f"{callee.name}({', '.join(args)})", call_pointers=tuple(pointers), work_size=work,
                   unused=tuple(u for u in step.unused if u not in passed), checks=callee.checks,
                   divides=callee.divides, statuses=tuple(sorted(set(step.statuses) | set(callee.statuses))),
                   uses_work=True)
