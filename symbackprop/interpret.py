"""A numpy interpreter of the tensor IR: no C is generated or compiled.

It evaluates forward graphs and the graphs that `autodiff.vjp` and
`autodiff.jvp` build, so an op's rules can be checked in milliseconds
against finite differences of the same interpreter (tests/test_op_rules.py,
in the manner of JAX's lax_autodiff_test), and a compiled module can be
compared with an independent evaluation of its own IR.

One evaluator per op in `EVALUATORS`: the numpy reference of each op. An op
without one (scan's) is a NotImplementedError that names it. Values are
float64 arrays of the node's concrete shape; Index leaves are int64 arrays of
shape (rows, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping, Sequence

import numpy as np
import sympy as sp

from .ir import Node, accumulates, binding_width, placeholder, row_placeholder, topological_order
from .ops.functions import numpy_namespace


@dataclass(frozen=True)
class Context:
    """What every evaluator may need besides its arguments' values."""

    dims: Mapping[sp.Symbol, int]

    def shape(self, node: Node) -> tuple[int, int]:
        return tuple(self.dims[d] if isinstance(d, sp.Symbol) else int(d) for d in node.shape)  # type: ignore[return-value]


Evaluator = Callable[[Node, list[np.ndarray], Context], np.ndarray]
EVALUATORS: dict[str, Evaluator] = {}


def evaluator(op: str) -> Callable[[Evaluator], Evaluator]:
    def register(function: Evaluator) -> Evaluator:
        EVALUATORS[op] = function
        return function

    return register


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
        function = EVALUATORS.get(node.op)
        if function is None:
            raise NotImplementedError(f"the interpreter has no evaluator for op {node.op!r}")
        values[node] = function(node, [values[a] for a in node.args], context)
    return [values[root] for root in roots]


@lru_cache(maxsize=4096)
def _compiled(body: sp.Expr, symbols: tuple[sp.Symbol, ...]) -> Callable:
    return sp.lambdify(symbols, body, modules=[numpy_namespace(), "numpy"])


def _apply(body: sp.Expr, symbols: tuple[sp.Symbol, ...], values: Sequence[np.ndarray], context: Context) -> np.ndarray:
    sizes = {d: sp.Integer(v) for d, v in context.dims.items() if d in body.free_symbols}
    if sizes:  # a symbolic dimension in a body (a mean's 1/n) is a number by now
        body = body.xreplace(sizes)
    with np.errstate(all="ignore"):  # IEEE results (inf, nan) are values here, as in the C
        return np.asarray(_compiled(body, symbols)(*values), dtype=np.float64)


@evaluator("map")
def _map(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    symbols = tuple(placeholder(i) for i in range(len(args)))
    return np.array(np.broadcast_to(_apply(node.attrs[0], symbols, args, context), context.shape(node)))


@evaluator("matmul")
def _matmul(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0] @ args[1]


@evaluator("transpose")
def _transpose(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0].T.copy()


@evaluator("sum")
def _sum(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0].sum(axis=node.attrs[0], keepdims=True)


@evaluator("logsumexp")
def _logsumexp(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    axis = node.attrs[0]
    top = args[0].max(axis=axis, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(all="ignore"):
        return safe + np.log(np.exp(args[0] - safe).sum(axis=axis, keepdims=True))


@evaluator("max")
def _max(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0].max(axis=node.attrs[0], keepdims=True)


@evaluator("min")
def _min(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0].min(axis=node.attrs[0], keepdims=True)


@evaluator("element")
def _element(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    i, j = node.attrs
    return args[0][i : i + 1, j : j + 1].copy()


@evaluator("pack")
def _pack(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    out = np.zeros(context.shape(node))
    for (i, j), value in zip(node.attrs[0], args):
        out[i, j] = value.item()
    return out


# --- per-example maps ---------------------------------------------------------


def _examples(loops: tuple, context: Context) -> list[np.ndarray]:
    """The loop variables of every example, flattened (i outer, k inner)."""
    sizes = [context.dims[d] if isinstance(d, sp.Symbol) else int(d) for d in loops]
    grids = np.meshgrid(*[np.arange(n) for n in sizes], indexing="ij")
    return [grid.reshape(-1) for grid in grids]


def _rows(binding: tuple, examples: list[np.ndarray], args: list[np.ndarray]) -> np.ndarray:
    """The row each example reads (or writes) under a binding."""
    kind = binding[0]
    if kind == "row":
        return examples[binding[1]]
    if kind == "gather":
        return args[binding[1]][examples[binding[2]], 0]
    return np.zeros_like(examples[0])  # "whole"


@evaluator("emap")
def _emap(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    bodies, bindings, loops, target, lets = node.attrs
    examples = _examples(loops, context)
    env: dict[sp.Symbol, np.ndarray] = {}
    for p, (arg, binding) in enumerate(zip(node.args, bindings)):
        if binding[0] == "index":
            continue
        if binding[0] == "cell":
            env[row_placeholder(p, 0)] = args[p][examples[0], examples[1]]
            continue
        rows = args[p][_rows(binding, examples, args)]
        for col in range(binding_width(arg, binding)):
            env[row_placeholder(p, col)] = rows[:, col]
    for symbol, expr in lets:
        env[symbol] = _evaluate_scalar(expr, env, len(examples[0]), context)
    out = np.zeros(context.shape(node))
    columns = np.stack([_evaluate_scalar(body, env, len(examples[0]), context) for body in bodies], axis=1)
    if target == ("cell",):
        out[examples[0], examples[1]] = columns[:, 0]
    elif accumulates(target, loops):
        np.add.at(out, _rows(target, examples, args), columns)
    else:
        out[_rows(target, examples, args)] = columns
    return out


def _evaluate_scalar(expr: sp.Expr, env: Mapping[sp.Symbol, np.ndarray], count: int, context: Context) -> np.ndarray:
    symbols = tuple(sorted(expr.free_symbols & env.keys(), key=str))
    return np.broadcast_to(_apply(expr, symbols, [env[s] for s in symbols], context), (count,))
