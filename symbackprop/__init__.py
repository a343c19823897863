"""symbackprop: a symbolic-to-C backprop compiler.

Declare a model in SymPy, compile it, call the generated C from Python::

    mod = symbackprop.compile(model)
    loss, grads = mod.value_and_grad(X=x, T=t, W1=w1, ...)
"""

from . import interop  # noqa: F401  (registers mod.as_torch and mod.as_jax)
from ._version import __version__
from .deep import build_deep
from .errors import ArgumentError, BuildError, ModelError, SymbackpropError
from .model import Model, as_scalar
from .optim import SGD, Adam
from .runtime import CompiledModule, compile
from .scan import final_state, scan
from .tensor import Index, cumsum, gather, map_examples, reduce

__all__ = [
    "Adam",
    "ArgumentError",
    "BuildError",
    "CompiledModule",
    "Index",
    "Model",
    "ModelError",
    "SGD",
    "SymbackpropError",
    "__version__",
    "as_scalar",
    "build_deep",
    "compile",
    "cumsum",
    "final_state",
    "gather",
    "map_examples",
    "reduce",
    "scan",
]
