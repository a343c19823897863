"""The ABI of a compiled module as plain data: what each generated C
function takes and returns, in the order C takes it.

The run stage (run/, binding.py) runs from this description alone, so a
module loaded from the cache needs no Plan. `plan_spec.module_spec(plan,
...)` makes it from a Plan (this module imports no stage); `to_json()` and `from_json()` turn it into JSON-able dicts
and back (from_json checks every field's type and raises ValueError on
anything unexpected: the memo on disk is not trusted).

Shapes are pairs (rows, cols); each entry is an int (a fixed size) or the
name of a symbolic dimension. A scalar is passed and returned as a number
(shape (1, 1) in C); an Index is int64 row numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from symbackprop.messages import show

Dim = "int | str"
Shape = tuple  # (rows, cols): ints and dimension names

KINDS = ("forward", "value_and_grad", "vjp", "jvp", "hvp", "train_step")


@dataclass(frozen=True)
class ArgSpec:
    """One array argument of a C function."""

    name: str
    shape: Shape
    scalar: bool = False  # passed as a number (or an array of one element)
    index: bool = False  # an Index: int64 row numbers, 1-D or (rows, 1)
    role: str = "leaf"  # "leaf" (an input or param), or seed/tangent/direction/hyper/state
    key: str = ""  # for an extra argument: the leaf, output or hyperparameter it is for


@dataclass(frozen=True)
class ReturnSpec:
    """One output argument of a C function and what it means to the caller."""

    name: str
    group: str  # "loss", "outputs", "grads", "hvp"
    key: str  # e.g. the param a gradient is for
    shape: Shape
    scalar: bool = False


@dataclass(frozen=True)
class FunctionSpec:
    """One generated C function."""

    kind: str
    of_output: str | None  # vjp: the output it is for
    c_name: str  # without the module prefix
    dims: tuple[str, ...]  # its dimension arguments, in order
    inputs: tuple[ArgSpec, ...]  # in C order: the leaves, then the extra arguments
    outputs: tuple[ReturnSpec, ...]
    index_bounds: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (Index, rows of each array it gathers from)
    inplace: tuple[str, ...] = ()  # arguments it overwrites (train_step)
    epoch_batch: str | None = None  # train_step: the batch dimension of train_epoch, if any
    epoch_data: tuple[str, ...] = ()  # train_step: the inputs train_epoch slices into minibatches
    # (dimension, least value, why): a fixed entry or slice the model takes along a dimension bound
    # at call time needs it that large (X[2, 0] of X (n x 3): n >= 3); the C returns status 1 below it
    minimums: tuple[tuple[str, int, str], ...] = ()

    @property
    def extra_roles(self) -> tuple[tuple[str, str, str], ...]:
        """(argument, role, key) of the arguments beyond the leaves."""
        return tuple((a.name, a.role, a.key) for a in self.inputs if a.role != "leaf")


@dataclass(frozen=True)
class ModuleSpec:
    """A compiled module: its functions and what the caller sees of the model."""

    prefix: str
    dtype: str
    dims: tuple[str, ...]
    leaves: tuple[str, ...]  # inputs then params, in C order
    outputs: tuple[tuple[str, Shape, bool], ...]  # named outputs: (name, shape, scalar)
    loss_shape: Shape
    has_loss: bool  # False for a model declared with outputs only
    wrt: tuple[str, ...]
    functions: tuple[FunctionSpec, ...]

    def function(self, kind: str, output: str | None = None) -> FunctionSpec:
        for fn in self.functions:
            if fn.kind == kind and fn.of_output == output:
                return fn
        raise KeyError((kind, output))

    def output_shape(self, name: str) -> Shape:
        """The shape of "loss" or a named output (KeyError if none)."""
        if name == "loss":
            return self.loss_shape
        return next(shape for out, shape, _ in self.outputs if out == name)

    def to_json(self) -> dict:
        """The spec as nested dicts, lists, strings, ints, bools and None."""
        return _to_json(self)

    @classmethod
    def from_json(cls, data: Any) -> ModuleSpec:
        """The spec to_json described. Raises ValueError on any unexpected
        key, type or value."""
        return _module_from(data)


# --- JSON ---------------------------------------------------------------------


def _to_json(value: Any) -> Any:
    if isinstance(value, (ModuleSpec, FunctionSpec, ArgSpec, ReturnSpec)):
        return {f: _to_json(getattr(value, f)) for f in value.__dataclass_fields__}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


def _fail(where: str, what: str, got: Any) -> ValueError:
    return ValueError(f"ABI spec: {where} must be {what}; got {type(got).__name__} {str(got)[:60]!r}")


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _fail(where, "a string", value)
    return value


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _fail(where, "a bool", value)
    return value


def _list(value: Any, where: str) -> list:
    if type(value) is not list:
        raise _fail(where, "a list", value)
    return value


def _strs(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_str(v, where) for v in _list(value, where))


def _size(value: Any, where: str) -> int | str:
    if type(value) is int and value >= 1:
        return value
    if type(value) is str and value:
        return value
    raise _fail(where, "a positive int or a dimension name", value)


def _shape_from(value: Any, where: str) -> Shape:
    items = _list(value, where)
    if len(items) != 2:
        raise _fail(where, "a pair (rows, cols)", value)
    return tuple(_size(v, where) for v in items)


def _fields(data: Any, cls: type, where: str) -> dict:
    if type(data) is not dict:
        raise _fail(where, "an object", data)
    fields = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if set(data) != fields:
        raise ValueError(f"ABI spec: {where} has the keys {sorted(data)}; expected {sorted(fields)}")
    return data


def _arg_from(data: Any, where: str) -> ArgSpec:
    d = _fields(data, ArgSpec, where)
    return ArgSpec(_str(d["name"], where), _shape_from(d["shape"], where), _bool(d["scalar"], where),
                   _bool(d["index"], where), _str(d["role"], where), _str(d["key"], where))


def _return_from(data: Any, where: str) -> ReturnSpec:
    d = _fields(data, ReturnSpec, where)
    return ReturnSpec(_str(d["name"], where), _str(d["group"], where), _str(d["key"], where),
                      _shape_from(d["shape"], where), _bool(d["scalar"], where))


def _bounds_from(value: Any, where: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    out = []
    for item in _list(value, where):
        pair = _list(item, where)
        if len(pair) != 2:
            raise _fail(where, "a pair (index, bounds)", item)
        out.append((_str(pair[0], where), tuple(_size(b, where) for b in _list(pair[1], where))))
    return tuple(out)


def _function_from(data: Any, where: str) -> FunctionSpec:
    d = _fields(data, FunctionSpec, where)
    kind = _str(d["kind"], where)
    if kind not in KINDS:
        raise _fail(where + ".kind", f"one of {KINDS}", kind)
    of_output = None if d["of_output"] is None else _str(d["of_output"], where)
    batch = None if d["epoch_batch"] is None else _str(d["epoch_batch"], where)
    c_name = _str(d["c_name"], where)
    if not c_name.replace("_", "a").isalnum() or not c_name.isascii():
        raise _fail(where + ".c_name", "a C identifier", c_name)
    return FunctionSpec(kind, of_output, c_name, _strs(d["dims"], where),
                        tuple(_arg_from(a, f"{where}.inputs") for a in _list(d["inputs"], where)),
                        tuple(_return_from(r, f"{where}.outputs") for r in _list(d["outputs"], where)),
                        _bounds_from(d["index_bounds"], where), _strs(d["inplace"], where), batch,
                        _strs(d["epoch_data"], where), _minimums_from(d["minimums"], where))


def _minimums_from(value: Any, where: str) -> tuple[tuple[str, int, str], ...]:
    out = []
    for item in _list(value, where):
        triple = _list(item, where)
        if len(triple) != 3 or type(triple[1]) is not int or triple[1] < 1:
            raise _fail(where + ".minimums", "a triple (dimension, least value >= 1, why)", item)
        out.append((_str(triple[0], where), triple[1], _str(triple[2], where)))
    return tuple(out)


def _module_from(data: Any) -> ModuleSpec:
    d = _fields(data, ModuleSpec, "the module")
    outputs = []
    for item in _list(d["outputs"], "outputs"):
        triple = _list(item, "outputs")
        if len(triple) != 3:
            raise _fail("outputs", "(name, shape, scalar)", item)
        outputs.append((_str(triple[0], "outputs"), _shape_from(triple[1], "outputs"), _bool(triple[2], "outputs")))
    dtype = _str(d["dtype"], "dtype")
    if dtype not in ("float32", "float64"):
        raise _fail("dtype", "float32 or float64", dtype)
    return ModuleSpec(_str(d["prefix"], "prefix"), dtype, _strs(d["dims"], "dims"), _strs(d["leaves"], "leaves"),
                      tuple(outputs), _shape_from(d["loss_shape"], "loss_shape"), _bool(d["has_loss"], "has_loss"),
                      _strs(d["wrt"], "wrt"),
                      tuple(_function_from(f, f"functions[{k}]") for k, f in enumerate(_list(d["functions"], "functions"))))


# What each status of a generated function means: the C checks everything it
# relies on at its entry, so a nonzero status means nothing was written. The
# header (module.h.j2) documents them and the binder (binding.py) raises them.
# This table is the one list of them: every status any generated function
# (the self-describing ones of emit/describe.py too) returns is here.
STATUS_TEXT = {
    0: "success",
    1: "a dimension is below 1 or below what the model's fixed entries need (nothing written)",
    2: "an Index holds a row number outside the array it gathers from (nothing written)",
    3: "no argument of that number (nothing written)",
    4: "a NULL pointer where an array is needed (nothing written)",
    5: "a batched scan's rows are not a multiple of its batch (nothing written)",
    6: "a size does not fit: an array or the workspace exceeds 2^59 entries (nothing written)",
}
SIZE_DOES_NOT_FIT = 6
# The most entries an array or a workspace of a generated function may hold
# (2^59: its bytes, 8 an entry, fit an int64_t with room to spare). The C
# computes every size of a call from the dimensions in checked arithmetic
# (emit/sizes.py, symbackprop_runtime.h) and returns SIZE_DOES_NOT_FIT above it.
SIZE_LIMIT = 2**59

# What an input array of a generated function is: its <function>_kind_in(i)
# in C returns the code (the header lists them from here).
ARG_REAL, ARG_INDEX, ARG_UPDATED = 0, 1, 2
ARG_KINDS = {
    ARG_REAL: "reals it reads",
    ARG_INDEX: "an Index: int64_t row numbers it reads",
    ARG_UPDATED: "reals it reads and updates in place (a train step's parameters and state)",
}


def concrete(shape: Shape, bound: Mapping[str, int]) -> tuple[int, ...]:
    """A shape with its dimension names replaced by their values."""
    return tuple(bound[d] if isinstance(d, str) else d for d in shape)


__all__ = ["ARG_INDEX", "ARG_KINDS", "ARG_REAL", "ARG_UPDATED", "SIZE_DOES_NOT_FIT", "SIZE_LIMIT", "STATUS_TEXT",
           "ArgSpec", "FunctionSpec", "ModuleSpec",
           "ReturnSpec", "concrete", "show"]
