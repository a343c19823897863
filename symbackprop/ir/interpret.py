"""A numpy interpreter of the tensor IR: no C is generated or compiled.

It evaluates forward graphs and the graphs that `autodiff.vjp` and
`autodiff.jvp` build, so an op's rules can be checked in milliseconds
against finite differences of the same interpreter (tests/ops/test_op_rules.py,
in the manner of JAX's lax_autodiff_test), and a compiled module can be
compared with an independent evaluation of its own IR.

The numpy reference of each op is the `evaluate` field of its record
(symbackprop.ops). An op without one (scan's) is a NotImplementedError that
names it. Values are
float64 arrays of the node's concrete shape; Index leaves are int64 arrays of
shape (rows, 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy as sp

from symbackprop.base.functions import numpy_namespace
from symbackprop.base.registry import record
from symbackprop.ir.node import Node, topological_order


@dataclass(frozen=True)
class Context:
    """What every evaluator may need besides its arguments' values."""

    dims: Mapping[sp.Symbol, int]

    def shape(self, node: Node) -> tuple[int, int]:
        return tuple(self.dims[d] if isinstance(d, sp.Symbol) else int(d) for d in node.shape)  # type: ignore[return-value]


def bind_dims(leaves: Mapping[str, Node], arrays: Mapping[str, np.ndarray]) -> dict[sp.Symbol, int]:
    """The symbolic dimensions, read off the leaves' arrays (no checks: the
    interpreter is a test oracle, not an entry point)."""
    dims: dict[sp.Symbol, int] = {}
    for name, node in leaves.items():
        for want, got in zip(node.shape, np.shape(arrays[name])):
            if isinstance(want, sp.Symbol):
                dims.setdefault(want, int(got))
    return dims


def evaluate(roots: Sequence[Node], arrays: Mapping[str, np.ndarray], dims: Mapping[sp.Symbol, int]) -> list[np.ndarray]:
    """The values of `roots`, given every leaf's array by name.

    Args:
        roots: the nodes to evaluate.
        arrays: leaf name -> array (float, or int64 row numbers for an Index).
        dims: the value of each symbolic dimension.

    Returns:
        One array per root, of the root's concrete shape.

    Raises:
        NotImplementedError: an op has no evaluator.
    """
    context = Context(dims)
    values: dict[Node, np.ndarray] = {}
    for node in topological_order(roots):
        if node.op == "leaf":
            name, role = node.attrs
            array = np.asarray(arrays[name], dtype=np.int64 if role == "index" else np.float64)
            values[node] = array.reshape(context.shape(node))
            continue
        function = record(node.op).evaluate
        if function is None:
            raise NotImplementedError(f"the interpreter has no evaluator for op {node.op!r}")
        values[node] = function(node, [values[a] for a in node.args], context)
    return [values[root] for root in roots]


@lru_cache(maxsize=4096)
def _compiled(body: sp.Expr, symbols: tuple[sp.Symbol, ...]) -> Callable:
    return sp.lambdify(symbols, body, modules=[numpy_namespace(), "numpy"])


def apply_body(body: sp.Expr, symbols: tuple[sp.Symbol, ...], values: Sequence[np.ndarray], context: Context) -> np.ndarray:
    sizes = {d: sp.Integer(v) for d, v in context.dims.items() if d in body.free_symbols}
    if sizes:  # a symbolic dimension in a body (a mean's 1/n) is a number by now
        body = body.xreplace(sizes)
    with np.errstate(all="ignore"):  # IEEE results (inf, nan) are values here, as in the C
        return np.asarray(_compiled(body, symbols)(*values), dtype=np.float64)
