"""The one argument binder: every entry point of a compiled module (calls,
prepare, train_step, train_epoch, vjp/jvp/hvp and their seeds, tangents and
directions, the Dask and framework bridges) checks its arguments here,
against the function's ABI spec (abi.FunctionSpec).

What is accepted, and the only conversions made:

- Python and numpy numbers (not bools), and lists and tuples of them, become
  arrays of the module's dtype;
- a scalar (a Symbol, or a seed, tangent or direction for one) may be a
  number, a 0-d array, or shape (1,), (1, 1);
- an Index may be 1-D or one column, of any integer dtype but uint64;
- arrays that are not C-contiguous or not aligned are copied.

A numpy array of another dtype is an error, not a silent cast; so are masked
arrays and symbolic dimensions below 1 (an empty array, such as X[:0]),
or below the least value the model's fixed entries along them need
(X[2, 0] of X (n x 3): n >= 3; FunctionSpec.minimums).
Every symbolic dimension must have one value >= 1 across all the arrays.
Every Index row number must lie within each array it gathers from.
An argument the function writes (train_step's params and optimizer state)
is never converted: it must be a writable, aligned, C-contiguous array of
the module's dtype and share no memory with any other argument.

The C hot path (_fastcall.c) takes patterns from `Binder.c_patterns`: it
accepts a subset of this (exact arrays, already right) and declines the rest
to `Binder.bind`. Status codes of generated functions (abi.STATUS_TEXT) are
turned into errors in one place, `raise_status`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from symbackprop.base.abi import STATUS_TEXT, ArgSpec, FunctionSpec, show
from symbackprop.errors import ArgumentError


def _masked(value: Any) -> bool:
    """Whether `value` is a numpy masked array. Whoever made one imported
    numpy.ma, so where it is not imported nothing is masked; it is not
    imported here (30-90 ms of CPU of every process that compiles)."""
    ma = sys.modules.get("numpy.ma")
    return ma is not None and isinstance(value, ma.MaskedArray)


_LABELS = {"seed": "the seed for {key!r}", "tangent": "the tangent for {key!r}", "direction": "the direction for {key!r}",
           "hyper": "the hyperparameter {key!r}", "state": "the optimizer state {name!r}"}


def label(spec: ArgSpec) -> str:
    """How messages name an argument: its name, or what a seed/tangent/... is for."""
    template = _LABELS.get(spec.role)
    return spec.name if template is None else template.format(key=spec.key, name=spec.name) + f" ({spec.name})"


class Binder:
    """Checks and converts the arguments of one function.

    Args:
        fn: the function's spec.
        dtype: the module's numpy dtype.
    """

    def __init__(self, fn: FunctionSpec, dtype: np.dtype) -> None:
        self.fn = fn
        self.dtype = dtype
        self.inputs = fn.inputs
        self.names = frozenset(a.name for a in fn.inputs)
        self.input_names = [a.name for a in fn.inputs]
        self.dims = fn.dims
        self.writes = frozenset(fn.inplace) & self.names
        self.bounds = dict(fn.index_bounds)
        position = {d: -(k + 1) for k, d in enumerate(fn.dims)}
        # shapes as patterns: a fixed size as itself, dimension k as -(k + 1)
        self.patterns = tuple((a.name, *(position.get(d, d) for d in a.shape)) for a in fn.inputs)
        self.out_patterns = tuple((*(position.get(d, d) for d in r.shape), r.scalar) for r in fn.outputs)
        self._fast_ok = not any(a.index for a in fn.inputs)  # row numbers are checked on the slow path
        # (position in dims, least value): fixed entries the model takes along a dimension (fn.minimums)
        self.least = tuple((fn.dims.index(d), value) for d, value, _ in fn.minimums if d in fn.dims)

    def c_patterns(self) -> tuple[list[tuple[int, int, int, bool]], list[tuple[int, int, int, bool]]]:
        """The C hot path's input and output patterns: (rows, cols, numpy
        type number, scalar: a number accepted / returned as a float)."""
        real: int = self.dtype.num
        index: int = np.dtype(np.int64).num
        inputs = [(r, c, index if a.index else real, a.scalar) for (_, r, c), a in zip(self.patterns, self.inputs)]
        return inputs, [(r, c, real, scalar) for r, c, scalar in self.out_patterns]

    def bind(self, arrays: Mapping[str, Any]) -> tuple[list[np.ndarray], list[int]]:
        """Checked, converted arrays in C order, and the bound dimensions.

        Args:
            arrays: every argument by name.

        Returns:
            (arrays in C order, the values of the symbolic dimensions in order).

        Raises:
            ArgumentError: a missing, unknown or malformed argument (named),
                inconsistent dimensions, an Index row out of range, or an
                argument the function writes that cannot be written.
        """
        if arrays.keys() != self.names:
            check_names(self.inputs, arrays)
        fast = self._bind_fast(arrays) if self._fast_ok else None
        if fast is None:
            bound: dict[str, int] = {}
            binder: dict[str, str] = {}
            values = [self._one(spec, arrays[spec.name], bound, binder) for spec in self.inputs]
            missing = [d for d in self.dims if d not in bound]
            if missing:
                raise ArgumentError(f"the dimensions {missing} are not fixed by any argument")
            for spec, value in zip(self.inputs, values):
                if spec.index:
                    check_rows(label(spec), value, self.bounds.get(spec.name, ()), bound)
            fast = values, [bound[d] for d in self.dims]
            check_least(self.fn, bound)
        if self.writes:
            self._check_aliasing(fast[0])
        return fast

    def _one(self, spec: ArgSpec, value: Any, bound: dict[str, int], binder: dict[str, str]) -> np.ndarray:
        if spec.name in self.writes:
            check_writable(spec, value, self.dtype)
        array = convert(spec, value, self.dtype, bound, binder)
        if spec.name in self.writes and not np.may_share_memory(array, value):
            raise ArgumentError(f"{label(spec)} is written in place: it must be passed as the array to update")
        return array

    def _bind_fast(self, arrays: Mapping[str, Any]) -> tuple[list[np.ndarray], list[int]] | None:
        """The arrays as they are when every one is already right, else None
        (and the slow path names what is wrong). Every symbolic dimension
        must be >= 1 in every array that has it."""
        dims = [0] * len(self.dims)
        values = []
        dtype, item, writes = self.dtype, self.dtype.itemsize, self.writes
        for name, rows, cols in self.patterns:
            value = arrays[name]
            if type(value) is not np.ndarray or value.dtype is not dtype:
                return None
            shape = value.shape
            if len(shape) != 2 or value.strides != (shape[1] * item, item):
                return None
            flags = value.flags
            if not flags.aligned or (name in writes and not flags.writeable):
                return None
            for want, got in ((rows, shape[0]), (cols, shape[1])):
                if want > 0:
                    if want != got:
                        return None
                    continue
                if got < 1:
                    return None
                have = dims[-want - 1]
                if have == 0:
                    dims[-want - 1] = got
                elif have != got:
                    return None
            values.append(value)
        for k, least in self.least:
            if dims[k] < least:
                return None
        return values, dims

    def _check_aliasing(self, values: Sequence[np.ndarray]) -> None:
        """No written array overlaps another argument (C would read what it
        has already overwritten). Arrays whose memory numpy allocated
        separately cannot overlap, which a walk to each base shows cheaply;
        shared or foreign memory (one base twice, a buffer, a memmap) gets
        the exact check."""
        roots: set[int] = set()
        exact = False
        for value in values:
            root = value
            while isinstance(root.base, np.ndarray):
                root = root.base
            exact = exact or root.base is not None or id(root) in roots
            roots.add(id(root))
        if exact:
            self._check_spans(values)

    def _check_spans(self, values: Sequence[np.ndarray]) -> None:
        """Bound arrays are C-contiguous, so their byte ranges overlap
        exactly when they share memory."""
        spans = sorted((v.__array_interface__["data"][0], v.nbytes, k) for k, v in enumerate(values) if v.nbytes)
        written = {k for k, spec in enumerate(self.inputs) if spec.name in self.writes}
        active: list[tuple[int, int]] = []
        for start, size, k in spans:
            active = [(end, j) for end, j in active if end > start]
            for _, j in active:
                if k in written or j in written:
                    w, other = (k, j) if k in written else (j, k)
                    raise ArgumentError(f"{label(self.inputs[w])} is written in place but shares memory with "
                                        f"{label(self.inputs[other])}: pass separate arrays")
            active.append((start + size, k))

    def dims_from(self, arrays: Mapping[str, Any]) -> dict[str, int]:
        """The dimensions bound by the arrays given (a subset of the
        arguments), each checked as `bind` would."""
        bound: dict[str, int] = {}
        binder: dict[str, str] = {}
        for spec in self.inputs:
            if spec.name in arrays:
                convert(spec, arrays[spec.name], self.dtype, bound, binder)
        return bound

    def diagnose(self, arrays: Mapping[str, Any], status: int, what: str) -> NoReturn:
        """After a nonzero status: bind again (naming the argument and row
        at fault), else raise the status's meaning."""
        try:
            _, dims = self.bind(arrays)
        except ArgumentError as exc:
            raise ArgumentError(f"{what} returned status {status} ({STATUS_TEXT.get(status, 'unknown')}): {exc}") from None
        raise_status(status, what, dict(zip(self.dims, dims)))


def raise_status(status: int, what: str, dims: Mapping[str, int] | None = None) -> NoReturn:
    """The ArgumentError for a nonzero status of a generated function."""
    meaning = STATUS_TEXT.get(status, "an unknown status")
    where = f" (dimensions {dict(dims)})" if dims else ""
    raise ArgumentError(f"{what} returned status {status}: {meaning}{where}")


def check_least(fn: FunctionSpec, bound: Mapping[str, int]) -> None:
    """Every dimension as large as the fixed entries the model takes along it need."""
    for dim, least, why in fn.minimums:
        if dim in bound and bound[dim] < least:
            raise ArgumentError(f"{dim} = {bound[dim]}, but {why}: {dim} must be at least {least}")


def check_names(inputs: Sequence[ArgSpec], arrays: Mapping[str, Any]) -> None:
    expected = [spec.name for spec in inputs]
    missing = [n for n in expected if n not in arrays]
    unknown = [n for n in arrays if n not in expected]
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise ArgumentError(f"{'; '.join(parts)}; expected the arguments {expected}")


def check_writable(spec: ArgSpec, value: Any, dtype: np.dtype) -> None:
    """An argument written in place: a writable, aligned, C-contiguous
    ndarray of the module's dtype (no conversion: the update would be lost)."""
    ok = (isinstance(value, np.ndarray) and not _masked(value) and value.dtype == dtype
          and value.dtype.isnative and value.flags.c_contiguous
          and value.flags.aligned and value.flags.writeable)
    if not ok:
        got = type(value).__name__
        if isinstance(value, np.ndarray):
            flags = value.flags
            bad = [w for w, good in (("read-only", flags.writeable), ("not C-contiguous", flags.c_contiguous),
                                     ("not aligned", flags.aligned)) if not good]
            got += f" of dtype {value.dtype}" + (f" ({', '.join(bad)})" if bad else "")
        raise ArgumentError(f"{label(spec)} is updated in place: pass a writable, aligned, C-contiguous numpy array "
                            f"of dtype {dtype}; got {got}")


def check_rows(name: str, index: np.ndarray, bounds: Any, bound: Mapping[str, int]) -> None:
    """Every row number lies within each array the index chooses rows of."""
    if not index.size:
        return
    low, high = int(index.min()), int(index.max())
    for rows in bounds:
        count = bound[rows] if isinstance(rows, str) else int(rows)
        if low < 0 or high >= count:
            bad = low if low < 0 else high
            row = int(np.flatnonzero(index.reshape(-1) == bad)[0])
            raise ArgumentError(f"{name} holds the row number {bad}, outside the {count} rows ({rows}) it chooses "
                                f"among (at entry {row} of {name})")


def as_index(spec: ArgSpec, value: Any) -> np.ndarray:
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or array.dtype.kind not in "iu" or array.dtype == np.uint64 or _masked(value):
        what = f"dtype {array.dtype}" if array is not None else type(value).__name__
        raise ArgumentError(f"{label(spec)} is an Index: an array of integer row numbers; got {what}")
    if array.ndim == 1:
        array = array.reshape(-1, 1)
    return array.astype(np.int64, copy=False)


def convert(spec: ArgSpec, value: Any, dtype: np.dtype, bound: dict[str, int], binder: dict[str, str]) -> np.ndarray:
    """One argument checked against its spec, converted as the module
    docstring says, with its symbolic dimensions bound (>= 1, and equal to
    those bound before)."""
    name = label(spec)
    array = as_index(spec, value) if spec.index else as_array(spec, value, dtype)
    if spec.scalar:
        if array.size != 1 or array.ndim > 2:
            raise ArgumentError(f"{name} is a scalar: a number or an array of shape (), (1,) or (1, 1); got shape {array.shape}")
        return np.require(array.reshape(1, 1), requirements=("C", "A"))
    if array.ndim != 2:
        raise ArgumentError(f"{name} must be a 2-D array of shape {show(spec.shape)}; got {array.ndim}-D shape {array.shape}")
    for want, got in zip(spec.shape, array.shape):
        if isinstance(want, str):
            if got < 1:
                raise ArgumentError(f"{name} must have shape {show(spec.shape)} with {want} >= 1; got {array.shape} "
                                    "(an empty array)")
            if bound.setdefault(want, got) != got:
                known = show(tuple(bound.get(d, d) if isinstance(d, str) else d for d in spec.shape))
                raise ArgumentError(f"{name} must have shape {show(spec.shape)} with {want}={bound[want]} "
                                    f"(as in {binder[want]}), that is {known}; got {array.shape}")
            binder.setdefault(want, name)
        elif want != got:
            raise ArgumentError(f"{name} must have shape {show(spec.shape)}; got {array.shape}")
    return np.require(array, requirements=("C", "A"))


def as_array(spec: ArgSpec, value: Any, dtype: np.dtype) -> np.ndarray:
    name = label(spec)
    if isinstance(value, np.ndarray):
        if value.dtype != dtype:
            raise ArgumentError(f"{name} must have dtype {dtype}; got {value.dtype} (shape {value.shape}); convert it explicitly")
        if _masked(value):
            raise ArgumentError(f"{name} is a masked array; its mask would be ignored: pass plain data")
        return value
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be real numbers of dtype {dtype}; got a bool")
    if isinstance(value, (int, float, np.floating, np.integer, list, tuple)):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ArgumentError(f"{name} could not be converted to an array of {dtype}: {exc}") from exc
        if array.dtype.kind not in "iuf":
            raise ArgumentError(f"{name} must be real numbers of dtype {dtype}; numpy reads the given "
                                f"{type(value).__name__} as {array.dtype} (shape {array.shape})")
        try:
            return array.astype(dtype, copy=False)
        except OverflowError as exc:
            raise ArgumentError(f"{name} could not be converted to an array of {dtype}: {exc}") from exc
    if spec.scalar:
        raise ArgumentError(f"{name} must be a real number (or a {dtype} array of one element); got {type(value).__name__}")
    raise ArgumentError(f"{name} must be a numpy array of dtype {dtype} and shape {show(spec.shape)}; "
                        f"got {type(value).__name__}")


__all__ = ["Binder", "check_least", "convert", "label", "raise_status"]
