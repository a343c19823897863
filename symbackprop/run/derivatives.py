"""The wider autograd surface of a compiled module: vector-Jacobian and
Jacobian-vector products, Hessian-vector products, and the full Hessian
and Jacobian of small models built from them. CompiledModule (module.py)
inherits them; each compiles its C function on first use."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from symbackprop.base.abi import ArgSpec, ModuleSpec, concrete, show
from symbackprop.declare.model import Model
from symbackprop.errors import ArgumentError
from symbackprop.run import fastcall
from symbackprop.run.binding import convert
from symbackprop.run.function import Function
from symbackprop.run.gradcheck import GradCheckReport, check_gradient, default_tolerance, enforce

# forward mode where the leaves have FORWARD_FROM times fewer entries than the output, not at once
# from fewer: a jvp run costs more than a vjp run (it computes every output and the loss); on an MLP of
# 26 parameter entries the sweeps cost the same at 40 output entries (benchmarks/jacobian.py)
FORWARD_FROM = 1.5


class Derivatives:
    """vjp, jvp, hvp (and value_grad_and_hvp), hessian, jacobian and check_grads, for CompiledModule (which
    gives the attributes and methods declared here)."""

    spec: ModuleSpec
    model: Model
    dtype: np.dtype

    if TYPE_CHECKING:  # CompiledModule's

        def function(self, kind: str, output: str | None = None) -> Function: ...

        def value_and_grad(self, **arrays: Any) -> tuple[float, dict[str, Any]]: ...

        def forward(self, **arrays: Any) -> dict[str, Any]: ...

        def _need_loss(self, what: str) -> None: ...

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
        return fn.answer({**arrays, seed_arg: seed})

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
        return fn.answer(full)

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

    def value_grad_and_hvp(self, directions: Mapping[str, Any], **arrays: Any) -> tuple[float, dict[str, Any], dict[str, Any]]:
        """The loss, its gradients and the Hessian times a direction, from
        one call of the C function `hvp` runs (which computes all three).

        Args:
            directions: as for `hvp`.
            **arrays: every input and param by name.

        Returns:
            (loss, {name: gradient}, {name: (H v) for that name}).

        Raises:
            ArgumentError, ModelError, BuildError: as `hvp` raises them.
        """
        fn, full = self._with_extra("hvp", directions, "direction", arrays)
        return fn.answer(full)

    def hessian(self, **arrays: Any) -> dict[str, dict[str, Any]]:
        """The full Hessian of the loss, by pairs of differentiated leaves
        (as jax.hessian of a function of a dict): ``H[a][b]`` is
        d^2 loss / (d a d b), of shape a.shape + b.shape (a float when both
        are scalars). For small models: one hvp per entry.

        Args:
            **arrays: every input and param by name.

        Returns:
            {a: {b: block}} over the differentiated leaves, in order.

        Raises:
            ArgumentError: a malformed argument, or a model without a loss.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        flat, shapes = self._hessian(arrays)
        sizes = [int(np.prod(shape)) for shape in shapes.values()]
        spans = {key: slice(end - size, end) for key, size, end in zip(shapes, sizes, np.cumsum(sizes))}
        blocks: dict[str, dict[str, Any]] = {}
        for a, shape_a in shapes.items():
            blocks[a] = {}
            for b, shape_b in shapes.items():
                block = flat[spans[a], spans[b]].reshape((*shape_a, *shape_b))
                blocks[a][b] = block.item() if block.ndim == 0 else block
        return blocks

    def hessian_matrix(self, **arrays: Any) -> np.ndarray:
        """The full Hessian of the loss as one square matrix: the
        differentiated leaves flattened (row-major) and concatenated in
        order (the blocks of `hessian`, for a solver or an eigendecomposition).

        Args:
            **arrays: every input and param by name.

        Returns:
            A square array, one row and column per entry of the leaves.

        Raises:
            ArgumentError: a malformed argument, or a model without a loss.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        return self._hessian(arrays)[0]

    def _hessian(self, arrays: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, tuple[int, ...]]]:
        """The flat Hessian (one hvp per column), and each leaf's shape as
        its gradient has it (() for a scalar)."""
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
        shown = {key: () if specs[arg].scalar else shapes[key] for arg, _, key in roles}
        return np.array(columns).T, shown

    def jacobian(self, output: str, **arrays: Any) -> dict[str, np.ndarray]:
        """d output / d name for each differentiated name, in one C call:
        the jvp once per entry of the differentiated leaves (forward mode,
        a column each) where they have fewer entries than the output (see
        FORWARD_FROM) and are all inputs or params, else the output's vjp
        once per output entry (reverse mode, a row each).

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
        forward = self.function("forward")
        values, dims = forward.bind(arrays)  # (its checks, and the arrays' sizes, are the cheapest way)
        bound = dict(zip(forward.binder.dims, dims))
        shape = _shape_in(found[0], bound, output)
        leaves = [value.size for spec, value in zip(forward.inputs, values) if spec.name in self.spec.wrt]
        if len(leaves) == len(self.spec.wrt) and FORWARD_FROM * sum(leaves) < math.prod(shape):
            return self._jacobian_forward(output, shape, bound, arrays)
        return self._jacobian_reverse(output, shape, arrays)

    def _jacobian_reverse(self, output: str, shape: tuple[int, ...], arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The Jacobian's rows: the output's vjp once per output entry."""
        fn = self.function("vjp", output)
        (seed_arg, _, _), = fn.spec.extra_roles
        values, dims = fn.bind({**arrays, seed_arg: np.zeros(shape, dtype=self.dtype)})
        slot = fn.input_names.index(seed_arg)
        values[slot] = np.zeros(values[slot].shape, dtype=self.dtype)  # the sweep writes each seed into it
        outputs = fn.allocate(dims)
        grads = fn.groups.get("grads", [])
        seeds = int(np.prod(shape))
        rows = [np.empty((seeds, *outputs[index].shape), dtype=self.dtype) for index, _ in grads]
        _sweep(fn, dims, values, outputs, (slot,), [(index, row) for (index, _), row in zip(grads, rows)])
        return {key: row.reshape(*shape, *(() if fn.outputs[index].scalar else outputs[index].shape))
                for (index, key), row in zip(grads, rows)}

    def _jacobian_forward(self, output: str, shape: tuple[int, ...], bound: Mapping[str, int],
                          arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The Jacobian's columns: the jvp once per entry of every
        differentiated leaf, one sweep through the tangents in turn."""
        fn = self.function("jvp")
        specs = {spec.name: spec for spec in fn.inputs}
        roles = fn.spec.extra_roles
        tangents = {arg: np.zeros(_shape_in(specs[arg].shape, bound, arg), dtype=self.dtype) for arg, _, _ in roles}
        values, dims = fn.bind({**arrays, **tangents})
        slots = tuple(fn.input_names.index(arg) for arg, _, _ in roles)
        for slot in slots:  # the sweep writes each seed into them
            values[slot] = np.zeros(values[slot].shape, dtype=self.dtype)
        outputs = fn.allocate(dims)
        (at,) = [index for index, out in enumerate(fn.outputs) if out.key == output and out.group != "loss"]
        columns = np.empty((sum(values[slot].size for slot in slots), *outputs[at].shape), dtype=self.dtype)
        _sweep(fn, dims, values, outputs, slots, [(at, columns)])
        jacobian, start = {}, 0
        for (arg, _, key), slot in zip(roles, slots):
            size, leaf = values[slot].size, () if specs[arg].scalar else values[slot].shape
            block = columns[start:start + size].reshape(size, -1).T
            jacobian[key] = np.ascontiguousarray(block).reshape(*shape, *leaf)
            start += size
        return jacobian

    def check_grads(self, *, rtol: float | None = None, atol: float | None = None, directions: int = 2,
                    step: float | None = None, seed: int = 0, raise_exception: bool = True,
                    **arrays: Any) -> GradCheckReport:
        """Check value_and_grad's gradients against central differences of
        the loss (forward) along random directions, as
        torch.autograd.gradcheck and jax.test_util.check_grads do, and fail
        by default (see gradcheck.py for the error model).

        Args:
            rtol: fail when, for some argument, |<grad, v> - difference|
                > atol + rtol * max(|<grad, v>|, |difference|) + the
                differences' rounding noise; None: the dtype's default
                (1e-6 in float64, 2e-3 in float32).
            atol: the absolute part of that tolerance; None: the dtype's
                default (1e-9 in float64, 2e-3 in float32).
            directions: random directions per argument.
            step: the difference step; None: eps^(1/5) times the argument's
                largest entry (at least 1).
            seed: the seed of the directions.
            raise_exception: False: return the report whatever it says.
            **arrays: every input and param by name (a leaf named like
                an option above cannot be passed here).

        Returns:
            The GradCheckReport: `.arguments[name].rel_error`, `.worst`;
            printing it gives one line per argument.

        Raises:
            GradientCheckError: a gradient exceeds the tolerance, or a
                gradient, the loss or a difference is NaN or inf (unless
                raise_exception is False).
            ArgumentError: a malformed argument, or a model without a loss.
        """
        _, grads = self.value_and_grad(**arrays)
        report = check_gradient(lambda a: self.forward(**a)["loss"], grads, arrays, self.dtype, directions, step, seed)
        if raise_exception:
            enforce(report, *default_tolerance(self.dtype, rtol, atol))
        return report


def _sweep(fn: Function, dims: list[int], values: list[np.ndarray], outputs: list[np.ndarray], slots: tuple[int, ...],
           copies: list[tuple[int, np.ndarray]]) -> None:
    """Runs fn once per one-hot seed: each entry of values[slots[0]] set to
    1 in turn, then of values[slots[1]]'s, ..., every other seed entry 0;
    copies outputs[index] into the next row of each (index, rows) of
    copies; leaves the seeds 0. In one C call where the call extension is
    at hand, else a loop here."""
    work = fn.workspace(dims)
    sweep = fastcall.sweeper(fn.lib, fn.ffi, fn.c_name)
    if sweep is not None:
        status = sweep(tuple(dims), [*values, *outputs], slots, int(fn.ffi.cast("uintptr_t", work)),
                       tuple(len(values) + index for index, _ in copies), tuple(rows for _, rows in copies))
        if status != 0:
            fn.binder.diagnose(dict(zip(fn.input_names, values)), status, fn.c_name)
        return
    seeds = [values[slot].reshape(-1) for slot in slots]
    for seed in seeds:
        seed[:] = 0
    run = 0
    for seed in seeds:
        for e in range(seed.size):
            seed[e] = 1
            fn.invoke(dims, values, outputs, work)
            seed[e] = 0
            for index, rows in copies:
                rows[run] = outputs[index]
            run += 1


def _shape_in(shape: tuple, bound: Mapping[str, int], what: str) -> tuple[int, ...]:
    """A shape with its dimensions' values, which the arguments must fix."""
    missing = [d for d in shape if isinstance(d, str) and d not in bound]
    if missing:
        raise ArgumentError(f"the shape {show(shape)} of {what} needs the dimensions {missing}, which no argument fixes")
    return concrete(shape, bound)


__all__ = ["Derivatives"]
