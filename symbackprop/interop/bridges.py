"""The bridges to PyTorch and JAX register with the run stage here, so that
`mod.as_torch()` and `mod.as_jax()` work while run/module.py names neither
bridge (symbackprop/__init__ imports this module). Each bridge imports its
framework on first use; they are symbackprop.interop.torch.as_torch and
symbackprop.interop.jax.as_jax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from symbackprop.run.bridge import register_bridge

if TYPE_CHECKING:  # only for annotations
    from symbackprop.run.module import CompiledModule


def _torch(mod: CompiledModule, outputs: Sequence[str]) -> Any:
    from symbackprop.interop.torch import as_torch

    return as_torch(mod, outputs)


def _jax(mod: CompiledModule, outputs: Sequence[str]) -> Any:
    from symbackprop.interop.jax import as_jax

    return as_jax(mod, outputs)


register_bridge("torch", _torch)
register_bridge("jax", _jax)
