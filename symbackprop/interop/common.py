"""What the framework bridges (interop_torch, interop_jax) share: the
argument names of a compiled module, and its gradients and vector-Jacobian
products as plain numpy arrays of the arguments' shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from symbackprop.errors import ArgumentError

if TYPE_CHECKING:  # only for annotations
    from symbackprop.run.module import CompiledModule


def leaf_names(mod: Any) -> tuple[str, ...]:
    """The module's arguments (inputs and params), in the C functions' order."""
    return tuple(mod.spec.leaves)


def check_outputs(mod: Any, outputs: Sequence[str]) -> tuple[str, ...]:
    outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    unknown = [o for o in outputs if o not in mod.model.outputs]
    if unknown:
        raise ArgumentError(f"no output named {unknown}; the outputs are {list(mod.model.outputs)}")
    return outputs


class Bridge:
    """What a framework's function of a compiled module holds: the module,
    its arguments' names in the C functions' order, and the named outputs
    it returns beside the loss.

    Args:
        mod: the compiled module.
        outputs: named outputs to return beside the loss.

    Raises:
        ArgumentError: an output name the model lacks.
    """

    def __init__(self, mod: CompiledModule, outputs: Sequence[str] = ()) -> None:
        self.mod = mod
        self.names = leaf_names(mod)
        self.outputs = check_outputs(mod, outputs)


def differentiable(mod: Any) -> tuple[str, ...]:
    """The arguments the module differentiates (its wrt, less named outputs)."""
    leaves = set(leaf_names(mod))
    return tuple(name for name in mod.wrt if name in leaves)


def scaled_gradients(
    mod: Any,
    arrays: Mapping[str, np.ndarray],
    grads: Mapping[str, Any],
    loss_seed: float,
    output_seeds: Mapping[str, np.ndarray | None],
) -> dict[str, np.ndarray]:
    """loss_seed * dloss/dw + sum over outputs y of (d sum(seed_y * y) / dw),
    for each differentiated argument w, shaped like arrays[w]. `grads` is
    value_and_grad's gradient dict; output seeds that are None are zero."""
    out = {}
    for name in differentiable(mod):
        shape = np.shape(arrays[name])
        out[name] = np.asarray(grads[name], dtype=mod.dtype).reshape(shape) * loss_seed
    for output, seed in output_seeds.items():
        if seed is None:
            continue
        for name, g in mod.vjp(output, np.asarray(seed, dtype=mod.dtype), **arrays).items():
            if name in out:
                out[name] = out[name] + np.asarray(g, dtype=mod.dtype).reshape(out[name].shape)
    return out


def value_and_grad_or_zero(mod: Any, arrays: Mapping[str, Any]) -> tuple[float, dict[str, np.ndarray]]:
    """value_and_grad, or for a model without a loss (only named outputs,
    whose gradients come from vjp) a loss of 0 and zero gradients."""
    if mod.spec.has_loss:
        return mod.value_and_grad(**arrays)
    mod.forward(**arrays)  # the binder checks the arguments
    return 0.0, {name: np.zeros(np.shape(arrays[name]), dtype=mod.dtype) for name in differentiable(mod)}
