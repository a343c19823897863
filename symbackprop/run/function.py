"""One generated C function called on numpy arrays.

Every argument of every entry point goes through one binder (binding.py),
which checks it (name, shape, dtype, dimensions >= 1 and consistent, Index
rows, writability of what a function writes) against the function's ABI
spec (abi.py) and says what is wrong in an ArgumentError naming the
argument. It converts Python and numpy numbers and lists of them to the
module's dtype, accepts a number, a 0-d array or shape (1,), (1, 1) for a
scalar (a Symbol, or a seed, tangent or direction for one), and copies
arrays that are not C-contiguous; a numpy array of another dtype is an
error, not a silent cast. NaN and infinity pass through with IEEE semantics.

Results are fresh arrays (numbers for scalars) on every call, except in a
prepared call (`CompiledModule.prepare`), which binds its arrays once and
writes its results into arrays it owns.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from symbackprop.base.abi import FunctionSpec
from symbackprop.emit.emitted import REAL_TYPES
from symbackprop.run import fastcall
from symbackprop.run.binding import Binder

WORK_ALIGN = 64  # bytes: a cache line, where the workspace starts (its dimension-sized buffers: 16-entry multiples in)


def empty_workspace(count: int, dtype: Any) -> np.ndarray:
    """An uninitialised workspace of `count` entries starting on a cache
    line (numpy's large arrays start 16 bytes past one): each of the
    generated code's buffers then starts on one too (schedule/workspace.py),
    and its vector loads do not straddle two lines (a float32 convolution's
    weight gradient took 2.9 ms instead of 2.0 ms on arrays 16 bytes off)."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(max(count, 1) + WORK_ALIGN // itemsize, dtype=dtype)
    skip = (-raw.ctypes.data % WORK_ALIGN) // itemsize
    return raw[skip:skip + max(count, 1)]


class Function:
    """One generated C function: its ABI spec, its binder, and the call.
    `call` is the hot path of the ordinary API: the C caller (fastcall.py)
    takes arrays that are already right; anything else goes through the
    binder (binding.py), which converts it or says what is wrong.

    Args:
        spec: the function's ABI spec.
        lib: the cffi library holding the C function.
        ffi: its FFI.
        prefix: the module's C prefix.
        dtype: the module's numpy dtype.
    """

    def __init__(self, spec: FunctionSpec, lib: Any, ffi: Any, prefix: str, dtype: np.dtype) -> None:
        self.spec = spec
        self.binder = Binder(spec, dtype)
        self.c_name = f"{prefix}_{spec.c_name}"
        self.c_function = getattr(lib, self.c_name)
        self.lib, self.ffi = lib, ffi  # the module's other functions (train_epoch beside train_step)
        self.work_len = getattr(lib, self.c_name + "_work_len")
        self.dims = spec.dims
        self.inputs = spec.inputs
        self.outputs = spec.outputs
        self.index_bounds = dict(spec.index_bounds)
        self.names = self.binder.names
        self.input_names = self.binder.input_names
        self.dtype = dtype
        self.from_buffer = ffi.from_buffer
        self.scalar_outputs = tuple(k for k, out in enumerate(spec.outputs) if out.scalar)
        self.groups: dict[str, list[tuple[int, str]]] = {}
        for index, out in enumerate(spec.outputs):
            self.groups.setdefault(out.group, []).append((index, out.key))
        # what the module's method of this kind returns, from call's results
        self.layout = self._layout()
        self._local = threading.local()  # per-thread workspace, reused while the dimensions stay
        # the C hot path (fastcall.py), from the binder's patterns; not for functions that write their inputs
        self.fast = self._caller(None)
        # `answer(arrays)`: what the module's method returns, in one C call where the hot path takes the
        # arguments (shaped by `layout`), else through `call` (which converts or explains)
        self.answer: Callable[[dict[str, Any]], Any] = self._caller(self.layout, self._answer) or self._answer

    def _caller(self, layout: Any, fallback: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """The C caller returning a list (layout None) or shaped, or None where there is none."""
        if self.spec.inplace:
            return None
        # (the caller's own copy of the layout: it indexes its results by it unchecked)
        return fastcall.caller(self.lib, self.ffi, self.c_name, len(self.dims), self.dtype.itemsize,
                               *self.binder.c_patterns(), tuple(self.input_names), copy.deepcopy(layout), fallback)

    def _answer(self, arrays: dict[str, Any]) -> Any:
        """`answer` through `call`: what the C caller does not take."""
        return self.returned(self.call(arrays))

    def bind(self, arrays: Mapping[str, Any]) -> tuple[list[np.ndarray], list[int]]:
        """Checked, converted arrays in C order, and the bound dimensions
        (see binding.Binder.bind).

        Args:
            arrays: every argument by name.

        Returns:
            (arrays in C order, the values of the symbolic dimensions in order).

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
        """
        return self.binder.bind(arrays)

    def allocate(self, dims: Sequence[int]) -> list[np.ndarray]:
        """Fresh (uninitialised) output arrays.

        Args:
            dims: the values of the symbolic dimensions, as bind returns them.

        Returns:
            One array per output, in C order.
        """
        empty, dtype = np.empty, self.dtype
        return [empty((r if r > 0 else dims[-r - 1], c if c > 0 else dims[-c - 1]), dtype)
                for r, c, _ in self.binder.out_patterns]

    def workspace(self, dims: Sequence[int]) -> Any:
        """A pointer to scratch memory of this thread, sized for `dims`.

        Args:
            dims: the values of the symbolic dimensions.

        Returns:
            A cffi pointer, valid until this thread asks for other dims.
        """
        local = self._local
        key = tuple(dims)
        if getattr(local, "key", None) != key:
            local.array = empty_workspace(self.work_len(*dims), self.dtype)
            local.pointer = self.from_buffer(local.array)
            local.key = key
        return local.pointer

    def invoke(self, dims: Sequence[int], values: Sequence[np.ndarray], outputs: Sequence[np.ndarray], work: Any) -> None:
        """Run the C function (no checks on the Python side before it).

        Args:
            dims: the values of the symbolic dimensions.
            values: the arguments, as bind returns them.
            outputs: the output arrays, as allocate returns them.
            work: the workspace pointer.

        Raises:
            ArgumentError: the C function returned a nonzero status (the
                binder then names the argument at fault).
        """
        buf = self.from_buffer
        status = self.c_function(*dims, *[buf(v) for v in values], *[buf(o) for o in outputs], work)
        if status != 0:
            self.binder.diagnose(dict(zip(self.input_names, values)), status, self.c_name)

    def call(self, arrays: Mapping[str, Any]) -> list[Any]:
        """Check, convert and run.

        Args:
            arrays: every argument by name.

        Returns:
            The outputs in the spec's order: numbers for scalars, else arrays.

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
        """
        fast = self.fast
        if fast is not None:  # it looks the arguments up by name, and declines unknown or missing ones
            results = fast(arrays if type(arrays) is dict else dict(arrays))
            if type(results) is list:
                return results
            if results is not None:  # a status: the binder names what is wrong
                self.binder.diagnose(arrays, results, self.c_name)
        values, dims = self.bind(arrays)
        outputs = self.allocate(dims)
        self.invoke(dims, values, outputs, self.workspace(dims))
        for index in self.scalar_outputs:
            outputs[index] = outputs[index].item()
        return outputs

    def group(self, results: Sequence[Any], name: str) -> dict[str, Any]:
        """The results of one group by key, e.g. the gradients by param name.

        Args:
            results: what call returned.
            name: the group ("grads", "hvp", ...).

        Returns:
            {key: result}; empty for a group the function lacks.
        """
        return {key: results[index] for index, key in self.groups.get(name, ())}

    def _layout(self) -> Any:
        """What the module's method of this function's kind returns, as
        indices into `call`'s results, the one place that decides it (the
        C hot path fills it in, `returned` in Python; a prepared call
        returns the same): an int is that result, a dict {key: int} a dict
        of them, a tuple of layouts a tuple.

        - forward, jvp: {"loss": ..., output name: ...};
        - value_and_grad: (loss, {name: gradient});
        - hvp: (loss, {name: gradient}, {name: H v}), as value_grad_and_hvp;
        - vjp: {name: gradient};
        - train_step: the loss before the update.
        """
        kind = self.spec.kind
        if kind in ("forward", "jvp"):
            return {out.key: k for k, out in enumerate(self.outputs)}
        if kind == "train_step":
            return 0
        grads = {key: i for i, key in self.groups.get("grads", ())}
        if "loss" not in self.groups:
            return grads
        loss = self.groups["loss"][0][0]
        if "hvp" not in self.groups:
            return loss, grads
        return loss, grads, {key: i for i, key in self.groups["hvp"]}

    def returned(self, results: Sequence[Any], layout: Any = None) -> Any:
        """A layout filled in with `call`'s results.

        Args:
            results: the call's results, in C order.
            layout: an index, a dict of them or a tuple of layouts; the
                function's own by default.

        Returns:
            The result, a dict or a tuple shaped as `layout`.
        """
        layout = self.layout if layout is None else layout
        if type(layout) is int:
            return results[layout]
        if type(layout) is dict:
            return {key: results[index] for key, index in layout.items()}
        return tuple(self.returned(results, part) for part in layout)

    def reused(self, outputs: Sequence[np.ndarray]) -> Callable[[], Any]:
        """What a prepared call over `outputs` returns after each run, built
        once: the same dicts of the same arrays every time, only its
        scalars read again (as Python floats, as `returned` gives them),
        so that a call allocates no more than the float of its loss and
        the tuple around it. Equal to `returned` of the call's results
        (the same shapes as `_layout`'s, with the arrays bound here).

        Args:
            outputs: the prepared call's output arrays, in C order.

        Returns:
            A function of no arguments, called after each run.
        """
        c_type = f"{REAL_TYPES[self.dtype.name].c} *"
        # a typed pointer reads a scalar faster than indexing its array
        scalar = {index: self.ffi.cast(c_type, self.from_buffer(outputs[index])) for index in self.scalar_outputs}
        kind = self.spec.kind
        if kind in ("forward", "jvp"):
            result = {out.key: outputs[k] for k, out in enumerate(self.outputs)}
            fresh = tuple((self.outputs[index].key, pointer) for index, pointer in scalar.items())

            def refreshed() -> dict[str, Any]:
                for key, pointer in fresh:
                    result[key] = pointer[0]
                return result

            return refreshed
        if kind == "train_step":
            first = scalar.get(0)
            return (lambda: outputs[0]) if first is None else (lambda: first[0])
        grads = {key: outputs[i] for i, key in self.groups.get("grads", ())}
        if "loss" not in self.groups:
            return lambda: grads
        loss = scalar[self.groups["loss"][0][0]]
        if "hvp" not in self.groups:
            return lambda: (loss[0], grads)
        hvp = {key: outputs[i] for i, key in self.groups["hvp"]}
        return lambda: (loss[0], grads, hvp)

class PreparedCall:
    """A function bound to arrays once; each call runs the C code on their
    current contents and writes into the arrays in `results`.

    Refill the bound input arrays in place (``call.inputs["X"][:] = batch``)
    between calls; the shapes are fixed at preparation. Arguments the
    function writes (train_step's params and optimizer state) are bound as
    given and must be writable arrays (see binding.py). Calling returns what
    the module's method of the function's kind returns (`Function.returned`:
    ``(loss, grads)`` for value_and_grad), built once at preparation
    (`Function.reused`): every call returns the same dicts holding the same
    arrays, those in `results`, overwritten by the next call, as a C
    library's preallocated buffers are (copy what you keep); only the
    scalars (the loss, a Python float) are new. `run()` runs it and returns
    only the loss (the least work a call can do, for the hottest loops).
    Not for concurrent use from several threads (one workspace).

    Args:
        function: the function to call.
        arrays: every argument by name (copied where a conversion is needed:
            refill ``call.inputs``, not the arrays given).

    Raises:
        ArgumentError: a missing, unknown or malformed argument, or
            inconsistent dimensions.
    """

    def __init__(self, function: Function, arrays: Mapping[str, Any]) -> None:
        values, dims = function.bind(arrays)
        outputs = function.allocate(dims)
        work = empty_workspace(function.work_len(*dims), function.dtype)
        self.function = function
        self.inputs = {spec.name: v for spec, v in zip(function.inputs, values)}
        self.results = {out.name: o for out, o in zip(function.outputs, outputs)}
        self._arrays = (values, outputs, work)  # keep every buffer alive
        self._reused = function.reused(outputs)
        buf, ffi = function.from_buffer, function.ffi
        pointers = self._pointers = [buf(a) for a in (*values, *outputs, work)]
        packed = getattr(function.lib, function.c_name + "__packed", None)
        if packed is None:
            self._c_function, self._args = function.c_function, (*dims, *pointers)
        else:  # two arguments, whatever the arity: cffi converts each argument of every call
            self._c_function = packed
            self._args = (ffi.new("int64_t[]", [*dims, 0]), ffi.new("void *[]", pointers))
        loss = self.results.get("loss")
        # a typed pointer reads the loss faster than indexing the array
        self._loss = None if loss is None else function.ffi.cast(f"{REAL_TYPES[function.dtype.name].c} *", buf(loss))

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """The gradient arrays this call writes, by differentiated name
        (empty for a function without gradients)."""
        return {out.key: self.results[out.name] for out in self.function.outputs if out.group == "grads"}

    def run(self) -> float | None:
        """Run the C function on the bound arrays' current contents.

        Returns:
            The loss, or None if the function does not compute it.

        Raises:
            ArgumentError: the C function returned a nonzero status (say, an
                Index refilled with a row number out of range: named).
        """
        status = self._c_function(*self._args)
        if status != 0:
            self.function.binder.diagnose(self.inputs, status, self.function.c_name)
        return None if self._loss is None else self._loss[0]

    def __call__(self) -> Any:
        """Run the C function on the bound arrays' current contents.

        Returns:
            What the module's method of the function's kind returns (see
            `Function.returned`): the same dicts and arrays (those of
            `results`) on every call, with the scalars read again.

        Raises:
            ArgumentError: as `run`.
        """
        status = self._c_function(*self._args)
        if status != 0:
            self.function.binder.diagnose(self.inputs, status, self.function.c_name)
        return self._reused()


__all__ = ["Function", "PreparedCall"]
