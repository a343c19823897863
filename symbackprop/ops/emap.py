"""emap: a per-example function over one loop of examples or two nested
(sbp.map_examples, and a gather alone), its body a straight-line program
whose derivatives extend it (see ir.emap). Per-example maps over the same
examples share one loop in the scheduler (fused="examples").
"""

from __future__ import annotations

import itertools
import re
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.exprdag import shallow_program, substitute
from symbackprop.base.registry import OpRecord, plain_grad_fn, register
from symbackprop.base.scalar import backward, forward
from symbackprop.base.stable import stabilize
from symbackprop.declare.tensor import ExampleMap, Gather, Index
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, worth_threads
from symbackprop.errors import ModelError
from symbackprop.ir.construct import accumulates, binding_width, element, emap, let_symbol, row_placeholder
from symbackprop.ir.interpret import Context, apply_body
from symbackprop.ir.lower import as_dim, scalar_atoms
from symbackprop.ir.node import SCALAR, Node, Shape
from symbackprop.messages import short
from symbackprop.schedule.cse import cse_program, inline
from symbackprop.schedule.kernel import (
    LOOP_I,
    LOOP_J,
    MAX_SHOWN_OPS,
    Equation,
    View,
    count_ops,
    latex,
    latex_name,
    loop_index,
)
from symbackprop.schedule.opcount import exceeds_all


@dataclass(frozen=True)
class EmapOutput:
    """One output of an EmapKernel: where each example writes its values."""

    buffer: str
    shape: Shape
    target: tuple  # the row the example writes, in load terms: (binding row, column 0)
    accumulate: bool  # several examples write one place: zeroed first, then added into


@dataclass(frozen=True)
class ColumnCopy:
    """Rows that the inner of two loops reads, copied column by column
    before the loops (each column contiguous): consecutive examples then
    read adjacent entries, which the compiler vectorizes, where a row-major
    row is `width` entries apart (centroids of k-means, a GMM's means)."""

    scratch: str  # a workspace buffer, columns x rows (x rows + PAD_ROWS where padded)
    source: View
    rows: sp.Expr
    columns: tuple[int, ...]  # the source's columns copied, in order
    # to whole eights of rows (ROWS8 apart): past the last example, the last again
    padded: bool = False
    across: sp.Expr | None = None  # of two loops, every column: the outer loop's (then columns is empty)

    @property
    def view(self) -> View:
        """How the loop reads the copy: example r's k-th column at k*rows + r."""
        return View(self.scratch, sp.Integer(0), sp.Integer(1), ROWS8 if self.padded else sp.sympify(self.rows))


@dataclass(frozen=True)
class OuterProductSums:
    """Sums over the inner loop of many products of two per-example values
    (a weight may multiply them all): GMM's gradient of a Cholesky factor,
    sum_i g_i (x_i - mu)_a (L (x_i - mu))_b for 190 pairs (a, b). Each
    example stores its left factors (times the weight) and its right ones
    down the columns of two scratch buffers, and after the loop one product
    gives every pair's sum (the runtime's outer_product_sums): no
    accumulator an example, where a wide body's hundreds of them were most
    of the C compiler's work. The sums are in that product's order, not the
    examples' order. They all add into one output."""

    stores: tuple[int, ...]  # the kernel's stores computed so, in order
    weight: sp.Expr | None
    left: tuple[sp.Expr, ...]
    right: tuple[sp.Expr, ...]
    pairs: tuple[tuple[int, int, sp.Expr], ...]  # (left, right, coefficient) of each store
    left_scratch: str  # len(left) x examples
    right_scratch: str  # len(right) x examples
    sums: str  # len(left) x len(right)


@dataclass(frozen=True)
class EmapKernel:
    """One loop (or two nested) over examples around a CSE'd program: loads
    read argument rows where each example's binding says; each output's
    values go to (or add into) the row its target names. Per-example maps
    over the same examples share one loop (a value and its derivatives)."""

    loops: tuple  # lengths
    loads: tuple[tuple[sp.Symbol, View, tuple], ...]  # (symbol, view, (binding row, column))
    temps: tuple[tuple[sp.Symbol, sp.Expr], ...]
    outputs: tuple[EmapOutput, ...]
    stores: tuple[tuple[int, int, sp.Expr], ...]  # (output, column, value)
    index_checks: tuple[tuple[str, object, object], ...]  # (index buffer, its rows, rows of what it chooses among)
    equations: tuple[Equation, ...]
    copies: tuple[ColumnCopy, ...] = ()
    outer: int = 0  # of two loops, the one that runs outside (see _outer_loop)
    products: OuterProductSums | None = None
    padded: bool = False  # its examples in whole eights (_whole_eights)
    lanes: str = ""  # where padded: each sum's eight lanes, and apart the last eight examples' (LANES)
    term_sums: str = ""  # and each sum, its lanes added up after the loop
    kind: str = "emap"

    def reads(self) -> list[str]:
        return ([copy.source.buffer for copy in self.copies] + [view.buffer for _, view, _ in self.loads]
                + [check[0] for check in self.index_checks])

    def writes(self) -> list[str]:
        # (in this order in the workspace: the buffers of whole rows of examples
        # first, which keeps them as aligned as the examples' count)
        sums = self.products
        scratch = [self.lanes] if self.lanes else []
        scratch += [sums.left_scratch, sums.right_scratch, sums.sums] if sums else []
        scratch += [self.term_sums] if self.lanes else []
        return [copy.scratch for copy in self.copies] + scratch + [out.buffer for out in self.outputs]

    title = "per-example loop"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): its program's, once an example."""
        per = sum((count_ops(e) for _, e in self.temps), sp.Integer(0))
        per += sum((count_ops(e) for *_, e in self.stores), sp.Integer(0))
        return sp.Integer(0), sp.Mul(*self.loops) * per


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
        if not needed[p] or bindings[p][0] == "index":
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
        if tangent is not None and bindings[p][0] != "index":
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
    if kind == "gather":
        return args[binding[1]][examples[binding[2]], 0]
    return np.zeros_like(examples[0])  # "whole"


def _evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
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
    return np.broadcast_to(apply_body(expr, symbols, [env[s] for s in symbols], context), (count,))


# --- kernel -----------------------------------------------------------------


def _group_kernel(sched, members: list[Node]) -> EmapKernel:
    loops = members[0].attrs[2]
    loads: dict[tuple, sp.Symbol] = {}  # (argument, binding, column) -> its symbol
    views: list[tuple[sp.Symbol, View, tuple]] = []
    readable: dict[sp.Symbol, sp.Symbol] = {}
    checks: dict[tuple, None] = {}  # (index buffer, its rows, the rows it chooses among), once each
    program: list[tuple[sp.Symbol, sp.Expr]] = []
    outputs, bodies, equations = [], [], []
    for number, node in enumerate(members):
        node_bodies, bindings, _, target, lets = node.attrs
        free = set().union(*(b.free_symbols for b in node_bodies), *(e.free_symbols for _, e in lets))
        subs: dict[sp.Symbol, sp.Symbol] = {sym: sp.Symbol(f"_m{number}{sym.name}", real=True) for sym, _ in lets}
        for p, arg in enumerate(node.args):
            if bindings[p][0] == "gather":
                index = node.args[bindings[p][1]]
                checks[(sched.view(index).buffer, index.shape[0], arg.shape[0])] = None
            for col in range(binding_width(arg, bindings[p])):
                if row_placeholder(p, col) not in free:
                    continue
                key = (arg, bindings[p] if bindings[p][0] != "gather" else ("gather", node.args[bindings[p][1]]), col)
                if key not in loads:
                    sym = loads[key] = sp.Symbol(f"_load{len(loads)}", real=True)
                    where = _where(sched, node, bindings[p], col)
                    views.append((sym, sched.view(arg), where))
                    readable[sym] = sp.Symbol(f"{sched.label(arg)}[{_where_text(where)}]")
                subs[row_placeholder(p, col)] = loads[key]
        if target[0] == "gather":
            index = node.args[target[1]]
            checks[(sched.view(index).buffer, index.shape[0], node.shape[0])] = None
        renamed = substitute([e for _, e in lets] + list(node_bodies), subs)  # shared parts renamed once
        member_program = [(subs[sym], e) for (sym, _), e in zip(lets, renamed)]
        member_bodies = renamed[len(lets):]
        program += member_program
        bodies.append(member_bodies)
        where = _where(sched, node, target, 0)
        out = sched.buffer_of[node]
        outputs.append(EmapOutput(out, node.shape, where, accumulates(target, loops)))
        equations.append(_equation(out, where, member_program, member_bodies, readable,
                                             "+=" if outputs[-1].accumulate else "="))
    program, flat = _number_values(program, [b for member in bodies for b in member])
    temps, reduced = cse_program(program, flat)
    stores, position = [], 0
    for number, member in enumerate(bodies):
        for col in range(len(member)):
            stores.append((number, col, reduced[position]))
            position += 1
    kernel = EmapKernel(tuple(loops), tuple(views), tuple(temps), tuple(outputs), tuple(stores),
                        tuple(checks), tuple(equations))
    uses = _loop_uses(kernel)
    kernel = replace(kernel, outer=_outer_loop(kernel, uses))
    split = _product_split(kernel, uses)
    inner = len(kernel.loops) - 1 - kernel.outer
    summed = set(split[0]) if split else set()
    count = sum(1 for k, (number, _, _) in enumerate(kernel.stores)  # the sums left in the loop
                if k not in summed and _local(kernel.outputs[number], inner))
    kernel = _whole_eights(sched, kernel) or _inner_rows_by_column(sched, kernel)
    kernel = _outer_product_sums(sched, kernel, split)
    if not kernel.padded or not count or _threaded(kernel):  # (threaded: its sums stay in its tail's locals)
        return kernel
    # two sets of eight lanes a sum, and one more row: room to start them on a 64-byte line
    return replace(kernel, lanes=sched.claim_scratch("example_lanes", (count + 1, 2 * LANES)),
                   term_sums=sched.claim_scratch("term_sums", (count, 1)))


# At least this many sums of products of two per-example values make an
# OuterProductSums, and the product computes at most this many times as many
# sums as are wanted (its left factors x right factors).
OUTER_SUMS_MIN = 64
OUTER_SUMS_WASTE = 4


def _product_split(kernel: EmapKernel, uses: dict) -> tuple | None:
    """The sums of products of two varying values a wide body adds into
    locals of one output, where there are many and they share factors:
    (store -> (left, right, coefficient), the weight, the left factors,
    the right ones), else None."""
    if len(kernel.loops) != 2:
        return None
    inner = 1 - kernel.outer
    by_output: dict[int, dict[int, tuple]] = {}  # output -> store -> (coefficient, varying factors)
    for k, (number, _, expr) in enumerate(kernel.stores):
        if _local(kernel.outputs[number], inner) and expr.is_Mul:
            split = _factors(expr, uses, inner)
            if split is not None:
                by_output.setdefault(number, {})[k] = split
    # one output's sums: a value-only call keeps or drops them together (codegen._value_only)
    pairs, weight = _pairs(max(by_output.values(), key=len, default={}))
    if len(pairs) < OUTER_SUMS_MIN:
        return None
    left, right = _sides([(a, b) for a, b, _ in pairs.values()])
    if len(left) * len(right) > OUTER_SUMS_WASTE * len(pairs):
        return None
    return pairs, weight, left, right


def _outer_product_sums(sched, kernel: EmapKernel, split: tuple | None) -> EmapKernel:
    """The kernel with the sums of _product_split as one product after its
    loop (OuterProductSums), their factors in scratch."""
    if split is None:
        return kernel
    pairs, weight, left, right = split
    inner = 1 - kernel.outer
    where_left, where_right = {f: n for n, f in enumerate(left)}, {f: n for n, f in enumerate(right)}

    def oriented(a: sp.Expr, b: sp.Expr) -> tuple[int, int]:
        return (where_left[a], where_right[b]) if a in where_left and b in where_right else (where_left[b], where_right[a])

    rows = kernel.loops[inner] + (PAD_ROWS if kernel.padded else 0)
    sums = OuterProductSums(
        tuple(pairs), weight, tuple(left), tuple(right),
        tuple((*oriented(a, b), c) for a, b, c in pairs.values()),
        sched.claim_scratch("left_factors", (len(left), rows)),
        sched.claim_scratch("right_factors", (len(right), rows)),
        sched.claim_scratch("outer_sums", (len(left), len(right))))
    return replace(kernel, products=sums)


def _factors(expr: sp.Mul, uses: dict, inner: int) -> tuple[sp.Expr, list[sp.Expr]] | None:
    """(the factors the inner loop does not change, as one; the two or
    three it changes, a square counted twice), or None for other counts."""
    varying, fixed = [], []
    for factor in expr.args:
        if not _varies(factor, uses, inner):
            fixed.append(factor)
        elif factor.is_Pow and factor.exp == 2:
            varying += [factor.base, factor.base]
        else:
            varying.append(factor)
    return (sp.Mul(*fixed), varying) if len(varying) in (2, 3) else None


def _pairs(split: dict[int, tuple]) -> tuple[dict[int, tuple], sp.Expr | None]:
    """Store -> (left, right, coefficient), and the weight that multiplies
    every pair: the more numerous of the products of three that hold the
    commonest factor (the weight) and the products of two (no weight)."""
    counts: dict[sp.Expr, int] = {}
    for _, varying in split.values():
        for factor in set(varying):
            counts[factor] = counts.get(factor, 0) + 1
    if not counts:
        return {}, None
    weight = max(counts, key=lambda f: (counts[f], sp.default_sort_key(f)))
    weighted, plain = {}, {}
    for k, (coefficient, varying) in split.items():
        if len(varying) == 3 and weight in varying:
            rest = list(varying)
            rest.remove(weight)
            weighted[k] = (rest[0], rest[1], coefficient)
        elif len(varying) == 2:
            plain[k] = (varying[0], varying[1], coefficient)
    return (weighted, weight) if len(weighted) >= len(plain) else (plain, None)


def _sides(pairs: list[tuple[sp.Expr, sp.Expr]]) -> tuple[list[sp.Expr], list[sp.Expr]]:
    """The left and right factors of pairs: two colours of the graph whose
    edges are the pairs, where it has two (no pair within one side); else
    every factor on both sides. In order of first appearance."""
    order = list(dict.fromkeys(f for pair in pairs for f in pair))
    edges: dict[sp.Expr, list[sp.Expr]] = {f: [] for f in order}
    for a, b in pairs:
        edges[a].append(b)
        edges[b].append(a)
    side: dict[sp.Expr, int] = {}
    for start in order:
        if start in side:
            continue
        side[start] = 0
        stack = [start]
        while stack:
            f = stack.pop()
            for g in edges[f]:
                if g not in side:
                    side[g] = 1 - side[f]
                    stack.append(g)
                elif side[g] == side[f]:
                    return order, order
    return [f for f in order if side[f] == 0], [f for f in order if side[f] == 1]


def _whole_eights(sched, kernel: EmapKernel) -> EmapKernel | None:
    """The kernel with its examples in whole eights (see ROWS8), where its
    body is wide, each output adds into a sum over the examples (a local)
    or stores one number an example into the workspace (given PAD_ROWS
    more rows), and each row it reads an example can be copied by column:
    at fixed columns or, of two loops, at the outer loop's. Else None."""
    inner = len(kernel.loops) - 1 - kernel.outer
    outer = 1 - inner if len(kernel.loops) == 2 else None
    results = {name for name, _ in sched.results}
    stored = [out for out in kernel.outputs if not _local(out, inner)]
    if not all(_contiguous(out, inner) and out.buffer not in results for out in stored):
        return None  # (an output of the function has no rows to spare)
    fixed: dict[View, list[int]] = {}
    across: dict[View, None] = {}
    for _, view, (row, col) in kernel.loads:
        if row == ("loop", inner):
            if col[0] == "const":
                fixed.setdefault(view, []).append(col[1])
            elif col == ("loop", outer):
                across[view] = None
            else:
                return None
        elif ("loop", inner) in (row, col) or any(spec[0] == "gather" and spec[-1] == inner for spec in (row, col)):
            return None
    size = _body_ops(kernel)
    if not (fixed or across) or size <= LANES_MAX_OPS:
        return None
    rows = kernel.loops[inner]
    for out in stored:  # one number an example, into the workspace: room for the rows past the last
        sched.pad_rows(out.buffer, PAD_ROWS)
    copies: dict[View, ColumnCopy] = {}
    for view in across:  # (a view read at fixed columns too: those columns of this copy)
        assert outer is not None
        scratch = sched.claim_scratch(f"{view.buffer}_by_column", (kernel.loops[outer], rows + PAD_ROWS))
        copies[view] = ColumnCopy(scratch, view, rows, (), padded=True, across=kernel.loops[outer])
    for view, used in fixed.items():
        if view not in copies:
            kept = tuple(sorted(set(used)))
            scratch = sched.claim_scratch(f"{view.buffer}_by_column", (len(kept), rows + PAD_ROWS))
            copies[view] = ColumnCopy(scratch, view, rows, kept, padded=True)
    loads = []
    for sym, view, where in kernel.loads:
        copy = copies.get(view)
        if copy is not None and where[0] == ("loop", inner):
            if copy.across is None:
                where = (where[0], ("const", copy.columns.index(where[1][1])))
            view = copy.view
        loads.append((sym, view, where))
    return replace(kernel, loads=tuple(loads), copies=tuple(copies.values()), padded=True)


def _body_ops(kernel: EmapKernel) -> int:
    """About how many operations an example's body takes (as _emit counts them)."""
    return sum(_ops(e) for _, e in kernel.temps) + sum(_ops(e) for *_, e in kernel.stores)


def _inner_rows_by_column(sched, kernel: EmapKernel) -> EmapKernel:
    """Of two loops, the rows the inner one reads (a row of `width`
    entries an example) come from a copy in columns (see ColumnCopy).
    The copy costs one pass over those rows; the loop reads them once per
    outer example."""
    if len(kernel.loops) != 2:
        return kernel
    inner = 1 - kernel.outer
    columns: dict[View, list[int]] = {}
    for _, view, where in kernel.loads:
        if where[0] == ("loop", inner) and where[1][0] == "const" and view.row_stride != 1:
            columns.setdefault(view, []).append(where[1][1])
    if not columns:
        return kernel
    rows = kernel.loops[inner]
    copies: dict[View, ColumnCopy] = {}
    for view, used in columns.items():
        kept = tuple(sorted(set(used)))
        scratch = sched.claim_scratch(f"{view.buffer}_by_column", (len(kept), rows))
        copies[view] = ColumnCopy(scratch, view, rows, kept)
    loads = []
    for sym, view, where in kernel.loads:
        copy = copies.get(view)
        if copy is not None and where[0] == ("loop", inner) and where[1][0] == "const":
            view = copy.view
            where = (where[0], ("const", copy.columns.index(where[1][1])))
        loads.append((sym, view, where))
    return replace(kernel, loads=tuple(loads), copies=tuple(copies.values()))

def _equation(out: str, where: tuple, program: list, exprs: list, readable: dict, assign: str) -> Equation:
    row = _where_text(where).rsplit(",", 1)[0]
    lhs = f"{out}[{row}, :]" if len(exprs) > 1 else f"{out}[{_where_text(where)}]"
    if exceeds_all([*exprs, *(e for _, e in program)], MAX_SHOWN_OPS):  # the temporaries in the C are the readable form
        used = set().union(*(e.free_symbols for e in exprs), *(e.free_symbols for _, e in program))
        shown_loads = sorted(used & readable.keys(), key=str)
        sources = dict.fromkeys(re.sub(r", \d+\]$", ", :]", str(readable[s])) for s in shown_loads)
        values = f"{len(exprs)} value{'s' if len(exprs) > 1 else ''}"
        text = f"{values} from {', '.join(sources)}: see the temporaries"
        return Equation(lhs, text, rf"{latex_name(out)} \mathrel{{{assign}}} \text{{{len(exprs)} values: see the C}}", assign)
    lets = dict(program)
    shown = [inline(e, lets).xreplace(readable) for e in exprs]
    text = sp.sstr(shown[0]) if len(shown) == 1 else "[" + ", ".join(map(sp.sstr, shown)) + "]"
    value = sp.Matrix(shown).T if len(shown) > 1 else shown[0]
    return Equation(lhs, text, lambda: rf"{latex_name(out)} \mathrel{{{assign}}} {latex(value)}", assign)  # when asked

def _where(sched, node: Node, binding: tuple, col: int) -> tuple:
    """(row, column) of a binding: ("loop", a), ("gather", index buffer, a), ("const", n)."""
    if binding[0] == "row":
        return ("loop", binding[1]), ("const", col)
    if binding[0] == "gather":
        return ("gather", sched.view(node.args[binding[1]]).buffer, binding[2]), ("const", col)
    if binding[0] == "cell":
        return ("loop", 0), ("loop", 1)
    return ("const", 0), ("const", col)

def _number_values(program: list, outputs: list) -> tuple[list, list]:
    """Value numbering over a straight-line program: a value computed again
    (the forward pass inside each of several derivatives) becomes the first."""
    seen: dict[sp.Basic, sp.Symbol] = {}
    alias: dict[sp.Symbol, sp.Basic] = {}
    kept = []
    for sym, expr in program:
        if alias:  # (none yet: nothing to rename)
            expr = expr.xreplace(alias)
        if expr in seen:
            alias[sym] = seen[expr]
        else:
            seen[expr] = sym
            kept.append((sym, expr))
    return kept, substitute(outputs, alias) if alias else list(outputs)


def _where_text(where: tuple) -> str:
    """(row, column) of an emap load as text: "i, 3", "cam[i], 0"."""
    def part(spec: tuple) -> str:
        if spec[0] == "loop":
            return "ij"[spec[1]]
        if spec[0] == "gather":
            return f"{spec[1]}[{'ij'[spec[2]]}]"
        return str(spec[1])
    return ", ".join(part(spec) for spec in where)



# --- C ----------------------------------------------------------------------

# Accumulators of a body at most this large (sympy operations an example)
# run in eight lanes, which the compiler vectorizes; a larger body stays
# one scalar lane, the compile time of a vectorized wide body being large.
LANES_MAX_OPS = 200
LANES = 8
# A wide body whose examples only add into sums and read rows it can copy
# (_whole_eights) runs over whole eights of examples: its copies (ColumnCopy)
# and factors (OuterProductSums) are ROWS8 rows apart, the rows past the
# last example its last again, and its sums add up only the examples'
# terms (its lanes, below). GCC then writes the body once: no second copy
# for the last examples (SYMBACKPROP_SCALAR_TAIL), which was a fifth of
# GCC's work on GradBench gmm's gradient and half of it on llsq's.
ROWS8 = loop_index("rows8")  # the examples rounded up to whole eights
PAST_LAST = loop_index("row")  # a padded copy's source row: the example's, or the last
# A padded buffer's rows past the examples: at most LANES - 1 are used;
# LANES keeps what follows it as aligned as before (gmm's gradient 3-7%
# slower with LANES - 1, its vector loads across cache lines)
PAD_ROWS = LANES
# Its sums: the loop runs eight examples at a time, example i0 + lane
# adding into lane `lane` of each sum's eight (a row of the workspace,
# from a 64-byte line: one vector of doubles, half of one of floats); the
# last eight, some past the last example, add into eight lanes apart, of
# which only the examples' are kept. After the loop each sum's lanes add
# up in order (the runtime's _lane_sums), so a sum's order depends on the
# examples' count only, not on the machine's vectors. Each sum's terms
# going down a scratch column, a block at a time, made llsq's gradient
# 2-3x slower (160 -> 340-600 us).
# A wide body adding into this many locals or more (each a sum of the
# examples in order: lane by lane, spilled) puts its function on 256-bit
# vectors (SYMBACKPROP_WIDE_SUMS, the runtime header): GradBench gmm d=20
# (231 sums) compiles 0.4 s faster and its gradient runs 9% faster, the same
# bits; llsq m=128 (128 sums, in one function with a forward loop that is
# 33% slower on 256-bit vectors) keeps 512.
WIDE_SUMS_NARROW = 192
# A wide body with a scalar tail (not over whole eights) whose sums over the
# examples are much of its work (a sum or more for every SIMD_SUMS_OPS
# operations) adds each sum in the vector's lanes and the lanes after the
# loop (SYMBACKPROP_SIMD_SUMS, the runtime header: OpenMP's simd
# reduction), not lane by lane in order: GradBench llsq m=128 (128 sums in
# 766 operations, before it ran over whole eights) took 2.5x less time for
# its gradient and GCC 15% less for its unit. gmm d=20 (41 sums in 1191 operations)
# keeps the order: its vector sums were 7% faster to run and 0.4-0.7 s
# slower to compile, with the body's values spilling around them. A loop
# storing factors for a product after it (OuterProductSums) keeps the order.
SIMD_SUMS_OPS = 16
# A run of at least this many adds after a loop into one row's consecutive
# columns (its sums' lanes added up, a product's sums) is one loop, reading
# a table of where each comes from where that is not consecutive: GCC spent
# 16% of GradBench gmm's gradient unit on 190 such lines, 8% of llsq's on
# 128. A copy of that many consecutive columns (ColumnCopy) is a loop too.
ADD_LOOP_MIN = 16


def _loop_uses(kernel: EmapKernel) -> dict[sp.Symbol, frozenset]:
    """The loops (0, 1) each load and temporary depends on."""
    uses: dict[sp.Symbol, frozenset] = {}
    for sym, _, where in kernel.loads:
        uses[sym] = frozenset(spec[-1] for spec in where if spec[0] in ("loop", "gather"))
    for sym, expr in kernel.temps:
        uses[sym] = frozenset().union(*(uses.get(s, frozenset()) for s in expr.free_symbols))
    return uses


def _varies(expr: sp.Basic, uses: dict, inner: int) -> bool:
    return any(inner in uses.get(s, ()) for s in expr.free_symbols)


def _worth_a_temporary(expr: sp.Basic) -> bool:
    """Not a symbol or number, nor a multiple of one (a negation)."""
    if expr.is_Atom or not isinstance(expr, sp.Expr):  # not a condition or a piece
        return False
    return not (expr.is_Mul and len(expr.args) == 2 and expr.args[0].is_Number and expr.args[1].is_Atom)


def _hoist(expr: sp.Basic, uses: dict, inner: int, fresh: Iterator[sp.Symbol], out: list) -> sp.Basic:
    """expr with its largest parts that the inner loop does not change
    (exp of a parameter, a sum of parameters) replaced by temporaries
    appended to `out`, computed once before that loop."""
    if not expr.args:
        return expr
    if not _varies(expr, uses, inner):
        if not _worth_a_temporary(expr):
            return expr
        sym = next(fresh)
        out.append((sym, expr))
        uses[sym] = frozenset()
        return sym
    args = expr.args
    if isinstance(expr, (sp.Add, sp.Mul)):
        fixed = [a for a in args if not _varies(a, uses, inner)]
        if len(fixed) > 1:  # the terms (factors) that do not vary, as one
            moving = [_hoist(a, uses, inner, fresh, out) for a in args if _varies(a, uses, inner)]
            return expr.func(_hoist(expr.func(*fixed), uses, inner, fresh, out), *moving)
    new = [_hoist(a, uses, inner, fresh, out) for a in args]
    return expr if all(a is b for a, b in zip(new, args)) else expr.func(*new)


def _fixed_ops(expr: sp.Basic, uses: dict, inner: int) -> int:
    """About how many operations of expr _hoist would take out of the inner loop."""
    if not expr.args:
        return 0
    if not _varies(expr, uses, inner):
        return _ops(expr) if _worth_a_temporary(expr) else 0
    return sum(_fixed_ops(a, uses, inner) for a in expr.args)


def _ops(expr: sp.Basic) -> int:
    """Operations in expr, about (count_ops without its cost)."""
    return sum(max(len(node.args) - 1, 1) for node in sp.preorder_traversal(expr) if node.args)


def _outer_loop(kernel: EmapKernel, uses: dict) -> int:
    """Which of two loops runs outside: the one whose rows the sums add
    into (the inner loop then adds into locals), else the one under which
    more of the body is computed once (exp of a parameter row, ...)."""
    if len(kernel.loops) == 1:
        return 0
    local = [sum(int(out.shape[1]) for out in kernel.outputs if _local(out, 1 - outer)) for outer in (0, 1)]
    if local[1] != local[0]:  # settled without counting the body (a walk over all of it)
        return 1 if local[1] > local[0] else 0
    exprs = [e for _, e in kernel.temps] + [e for *_, e in kernel.stores]

    def fixed(outer: int) -> int:
        return sum(_fixed_ops(e, uses, 1 - outer) for e in exprs)

    return 1 if fixed(1) > fixed(0) else 0


def _local(out: EmapOutput, inner: int) -> bool:
    """Whether an output adds into one row during the whole inner loop:
    then it adds into a local there, and into memory once after."""
    row = out.target[0]
    return out.accumulate and (row[0] == "const" or (row[0] in ("loop", "gather") and row[-1] != inner))


def _apart(out: EmapOutput, inner: int) -> bool:
    """Whether each example of the inner loop writes its own place (not
    through an index, where two examples may choose one row)."""
    return ("loop", inner) in out.target and not any(s[0] == "gather" and s[-1] == inner for s in out.target)


@dataclass(frozen=True)
class _Add:
    """`into[row, col] += scale*source[at]`, after a loop; `buffer` is the
    output it writes (a call that needs only some outputs keeps its adds)."""
    into: View
    row: sp.Expr
    col: sp.Expr
    source: str
    at: int
    buffer: str
    scale: str = ""  # C, or none


def _adds(em: FunctionEmitter, adds: Sequence[_Add]) -> list[tuple[str, str]]:
    """(the C, the buffer it writes) for each add in order; a run of
    ADD_LOOP_MIN or more unscaled into consecutive columns of one row, one loop."""
    out: list[tuple[str, str]] = []
    start = 0
    while start < len(adds):
        first, end = adds[start], start + 1
        while (end < len(adds) and (adds[end].into, adds[end].row, adds[end].source) == (first.into, first.row, first.source)
               and adds[end].col - first.col == end - start and not first.scale and not adds[end].scale):
            end += 1
        if end - start >= ADD_LOOP_MIN:
            out.append((_add_loop(em, adds[start:end]), first.buffer))
        else:
            out += [(f"{em.access(a.into, a.row, a.col)} += {a.scale + '*' if a.scale else ''}{a.source}[{a.at}];", a.buffer)
                    for a in adds[start:end]]
        start = end
    return out


def _column_index(em: FunctionEmitter) -> sp.Symbol:
    """k, a loop over columns (of adds after a loop, of a ColumnCopy)."""
    column = loop_index("k")
    em.index.text[column] = "k"
    return column


def _add_loop(em: FunctionEmitter, run: Sequence[_Add]) -> str:
    """A run of adds as one loop over its columns k: source[at + k], or
    source[picks[k]] from a table where the ats are not consecutive."""
    first = run[0]
    into = em.access(first.into, first.row, first.col + _column_index(em))
    ats = [a.at for a in run]
    loop = f"for (int64_t k = 0; k < {len(run)}; ++k) {{\n"
    if ats == list(range(ats[0], ats[0] + len(run))):
        return loop + f"    {into} += {first.source}[{f'{ats[0]} + k' if ats[0] else 'k'}];\n}}"
    table = textwrap.fill(", ".join(map(str, ats)), width=88, initial_indent="        ", subsequent_indent="        ")
    return (f"{{  /* where in {first.source} each of the {len(run)} columns comes from */\n"
            f"    static const int32_t picks[{len(run)}] = {{\n{table}\n    }};\n"
            + textwrap.indent(loop + f"    {into} += {first.source}[picks[k]];\n}}", "    ") + "\n}")


def _emit(em: FunctionEmitter, kernel: EmapKernel) -> dict:
    """Loops over the examples; gathered rows are read through their
    index (checked at the function's entry: see entry_checks). What the
    inner loop does not change is computed before it (the loads it reads
    first: locals, which the compiler need not read again after each
    store), and sums into one row add into locals there (in eight lanes
    for a small body)."""
    loop_vars = ("i", "j")

    def position(where: tuple) -> tuple[sp.Expr, sp.Expr]:
        out = []
        for spec in where:
            if spec[0] == "loop":
                out.append((LOOP_I, LOOP_J)[spec[1]])
            elif spec[0] == "gather":
                symbol = sp.Symbol(f"_gather_{spec[1]}_{spec[2]}", integer=True)
                em.index.text[symbol] = f"{em.namer.name(spec[1])}[{loop_vars[spec[2]]}]"
                out.append(symbol)
            else:
                out.append(sp.Integer(spec[1]))
        return out[0], out[1]

    uses = _loop_uses(kernel)
    outer = kernel.outer
    inner = len(kernel.loops) - 1 - outer
    if kernel.padded:
        em.index.text.update({ROWS8: "rows8", PAST_LAST: "row"})
    access = {sym: em.access(view, *position(where)) for sym, view, where in kernel.loads}
    used = set().union(*(e.free_symbols for _, e in kernel.temps), *(e.free_symbols for *_, e in kernel.stores))
    loaded = [sym for sym, _, _ in kernel.loads if inner not in uses[sym] and sym in used]
    hoisted = [(sym, e) for sym, e in kernel.temps if inner not in uses[sym]]
    fresh = (sp.Symbol(f"_h{k}") for k in itertools.count())
    sums = kernel.products
    summed = set(sums.stores) if sums else set()
    store_exprs = [None if k in summed else _hoist(expr, uses, inner, fresh, hoisted)
                   for k, (*_, expr) in enumerate(kernel.stores)]
    if sums:
        weighted = [f if sums.weight is None else sums.weight * f for f in sums.left]
        factor_exprs = [_hoist(f, uses, inner, fresh, hoisted) for f in weighted + list(sums.right)]
        coefficients = [_hoist(c, uses, inner, fresh, hoisted) for *_, c in sums.pairs]
    moving = [(sym, _hoist(e, uses, inner, fresh, hoisted)) for sym, e in kernel.temps if inner in uses[sym]]
    # named x0, x1, ... in the order the C computes them
    order = [(sym, sym) for sym in loaded] + hoisted + moving
    names = {sym: f"x{k}" for k, (sym, _) in enumerate(order)}
    text = {**access, **names}
    text.update({d: f"(({em.real.c}){c})" for d, c in em.dims.items()})
    printer = CheckedPrinter(ScalarPrinter(text, em.real), kernel)
    temps = [(names[sym], access[sym], True) for sym in loaded]
    temps += [(names[sym], printer.doprint(e), k < len(hoisted)) for k, (sym, e) in enumerate(hoisted + moving)]
    stores: list[tuple[str, str, str, str]] = []
    buffers: list[str] = []  # what each store writes into (or is for)
    in_order: list[bool] = []  # each store adds into a local or stores one number an example
    places = {}  # each store's (view, row, column)
    for k, ((number, col, _), expr) in enumerate(zip(kernel.stores, store_exprs)):
        out = kernel.outputs[number]
        rows, cols = out.shape
        view = View(out.buffer, sp.Integer(0), sp.sympify(cols) if rows != 1 else sp.Integer(0), sp.Integer(1))
        row, first = position(out.target)
        places[k] = (view, row, first + col)
        if k in summed:
            continue
        local = f"acc{sum(1 for *_, named in stores if named)}" if _local(out, inner) else ""
        stores.append((em.access(*places[k]), "+=" if out.accumulate else "=", printer.doprint(expr), local))
        buffers.append(out.buffer)
        in_order.append(bool(local) or _contiguous(out, inner))
    after: list[str] = []
    # the output the sums add into (one: _outer_product_sums); the factors' stores are for it
    summed_into = kernel.outputs[kernel.stores[sums.stores[0]][0]].buffer if sums else ""
    if sums:
        var, examples = loop_vars[inner], em.dim(kernel.loops[inner])
        apart = "rows8" if kernel.padded else examples  # one factor's examples to the next's
        left, right, product = (em.namer.name(b) for b in (sums.left_scratch, sums.right_scratch, sums.sums))
        sides = [(left, k) for k in range(len(sums.left))] + [(right, k) for k in range(len(sums.right))]
        for (scratch, k), expr in zip(sides, factor_exprs):
            stores.append((f"{scratch}[{k}*{apart} + {var}]" if k else f"{scratch}[{var}]", "=",
                           printer.doprint(expr), ""))
            buffers.append(summed_into)
            in_order.append(True)
        after.append(f"/* {len(sums.pairs)} sums over {var} of {left}[a] * {right}[b], as one product */")
        after.append(f"{em.real.helper_prefix}_outer_product_sums({len(sums.left)}, {len(sums.right)}, {examples}, "
                     f"{apart}, {left}, {right}, {product});")
        adds = [_Add(*places[k], product, a * len(sums.right) + b, summed_into, "" if c == 1 else printer.doprint(c))
                for k, (a, b, _), c in zip(sums.stores, sums.pairs, coefficients)]
        after += [line for line, _ in _adds(em, adds)]
    emitted = [e for e in store_exprs if e is not None] + (factor_exprs if sums else [])
    size = sum(_ops(e) for _, e in hoisted + moving) + sum(_ops(e) for e in emitted)
    locals_count = sum(1 for *_, local in stores if local)
    # a wide body adding into locals or storing one number an example:
    # whole eights, then a scalar tail
    # (GCC's two vectorized epilogues of such a body were a third of gmm's compile)
    eights = size > LANES_MAX_OPS and all(in_order)
    parallel = _threaded(kernel)
    whole_eights = kernel.padded and eights and not parallel
    # (whole eights) the C that adds the sums into their targets, each piece
    # with the output it writes (_adds), and the line that adds up every sum's lanes
    sums_after: list[tuple[str, str]] = []
    sums_call, sums_count = "", 0
    if whole_eights and kernel.lanes:  # each sum in eight lanes (LANES)
        examples, term_sums = em.dim(kernel.loops[inner]), em.namer.name(kernel.term_sums)
        stored = [places[k] for k in range(len(kernel.stores)) if k not in summed]  # where each of stores is
        adds = []
        for k, (_, _, expr, local) in enumerate(stores):
            if local:
                number = len(adds)
                stores[k] = (f"into[{LANES * number} + lane]" if number else "into[lane]", "+=", expr, "")
                adds.append(_Add(*stored[k], term_sums, number, buffers[k]))
        sums_after, sums_count = _adds(em, adds), len(adds)
        sums_call = (f"{em.real.helper_prefix}_lane_sums(lanes, {sums_count}, {examples} - (rows8 - {LANES}), "
                     f"{term_sums});")

    def named(expr: sp.Basic) -> list[str]:
        return sorted(names[s] for s in expr.free_symbols if s in names)

    return {
        "copies": [_copy_fields(em, copy) for copy in kernel.copies],
        "loops": [(loop_vars[a], em.dim(kernel.loops[a])) for a in (outer, inner)[:len(kernel.loops)]],
        "lanes": LANES if size <= LANES_MAX_OPS else 1,
        # of two loops, an inner loop of a small body whose examples write
        # apart (and add up only in locals) carries `#pragma GCC ivdep`: GCC
        # cannot tell the workspace's buffers apart and would not vectorize it
        "independent": len(kernel.loops) == 2 and size <= LANES_MAX_OPS
        and all(_local(out, inner) or _apart(out, inner) for out in kernel.outputs),
        "wide": size > LANES_MAX_OPS,  # its function is SYMBACKPROP_WIDE
        "wide_sums": size > LANES_MAX_OPS and locals_count >= WIDE_SUMS_NARROW,
        "eights": eights,
        "simd_sums": eights and not after and locals_count * SIMD_SUMS_OPS >= size,
        "after": after,  # inside the outer loop, after the inner one (OuterProductSums)
        "sums_after": sums_after,  # (whole eights) the sums over the examples, after the loop
        "sums_call": sums_call,
        "sums_count": sums_count,
        "lane_count": LANES,
        "lanes_scratch": em.namer.name(kernel.lanes) if kernel.lanes else "",
        "after_buffer": summed_into or None,
        "lanes_whole": LANES - 1,
        "zero": [(em.namer.name(out.buffer), em.dim(sp.sympify(out.shape[0]) * out.shape[1]))
                 for out in kernel.outputs if out.accumulate],
        "parallel": parallel,
        # the examples in whole eights: one loop, no tail (_whole_eights)
        "padded": em.dim(kernel.loops[inner]) if kernel.padded else None,
        "whole_eights": whole_eights,
        "temps": temps,
        "stores": stores,
        # what each piece writes and reads, for a call that needs only some
        # outputs (codegen.forward_only: forward through the shared function)
        "zero_buffers": [out.buffer for out in kernel.outputs if out.accumulate],
        "store_buffers": buffers,
        "temp_uses": [[] for _ in loaded] + [named(e) for _, e in hoisted + moving],
        "store_uses": [named(e) for e in emitted],
    }


def _threaded(kernel: EmapKernel) -> bool:
    """Whether its outer loop runs on threads: only where no two examples
    of different threads add into one place (and not where the examples'
    factors go through one scratch: OuterProductSums), and the loop is
    long enough. A padded kernel so threaded keeps its scalar tail."""
    safe = kernel.products is None and all(not out.accumulate or out.target[0] == ("loop", kernel.outer)
                                           for out in kernel.outputs)
    return safe and worth_threads(kernel.loops[kernel.outer])


def _contiguous(out: EmapOutput, inner: int) -> bool:
    """Whether each example of the inner loop stores one number, next to
    the previous example's (a store GCC vectorizes)."""
    return out.target[0] == ("loop", inner) and out.shape[1] == 1 and not out.accumulate


def _copy_fields(em: FunctionEmitter, copy: ColumnCopy) -> dict:
    """A ColumnCopy's loop: each source row read once, written down the
    columns (padded: to whole eights, the last row again past the last)."""
    row = PAST_LAST if copy.padded else LOOP_I
    first, count = (copy.columns[0], len(copy.columns)) if copy.columns else (0, 0)
    inner = None  # a loop over the columns: (its variable, its count)
    if copy.across is not None:
        assigns = [(em.access(copy.view, LOOP_I, LOOP_J), em.access(copy.source, row, LOOP_J))]
        inner = ("j", em.dim(copy.across))
    elif count >= ADD_LOOP_MIN and copy.columns == tuple(range(first, first + count)):
        k = _column_index(em)
        assigns = [(em.access(copy.view, LOOP_I, k), em.access(copy.source, row, first + k))]
        inner = ("k", str(count))
    else:
        assigns = [(em.access(copy.view, LOOP_I, sp.Integer(k)), em.access(copy.source, row, sp.Integer(col)))
                   for k, col in enumerate(copy.columns)]
    return {
        "rows": "rows8" if copy.padded else em.dim(copy.rows),
        "last": em.dim(copy.rows) if copy.padded else None,
        "inner": inner,
        "assigns": assigns,
        "source": em.namer.name(copy.source.buffer),
        "scratch": em.namer.name(copy.scratch),
    }


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
                parent, i, j = atom.args
                if not (i.is_Integer and j.is_Integer):
                    raise ModelError(f"only constant indices are supported: {short(atom)}")
                node = element(lowerer.lower(parent), int(i), int(j))
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
    group_kernel=_group_kernel,
    emit=_emit,
    template="kernel_emap.c.j2",
    grad_fn=plain_grad_fn("MapExamples"),
    lowering=((Gather, _gather), (ExampleMap, _example_map)),
))
