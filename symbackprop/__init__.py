"""symbackprop: a symbolic-to-C backprop compiler.

Declare a model in SymPy, compile it, call the generated C from Python::

    mod = symbackprop.compile(model)
    loss, grads = mod.value_and_grad(X=x, T=t, W1=w1, ...)

Importing the package imports the model language (SymPy, numpy), `compile`
and the run stage, not the compiler: the stages, Jinja and cffi's builder
are imported only where a model's C is generated (a module loaded from the
cache needs none of them), and the optimizers and `from_torch` on first
use (`__getattr__`, PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from symbackprop._version import __version__
from symbackprop.declare.attention import Sequences, key_padding, position_ids, sequence_starts, sequences
from symbackprop.declare.conv import Images, conv_weight, images
from symbackprop.declare.derivatives import grad, jvp, stop_gradient
from symbackprop.declare.linalg import cholesky, det, logdet, solve, triangular_solve
from symbackprop.declare.model import Model, as_scalar
from symbackprop.declare.select import where
from symbackprop.declare.tensor import Index, cumsum, gather, map_examples, reduce, shift
from symbackprop.deep import build_deep
from symbackprop.errors import ArgumentError, BuildError, GradientCheckError, ModelError, SymbackpropError
from symbackprop.interop import bridges as _bridges  # noqa: F401  (registers mod.as_torch and mod.as_jax)
from symbackprop.loops.declare import final_state, scan
from symbackprop.loops.fixpoint import fixed_point, iterations
from symbackprop.run.module import CompiledModule
from symbackprop.run.runtime import compile, compile_all  # the run stage and the builder, not the compiler
from symbackprop.run.sparse import SparseLayout, sparse_layout
from symbackprop.toolchain.builder import BuildOptions
from symbackprop.toolchain.threads import get_num_threads, set_num_threads

if TYPE_CHECKING:  # imported on first use (__getattr__)
    from symbackprop.interop.from_torch import from_torch
    from symbackprop.run.optim import SGD, Adam

# name -> the module it is imported from on first use
_ON_FIRST_USE = {
    "from_torch": "symbackprop.interop.from_torch",
    "SGD": "symbackprop.run.optim",
    "Adam": "symbackprop.run.optim",
}


def __getattr__(name: str) -> Any:
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'symbackprop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE))


__all__ = [
    "SGD",
    "Adam",
    "ArgumentError",
    "BuildError",
    "BuildOptions",
    "CompiledModule",
    "GradientCheckError",
    "Images",
    "Index",
    "Model",
    "ModelError",
    "Sequences",
    "SparseLayout",
    "SymbackpropError",
    "__version__",
    "as_scalar",
    "build_deep",
    "cholesky",
    "compile",
    "compile_all",
    "conv_weight",
    "cumsum",
    "det",
    "final_state",
    "fixed_point",
    "from_torch",
    "gather",
    "get_num_threads",
    "grad",
    "images",
    "iterations",
    "jvp",
    "key_padding",
    "logdet",
    "map_examples",
    "position_ids",
    "reduce",
    "scan",
    "sequence_starts",
    "sequences",
    "set_num_threads",
    "shift",
    "solve",
    "sparse_layout",
    "stop_gradient",
    "triangular_solve",
    "where",
]
