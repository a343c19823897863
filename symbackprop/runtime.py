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

Results are fresh arrays (numbers for scalars) on every call, except in a
prepared call (`CompiledModule.prepare`), which binds its arrays once and
writes its results into arrays it owns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TextIO, cast

import numpy as np
import sympy as sp

from . import fastcall
from .build import BuildOptions, build, find_blas, load_built, package_digest, read_memo, write_memo
from .codegen import REAL_TYPES, Emitted
from .compiler import DEFAULT_FUNCTIONS, FunctionPlan, Plan, generate
from .derivation import itemsize_of, memory_plan
from .errors import ArgumentError, ModelError
from .graph import graph_text
from .model import Model, leaf_name

if TYPE_CHECKING:  # only for annotations: these modules are imported on first use
    from .interop_jax import JaxFunction
    from .interop_torch import TorchFunction
    from .optim import SGD, Adam
    from .train import Trainer


@dataclass(frozen=True)
class ArraySpec:
    name: str
    shape: tuple  # ints and dimension Symbols
    scalar: bool  # declared as a Symbol: passed and returned as a number
    index: bool = False  # an Index: int64 row numbers, a 1-D or (rows, 1) array


class Function:
    """One generated C function: its arguments in C order, their checks, and
    the call. `call` is the hot path of the ordinary API: arrays that are
    already right pass a few attribute checks; anything else goes through
    `_convert`, which converts it or says what is wrong.

    Args:
        fn: the function's plan.
        plan: the plan of the module it belongs to.
        scalars: the names passed and returned as numbers.
        lib: the cffi library holding the C function.
        ffi: its FFI.
        prefix: the module's C prefix.
        dtype: the module's numpy dtype.
    """

    def __init__(
        self, fn: FunctionPlan, plan: Plan, scalars: set[str], lib: Any, ffi: Any, prefix: str, dtype: np.dtype
    ) -> None:
        self.plan = fn
        self.c_name = f"{prefix}_{fn.function_name}"
        self.c_function = getattr(lib, self.c_name)
        self.lib, self.ffi = lib, ffi  # the module's other functions (train_epoch beside train_step)
        self.work_len = getattr(lib, self.c_name + "_work_len")
        self.dims = plan.lowered.dims
        leaves = list(plan.lowered.leaves.items()) + list(fn.extra_inputs)
        self.inputs = tuple(ArraySpec(name, node.shape, name in scalars, node.attrs[1] == "index") for name, node in leaves)
        # each Index with the row counts of the arrays it chooses rows of
        self.index_bounds: dict[str, set] = {}
        for kernel in fn.schedule.kernels:
            for name, _, bound in getattr(kernel, "index_checks", ()):
                self.index_bounds.setdefault(name, set()).add(bound)
        nodes = dict(fn.schedule.results)
        self.outputs = tuple(ArraySpec(out, nodes[out].shape, key in scalars) for out, _, key in fn.returns)
        self.names = frozenset(spec.name for spec in self.inputs)
        self.dtype = dtype
        self.from_buffer = ffi.from_buffer
        # shapes as patterns: a fixed size as itself, dimension k as -(k + 1)
        position = {d: -(k + 1) for k, d in enumerate(self.dims)}
        self.patterns = tuple((s.name, *(position.get(d, d) for d in s.shape)) for s in self.inputs)
        self.out_patterns = tuple((position.get(r, r), position.get(c, c), s.scalar) for s in self.outputs for r, c in [s.shape])
        self.out_fixed = tuple((r, c) if r > 0 and c > 0 else None for r, c, _ in self.out_patterns)
        self.scalar_outputs = tuple(k for k, (_, _, scalar) in enumerate(self.out_patterns) if scalar)
        self.groups: dict[str, list[tuple[int, str]]] = {}
        for index, (_, group, key) in enumerate(fn.returns):
            self.groups.setdefault(group, []).append((index, key))
        self._local = threading.local()  # per-thread workspace, reused while the dimensions stay
        self.input_names = [spec.name for spec in self.inputs]
        # the C hot path (fastcall.py); not for functions that overwrite their inputs
        self.fast = None if fn.inplace else fastcall.caller(
            lib, ffi, self.c_name, len(self.dims), dtype.itemsize,
            [(r, c, np.dtype(np.int64 if spec.index else dtype).num) for (_, r, c), spec in zip(self.patterns, self.inputs)],
            [(r, c, dtype.num, scalar) for r, c, scalar in self.out_patterns])

    def bind(self, arrays: Mapping[str, Any]) -> tuple[list[np.ndarray], list[int]]:
        """Checked, converted arrays in C order, and the bound dimensions.

        Args:
            arrays: every argument by name.

        Returns:
            (arrays in C order, the values of the symbolic dimensions in order).

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
        """
        if arrays.keys() != self.names:
            _check_names(self.inputs, arrays)
        fast = self._bind_fast(arrays)
        if fast is not None:
            return fast
        bound: dict[sp.Symbol, int] = {}
        binder: dict[sp.Symbol, str] = {}
        values = [_convert(spec, arrays[spec.name], self.dtype, bound, binder) for spec in self.inputs]
        for dim in self.dims:
            if dim not in bound:
                raise ArgumentError(f"dimension {dim} is not fixed by any argument")
        for spec, value in zip(self.inputs, values):
            if spec.index:
                _check_rows(spec.name, value, self.index_bounds.get(spec.name, ()), bound)
        return values, [bound[d] for d in self.dims]

    def _bind_fast(self, arrays: Mapping[str, Any]) -> tuple[list[np.ndarray], list[int]] | None:
        """The arrays as they are when every one is already right, else None
        (and `bind` takes the slow path, which names what is wrong). Strides
        equal to a C-contiguous layout's stand for the contiguity check."""
        dims = [0] * len(self.dims)
        values = []
        dtype, item = self.dtype, self.dtype.itemsize
        for name, rows, cols in self.patterns:
            value = arrays[name]
            if type(value) is not np.ndarray or value.dtype is not dtype:
                return None
            shape = value.shape
            if rows > 0 and cols > 0:
                if shape != (rows, cols) or value.strides != (cols * item, item):
                    return None
                values.append(value)
                continue
            if len(shape) != 2 or value.strides != (shape[1] * item, item):
                return None
            for want, got in ((rows, shape[0]), (cols, shape[1])):
                if want > 0:
                    if want != got:
                        return None
                elif dims[-want - 1] != got:
                    if dims[-want - 1] or got < 1:
                        return None
                    dims[-want - 1] = got
            values.append(value)
        return values, dims

    def allocate(self, dims: Sequence[int]) -> list[np.ndarray]:
        """Fresh (uninitialised) output arrays.

        Args:
            dims: the values of the symbolic dimensions, as bind returns them.

        Returns:
            One array per output, in C order.
        """
        empty, dtype = np.empty, self.dtype
        return [
            empty(fixed if fixed is not None else (r if r > 0 else dims[-r - 1], c if c > 0 else dims[-c - 1]), dtype)
            for (r, c, _), fixed in zip(self.out_patterns, self.out_fixed)
        ]

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
            local.array = np.empty(max(self.work_len(*dims), 1), dtype=self.dtype)
            local.pointer = self.from_buffer(local.array)
            local.key = key
        return local.pointer

    def invoke(self, dims: Sequence[int], values: Sequence[np.ndarray], outputs: Sequence[np.ndarray], work: Any) -> None:
        """Run the C function (no checks on the Python side).

        Args:
            dims: the values of the symbolic dimensions.
            values: the arguments, as bind returns them.
            outputs: the output arrays, as allocate returns them.
            work: the workspace pointer.

        Raises:
            ArgumentError: the C function rejected the dimensions, or an index
                array holds a row number out of range.
        """
        buf = self.from_buffer
        status = self.c_function(*dims, *[buf(v) for v in values], *[buf(o) for o in outputs], work)
        if status == 2:
            raise ArgumentError(f"{self.c_name}: an index array holds a row number outside the array it gathers from")
        if status != 0:
            raise ArgumentError(f"{self.c_name} rejected the dimensions {dict(zip(map(str, self.dims), dims))}")

    def call(self, arrays: Mapping[str, Any]) -> list[Any]:
        """Check, convert and run.

        Args:
            arrays: every argument by name.

        Returns:
            The outputs in the plan's order: numbers for scalars, else arrays.

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
        """
        fast = self.fast
        if fast is not None and arrays.keys() == self.names:
            results = fast([arrays[name] for name in self.input_names])
            if type(results) is list:
                return results
            # declined (None) or failed (a status): the Python path converts or explains
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


class PreparedCall:
    """A function bound to arrays once; each call runs the C code on their
    current contents and writes into the arrays in `results`.

    Refill the bound input arrays in place (``call.inputs["X"][:] = batch``)
    between calls; the shapes are fixed at preparation. Nothing is checked
    per call. Not for concurrent use from several threads (one workspace).

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
        work = np.empty(max(function.work_len(*dims), 1), dtype=function.dtype)
        self.function = function
        self.inputs = {spec.name: v for spec, v in zip(function.inputs, values)}
        self.results = {out: o for (out, _, _), o in zip(function.plan.returns, outputs)}
        self._arrays = (values, outputs, work)  # keep every buffer alive
        self._c_function = function.c_function
        buf = function.from_buffer
        self._args = (*dims, *[buf(a) for a in (*values, *outputs, work)])
        loss = self.results.get("loss")
        # a typed pointer reads the loss faster than indexing the array
        self._loss = None if loss is None else function.ffi.cast(f"{REAL_TYPES[function.dtype.name].c} *", buf(loss))

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """The gradient arrays this call writes, by differentiated name
        (empty for a function without gradients)."""
        return {key: self.results[out] for out, group, key in self.function.plan.returns if group == "grads"}

    def __call__(self) -> float | None:
        """Run the C function on the bound arrays' current contents.

        Returns:
            The loss, or None if the function does not compute it.

        Raises:
            ArgumentError: the C function rejected its dimensions.
        """
        if self._c_function(*self._args) != 0:
            raise ArgumentError(f"{self.function.c_name} rejected its dimensions")
        return None if self._loss is None else self._loss[0]


class CompiledModule:
    """A compiled model: call `forward` and `value_and_grad` with the
    model's inputs and parameters as keyword arguments.

    `vjp`, `jvp`, `hvp`, `hessian` and `jacobian` compile their C functions
    on first use (then load them from the cache).

    Made by `symbackprop.compile`, which passes:

    Args:
        model: the model.
        emitted: the generated code.
        plan: the plan it was generated from.
        lib: the built cffi library.
        ffi: its FFI.
        folder: where the built module is.
        dtype: "float64" or "float32".
        options: the build options (for functions built on first use).
        optimizer: the optimizer for train_step, or None.
    """

    def __init__(self, model: Model, emitted: Emitted, plan: Plan, lib: Any, ffi: Any, folder: Path,
                 dtype: str, options: BuildOptions | None = None, optimizer: SGD | Adam | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._trainer: Trainer | None = None
        self.emitted = emitted
        self.plan = plan
        self.folder = folder
        self.dtype = np.dtype(REAL_TYPES[dtype].numpy)
        self.wrt = plan.wrt
        self.options = options
        self._scalars = _scalar_names(model, plan)
        self._functions: dict[tuple[str, str | None], Function] = {}
        self._add(plan, lib, ffi, emitted.prefix)
        self._lock = threading.Lock()

    def _add(self, plan: Plan, lib: Any, ffi: Any, prefix: str) -> None:
        for fn in plan.functions:
            self._functions[(fn.kind, fn.of_output)] = Function(fn, plan, self._scalars, lib, ffi, prefix, self.dtype)

    def function(self, kind: str, output: str | None = None) -> Function:
        """The C function of a kind (compiled now if this module lacks it).

        Args:
            kind: "forward", "value_and_grad", "vjp", "jvp", "hvp" or "train_step".
            output: for "vjp", the output it is for.

        Returns:
            The Function.

        Raises:
            ArgumentError: train_step without an optimizer, or no output of that name.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        found = self._functions.get((kind, output))
        if found is None:
            with self._lock:
                if (kind, None if kind != "vjp" else output) not in self._functions:
                    if kind == "train_step" and self.optimizer is None:
                        raise ArgumentError("train_step needs an optimizer: compile(model, optimizer=symbackprop.Adam(...))")
                    emitted, plan = generate(self.model, self.dtype.name, functions=(kind,), wrt=self.wrt,
                                             optimizer=self.optimizer)
                    module, _ = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, self.options)
                    self._add(plan, module.lib, module.ffi, emitted.prefix)
            found = self._functions.get((kind, output))
        if found is None:
            raise ArgumentError(f"the model has no output named {output!r}; its outputs are {list(self.model.outputs)}")
        return found

    @property
    def source(self) -> str:
        """The generated C source (forward and value_and_grad)."""
        return self.emitted.source

    @property
    def header(self) -> str:
        """The generated C header (forward and value_and_grad)."""
        return self.emitted.header

    # --- the ordinary API ---------------------------------------------

    def forward(self, **arrays: Any) -> dict[str, Any]:
        """The loss and the named outputs.

        Args:
            **arrays: every input and param by name.

        Returns:
            {"loss": float, output name: array (a float for a scalar output)}.

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
        """
        fn = self.function("forward")
        results = fn.call(arrays)
        return {key: r for (_, _, key), r in zip(fn.plan.returns, results)}

    def value_and_grad(self, **arrays: Any) -> tuple[float, dict[str, Any]]:
        """The loss and its gradients.

        Args:
            **arrays: every input and param by name.

        Returns:
            (loss, {name: gradient}) for each differentiated name (``wrt``).

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
        """
        fn = self.function("value_and_grad")
        results = fn.call(arrays)
        return results[0], fn.group(results, "grads")

    def prepare(self, function: str = "value_and_grad", **arrays: Any) -> PreparedCall:
        """Bind arrays once for a hot loop: checks and allocation happen
        here, none per call (see PreparedCall).

        Args:
            function: the kind of C function to call (see `function`).
            **arrays: every argument by name.

        Returns:
            The PreparedCall.

        Raises:
            ArgumentError: a missing, unknown or malformed argument, or
                inconsistent dimensions.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        return PreparedCall(self.function(function), arrays)

    def memory(self, **dims: int) -> dict[str, int]:
        """Bytes of memory for the given symbolic dimensions (e.g. n=128):

        - "kept_for_backward": forward values value_and_grad keeps for its
          backward pass (its buffer plan);
        - "prediction": the workspace of a prediction-only forward pass;
        - "value_and_grad": the whole workspace of value_and_grad.

        Args:
            **dims: the value of every symbolic dimension, by name.

        Returns:
            Those three sizes, by name.

        Raises:
            ArgumentError: a dimension is missing or unknown.
        """
        known = {str(d): d for d in self.plan.lowered.dims}
        if set(dims) != set(known):
            raise ArgumentError(f"memory() needs the dimensions {sorted(known)}; got {sorted(dims)}")
        plan = memory_plan(
            self.plan.function("forward").schedule,
            self.plan.function("value_and_grad").schedule,
            itemsize_of(self.dtype.name),
        )
        values = {known[name]: int(value) for name, value in dims.items()}
        return {
            "kept_for_backward": int(plan.kept_bytes.subs(values)),
            "prediction": int(plan.forward_work_bytes.subs(values)),
            "value_and_grad": int(plan.gradient_work_bytes.subs(values)),
        }

    def print_graph(self, file: TextIO | None = None) -> None:
        """Print the backward graph as an indented tree, grad_fn style.

        Args:
            file: where to print (None: sys.stdout).
        """
        print(graph_text(self.plan), file=file)

    # --- training ------------------------------------------------------

    @property
    def trainer(self) -> Trainer:
        """The training state of this module (see symbackprop.train.Trainer);
        made, and train_step compiled, on first use. Raises ArgumentError when
        compile was given no optimizer."""
        if self._trainer is None:
            from .train import Trainer

            self._trainer = Trainer(self, self.function("train_step"))
        return self._trainer

    def train_step(self, **arrays: Any) -> float:
        """Forward, backward and the optimizer's update in one C call; the
        parameter arrays passed are updated in place.

        Args:
            **arrays: every input and param by name.

        Returns:
            The loss before the update.

        Raises:
            ArgumentError: no optimizer was given to compile, a parameter is
                not a writable C-contiguous array of the module's dtype, or
                any check of value_and_grad fails.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        return self.trainer.step(**arrays)

    def train_epoch(self, batch_size: Any = None, order: Any = None, /, **arrays: Any) -> np.ndarray:
        """train_step over every minibatch of the data inputs, in one C call
        (see Trainer.epoch).

        Args:
            batch_size: rows per minibatch, a positive integer.
            order: the row order (a permutation of the rows), or None.
            **arrays: every input and param by name.

        Returns:
            The minibatches' losses, in the order they ran.

        Raises:
            ArgumentError: as train_step, or a bad batch_size or order, or a
                model without a batch dimension.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        return self.trainer.epoch(batch_size, order, **arrays)

    @property
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer's state arrays (momentum, moments, step count), by
        name; empty before the first step. Raises ArgumentError when compile
        was given no optimizer."""
        return self.trainer.state

    def as_torch(self, outputs: Sequence[str] = ()) -> TorchFunction:
        """This module as a torch autograd function (see symbackprop.interop_torch).

        Args:
            outputs: named outputs to return beside the loss.

        Returns:
            The TorchFunction.

        Raises:
            ArgumentError: an output name the model lacks.
            ImportError: PyTorch is not installed.
        """
        from .interop_torch import as_torch

        return as_torch(self, outputs)

    def as_jax(self, outputs: Sequence[str] = ()) -> JaxFunction:
        """This module as a JAX function with a custom VJP (see symbackprop.interop_jax).

        Args:
            outputs: named outputs to return beside the loss.

        Returns:
            The JaxFunction.

        Raises:
            ArgumentError: an output name the model lacks.
            ImportError: JAX is not installed.
        """
        from .interop_jax import as_jax

        return as_jax(self, outputs)

    # --- the wider autograd surface -------------------------------------

    def vjp(self, output: str, seed: Any = None, **arrays: Any) -> dict[str, Any]:
        """Gradients of sum(seed * output) for each differentiated name.

        Args:
            output: "loss" or a named output.
            seed: an array of the output's shape; may be omitted only for a
                scalar output (then it is 1).
            **arrays: every input and param by name.

        Returns:
            {name: gradient} for each differentiated name.

        Raises:
            ArgumentError: no output of that name, no seed for a non-scalar
                output, a seed of the wrong shape (both shapes named), or a
                malformed argument.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        if output == "loss":
            node = self.plan.lowered.loss
        elif output in self.plan.lowered.outputs:
            node = self.plan.lowered.outputs[output]
        else:
            raise ArgumentError(f"no output named {output!r}; the outputs are {['loss', *self.model.outputs]}")
        if seed is None:
            if node.shape != (1, 1):
                raise ArgumentError(
                    f"vjp of {output!r} needs a seed because the output is not a scalar (its shape is {_show(node.shape)})"
                )
            seed = 1.0
        if output == "loss":
            loss, grads = self.value_and_grad(**arrays)
            factor = float(np.asarray(seed).reshape(-1)[0])
            return {k: g * factor for k, g in grads.items()}
        fn = self.function("vjp", output)
        expected = _concrete(node.shape, _dims_from(fn, arrays))
        seed = _as_array(ArraySpec(f"the seed for {output!r}", node.shape, False), seed, self.dtype)
        if expected == (1, 1) and seed.size == 1:
            seed = seed.reshape(1, 1)
        if tuple(seed.shape) != expected:
            raise ArgumentError(f"the seed for {output!r} must have the output's shape {expected}; got {tuple(seed.shape)}")
        return fn.group(fn.call({**arrays, fn.plan.extra_inputs[0][0]: seed}), "grads")

    def _with_extra(self, kind: str, given: Mapping[str, Any], what: str, arrays: Mapping[str, Any]) -> tuple[Function, dict]:
        fn = self.function(kind)
        extra = {key: arg for arg, _, key in fn.plan.extra_roles}
        unknown = [k for k in given if k not in extra]
        if unknown:
            raise ArgumentError(f"{what}s given for {unknown}, which are not differentiated; expected some of {list(extra)}")
        full = dict(arrays)
        missing = [key for key in extra if key not in given]
        bound = _dims_from(fn, arrays) if missing else {}
        shapes = {spec.name: spec.shape for spec in fn.inputs}
        for key, arg in extra.items():
            full[arg] = given[key] if key in given else np.zeros(_concrete(shapes[arg], bound), dtype=self.dtype)
        return fn, full

    def jvp(self, tangents: Mapping[str, Any], **arrays: Any) -> dict[str, Any]:
        """Jacobian-vector product (forward mode).

        Args:
            tangents: {differentiated leaf name: array}; those missing are 0.
            **arrays: every input and param by name.

        Returns:
            {"loss": dloss, output name: doutput}.

        Raises:
            ArgumentError: a tangent for a name not differentiated, or a
                malformed argument.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        fn, full = self._with_extra("jvp", tangents, "tangent", arrays)
        results = fn.call(full)
        return {key: r for (_, _, key), r in zip(fn.plan.returns, results)}

    def hvp(self, directions: Mapping[str, Any], **arrays: Any) -> dict[str, Any]:
        """Hessian of the loss times a direction.

        Args:
            directions: {differentiated leaf name: array}; those missing are 0.
            **arrays: every input and param by name.

        Returns:
            {name: (H v) for that name}.

        Raises:
            ArgumentError: a direction for a name not differentiated, or a
                malformed argument.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        fn, full = self._with_extra("hvp", directions, "direction", arrays)
        return fn.group(fn.call(full), "hvp")

    def hessian(self, **arrays: Any) -> np.ndarray:
        """The full Hessian of the loss over the differentiated leaves,
        flattened in order (for small models: one hvp per entry).

        Args:
            **arrays: every input and param by name.

        Returns:
            A square array, one row and column per entry of the leaves.

        Raises:
            ArgumentError: a malformed argument.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        fn = self.function("hvp")
        bound = _dims_from(fn, arrays)
        specs = {spec.name: spec for spec in fn.inputs}
        keys = [key for _, _, key in fn.plan.extra_roles]
        shapes = {key: _concrete(specs[arg].shape, bound) for arg, _, key in fn.plan.extra_roles}
        sizes = [int(np.prod(shapes[k])) for k in keys]
        columns = []
        for k, size in zip(keys, sizes):
            for index in range(size):
                direction = np.zeros(size, dtype=self.dtype)
                direction[index] = 1.0
                product = self.hvp({k: direction.reshape(shapes[k])}, **arrays)
                columns.append(np.concatenate([np.ravel(product[j]) for j in keys]))
        return np.array(columns).T

    def jacobian(self, output: str, **arrays: Any) -> dict[str, np.ndarray]:
        """d output / d name for each differentiated name (for small models:
        one vjp per entry).

        Args:
            output: a named output (not "loss").
            **arrays: every input and param by name.

        Returns:
            {name: array of shape output.shape + name.shape}.

        Raises:
            ArgumentError: no output of that name, or a malformed argument.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        node = self.plan.lowered.outputs.get(output)
        if node is None:
            raise ArgumentError(f"no output named {output!r}; the outputs are {list(self.model.outputs)}")
        shape = _concrete(node.shape, _dims_from(self.function("forward"), arrays))
        rows: dict[str, list] = {}
        for index in np.ndindex(*shape):
            seed = np.zeros(shape, dtype=self.dtype)
            seed[index] = 1.0
            for key, grad in self.vjp(output, seed, **arrays).items():
                rows.setdefault(key, []).append(np.asarray(grad, dtype=self.dtype))
        return {k: np.array(v).reshape(*shape, *np.shape(v[0])) for k, v in rows.items()}


def _scalar_names(model: Model, plan: Plan) -> set[str]:
    """Names passed and returned as numbers: Symbol leaves, the loss, and
    outputs given as scalar (non-matrix) expressions."""
    names = {leaf_name(s) for s in model.inputs + model.params if isinstance(s, sp.Symbol)}
    names.add("loss")
    names |= {n for n, e in model.outputs.items() if not isinstance(e, (sp.MatrixExpr, sp.MatrixBase))}
    return names


def _dims_from(fn: Function, arrays: Mapping[str, Any]) -> dict[sp.Symbol, int]:
    """Symbolic dimensions bound by the model's own arrays."""
    bound: dict[sp.Symbol, int] = {}
    binder: dict[sp.Symbol, str] = {}
    for spec in fn.inputs:
        if spec.name in arrays:
            _convert(spec, arrays[spec.name], fn.dtype, bound, binder)
    return bound


def _check_names(inputs: Sequence[ArraySpec], arrays: Mapping[str, Any]) -> None:
    expected = [spec.name for spec in inputs]
    missing = [n for n in expected if n not in arrays]
    unknown = [n for n in arrays if n not in expected]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unknown:
            parts.append(f"unknown {unknown}")
        raise ArgumentError(f"{'; '.join(parts)}; expected the arguments {expected}")


def _check_rows(name: str, index: np.ndarray, bounds: Any, bound: Mapping[sp.Symbol, int]) -> None:
    """Every row number lies within each array the index chooses rows of."""
    if not index.size:
        return
    low, high = int(index.min()), int(index.max())
    for rows in bounds:
        count = bound[rows] if isinstance(rows, sp.Symbol) else int(rows)
        if low < 0 or high >= count:
            bad = low if low < 0 else high
            raise ArgumentError(f"{name} holds the row number {bad}, outside the {count} rows ({rows}) it chooses among")


def _as_index(spec: ArraySpec, value: Any) -> np.ndarray:
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or array.dtype.kind not in "iu" or array.dtype == np.uint64:
        what = f"dtype {array.dtype}" if array is not None else type(value).__name__
        raise ArgumentError(f"{spec.name} is an Index: an array of integer row numbers; got {what}")
    if array.ndim == 1:
        array = array.reshape(-1, 1)
    return array.astype(np.int64, copy=False)


def _convert(
    spec: ArraySpec, value: Any, dtype: np.dtype, bound: dict[sp.Symbol, int], binder: dict[sp.Symbol, str]
) -> np.ndarray:
    array = _as_index(spec, value) if spec.index else _as_array(spec, value, dtype)
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
    for want, got in zip(spec.shape, array.shape):
        if isinstance(want, sp.Symbol):
            if got < 1:
                raise ArgumentError(f"{spec.name} must have shape {_show(spec.shape)} with {want} >= 1; got {array.shape}")
            if bound.setdefault(want, got) != got:
                raise ArgumentError(
                    f"{spec.name} must have shape {_show(spec.shape)} with {want}={bound[want]} "
                    f"(as in {binder[want]}); got {array.shape}"
                )
            binder.setdefault(want, spec.name)
        elif want != got:
            raise ArgumentError(f"{spec.name} must have shape {_show(spec.shape)}; got {array.shape}")
    return np.ascontiguousarray(array)


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
                f"{spec.name} must be real numbers of dtype {dtype}; numpy reads the given "
                f"{type(value).__name__} as {array.dtype} (shape {array.shape})"
            )
        return array.astype(dtype, copy=False)
    if spec.scalar:
        raise ArgumentError(f"{spec.name} must be a real number (or a {dtype} array of one element); got {type(value).__name__}")
    raise ArgumentError(
        f"{spec.name} must be a numpy array of dtype {dtype} and shape {_show(spec.shape)}; got {type(value).__name__}"
    )


def _concrete(shape: tuple, bound: Mapping[sp.Symbol, int]) -> tuple[int, ...]:
    return tuple(bound[d] if isinstance(d, sp.Symbol) else int(d) for d in shape)


def _show(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def compile(
    model: Model,
    dtype: str = "float64",
    options: BuildOptions | None = None,
    wrt: Sequence[str] | None = None,
    functions: Sequence[str] = DEFAULT_FUNCTIONS,
    optimizer: SGD | Adam | None = None,
) -> CompiledModule:
    """Generate, build (or load from the cache) and wrap the model.

    Args:
        model: the Model to compile.
        dtype: "float64" (default) or "float32".
        options: compiler flags, cache folder, BLAS (see BuildOptions).
        wrt: names to differentiate with respect to: params, inputs, or named
            outputs (the gradient of an intermediate); default: the model's
            params and grad_inputs. Nothing else is differentiated.
        functions: C functions to build now; others ("vjp", "jvp", "hvp",
            "train_step") are built on first use.
        optimizer: for train_step: a symbackprop.SGD or symbackprop.Adam.

    Returns:
        The CompiledModule.

    Raises:
        ModelError: the model cannot be compiled (names the subexpression),
            or dtype is not one of the two.
        BuildError: the C compiler is missing or failed (names the log).
    """
    if dtype not in REAL_TYPES:
        raise ModelError(f"dtype must be one of {sorted(REAL_TYPES)}; got {dtype!r}")
    key = model_fingerprint(model, dtype, tuple(functions), None if wrt is None else tuple(wrt), optimizer, options)
    memo = read_memo(key, options)
    module = None
    if memo is not None:
        emitted, plan, folder = cast("tuple[Emitted, Plan, Path]", memo)  # as write_memo stored it below
        module = load_built(folder, emitted.prefix)
    if module is None:
        emitted, plan = generate(model, dtype, functions=functions, wrt=wrt, optimizer=optimizer)
        module, folder = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, options)
        write_memo(key, (emitted, plan, folder), options)
    return CompiledModule(model, emitted, plan, module.lib, module.ffi, folder, dtype, options, optimizer)


class _ExpressionDigest:
    """A hash of an expression's structure that visits each subexpression
    object once (srepr and preorder_traversal walk every path of a shared
    DAG, which is exponential for an unrolled recurrent model); Dummy
    symbols are numbered in the order they are met."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[Any, str]] = {}
        self.dummies: dict[sp.Dummy, int] = {}

    def __call__(self, expr: Any) -> str:
        from .cache_key import digest

        found = self.memo.get(id(expr))
        if found is not None:
            return found[1]
        if isinstance(expr, sp.Dummy):
            number = self.dummies.setdefault(expr, len(self.dummies))
            text = f"Dummy{number}{sorted(expr.assumptions0.items())}"
        elif isinstance(expr, sp.Basic) and expr.args:
            text = f"{type(expr).__name__}({','.join(self(a) for a in expr.args)})"
        else:
            text = sp.srepr(expr) if isinstance(expr, sp.Basic) else repr(expr)
        value = digest("expression", text)
        self.memo[id(expr)] = (expr, value)  # holds expr so that its id stays unique
        return value


def model_fingerprint(model: Model, *settings: Any) -> str:
    """A hash of everything generation depends on: the model's expressions
    (SymPy's srepr, with Lambda's dummy variables numbered in order), the
    settings, whether BLAS is installed, the CPU where the flags ask for
    the host's (the memo names a cache entry built for it), and
    symbackprop's own code."""
    from .build import host_target
    from .cache_key import digest as key_digest

    options = next((s for s in settings if isinstance(s, BuildOptions)), None)
    expressions = [model.loss, *model.outputs.values()]
    digest = _ExpressionDigest()
    parts = [
        model.name,
        *(sp.srepr(leaf) for leaf in (*model.inputs, "|", *model.params, "|", *model.grad_inputs)),
        *model.outputs,
        *(digest(sp.sympify(expr)) for expr in expressions),
        repr(settings),
        str(find_blas() is not None),
        host_target(options),
        package_digest(),
    ]
    return key_digest("model", *parts)
