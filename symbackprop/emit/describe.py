"""A generated module describes itself in C, in the manner of CasADi's
generated code (f_n_in, f_name_in, f_sparsity_in, f_work): a C or C++
program can find every function's arrays, their names and their shapes
for given dimensions, and the workspace, without reading Python.

For the module <prefix>: <prefix>_n_dims() and <prefix>_name_dim(i), the
dimensions in the order a `dims` array holds them. For each public function
F: F_n_in(), F_n_out(), F_name_in(i), F_name_out(i), F_kind_in(i) (a code of
run.abi.ARG_KINDS), F_shape_in(i, dims, shape), F_shape_out(i, dims, shape)
(a status of run.abi.STATUS_TEXT), besides F_work_len(dims...). Arrays are
dense: a shape is (rows, cols), row-major. The names are the C parameter
names of F (cnames), so they are plain identifiers. templates/describe.c.j2
prints the definitions, module.h.j2 the declarations; docs/c_programs.md
shows them used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from symbackprop.emit.cnames import describing
from symbackprop.run.abi import ARG_INDEX, ARG_REAL, ARG_UPDATED

# What the shape functions return (run.abi.STATUS_TEXT): success, a
# dimension below 1, no argument of that number.
SHAPE_STATUSES = (0, 1, 3)


@dataclass(frozen=True)
class CArgument:
    """One array of a function, as its self-description tells it."""

    name: str  # its C parameter name
    kind: int  # run.abi.ARG_KINDS (inputs; ARG_REAL for outputs)
    shape: tuple[str, str]  # C expressions in the dimensions' C names


@dataclass(frozen=True)
class CDescription:
    """What the self-describing functions of one function return."""

    function: str
    names: dict[str, str]  # cnames.describing: what -> C name
    inputs: tuple[CArgument, ...]
    outputs: tuple[CArgument, ...]


def _kind(role: str, index: bool) -> int:
    return ARG_UPDATED if role == "inout" else ARG_INDEX if index else ARG_REAL


def describe(fn: Any) -> CDescription:
    """The description of a public function (codegen.CFunction): its array
    parameters in C order, those it reads and those it only writes."""
    inputs: list[CArgument] = []
    outputs: list[CArgument] = []
    for p in fn.params:
        if p.role in ("input", "inout", "output"):
            rows, cols = p.shape
            arg = CArgument(p.cname, _kind(p.role, p.index), (rows, cols))
            (outputs if p.role == "output" else inputs).append(arg)
    return CDescription(fn.name, describing(fn.name), tuple(inputs), tuple(outputs))


__all__ = ["SHAPE_STATUSES", "CArgument", "CDescription", "describe"]
