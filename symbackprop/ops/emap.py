"""emap: a per-example function over one loop of examples or two nested
(sbp.map_examples, and a gather alone), its body a straight-line program
whose derivatives extend it (see ir.emap). Per-example maps over the same
examples share one loop in the scheduler (fused="examples").

This module holds the op's rules (derivatives, numpy reference, lowering);
its kernel is ops/emap_kernel.py, built by ops/emap_group.py, and its C is
ops/emap_c.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.exprdag import shallow_program, substitute
from symbackprop.base.registry import OpRecord, plain_grad_fn, register
from symbackprop.base.scalar import backward, forward
from symbackprop.base.stable import stabilize
from symbackprop.declare.tensor import ExampleMap, Gather, Index
from symbackprop.errors import ModelError
from symbackprop.ir.construct import accumulates, binding_width, emap, let_symbol, row_placeholder
from symbackprop.ir.interpret import Context, apply_body
from symbackprop.ir.lower import as_dim, scalar_atoms
from symbackprop.ir.node import SCALAR, Node
from symbackprop.messages import short
from symbackprop.ops.emap_c import emit_emap
from symbackprop.ops.emap_group import group_kernel
from symbackprop.ops.extreme import through_extreme

# --- derivatives ------------------------------------------------------------


def _is_variable(symbol: sp.Basic) -> bool:
    """An argument column (_e<p>_<l>) or a local value (_v<k>) of an emap body:
    what its derivatives are taken with respect to (not dimensions)."""
    return isinstance(symbol, sp.Symbol) and symbol.name[:2] in ("_e", "_v")


def _extensible(lets: tuple) -> tuple[list, Callable[[sp.Expr], sp.Symbol]]:
    """The body's program as a list, and a function that appends a value
    to it as a new local value and returns its symbol (the derivatives'
    adjoints and tangents, shared where several terms use them)."""
    program = list(lets)
    taken = [int(sym.name[2:]) for sym, _ in lets]
    fresh = (let_symbol(k) for k in itertools.count(max(taken, default=-1) + 1))

    def let(value: sp.Expr) -> sp.Symbol:
        symbol = next(fresh)
        program.append((symbol, value))
        return symbol

    return program, let


def _vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    """Reverse mode over the body's program: each local value's adjoint
    becomes one more local value (and so does an adjoint inside an
    expression that several of its terms use), and each argument's adjoint is one more
    emap over the same examples, written (added) where the argument was read.
    The adjoint rows g are read where the node wrote its outputs."""
    sparse = through_extreme(node, g, needed, _vjp)
    if sparse is not None:
        return sparse
    bodies, bindings, loops, target, lets = node.attrs
    seed = len(node.args)  # g joins as the last argument, bound like the target
    contributions: dict[sp.Basic, list[sp.Expr]] = {}
    program, let = _extensible(lets)

    def propagate(expr: sp.Expr, adjoint: sp.Expr) -> None:
        for symbol, term in backward(expr, sp.Integer(1), _is_variable, let).items():
            contributions.setdefault(symbol, []).append(adjoint * term)

    for column, body in enumerate(bodies):
        propagate(body, row_placeholder(seed, column))
    for symbol, expr in reversed(lets):
        terms = contributions.pop(symbol, None)
        if terms:
            propagate(expr, let(sp.Add(*terms)))
    adjoints: list[Node | None] = []
    for p, arg in enumerate(node.args):
        if not needed[p] or bindings[p][0] in ("index", "guard"):
            adjoints.append(None)
            continue
        columns = [sp.Add(*contributions.get(row_placeholder(p, col), []))
                   for col in range(binding_width(arg, bindings[p]))]
        adjoints.append(emap(columns, node.args + (g,), bindings + (target,), loops, bindings[p], arg.shape, program))
    return tuple(adjoints)


def _jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """Forward mode over the body's program: a tangent local value beside
    each local value that depends on a tangent argument."""
    bodies, bindings, loops, target, lets = node.attrs
    args, extra_bindings = list(node.args), list(bindings)
    tangent_of: dict[sp.Basic, sp.Expr] = {}
    for p, tangent in enumerate(tangents):
        if tangent is not None and bindings[p][0] not in ("index", "guard"):
            for col in range(binding_width(node.args[p], bindings[p])):
                tangent_of[row_placeholder(p, col)] = row_placeholder(len(args), col)
            args.append(tangent)
            extra_bindings.append(bindings[p])
    if not tangent_of:
        return None

    program, let = _extensible(lets)

    def differential(expr: sp.Expr) -> sp.Expr:
        return forward(expr, tangent_of, let)

    for symbol, expr in lets:
        d = differential(expr)
        if d != 0:
            tangent_of[symbol] = let(d)
    return emap([differential(body) for body in bodies], args, extra_bindings, loops, target, node.shape, program)


# --- numpy reference --------------------------------------------------------


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
    if kind == "gather":  # (an index a kernel computed is a real number: extreme_tie's first)
        return args[binding[1]][examples[binding[2]], 0].astype(np.int64)
    return np.zeros_like(examples[0])  # "whole"


def _evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    bodies, bindings, loops, target, lets = node.attrs
    examples = _examples(loops, context)
    for p, binding in enumerate(bindings):
        if binding[0] == "guard":  # the examples whose guard entry is 0 are skipped
            kept = args[p][examples[binding[1]], 0] != 0
            examples = [e[kept] for e in examples]
    env: dict[sp.Symbol, np.ndarray] = {}
    for p, (arg, binding) in enumerate(zip(node.args, bindings)):
        if binding[0] in ("index", "guard"):
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
    return np.broadcast_to(apply_body(expr, symbols, [env[s] for s in symbols], context), (count,))




# --- lowering from SymPy ---------------------------------------------------------


def index_leaf(lowerer, index: Index) -> Node:
    node = lowerer.leaves.get(index)
    if node is None or node.attrs[1] != "index":
        raise ModelError(f"the Index {index} is not declared as an input")
    return node


def _gather(lowerer, expr: Gather) -> Node:
    """A gather alone is a map that copies the chosen rows."""
    array = lowerer.lower(expr.array)
    index = index_leaf(lowerer, expr.index)
    width = int(array.shape[1])
    bodies = [row_placeholder(1, col) for col in range(width)]
    rows = index.shape[0]
    return emap(bodies, [index, array], [("index",), ("gather", 0, 0)], (rows,), ("row", 0), (rows, width))


def _example_map(lowerer, expr: ExampleMap) -> Node:
    loops = tuple(as_dim(d, expr) for d in expr.loops)
    args: list[Node] = []
    bindings: list[tuple] = []
    subs: dict[sp.Basic, sp.Expr] = {}

    def add(node: Node, binding: tuple) -> int:
        if (node, binding) in zip(args, bindings):
            return list(zip(args, bindings)).index((node, binding))
        args.append(node)
        bindings.append(binding)
        return len(args) - 1

    for symbols, source in expr.bindings:
        if isinstance(source, Gather):
            index = add(index_leaf(lowerer, source.index), ("index",))
            loop = loops.index(as_dim(source.index.shape[0], source))
            position = add(lowerer.lower(source.array), ("gather", index, loop))
        else:
            node = lowerer.lower(source)
            binding = ("whole",) if node.shape[0] == 1 else ("row", loops.index(node.shape[0]))
            position = add(node, binding)
        for col, symbol in enumerate(symbols):
            subs[symbol] = row_placeholder(position, col)
    for entry in expr.body:
        for atom in scalar_atoms(entry):
            if atom in subs or atom in lowerer.dims:
                continue
            if isinstance(atom, MatrixElement):
                node = lowerer.entry(atom)
            elif atom in lowerer.leaves and lowerer.leaves[atom].shape == SCALAR:
                node = lowerer.leaves[atom]
            else:
                raise ModelError(f"{short(atom)} in the map's body is neither bound by the map nor a scalar input or param")
            subs[atom] = row_placeholder(add(node, ("whole",)), 0)
    # stabilized before CSE splits 1 + exp(u) apart
    bodies = [stabilize(body) for body in substitute(list(expr.body), subs)]
    # the body as a straight-line program, so that derivatives extend it step by step
    names = (let_symbol(k) for k in itertools.count())
    # SymPy's cse here, not dagcse's: with dagcse's lets, bundle adjustment's
    # primal was 35% slower (1.0 -> 1.35 ms, its Jacobian 15%), measured
    common, reduced = sp.cse(bodies, symbols=names, order="none")
    lets, bodies = shallow_program(common, reduced, names)
    if len(loops) == 1:
        return emap(bodies, args, bindings, loops, ("row", 0), (loops[0], len(bodies)), lets)
    return emap(bodies, args, bindings, loops, ("cell",), (loops[0], loops[1]), lets)


register(OpRecord(
    "emap",
    vjp=_vjp,
    jvp=_jvp,
    evaluate=_evaluate,
    fused="examples",
    group_kernel=group_kernel,
    emit=emit_emap,
    template="kernel_emap.c.j2",
    grad_fn=plain_grad_fn("MapExamples"),
    lowering=((Gather, _gather), (ExampleMap, _example_map)),
))
