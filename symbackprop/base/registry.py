"""One record per IR op: everything each stage needs to know about it.

A family module (elementwise.py, matmul.py, reduce.py, views.py, emap.py;
scan registers its own) declares an op's rules side by side and registers
one `OpRecord`. The drivers (lowering, vjp/jvp, interpreter, scheduler,
emitter, grad_fn graph) look records up by the op's tag and hold no
per-op ladder. A missing op or a missing field is an error that names both.

The family modules are imported on the first look-up, not here: they build
on ir, schedule and codegen, which read the registry themselves.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from symbackprop.errors import ModelError

if TYPE_CHECKING:  # only for annotations: the registry imports no stage
    import numpy as np
    import sympy as sp

    from symbackprop.ir.node import Node
    from symbackprop.schedule.kernel import View

VjpRule = Callable[["Node", "Node", Sequence[bool]], tuple["Node | None", ...]]
JvpRule = Callable[["Node", Sequence["Node | None"]], "Node | None"]
Evaluator = Callable[["Node", list["np.ndarray"], Any], "np.ndarray"]  # (node, argument values, interpret.Context)
KernelBuilder = Callable[[Any, "Node", str], Any]  # (scheduler, node, output buffer) -> kernel
GroupKernelBuilder = Callable[[Any, list["Node"]], Any]  # (scheduler, the nodes of one loop) -> kernel
Emitter = Callable[[Any, Any], dict]  # (codegen.FunctionEmitter, kernel) -> the template's fields
GradFnName = Callable[["Node"], tuple[str, list]]  # node -> (grad_fn name, [operand shown below it])
LoweringRule = Callable[[Any, Any], "Node"]  # (ir lowerer, SymPy expression) -> node
ShapeRule = Callable[[Any, Callable[[Any], tuple]], tuple]  # (SymPy expression, shape of a subexpression) -> shape
TermMerger = Callable[[list["Node"]], list["Node"]]  # a sum's terms -> the same sum in fewer terms


class MissingRule(ModelError, LookupError):
    """An op is not registered, or its record lacks the field a stage needs."""


@dataclass(frozen=True)
class ViewRule:
    """How a view op reads its argument's memory, with no kernel of its own."""

    strides: Callable[[View, Node], View]  # the argument's view -> the node's
    label: Callable[[str, Node], str]  # the argument's label -> the node's ("A^T", "A[0,1]")
    symbol: Callable[[sp.Basic, Node], sp.Basic]  # the argument's SymPy stand-in -> the node's


@dataclass(frozen=True)
class OpRecord:
    """An IR op tag and its rules; None where a stage does not apply to it.

    name: the tag of ir.Node.op.
    vjp, jvp: derivative rules (see autodiff).
    evaluate: the numpy reference (see interpret).
    kernel: builds the kernel of one node in the scheduler (None: fused or
        a view). A kernel says what it touches with reads() and writes(),
        and its `kind` is the op whose emit and template print it.
    fused: the scheduler groups nodes of this op into shared loops:
        "elementwise" (map: the scheduler's own fused loops) or "examples"
        (emap); None: one kernel a node.
    group_kernel: the kernel of one group of a fused op (emap's loops).
    emit: the template data of the op's kernel (see codegen).
    template: the macro of templates/macros.j2 that prints the kernel, or
        a template file (name ending in .j2) it includes.
    grad_fn: the node's name in the grad_fn graph and its operands (see graph).
    view: how a view op (transpose, element) reads its argument, else None.
    lowering: (SymPy class, rule) pairs of what lowers to this op.
    shapes: (SymPy class, rule) pairs: a lowered class's shape from its
        arguments' (without SymPy's own walk over the whole subtree).
    reduction: a reduction over one axis, named in sbp.reduce(name, x, axis).
    helper: its kernel calls the module's C function <prefix>_<name>, whose
        definition is the block of that name in templates/reduce.c.j2
        (linalg.c.j2 for linear algebra), in the runtime header.
    loop: its node runs a loop over a step graph of its own (scan, its
        backward pass, fixed_point): a Hessian-vector product through one
        goes reverse over forward. A loop's step may hold another (emitted
        inside the outer loop's body, its scratch in the step's).
    attrs: what the op's kernel does, as data of its family (a frozen
        dataclass: which loop nest, gather or scatter, ...): the family's
        kernel, emit and template read these, not the op's name.
    merge_terms: how the terms of an adjoint's sum that are nodes of this
        op combine into fewer (slice_scatter: disjoint slices of one parent
        as one buffer); autodiff's sum applies it.
    """

    name: str
    vjp: VjpRule | None = None
    jvp: JvpRule | None = None
    evaluate: Evaluator | None = None
    kernel: KernelBuilder | None = None
    fused: str | None = None
    group_kernel: GroupKernelBuilder | None = None
    emit: Emitter | None = None
    template: str | None = None
    grad_fn: GradFnName | None = None
    view: ViewRule | None = None
    lowering: tuple[tuple[type, LoweringRule], ...] = ()
    shapes: tuple[tuple[type, ShapeRule], ...] = ()
    reduction: bool = False
    helper: bool = False
    loop: bool = False
    attrs: object = None
    merge_terms: TermMerger | None = None

    def need(self, field: str) -> Any:
        """The value of `field`, or MissingRule naming the op and the field."""
        value = getattr(self, field)
        if value is None:
            raise MissingRule(f"op {self.name!r} has no {field} in its record (symbackprop.ops)")
        return value


FIELDS = tuple(f.name for f in fields(OpRecord))
_RECORDS: dict[str, OpRecord] = {}
_LOWERING: dict[type, tuple[str, LoweringRule]] = {}
_SHAPES: dict[type, ShapeRule] = {}
# the modules that register ops (on import), loaded on the first look-up
FAMILIES = tuple(f"symbackprop.ops.{family}"
                 for family in ("elementwise", "matmul", "extreme", "reduce", "cumulative", "views", "emap", "linalg", "conv",
                                "attention", "pick", "normalize", "slices"))
FAMILIES += ("symbackprop.loops.register", "symbackprop.diff.nested")
_loaded = False


def register(record: OpRecord) -> OpRecord:
    """Add an op's record (an op registered twice is an error)."""
    if record.name in _RECORDS:
        raise ValueError(f"op {record.name!r} is registered twice")
    _RECORDS[record.name] = record
    _index(record)
    return record


def extend(op: str, **values: Any) -> OpRecord:
    """Set fields of an op's record, creating it if new (a module that
    declares an op's rules in several places, as scan does)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise TypeError(f"OpRecord has no field {sorted(unknown)[0]!r}")
    record = replace(_RECORDS.get(op, OpRecord(op)), **values)
    _RECORDS[op] = record
    _index(record)
    return record


def _index(record: OpRecord) -> None:
    for cls, rule in record.lowering:
        _LOWERING[cls] = (record.name, rule)
    _SHAPES.update(record.shapes)


def _load() -> None:
    """Import the built-in families once (they register on import)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for family in FAMILIES:
            importlib.import_module(family)


def record(op: str) -> OpRecord:
    """The record of `op`.

    Raises:
        MissingRule: no op of that name is registered.
    """
    _load()
    found = _RECORDS.get(op)
    if found is None:
        raise MissingRule(f"op {op!r} is not registered (symbackprop.ops)")
    return found


_Attrs = TypeVar("_Attrs")


def attrs_of(op: str, family: type[_Attrs]) -> _Attrs:
    """The `attrs` of op's record, an instance of its family's `family`.

    Raises:
        MissingRule: the op is not registered, or its attrs are not a `family`.
    """
    found = record(op).attrs
    if not isinstance(found, family):
        raise MissingRule(f"op {op!r} has no {family.__name__} attrs in its record")
    return found


def plain_grad_fn(name: str) -> GradFnName:
    """A grad_fn rule that shows every argument below a node of this name."""
    return lambda node: (name, list(node.args))


def rule(op: str, field: str) -> Any:
    """record(op).need(field): the field, or MissingRule naming both."""
    return record(op).need(field)


def records() -> list[OpRecord]:
    """Every registered record, in registration order."""
    _load()
    return list(_RECORDS.values())


def is_view(op: str) -> bool:
    """Whether `op` is a view: read through its argument's memory, never stored."""
    _load()
    found = _RECORDS.get(op)
    return found is not None and found.view is not None


def is_loop(op: str) -> bool:
    """Whether `op`'s node runs a loop over a step graph of its own (OpRecord.loop)."""
    _load()
    found = _RECORDS.get(op)
    return found is not None and found.loop


def reductions() -> tuple[str, ...]:
    """The reductions over one axis: the one list of their names."""
    return tuple(r.name for r in records() if r.reduction)


def helpers() -> frozenset[str]:
    """The ops whose kernels call a C helper of their name (reduce.c.j2, linalg.c.j2)."""
    return frozenset(r.name for r in records() if r.helper)


def lowering_rule(cls: type) -> tuple[str, LoweringRule] | None:
    """(op, rule) for a SymPy class that lowers through a record, else None."""
    _load()
    return _inherited(_LOWERING, cls)


def shape_rule(cls: type) -> ShapeRule | None:
    _load()
    return _inherited(_SHAPES, cls)


def _inherited(table: dict, cls: type) -> Any:
    """table's entry for cls, else for the SymPy class it declares it is
    (`sympy_class`: nn's layers are SymPy's classes with what they compute
    remembered, symbackprop.declare.standing.Layered). Not any base's: an
    Inverse is a MatPow to Python, not to lowering."""
    found = table.get(cls)
    if found is None and getattr(cls, "sympy_class", None) is not None:
        found = table.get(cls.sympy_class)  # type: ignore[attr-defined]
    return found
