"""Call a compiled module on numpy arrays.

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

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TextIO

import numpy as np
import sympy as sp

from . import fastcall
from .abi import ArgSpec, FunctionSpec, ModuleSpec, concrete, module_spec, show
from .binding import Binder, convert
from .build import BuildOptions, build, find_blas, load_built, package_digest, read_memo, write_memo
from .codegen import REAL_TYPES, Emitted
from .compiler import DEFAULT_FUNCTIONS, Plan, generate
from .derivation import itemsize_of, memory_plan
from .errors import ArgumentError, ModelError
from .graph import graph_text
from .model import Model

if TYPE_CHECKING:  # only for annotations: these modules are imported on first use
    from .interop_jax import JaxFunction
    from .interop_torch import TorchFunction
    from .optim import SGD, Adam
    from .train import Trainer

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
        self._local = threading.local()  # per-thread workspace, reused while the dimensions stay
        # the C hot path (fastcall.py), from the binder's patterns; not for functions that write their inputs
        self.fast = None if spec.inplace else fastcall.caller(lib, ffi, self.c_name, len(self.dims), dtype.itemsize,
                                                              *self.binder.c_patterns())

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
            local.array = np.empty(max(self.work_len(*dims), 1), dtype=self.dtype)
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
        if fast is not None and arrays.keys() == self.names:
            results = fast([arrays[name] for name in self.input_names])
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


class PreparedCall:
    """A function bound to arrays once; each call runs the C code on their
    current contents and writes into the arrays in `results`.

    Refill the bound input arrays in place (``call.inputs["X"][:] = batch``)
    between calls; the shapes are fixed at preparation. Arguments the
    function writes (train_step's params and optimizer state) are bound as
    given and must be writable arrays (see binding.py). Calling returns the
    loss; the gradients are in ``call.grads``. Not for concurrent use from
    several threads (one workspace).

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
        self.results = {out.name: o for out, o in zip(function.outputs, outputs)}
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
        return {out.key: self.results[out.name] for out in self.function.outputs if out.group == "grads"}

    def __call__(self) -> float | None:
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


class CompiledModule:
    """A compiled model: call `forward` and `value_and_grad` with the
    model's inputs and parameters as keyword arguments.

    `vjp`, `jvp`, `hvp`, `hessian` and `jacobian` compile their C functions
    on first use (then load them from the cache). The module runs from its
    ABI spec (`spec`, see abi.py); the full Plan (`plan`, for `memory` and
    `print_graph`) is generated again on first use when the module came
    from the cache.

    Made by `symbackprop.compile`, which passes:

    Args:
        model: the model.
        emitted: the generated code.
        spec: the ABI spec of the module's functions.
        lib: the built cffi library.
        ffi: its FFI.
        folder: where the built module is.
        dtype: "float64" or "float32".
        options: the build options (for functions built on first use).
        optimizer: the optimizer for train_step, or None.
        plan: the plan the module was generated from, if at hand.
    """

    def __init__(self, model: Model, emitted: Emitted, spec: ModuleSpec, lib: Any, ffi: Any, folder: Path,
                 dtype: str, options: BuildOptions | None = None, optimizer: SGD | Adam | None = None,
                 plan: Plan | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._trainer: Trainer | None = None
        self.emitted = emitted
        self.spec = spec
        self._plan = plan
        self.folder = folder
        self.dtype = np.dtype(REAL_TYPES[dtype].numpy)
        self.wrt = spec.wrt
        self.options = options
        self._functions: dict[tuple[str, str | None], Function] = {}
        self._add(spec, lib, ffi)
        self._lock = threading.Lock()

    def _add(self, spec: ModuleSpec, lib: Any, ffi: Any) -> None:
        for fn in spec.functions:
            self._functions[(fn.kind, fn.of_output)] = Function(fn, lib, ffi, spec.prefix, self.dtype)

    @property
    def plan(self) -> Plan:
        """The full plan of the module's functions (generated again on
        first use for a module loaded from the cache)."""
        if self._plan is None:
            kinds = tuple(dict.fromkeys(fn.kind for fn in self.spec.functions))
            _, self._plan = generate(self.model, self.dtype.name, functions=kinds, wrt=self.wrt, optimizer=self.optimizer)
        return self._plan

    def function(self, kind: str, output: str | None = None) -> Function:
        """The C function of a kind (compiled now if this module lacks it).

        Args:
            kind: "forward", "value_and_grad", "vjp", "jvp", "hvp" or "train_step".
            output: for "vjp", the output it is for.

        Returns:
            The Function.

        Raises:
            ArgumentError: train_step without an optimizer, no output of that
                name, or a function of the loss for a model without one.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        if not self.spec.has_loss and kind in ("value_and_grad", "hvp", "train_step"):
            self._need_loss(kind)
        found = self._functions.get((kind, output))
        if found is None:
            with self._lock:
                if (kind, None if kind != "vjp" else output) not in self._functions:
                    if kind == "train_step" and self.optimizer is None:
                        raise ArgumentError("train_step needs an optimizer: compile(model, optimizer=symbackprop.Adam(...))")
                    emitted, plan = generate(self.model, self.dtype.name, functions=(kind,), wrt=self.wrt,
                                             optimizer=self.optimizer)
                    module, _ = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, self.options)
                    self._add(module_spec(plan, self.model, self.dtype.name, emitted.prefix), module.lib, module.ffi)
            found = self._functions.get((kind, output))
        if found is None:
            raise ArgumentError(f"the model has no output named {output!r}; its outputs are {list(self.model.outputs)}")
        return found

    def _need_loss(self, what: str) -> None:
        if not self.spec.has_loss:
            outputs = [name for name, _, _ in self.spec.outputs]
            raise ArgumentError(
                f"{what}: the model {self.model.name!r} has no loss (only the named outputs {outputs}), so there is "
                "nothing to differentiate; call vjp(output, seed, ...) for the gradient of a named output")

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
        return {out.key: r for out, r in zip(fn.outputs, results)}

    def value_and_grad(self, **arrays: Any) -> tuple[float, dict[str, Any]]:
        """The loss and its gradients.

        Args:
            **arrays: every input and param by name.

        Returns:
            (loss, {name: gradient}) for each differentiated name (``wrt``).

        Raises:
            ArgumentError: a missing, unknown or malformed argument,
                inconsistent dimensions, or a model without a loss.
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
        if set(dims) != set(self.spec.dims):
            raise ArgumentError(f"memory() needs the dimensions {sorted(self.spec.dims)}; got {sorted(dims)}")
        known = {str(d): d for d in self.plan.lowered.dims}
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
            seed: an array of the output's shape (a number for a scalar
                output, as any scalar argument); may be omitted only for an
                output of shape (1, 1) (then it is 1).
            **arrays: every input and param by name.

        Returns:
            {name: gradient} for each differentiated name.

        Raises:
            ArgumentError: no output of that name, no seed for a non-scalar
                output, a malformed seed (named, with both shapes), a model
                without a loss for "loss", or a malformed argument.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        try:
            shape = self.spec.output_shape(output)
        except (KeyError, StopIteration):
            raise ArgumentError(f"no output named {output!r}; the outputs are {['loss', *self.model.outputs]}") from None
        if seed is None:
            if shape != (1, 1):
                raise ArgumentError(
                    f"vjp of {output!r} needs a seed because the output is not a scalar (its shape is {show(shape)})")
            seed = np.ones((1, 1), dtype=self.dtype)
        if output == "loss":
            self._need_loss("vjp('loss')")
            spec = ArgSpec("seed_loss", shape, True, role="seed", key="loss")
            factor = float(convert(spec, seed, self.dtype, {}, {})[0, 0])
            _, grads = self.value_and_grad(**arrays)
            return {k: g * factor for k, g in grads.items()}
        fn = self.function("vjp", output)
        (seed_arg, _, _), = fn.spec.extra_roles
        return fn.group(fn.call({**arrays, seed_arg: seed}), "grads")

    def _with_extra(self, kind: str, given: Mapping[str, Any], what: str, arrays: Mapping[str, Any]) -> tuple[Function, dict]:
        """The function and its arguments, with zeros for the tangents or
        directions not given (each given one is bound as an argument)."""
        fn = self.function(kind)
        if not isinstance(given, Mapping):
            raise ArgumentError(f"{what}s must be a dict {{name: array}}; got {type(given).__name__}")
        extra = {key: arg for arg, _, key in fn.spec.extra_roles}
        unknown = [k for k in given if k not in extra]
        if unknown:
            raise ArgumentError(f"{what}s given for {unknown}, which are not differentiated; expected some of {list(extra)}")
        full = dict(arrays)
        missing = [key for key in extra if key not in given]
        bound = fn.binder.dims_from(arrays) if missing else {}
        shapes = {spec.name: spec.shape for spec in fn.inputs}
        for key, arg in extra.items():
            full[arg] = given[key] if key in given else np.zeros(_shape_in(shapes[arg], bound, arg), dtype=self.dtype)
        return fn, full

    def jvp(self, tangents: Mapping[str, Any], **arrays: Any) -> dict[str, Any]:
        """Jacobian-vector product (forward mode).

        Args:
            tangents: {differentiated leaf name: array (a number for a
                scalar)}; those missing are 0.
            **arrays: every input and param by name.

        Returns:
            {"loss": dloss, output name: doutput}.

        Raises:
            ArgumentError: a tangent for a name not differentiated, or a
                malformed argument or tangent.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        fn, full = self._with_extra("jvp", tangents, "tangent", arrays)
        results = fn.call(full)
        return {out.key: r for out, r in zip(fn.outputs, results)}

    def hvp(self, directions: Mapping[str, Any], **arrays: Any) -> dict[str, Any]:
        """Hessian of the loss times a direction.

        Args:
            directions: {differentiated leaf name: array (a number for a
                scalar)}; those missing are 0.
            **arrays: every input and param by name.

        Returns:
            {name: (H v) for that name}.

        Raises:
            ArgumentError: a direction for a name not differentiated, a
                model without a loss, or a malformed argument or direction.
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
            ArgumentError: a malformed argument, or a model without a loss.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        fn = self.function("hvp")
        bound = fn.binder.dims_from(arrays)
        specs = {spec.name: spec for spec in fn.inputs}
        roles = fn.spec.extra_roles
        keys = [key for _, _, key in roles]
        shapes = {key: _shape_in(specs[arg].shape, bound, arg) for arg, _, key in roles}
        columns = []
        for k in keys:
            size = int(np.prod(shapes[k]))
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
        found = [shape for name, shape, _ in self.spec.outputs if name == output]
        if not found:
            raise ArgumentError(f"no output named {output!r}; the outputs are {list(self.model.outputs)}")
        shape = _shape_in(found[0], self.function("forward").binder.dims_from(arrays), output)
        rows: dict[str, list] = {}
        for index in np.ndindex(*shape):
            seed = np.zeros(shape, dtype=self.dtype)
            seed[index] = 1.0
            for key, grad in self.vjp(output, seed, **arrays).items():
                rows.setdefault(key, []).append(np.asarray(grad, dtype=self.dtype))
        return {k: np.array(v).reshape(*shape, *np.shape(v[0])) for k, v in rows.items()}


def _shape_in(shape: tuple, bound: Mapping[str, int], what: str) -> tuple[int, ...]:
    """A shape with its dimensions' values, which the arguments must fix."""
    missing = [d for d in shape if isinstance(d, str) and d not in bound]
    if missing:
        raise ArgumentError(f"the shape {show(shape)} of {what} needs the dimensions {missing}, which no argument fixes")
    return concrete(shape, bound)


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
    found = _from_memo(read_memo(key, options))
    module, plan = None, None
    if found is not None:
        emitted, spec, folder = found
        module = load_built(folder, emitted.prefix, options)
    if module is None:
        emitted, plan = generate(model, dtype, functions=functions, wrt=wrt, optimizer=optimizer)
        spec = module_spec(plan, model, dtype, emitted.prefix)
        module, folder = build(emitted.prefix, emitted.source, emitted.header, emitted.cdef, options)
        write_memo(key, _memo(emitted, spec, folder), options)
    return CompiledModule(model, emitted, spec, module.lib, module.ffi, folder, dtype, options, optimizer, plan)


_EMITTED_TEXTS = ("prefix", "source", "header", "cdef", "derivation")


def _memo(emitted: Emitted, spec: ModuleSpec, folder: Path) -> dict:
    """What compile() stores in the memo: JSON-able texts, the ABI spec and the folder."""
    return {"emitted": {name: getattr(emitted, name) for name in _EMITTED_TEXTS}, "spec": spec.to_json(),
            "folder": str(folder)}


def _from_memo(memo: Any) -> tuple[Emitted, ModuleSpec, Path] | None:
    """What _memo stored, checked; None (a miss) for anything else."""
    try:
        texts, folder = memo["emitted"], memo["folder"]
        if type(texts) is not dict or set(texts) != set(_EMITTED_TEXTS) or type(folder) is not str:
            return None
        if not all(type(texts[name]) is str for name in _EMITTED_TEXTS):
            return None
        spec = ModuleSpec.from_json(memo["spec"])
        if spec.prefix != texts["prefix"]:
            return None
        # the C model (CModule) is not kept: nothing reads it after rendering
        return Emitted(**texts, module=None), spec, Path(folder)
    except (ValueError, KeyError, TypeError):
        return None


class _ExpressionDigest:
    """A hash of an expression's structure that visits each subexpression
    object once (srepr and preorder_traversal walk every path of a shared
    DAG, which is exponential for an unrolled recurrent model); Dummy
    symbols are numbered in the order they are met."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[Any, str]] = {}
        self.dummies: dict[sp.Dummy, int] = {}

    def __call__(self, root: Any) -> str:
        """The digest of root, walked with an explicit stack (no recursion
        per level: a model 1,000 layers deep is 1,000s of levels)."""
        from .cache_key import digest

        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            expr, expanded = stack.pop()
            if id(expr) in self.memo:
                continue
            if isinstance(expr, sp.Dummy):
                number = self.dummies.setdefault(expr, len(self.dummies))
                text = f"Dummy{number}{sorted(expr.assumptions0.items())}"
            elif isinstance(expr, sp.Basic) and expr.args:
                if not expanded:  # its arguments first, left to right (the order dummies are numbered in)
                    stack.append((expr, True))
                    stack.extend((a, False) for a in reversed(expr.args))
                    continue
                text = f"{type(expr).__name__}({','.join(self.memo[id(a)][1] for a in expr.args)})"
            else:
                text = sp.srepr(expr) if isinstance(expr, sp.Basic) else repr(expr)
            self.memo[id(expr)] = (expr, digest("expression", text))  # holds expr so that its id stays unique
        return self.memo[id(root)][1]


def model_fingerprint(model: Model, *settings: Any) -> str:
    """A hash of everything generation depends on: the model's expressions
    (SymPy's srepr, with Lambda's dummy variables numbered in order), the
    settings, whether BLAS is installed, the CPU where the flags ask for
    the host's (the memo names a cache entry built for it), and
    symbackprop's own code."""
    from .build import host_target
    from .cache_key import digest as key_digest

    options = next((s for s in settings if isinstance(s, BuildOptions)), None)
    expressions = [model.loss, *model.outputs.values(), *model.names.values()]
    digest = _ExpressionDigest()
    parts = [
        model.name,
        str(model.has_loss),
        *(sp.srepr(leaf) for leaf in (*model.inputs, "|", *model.params, "|", *model.grad_inputs)),
        *model.outputs,
        "|",
        *model.names,
        *(digest(sp.sympify(expr)) for expr in expressions),
        repr(settings),
        str(find_blas() is not None),
        host_target(options),
        package_digest(),
    ]
    return key_digest("model", *parts)
