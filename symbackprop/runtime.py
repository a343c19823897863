"""Call a compiled module on numpy arrays.

Every array is checked (name, shape, dtype) before the C call; symbolic
dimensions are bound from the arrays' shapes. Conversions that are made
(and nothing else is converted):

- Python and numpy numbers (not bools), and lists and tuples of them, become
  arrays of the module's dtype;
- a scalar (Symbol) argument may be a number, a 0-d array, or shape (1,),
  (1, 1);
- arrays that are not C-contiguous (Fortran order, strided views) are
  copied to C order.

A numpy array of another dtype (float32 into a float64 module, integers,
complex) is an error, not a silent cast; so are masked arrays, whose masks
would be ignored, and symbolic dimensions below 1 (an empty batch). Every
error is an ArgumentError naming the argument, what was expected and what
was received. NaN and infinity pass through with IEEE semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import sympy as sp

from .build import BuildOptions, build
from .codegen import REAL_TYPES, Emitted
from .compiler import Plan, generate
from .errors import ArgumentError
from .model import Model, leaf_name


@dataclass(frozen=True)
class ArraySpec:
    name: str
    shape: tuple  # ints and dimension Symbols
    scalar: bool  # declared as a Symbol: passed and returned as a number


@dataclass(frozen=True)
class Signature:
    """What one C function takes and gives, in C argument order."""

    c_name: str
    dims: tuple[sp.Symbol, ...]
    inputs: tuple[ArraySpec, ...]
    outputs: tuple[ArraySpec, ...]


class CompiledModule:
    """A compiled model. Call `forward` and `value_and_grad` with the model's
    inputs and parameters as keyword arguments."""

    def __init__(self, model: Model, emitted: Emitted, plan: Plan, lib: Any, ffi: Any, folder: Path, dtype: str):
        self.model = model
        self.emitted = emitted
        self.plan = plan
        self.folder = folder
        self.dtype = np.dtype(REAL_TYPES[dtype].numpy)
        self._ctype = REAL_TYPES[dtype].c + "[]"
        self._lib = lib
        self._ffi = ffi
        scalars = {leaf_name(s) for s in model.inputs + model.params if isinstance(s, sp.Symbol)}
        inputs = tuple(ArraySpec(n, node.shape, n in scalars) for n, node in plan.lowered.leaves.items())
        self.grad_names = plan.grad_names
        by_output = {v: k for k, v in plan.grad_names.items()}
        self.signatures = {}
        for fn in plan.functions:
            outputs = tuple(
                ArraySpec(name, node.shape, name == "loss" or by_output.get(name) in scalars)
                for name, node in fn.results
            )
            self.signatures[fn.name] = Signature(f"{emitted.prefix}_{fn.name}", plan.lowered.dims, inputs, outputs)

    @property
    def source(self) -> str:
        """The generated C source."""
        return self.emitted.source

    @property
    def header(self) -> str:
        return self.emitted.header

    def forward(self, **arrays: Any) -> dict[str, Any]:
        """The loss and the named outputs: {"loss": float, name: array}.

        Raises:
            ArgumentError: a missing, unknown or malformed argument.
        """
        return dict(self._call("forward", arrays))

    def value_and_grad(self, **arrays: Any) -> tuple[float, dict[str, Any]]:
        """The loss and {name: gradient} for each parameter (and grad input).

        Raises:
            ArgumentError: a missing, unknown or malformed argument.
        """
        results = self._call("value_and_grad", arrays)
        loss = results.pop("loss")
        return loss, {leaf: results[out] for leaf, out in self.grad_names.items()}

    def _call(self, function: str, arrays: Mapping[str, Any]) -> dict[str, Any]:
        sig = self.signatures[function]
        _check_names(sig, arrays)
        bound: dict[sp.Symbol, int] = {}
        binder: dict[sp.Symbol, str] = {}  # the argument each dimension was bound from
        values = [self._convert(spec, arrays[spec.name], bound, binder) for spec in sig.inputs]
        for dim in sig.dims:
            if dim not in bound:
                raise ArgumentError(f"dimension {dim} is not fixed by any argument")
        outputs = [np.empty(_concrete(spec.shape, bound), dtype=self.dtype) for spec in sig.outputs]
        dims = [bound[d] for d in sig.dims]
        work = np.empty(getattr(self._lib, sig.c_name + "_work_len")(*dims), dtype=self.dtype)
        buf = self._ffi.from_buffer
        ctype = self._ctype
        status = getattr(self._lib, sig.c_name)(
            *dims, *[buf(ctype, v) for v in values], *[buf(ctype, o) for o in outputs], buf(ctype, work)
        )
        if status != 0:
            raise ArgumentError(f"{sig.c_name} rejected the dimensions {dict(zip(map(str, sig.dims), dims))}")
        return {spec.name: (float(o.reshape(-1)[0]) if spec.scalar else o) for spec, o in zip(sig.outputs, outputs)}

    def _convert(self, spec: ArraySpec, value: Any, bound: dict[sp.Symbol, int], binder: dict[sp.Symbol, str]) -> np.ndarray:
        array = _as_array(spec, value, self.dtype)
        if spec.scalar:
            if array.size != 1 or array.ndim > 2:
                raise ArgumentError(
                    f"{spec.name} is a scalar: a number or an array of shape (), (1,) or (1, 1); got shape {array.shape}"
                )
            return np.ascontiguousarray(array.reshape(1, 1))
        if array.ndim != 2:
            raise ArgumentError(
                f"{spec.name} must be a 2-D array of shape {_show(spec.shape)}; got {array.ndim}-D shape {array.shape}"
            )
        for axis, (want, got) in enumerate(zip(spec.shape, array.shape)):
            if isinstance(want, sp.Symbol):
                if got < 1:
                    raise ArgumentError(
                        f"{spec.name} must have shape {_show(spec.shape)} with {want} >= 1; got {array.shape}"
                    )
                if bound.setdefault(want, got) != got:
                    raise ArgumentError(
                        f"{spec.name} must have shape {_show(spec.shape)} with {want}={bound[want]} "
                        f"(as in {binder[want]}); got {array.shape}"
                    )
                binder.setdefault(want, spec.name)
            elif want != got:
                raise ArgumentError(f"{spec.name} must have shape {_show(spec.shape)}; got {array.shape}")
        return np.ascontiguousarray(array)


def _check_names(sig: Signature, arrays: Mapping[str, Any]) -> None:
    expected = [spec.name for spec in sig.inputs]
    missing = [n for n in expected if n not in arrays]
    unknown = [n for n in arrays if n not in expected]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unknown:
            parts.append(f"unknown {unknown}")
        raise ArgumentError(f"{'; '.join(parts)}; expected the arguments {expected}")


_MASKED = np.ma.MaskedArray


def _as_array(spec: ArraySpec, value: Any, dtype: np.dtype) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.dtype != dtype:
            raise ArgumentError(
                f"{spec.name} must have dtype {dtype}; got {value.dtype} (shape {value.shape}); convert it explicitly"
            )
        if isinstance(value, _MASKED):
            raise ArgumentError(f"{spec.name} is a masked array; its mask would be ignored: pass plain data")
        return value
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{spec.name} must be real numbers of dtype {dtype}; got a bool")
    if isinstance(value, (int, float, np.floating, np.integer, list, tuple)):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ArgumentError(f"{spec.name} could not be converted to an array of {dtype}: {exc}") from exc
        if array.dtype.kind not in "iuf":
            raise ArgumentError(
                f"{spec.name} must be real numbers of dtype {dtype}; got a {type(value).__name__} "
                f"that numpy reads as {array.dtype} (shape {array.shape})"
            )
        return array.astype(dtype, copy=False)
    raise ArgumentError(
        f"{spec.name} must be a numpy array of dtype {dtype} and shape {_show(spec.shape)}; got {type(value).__name__}"
    )


def _concrete(shape: tuple, bound: Mapping[sp.Symbol, int]) -> tuple[int, ...]:
    return tuple(bound[d] if isinstance(d, sp.Symbol) else int(d) for d in shape)


def _show(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def compile(model: Model, dtype: str = "float64", options: BuildOptions | None = None) -> CompiledModule:
    """Generate, build (or load from the cache) and wrap the model.

    Args:
        model: the Model to compile.
        dtype: "float64" (default).
        options: compiler flags and cache folder (see BuildOptions).

    Raises:
        ModelError: the model cannot be compiled (names the subexpression).
        BuildError: the C compiler is missing or failed (names the log).
    """
    emitted, plan = generate(model, dtype)
    module, folder = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, options)
    return CompiledModule(model, emitted, plan, module.lib, module.ffi, folder, dtype)
