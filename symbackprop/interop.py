"""The bridges to PyTorch and JAX, on top of the run stage:
`symbackprop.as_torch(mod)` and `symbackprop.as_jax(mod)` (also
`mod.as_torch()` and `mod.as_jax()`, which call them through the
registration below). Each imports its framework on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .run.module import register_bridge

if TYPE_CHECKING:  # only for annotations
    from .interop_jax import JaxFunction
    from .interop_torch import TorchFunction
    from .run.module import CompiledModule


def as_torch(mod: CompiledModule, outputs: Sequence[str] = ()) -> TorchFunction:
    """The module as a torch autograd function (see symbackprop.interop_torch).

    Args:
        mod: the compiled module.
        outputs: named outputs to return beside the loss.

    Returns:
        The TorchFunction.

    Raises:
        ArgumentError: an output name the model lacks.
        ImportError: PyTorch is not installed.
    """
    from .interop_torch import as_torch as bridge

    return bridge(mod, outputs)


def as_jax(mod: CompiledModule, outputs: Sequence[str] = ()) -> JaxFunction:
    """The module as a JAX function with a custom VJP (see symbackprop.interop_jax).

    Args:
        mod: the compiled module.
        outputs: named outputs to return beside the loss.

    Returns:
        The JaxFunction.

    Raises:
        ArgumentError: an output name the model lacks.
        ImportError: JAX is not installed.
    """
    from .interop_jax import as_jax as bridge

    return bridge(mod, outputs)


register_bridge("torch", as_torch)
register_bridge("jax", as_jax)

__all__ = ["as_jax", "as_torch"]
