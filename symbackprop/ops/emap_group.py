"""How the emap nodes of one loop become one EmapKernel (the scheduler's
group_kernel for emap): their programs renamed into one and CSE'd, their
loads and outputs placed, then the loops ordered, rows copied by column,
sums of products of two values moved to one product after the loop, and a
wide body run over whole groups of lanes of examples."""

from __future__ import annotations

import re
from dataclasses import replace

import sympy as sp

from symbackprop.base.exprdag import substitute
from symbackprop.emit.emitted import MOST_LANES
from symbackprop.ir.construct import accumulates, binding_width, row_placeholder
from symbackprop.ir.node import Node
from symbackprop.ops.emap_kernel import (
    LANES_MAX_OPS,
    PAD_ROWS,
    ColumnCopy,
    EmapKernel,
    EmapOutput,
    OuterProductSums,
    adds_locally,
    contiguous,
    loop_uses,
    op_count,
    outer_loop,
    threaded,
    varies,
)
from symbackprop.schedule.cse import cse_program, inline
from symbackprop.schedule.kernel import MAX_SHOWN_OPS, Equation, View, latex, latex_name
from symbackprop.schedule.opcount import exceeds_all


def group_kernel(sched, members: list[Node]) -> EmapKernel:
    loops = members[0].attrs[2]
    loads: dict[tuple, sp.Symbol] = {}  # (argument, binding, column) -> its symbol
    views: list[tuple[sp.Symbol, View, tuple]] = []
    readable: dict[sp.Symbol, sp.Symbol] = {}
    checks: dict[tuple, None] = {}  # (index buffer, its rows, the rows it chooses among), once each
    computed: dict[str, None] = {}  # the index buffers a kernel computed (extreme_tie's first), not checked
    guard: tuple[View, int] | None = None
    program: list[tuple[sp.Symbol, sp.Expr]] = []
    outputs, bodies, equations = [], [], []
    for number, node in enumerate(members):
        node_bodies, bindings, _, target, lets = node.attrs
        free = set().union(*(b.free_symbols for b in node_bodies), *(e.free_symbols for _, e in lets))
        subs: dict[sp.Symbol, sp.Symbol] = {sym: sp.Symbol(f"_m{number}{sym.name}", real=True) for sym, _ in lets}
        for p, arg in enumerate(node.args):
            if bindings[p][0] == "gather":
                _index_read(sched, node.args[bindings[p][1]], arg.shape[0], checks, computed)
            elif bindings[p][0] == "guard":  # (the members of a group share it: fusion.ExamplesGroup)
                guard = (sched.view(arg), bindings[p][1])
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
            _index_read(sched, node.args[target[1]], node.shape[0], checks, computed)
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
                        tuple(checks), tuple(equations), computed=tuple(computed), guard=guard)
    uses = loop_uses(kernel)
    # a guard skips examples of the outer loop (every pair of a skipped row)
    kernel = replace(kernel, outer=guard[1] if guard else outer_loop(kernel, uses))
    split = _product_split(kernel, uses)
    inner = len(kernel.loops) - 1 - kernel.outer
    summed = set(split[0]) if split else set()
    count = sum(1 for k, (number, _, _) in enumerate(kernel.stores)  # the sums left in the loop
                if k not in summed and adds_locally(kernel.outputs[number], inner))
    # (whole eights read a guard past the last example: a guarded loop keeps its tail)
    kernel = (None if guard else _whole_eights(sched, kernel)) or _inner_rows_by_column(sched, kernel)
    kernel = _outer_product_sums(sched, kernel, split)
    if not kernel.padded or not count or threaded(kernel):  # (threaded: its sums stay in its tail's locals)
        return kernel
    # two sets of lanes a sum, and one more row: room to start them on a 64-byte line (as
    # many lanes as any real type keeps, MOST_LANES: the schedule does not know the type)
    return replace(kernel, lanes=sched.claim_scratch("example_lanes", (count + 1, 2 * MOST_LANES)),
                   term_sums=sched.claim_scratch("term_sums", (count, 1)))


def _index_read(sched, index: Node, rows: object, checks: dict, computed: dict) -> None:
    """An index a gather reads: an Index's range is checked at the
    function's entry; one a kernel computed is in range by construction."""
    buffer = sched.view(index).buffer
    if index.op == "leaf":
        checks[(buffer, index.shape[0], rows)] = None
    else:
        computed[buffer] = None


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
        if adds_locally(kernel.outputs[number], inner) and expr.is_Mul:
            split = _factors(expr, uses, inner)
            if split is not None:
                by_output.setdefault(number, {})[k] = split
    # one output's sums: a value-only call keeps or drops them together (cfunction._value_only)
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
        if not varies(factor, uses, inner):
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
    """The kernel with its examples in whole groups of lanes (see
    ROWS_WHOLE), where its body is wide, each output adds into a sum over
    the examples (a local) or stores one number an example into the
    workspace (given PAD_ROWS more rows), and each row it reads an example
    can be copied by column: at fixed columns or, of two loops, at the
    outer loop's. Else None."""
    inner = len(kernel.loops) - 1 - kernel.outer
    outer = 1 - inner if len(kernel.loops) == 2 else None
    results = {name for name, _ in sched.results}
    stored = [out for out in kernel.outputs if not adds_locally(out, inner)]
    if not all(contiguous(out, inner) and out.buffer not in results for out in stored):
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
    """About how many operations an example's body takes (as emit_emap counts them: ops/emap_c.py)."""
    return sum(op_count(e) for _, e in kernel.temps) + sum(op_count(e) for *_, e in kernel.stores)


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
