"""A compiled model called from Python: CompiledModule holds one Function
per generated C function (function.py) and builds the ones it lacks on
first use; its derivatives (derivatives.py) and training (train.py) come
from the classes it inherits. Made by symbackprop.compile (runtime.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from symbackprop.base.abi import ModuleSpec
from symbackprop.declare.model import Model
from symbackprop.emit.emitted import REAL_TYPES, Emitted
from symbackprop.errors import ArgumentError
from symbackprop.log import slow_work
from symbackprop.run.bridge import BRIDGES
from symbackprop.run.derivatives import Derivatives
from symbackprop.run.function import Function, PreparedCall
from symbackprop.run.train import Trainer, Training
from symbackprop.toolchain.builder import BuildOptions, build

if TYPE_CHECKING:  # only for annotations
    from symbackprop.emit.derivation import MemoryPlan
    from symbackprop.plan import Plan
    from symbackprop.run.display import BackwardGraph
    from symbackprop.run.optim import SGD, Adam

# The keys of the ordinary API's functions, looked up on every call
# (`function` also builds what is missing, and explains).
_FORWARD, _VALUE_AND_GRAD = ("forward", None), ("value_and_grad", None)

# The compiler (pipeline, emit) and the displays are imported where a method
# needs them: a module loaded from the cache imports neither.


class CompiledModule(Training, Derivatives):
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
            from symbackprop.pipeline import generate

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
                    from symbackprop.pipeline import generate
                    from symbackprop.run.plan_spec import module_spec

                    with slow_work(f"compiling {kind} of {self.model.name!r} (built on first use)"):
                        emitted, plan = generate(self.model, self.dtype.name, functions=(kind,), wrt=self.wrt,
                                                 optimizer=self.optimizer, derivation=False)  # (C only)
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
        fn = self._functions.get(_FORWARD) or self.function("forward")
        return fn.answer(arrays)

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
        fn = (self.spec.has_loss and self._functions.get(_VALUE_AND_GRAD)) or self.function("value_and_grad")
        return fn.answer(arrays)

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
            Those three sizes, by name (a dict; shown as a table in Jupyter).

        Raises:
            ArgumentError: a dimension is missing or unknown.
        """
        from symbackprop.run.display import MemoryReport

        if set(dims) != set(self.spec.dims):
            raise ArgumentError(f"memory() needs the dimensions {sorted(self.spec.dims)}; got {sorted(dims)}")
        known = {str(d): d for d in self.plan.lowered.dims}
        values = {known[name]: int(value) for name, value in dims.items()}
        return MemoryReport({name: int(size.subs(values)) for name, size in self.memory_plan().sizes().items()}, dims)

    def memory_plan(self) -> MemoryPlan:
        """The memory report's sizes as expressions in the dimensions (see `memory`).

        Returns:
            The MemoryPlan of forward and value_and_grad.
        """
        from symbackprop.emit.derivation import itemsize_of, memory_plan

        return memory_plan(
            self.plan.function("forward").schedule,
            self.plan.function("value_and_grad").schedule,
            itemsize_of(self.dtype.name),
        )

    def print_graph(self, file: TextIO | None = None) -> None:
        """Print the backward graph as an indented tree, grad_fn style.

        Args:
            file: where to print (None: sys.stdout).
        """
        from symbackprop.emit.graph import graph_text

        print(graph_text(self.plan), file=file)

    @property
    def graph(self) -> BackwardGraph:
        """The backward graph: text when printed, an SVG in Jupyter (see run.display)."""
        from symbackprop.run.display import BackwardGraph

        return BackwardGraph(self.plan)

    def __repr__(self) -> str:
        from symbackprop.run.display import module_text

        built = list(dict.fromkeys(kind for kind, _ in self._functions))
        return module_text(self, built)

    def _repr_html_(self) -> str:
        from symbackprop.run.display import module_html

        return module_html(self)

    def _repr_markdown_(self) -> str:
        from symbackprop.run.display import module_markdown

        return module_markdown(self)

    def as_torch(self, outputs: Sequence[str] = ()) -> Any:
        """This module as a torch autograd function (see symbackprop.interop.torch).

        Args:
            outputs: named outputs to return beside the loss.

        Returns:
            The TorchFunction.

        Raises:
            ArgumentError: an output name the model lacks.
            ImportError: PyTorch is not installed.
        """
        return BRIDGES["torch"](self, outputs)

    def as_jax(self, outputs: Sequence[str] = ()) -> Any:
        """This module as a JAX function with a custom VJP (see symbackprop.interop.jax).

        Args:
            outputs: named outputs to return beside the loss.

        Returns:
            The JaxFunction.

        Raises:
            ArgumentError: an output name the model lacks.
            ImportError: JAX is not installed.
        """
        return BRIDGES["jax"](self, outputs)


__all__ = ["CompiledModule"]
