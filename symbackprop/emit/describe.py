"""A generated module describes itself in C, in the manner of CasADi's
generated code (f_n_in, f_name_in, f_sparsity_in, f_work, and f(arg, res,
iw, w, mem)): a C or C++ program can find every function's arrays, their
names and their shapes for given dimensions, and the workspace, and call
the function with its arrays in arrays, without reading Python.

For the module <prefix>: <prefix>_n_dims() and <prefix>_name_dim(i), the
dimensions in the order a `dims` array holds them. For each public function
F (train_epoch too): F_n_dims() and F_name_dim(i), the dimensions its `dims`
array holds (the module's, but for train_epoch: rows, batch, the others);
F_n_in(), F_n_out(), F_name_in(i), F_name_out(i), F_kind_in(i) (a code of
base.abi.ARG_KINDS), F_shape_in(i, dims, shape), F_shape_out(i, dims, shape)
(a status of base.abi.STATUS_TEXT); the array-form call F_call(dims, in, out,
work), which checks its pointers (NULL_POINTER) and calls F, and
F_call_work_len(dims), besides F_work_len(dims...). An input F updates in
place (ARG_UPDATED) is in `in`, as F_kind_in says, and must be writable.
Arrays are dense: a shape is (rows, cols), row-major. The names are the C
parameter names of F (cnames), so they are plain identifiers.

train_epoch's description is read off train_step's (describe_epoch): its
`order` first, then the step's inputs with the batch dimension the data's
rows, and one loss a minibatch. templates/describe.c.j2 prints the
definitions, module.h.j2 the declarations; docs/c_programs.md shows them
used.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from symbackprop.base.abi import ARG_INDEX, ARG_REAL, ARG_UPDATED, SIZE_DOES_NOT_FIT
from symbackprop.base.cnames import describing


class EpochNames(Protocol):
    """What describe_epoch reads of an epoch.CEpoch (a protocol, so that
    neither this module nor codegen imports epoch, which imports codegen)."""

    @property
    def name(self) -> str: ...
    @property
    def step(self) -> str: ...
    @property
    def rows(self) -> str: ...
    @property
    def batch(self) -> str: ...
    @property
    def size(self) -> str: ...
    @property
    def order(self) -> str: ...
    @property
    def losses(self) -> str: ...
    @property
    def dims(self) -> tuple[str, ...]: ...
    @property
    def params(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def statuses(self) -> tuple[int, ...]: ...
    @property
    def size_check(self) -> str | None: ...

# What the shape functions return (base.abi.STATUS_TEXT): success, a
# dimension below 1, no argument of that number, a size that does not fit
# (the function's: emit/sizes.py).
SHAPE_STATUSES = (0, 1, 3, SIZE_DOES_NOT_FIT)
# What F_call returns besides F's statuses: a pointer it needs is NULL.
NULL_POINTER = 4
LINE = 100  # F_call's arguments to F take lines of about this length


@dataclass(frozen=True)
class CArgument:
    """One array of a function, as its self-description tells it."""

    name: str  # its C parameter name
    kind: int  # base.abi.ARG_KINDS (inputs; ARG_REAL for outputs)
    shape: tuple[str, str]  # C expressions in the dimensions' C names


@dataclass(frozen=True)
class CDescription:
    """What the self-describing functions of one function return."""

    function: str
    names: dict[str, str]  # cnames.describing: what -> C name
    dims: tuple[str, ...]  # C names of its dimensions, in the order of its `dims` array
    inputs: tuple[CArgument, ...]
    outputs: tuple[CArgument, ...]
    arguments: tuple[str, ...]  # what F_call passes to F: C expressions in dims, in, out and work
    statuses: tuple[int, ...]  # what F_call returns
    optional: int = 0  # how many first inputs F_call lets be NULL (train_epoch's order)
    size_check: str | None = None  # F's sizes summed, checked C in `dims` (emit/sizes.py); None: fixed

    @property
    def argument_lines(self) -> tuple[str, ...]:
        """F_call's arguments to F: on one line where they fit, else one a
        line, so that an array added or removed is a line of a diff, not
        the lines after it moved along."""
        joined = ", ".join(self.arguments)
        if len(joined) <= LINE - 8:  # after its indent
            return (joined,)
        return tuple(arg + ("," if number < len(self.arguments) - 1 else "") for number, arg in enumerate(self.arguments))

    @property
    def work_len(self) -> str:
        """F_work_len called with the entries of a `dims` array."""
        return f"{self.function}_work_len({', '.join(f'dims[{k}]' for k in range(len(self.dims))) or ''})"


def _kind(role: str, index: bool) -> int:
    return ARG_UPDATED if role == "inout" else ARG_INDEX if index else ARG_REAL


def _pointer(kind: int, real: str) -> str:
    """The C type of an input's pointer: an updated array's is writable."""
    return {ARG_REAL: f"const {real} *", ARG_INDEX: "const int64_t *", ARG_UPDATED: f"{real} *"}[kind]


def _arguments(roles: Sequence[str], inputs: Sequence[CArgument], real: str) -> tuple[str, ...]:
    """F's arguments, in the order of its parameters' roles ("dim", "output",
    "work", else an input), from the array-form call's dims, in, out, work."""
    taken = {"dim": 0, "in": 0, "out": 0}
    out = []
    for role in roles:
        if role == "work":
            out.append("work")
        elif role == "dim":
            out.append(f"dims[{taken['dim']}]")
            taken["dim"] += 1
        elif role == "output":
            out.append(f"({real} *)out[{taken['out']}]")
            taken["out"] += 1
        else:
            i = taken["in"]
            out.append(f"({_pointer(inputs[i].kind, real)})in[{i}]")
            taken["in"] += 1
    return tuple(out)


def _statuses(function_statuses: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted({*function_statuses, NULL_POINTER}))


def describe(fn: Any, real: str) -> CDescription:
    """The description of a public function (codegen.CFunction): its array
    parameters in C order, those it reads and those it only writes; `real`
    is the module's real type in C (its macro)."""
    inputs: list[CArgument] = []
    outputs: list[CArgument] = []
    for p in fn.params:
        if p.role in ("input", "inout", "output"):
            rows, cols = p.shape
            arg = CArgument(p.cname, _kind(p.role, p.index), (rows, cols))
            (outputs if p.role == "output" else inputs).append(arg)
    dims = tuple(p.cname for p in fn.params if p.role == "dim")
    return CDescription(fn.name, describing(fn.name), dims, tuple(inputs), tuple(outputs),
                        _arguments([p.role for p in fn.params], inputs, real), _statuses(fn.statuses),
                        size_check=fn.size_check)


def describe_epoch(step: CDescription, epoch: EpochNames, real: str) -> CDescription:
    """train_epoch's description, read off train_step's: its dimensions are
    the rows of the data, the minibatch size, and the step's others; its
    inputs the row order (an Index, which may be NULL), then the step's, the
    data with all their rows; its output one loss a minibatch."""
    rows = re.compile(rf"\b{re.escape(epoch.size)}\b")  # the step's batch dimension: the data's rows here
    inputs = (CArgument(epoch.order, ARG_INDEX, (epoch.rows, "1")),) + tuple(
        CArgument(a.name, a.kind, (rows.sub(epoch.rows, a.shape[0]), rows.sub(epoch.rows, a.shape[1])))
        for a in step.inputs)
    minibatches = f"({epoch.rows} - 1)/{epoch.batch} + 1"  # rows + batch - 1 would overflow
    outputs = (CArgument(epoch.losses, ARG_REAL, (minibatches, "1")),)
    roles = [role for role, _ in epoch.params]
    return CDescription(epoch.name, describing(epoch.name), (epoch.rows, epoch.batch, *epoch.dims), inputs, outputs,
                        _arguments(roles, inputs, real), _statuses(epoch.statuses), optional=1,
                        size_check=epoch.size_check)


__all__ = ["NULL_POINTER", "SHAPE_STATUSES", "CArgument", "CDescription", "describe", "describe_epoch"]
