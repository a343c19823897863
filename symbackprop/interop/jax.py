"""A compiled module as a JAX function with a custom VJP.

    f = symbackprop.interop.jax.as_jax(mod)        # or mod.as_jax()
    loss = f(X=x, T=t, W1=w1, ...)                 # arrays by keyword; a 0-d array
    grads = jax.grad(lambda p: f(X=x, T=t, **p))(params)
    jax.jit(jax.value_and_grad(lambda p: f(X=x, T=t, **p)))(params)

The C code runs through `jax.pure_callback` (on the host), so the function
works under `jax.jit`, `jax.grad` and `jax.value_and_grad`; the forward
pass of a gradient makes one `value_and_grad` C call and keeps the
gradients as residuals, and the backward pass scales them by the
cotangent. With `outputs=("Y",)` the function returns
`(loss, {"Y": array})` (one more C call, `forward`), and cotangents of the
outputs are carried back by `mod.vjp`.

Arguments the module does not differentiate (not in `mod.wrt`) are
treated as constants: their cotangent is zero. Batching (`jax.vmap`) calls
the module once per example (`vmap_method="sequential"`).

Precision: JAX computes in float32 unless `jax.config.update("jax_enable_x64",
True)` is set. The arrays are converted to the module's dtype on the host
and the results come back in the dtype of the arguments, so a float64
module called without x64 computes in float64 and rounds its results to
float32. Enable x64 for float64 results (the tests do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from symbackprop.base.abi import concrete
from symbackprop.errors import ArgumentError
from symbackprop.interop.common import Bridge, differentiable, scaled_gradients, value_and_grad_or_zero

if TYPE_CHECKING:  # only for annotations
    from symbackprop.run.module import CompiledModule


class JaxFunction(Bridge):
    """The compiled module as a function of JAX arrays (see the module's docstring).

    Args:
        mod: the compiled module, called on the host (jax.pure_callback).
        outputs: named outputs to return beside the loss.

    Raises:
        ArgumentError: an output name the model lacks.
    """

    def __init__(self, mod: CompiledModule, outputs: Sequence[str] = ()) -> None:
        super().__init__(mod, outputs)
        self.wrt = differentiable(mod)
        self.indices = frozenset(a.name for a in mod.function("forward").inputs if a.index)  # int64 row numbers
        self._core = self._make_core()

    # --- the host side: numpy in, numpy out --------------------------------

    def _arrays(self, values: Sequence[Any]) -> dict[str, Any]:
        # an Index keeps its integer dtype: the binder refuses anything else
        return {name: np.asarray(v) if name in self.indices else np.asarray(v, dtype=self.mod.dtype)
                for name, v in zip(self.names, values)}

    def _real_dtype(self, values: Sequence[Any]) -> Any:
        """The floating dtype the caller uses (not an Index's integers)."""
        reals = [np.asarray(v).dtype for n, v in zip(self.names, values) if n not in self.indices]
        return reals[0] if reals else self.mod.dtype

    def _output_shapes(self, values: Sequence[Any]) -> list[tuple[int, ...]]:
        """The named outputs' shapes, from the ABI spec and the arguments'
        shapes (values may be tracers: the host call binds and checks them)."""
        specs = {a.name: a for a in self.mod.function("forward").inputs}
        bound: dict[str, int] = {}
        for name, value in zip(self.names, values):
            shape = np.shape(value)
            if specs[name].index and len(shape) == 1:
                shape = (*shape, 1)
            for want, got in zip(specs[name].shape, shape):
                if isinstance(want, str):
                    bound.setdefault(want, int(got))
        outputs = {name: (shape, scalar) for name, shape, scalar in self.mod.spec.outputs}
        missing = [d for name in self.outputs for d in outputs[name][0] if isinstance(d, str) and d not in bound]
        if missing:
            raise ArgumentError(f"the outputs' dimensions {missing} are not fixed by the arguments' shapes")
        return [() if outputs[name][1] else concrete(outputs[name][0], bound) for name in self.outputs]

    def _result_types(self, values: Sequence[Any], dtype: Any) -> tuple[Any, ...]:
        return (jax.ShapeDtypeStruct((), dtype),
                *(jax.ShapeDtypeStruct(s, dtype) for s in self._output_shapes(values)))

    def _host_forward(self, *values: Any) -> tuple[np.ndarray, ...]:
        dtype = self._real_dtype(values)
        results = self.mod.forward(**self._arrays(values))
        return (np.asarray(results["loss"], dtype=dtype),
                *(np.asarray(results[o], dtype=dtype) for o in self.outputs))

    def _host_value_and_grad(self, *values: Any) -> tuple[np.ndarray, ...]:
        dtype = self._real_dtype(values)
        arrays = self._arrays(values)
        loss, grads = value_and_grad_or_zero(self.mod, arrays)
        grads = scaled_gradients(self.mod, arrays, grads, 1.0, {})
        outs = []
        if self.outputs:
            results = self.mod.forward(**arrays)
            outs = [np.asarray(results[o], dtype=dtype) for o in self.outputs]
        return (np.asarray(loss, dtype=dtype), *outs,
                *(np.asarray(grads[n], dtype=dtype).reshape(np.shape(values[self.names.index(n)])) for n in self.wrt))

    def _host_vjp(self, *values: Any) -> tuple[np.ndarray, ...]:
        """Gradients of sum(seed_y * y) summed over the outputs y."""
        count = len(self.names)
        arrays = self._arrays(values[:count])
        seeds = dict(zip(self.outputs, (np.asarray(s, dtype=self.mod.dtype) for s in values[count:])))
        dtype = self._real_dtype(values[:count])
        grads = scaled_gradients(self.mod, arrays, {n: np.zeros(np.shape(arrays[n])) for n in self.wrt}, 0.0, seeds)
        return tuple(np.asarray(grads[n], dtype=dtype) for n in self.wrt)

    # --- the JAX side --------------------------------------------------

    def _make_core(self) -> Any:
        names, wrt, outputs, indices = self.names, self.wrt, self.outputs, self.indices

        def dtype_of(values):
            reals = [v for n, v in zip(names, values) if n not in indices]
            return jnp.result_type(*reals) if reals else jnp.float64

        def zero_cotangent(name, value):
            if name in indices:  # integers have no tangent space: JAX's float0
                return np.zeros(jnp.shape(value), dtype=jax.dtypes.float0)
            return jnp.zeros_like(value)

        @jax.custom_vjp
        def core(*values):
            types = self._result_types(values, dtype_of(values))
            return jax.pure_callback(self._host_forward, types, *values, vmap_method="sequential")

        def fwd(*values):
            dtype = dtype_of(values)
            types = self._result_types(values, dtype)
            grad_types = tuple(jax.ShapeDtypeStruct(jnp.shape(values[names.index(n)]), dtype) for n in wrt)
            results = jax.pure_callback(self._host_value_and_grad, (*types, *grad_types), *values,
                                        vmap_method="sequential")
            primal = results[: 1 + len(outputs)]
            return tuple(primal), (values, results[1 + len(outputs):])

        def bwd(residuals, cotangents):
            values, grads = residuals
            g_loss, g_outputs = cotangents[0], cotangents[1:]
            by_name = {n: g_loss * g for n, g in zip(wrt, grads)}
            if outputs:
                dtype = dtype_of(values)
                grad_types = tuple(jax.ShapeDtypeStruct(jnp.shape(values[names.index(n)]), dtype) for n in wrt)
                extra = jax.pure_callback(self._host_vjp, grad_types, *values, *g_outputs, vmap_method="sequential")
                by_name = {n: by_name[n] + e for n, e in zip(wrt, extra)}
            return tuple(by_name[n] if n in by_name else zero_cotangent(n, v) for n, v in zip(names, values))

        core.defvjp(fwd, bwd)
        return core

    def __call__(self, **arrays: Any) -> Any:
        """The loss, differentiable by jax.grad and traceable by jax.jit.

        Args:
            **arrays: every input and param by name (JAX or numpy arrays, numbers).

        Returns:
            The loss as a 0-d array; with outputs, ``(loss, {name: array})``.

        Raises:
            ArgumentError: missing or unknown arguments.
        """
        missing = [n for n in self.names if n not in arrays]
        unknown = [n for n in arrays if n not in self.names]
        if missing or unknown:
            raise ArgumentError(f"missing {missing}, unknown {unknown}; expected the arguments {list(self.names)}")
        results = self._core(*(jnp.asarray(arrays[n]) for n in self.names))
        if not self.outputs:
            return results[0]
        return results[0], dict(zip(self.outputs, results[1:]))


def as_jax(mod: CompiledModule, outputs: Sequence[str] = ()) -> JaxFunction:
    """A function of JAX arrays by keyword returning the loss (a 0-d array),
    differentiable by jax.grad and traceable by jax.jit; with `outputs`,
    `(loss, {name: array})`.

    Args:
        mod: the compiled module.
        outputs: named outputs to return beside the loss.

    Returns:
        The JaxFunction.

    Raises:
        ArgumentError: an output name the model lacks; on call, missing or
            unknown arguments.
    """
    return JaxFunction(mod, outputs)


__all__ = ["JaxFunction", "as_jax"]
