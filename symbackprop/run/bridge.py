"""Where the bridges to other frameworks register (symbackprop.interop.bridges,
which symbackprop/__init__ imports): the run stage names none of them, and
registering imports nothing else of the run stage (so that importing the
package does not import the compiler: symbackprop/__init__'s lazy names)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# framework -> make(a CompiledModule, its outputs); Any: naming the class would import the run stage
BRIDGES: dict[str, Callable[[Any, Sequence[str]], Any]] = {}


def register_bridge(framework: str, make: Callable[[Any, Sequence[str]], Any]) -> None:
    """Let `CompiledModule.as_<framework>(outputs)` return `make(module, outputs)`.

    Args:
        framework: "torch" or "jax".
        make: the bridge's constructor.
    """
    BRIDGES[framework] = make


__all__ = ["BRIDGES", "register_bridge"]
