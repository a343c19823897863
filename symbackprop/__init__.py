"""symbackprop: a symbolic-to-C backprop compiler.

Declare a model in SymPy, compile it, call the generated C from Python::

    mod = symbackprop.compile(model)
    loss, grads = mod.value_and_grad(X=x, T=t, W1=w1, ...)
"""

from symbackprop._version import __version__
from symbackprop.declare.attention import Sequences, position_ids, sequences
from symbackprop.declare.conv import Images, conv_weight, images
from symbackprop.declare.derivatives import grad, jvp
from symbackprop.declare.linalg import cholesky, det, logdet, solve, triangular_solve
from symbackprop.declare.model import Model, as_scalar
from symbackprop.declare.select import where
from symbackprop.declare.tensor import Index, cumsum, gather, map_examples, reduce, shift
from symbackprop.deep import build_deep
from symbackprop.errors import ArgumentError, BuildError, GradientCheckError, ModelError, SymbackpropError
from symbackprop.interop import bridges as _bridges  # noqa: F401  (registers mod.as_torch and mod.as_jax)
from symbackprop.interop.from_torch import from_torch
from symbackprop.loops.declare import final_state, scan
from symbackprop.loops.fixpoint import fixed_point, iterations
from symbackprop.run.optim import SGD, Adam
from symbackprop.run.runtime import CompiledModule, compile
from symbackprop.run.sparse import SparseLayout, sparse_layout

__all__ = [
    "SGD",
    "Adam",
    "ArgumentError",
    "BuildError",
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
    "conv_weight",
    "cumsum",
    "det",
    "final_state",
    "fixed_point",
    "from_torch",
    "gather",
    "grad",
    "images",
    "iterations",
    "jvp",
    "logdet",
    "map_examples",
    "position_ids",
    "reduce",
    "scan",
    "sequences",
    "shift",
    "solve",
    "sparse_layout",
    "triangular_solve",
    "where",
]
