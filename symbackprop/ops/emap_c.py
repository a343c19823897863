"""The C of an emap kernel (ops/emap_kernel.py): loops over the examples
around its program, as the fields of templates/kernel_emap.c.j2. What the
inner loop does not change is computed before it; sums into one row add
into locals (in lanes for a small body: one vector register's, the real
type's RealType.lanes); a wide body over whole groups of lanes adds its
sums lane by lane and adds the lanes up after the loop."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import sympy as sp

from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter
from symbackprop.ops.emap_kernel import (
    LANES_MAX_OPS,
    ROWS_WHOLE,
    ColumnCopy,
    EmapKernel,
    EmapOutput,
    adds_locally,
    contiguous,
    loop_uses,
    op_count,
    threaded,
    varies,
    worth_a_temporary,
    writes_apart,
)
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, View, loop_index

PAST_LAST = loop_index("row")  # a padded copy's source row: the example's, or the last
# Of a loop over whole groups of lanes, each sum adds into its lanes (a row
# of the workspace, a 64-byte line); after the loop each sum's lanes add up
# in order (the runtime's _lane_sums), so that a sum's order depends on the
# examples' count and the real type only, not on the machine's vectors.
# A wide body adding into this many locals or more (each a sum of the
# examples in order: lane by lane, spilled) puts its function on 256-bit
# vectors (SYMBACKPROP_WIDE_SUMS, the runtime header): faster to compile
# and to run where the sums are many.
WIDE_SUMS_NARROW = 192
# A wide body with a scalar tail (not over whole groups of lanes) whose sums over the
# examples are much of its work (a sum or more for every SIMD_SUMS_OPS
# operations) adds each sum in the vector's lanes and the lanes after the
# loop (SYMBACKPROP_SIMD_SUMS, the runtime header: OpenMP's simd
# reduction), not lane by lane in order. A loop storing factors for a
# product after it (OuterProductSums) keeps the order.
SIMD_SUMS_OPS = 16
# A run of at least this many adds after a loop into one row's consecutive
# columns (its sums' lanes added up, a product's sums) is one loop, reading
# a table of where each comes from where that is not consecutive: fewer
# lines for GCC to compile. A copy of that many consecutive columns
# (ColumnCopy) is a loop too.
ADD_LOOP_MIN = 16


def _hoist(expr: sp.Basic, uses: dict, inner: int, fresh: Iterator[sp.Symbol], out: list) -> sp.Basic:
    """expr with its largest parts that the inner loop does not change
    (exp of a parameter, a sum of parameters) replaced by temporaries
    appended to `out`, computed once before that loop."""
    if not expr.args:
        return expr
    if not varies(expr, uses, inner):
        if not worth_a_temporary(expr):
            return expr
        sym = next(fresh)
        out.append((sym, expr))
        uses[sym] = frozenset()
        return sym
    args = expr.args
    if isinstance(expr, (sp.Add, sp.Mul)):
        fixed = [a for a in args if not varies(a, uses, inner)]
        if len(fixed) > 1:  # the terms (factors) that do not vary, as one
            moving = [_hoist(a, uses, inner, fresh, out) for a in args if varies(a, uses, inner)]
            return expr.func(_hoist(expr.func(*fixed), uses, inner, fresh, out), *moving)
    new = [_hoist(a, uses, inner, fresh, out) for a in args]
    return expr if all(a is b for a, b in zip(new, args)) else expr.func(*new)



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


LOOP_VARS = ("i", "j")


def _computed_rows(em: FunctionEmitter, kernel: EmapKernel) -> list[tuple[str, str]]:
    """The computed indices (real numbers) of a loop over one loop, each
    read once an example into an integer local (name, C): the compiler
    would read it again after each store through it, which may alias it."""
    if len(kernel.loops) != 1:
        return []
    return [(f"row{k}", f"(int64_t){em.namer.name(buffer)}[i]") for k, buffer in enumerate(kernel.computed)]


def _position(em: FunctionEmitter, where: tuple, kernel: EmapKernel | None = None) -> tuple[sp.Expr, sp.Expr]:
    """A load's or target's (row, column) as index expressions; a gathered
    row reads its index (named in the index printer's text), a computed
    index (a real number) as an integer: its local (_computed_rows), or cast."""
    computed = kernel.computed if kernel is not None else ()
    out = []
    for spec in where:
        if spec[0] == "loop":
            out.append((LOOP_I, LOOP_J)[spec[1]])
        elif spec[0] == "gather":
            symbol = sp.Symbol(f"_gather_{spec[1]}_{spec[2]}", integer=True)
            read = f"{em.namer.name(spec[1])}[{LOOP_VARS[spec[2]]}]"
            if kernel is not None and spec[1] in computed:
                read = f"row{computed.index(spec[1])}" if len(kernel.loops) == 1 else f"(int64_t){read}"
            em.index.text[symbol] = read
            out.append(symbol)
        else:
            out.append(sp.Integer(spec[1]))
    return out[0], out[1]


@dataclass
class _Body:
    """An example's program as the C computes it: the loads the inner loop
    does not change (read first, into locals), the values computed before
    it (hoisted) and in it (moving), named x0, x1, ... in that order."""

    inner: int
    printer: CheckedPrinter
    loaded: list[sp.Symbol]
    hoisted: list[tuple[sp.Symbol, sp.Basic]]
    moving: list[tuple[sp.Symbol, sp.Basic]]
    names: dict[sp.Symbol, str]
    temps: list[tuple[str, str, bool]]
    store_exprs: list  # each store's value (None: a sum of OuterProductSums)
    factor_exprs: list  # OuterProductSums' factors (left ones weighted, then right ones)
    coefficients: list  # and the coefficient of each of its pairs


def _body(em: FunctionEmitter, kernel: EmapKernel) -> _Body:
    """The body's temporaries, with what the inner loop does not change
    hoisted before it."""
    uses = loop_uses(kernel)
    inner = len(kernel.loops) - 1 - kernel.outer
    if kernel.padded:
        em.index.text.update({ROWS_WHOLE: rows_whole(em), PAST_LAST: "row"})
    access = {sym: em.access(view, *_position(em, where, kernel)) for sym, view, where in kernel.loads}
    used = set().union(*(e.free_symbols for _, e in kernel.temps), *(e.free_symbols for *_, e in kernel.stores))
    loaded = [sym for sym, _, _ in kernel.loads if inner not in uses[sym] and sym in used]
    hoisted = [(sym, e) for sym, e in kernel.temps if inner not in uses[sym]]
    fresh = (sp.Symbol(f"_h{k}") for k in itertools.count())
    sums = kernel.products
    summed = set(sums.stores) if sums else set()
    store_exprs = [None if k in summed else _hoist(expr, uses, inner, fresh, hoisted)
                   for k, (*_, expr) in enumerate(kernel.stores)]
    factor_exprs: list = []
    coefficients: list = []
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
    return _Body(inner, printer, loaded, hoisted, moving, names, temps, store_exprs, factor_exprs, coefficients)


@dataclass
class _Stores:
    """The loop's stores as C (place, operator, value, the local it adds
    into or ""), with what each writes into (or is for), whether it adds
    into a local or stores one number an example, and each kernel store's
    (view, row, column)."""

    stores: list[tuple[str, str, str, str]]
    buffers: list[str]
    in_order: list[bool]
    places: dict[int, tuple[View, sp.Expr, sp.Expr]]
    targets: list[tuple[str, str]] = field(default_factory=list)  # (name, C) of each gathered row's pointer


def _stores(em: FunctionEmitter, kernel: EmapKernel, body: _Body) -> _Stores:
    """Each store of the kernel (those summed by OuterProductSums only placed).
    An example's stores into a row it chooses through an index (a
    scatter-add) go through a pointer to that row (`targets`, computed
    once an example): written a[8*row0 + 3], GCC vectorized none of them
    (it could not tell the rows' entries apart), written target0[3], the
    row's entries in a few vector instructions."""
    summed = set(kernel.products.stores) if kernel.products else set()
    out = _Stores([], [], [], {})
    pointers: dict[int, str] = {}  # output -> the name of its row's pointer
    for k, ((number, col, _), expr) in enumerate(zip(kernel.stores, body.store_exprs)):
        output = kernel.outputs[number]
        rows, cols = output.shape
        view = View(output.buffer, sp.Integer(0), sp.sympify(cols) if rows != 1 else sp.Integer(0), sp.Integer(1))
        row, first = _position(em, output.target, kernel)
        out.places[k] = (view, row, first + col)
        if k in summed:
            continue
        local = f"acc{sum(1 for *_, named in out.stores if named)}" if adds_locally(output, body.inner) else ""
        target = em.access(*out.places[k])
        if not local and output.target[0][0] == "gather":
            if number not in pointers:
                pointers[number] = f"target{len(pointers)}"
                out.targets.append((pointers[number], "&" + em.access(replace(view, col_stride=sp.Integer(0)), row,
                                                                      sp.Integer(0))))
            target = f"{pointers[number]}[{em.index.doprint(sp.sympify(first + col))}]"
        out.stores.append((target, "+=" if output.accumulate else "=", body.printer.doprint(expr), local))
        out.buffers.append(output.buffer)
        out.in_order.append(bool(local) or contiguous(output, body.inner))
    return out


def _product_stores(em: FunctionEmitter, kernel: EmapKernel, body: _Body, out: _Stores) -> tuple[list[str], str]:
    """OuterProductSums' factors stored in the loop (appended to `out`),
    and the C after the inner loop: the product, and its sums added into
    their places. With the output the sums add into (one:
    emap_group._outer_product_sums); ([], "") without."""
    sums = kernel.products
    if not sums:
        return [], ""
    after: list[str] = []
    summed_into = kernel.outputs[kernel.stores[sums.stores[0]][0]].buffer
    var, examples = LOOP_VARS[body.inner], em.dim(kernel.loops[body.inner])
    apart = rows_whole(em) if kernel.padded else examples  # one factor's examples to the next's
    left, right, product = (em.namer.name(b) for b in (sums.left_scratch, sums.right_scratch, sums.sums))
    sides = [(left, k) for k in range(len(sums.left))] + [(right, k) for k in range(len(sums.right))]
    for (scratch, k), expr in zip(sides, body.factor_exprs):
        out.stores.append((f"{scratch}[{k}*{apart} + {var}]" if k else f"{scratch}[{var}]", "=",
                           body.printer.doprint(expr), ""))
        out.buffers.append(summed_into)
        out.in_order.append(True)
    after.append(f"/* {len(sums.pairs)} sums over {var} of {left}[a] * {right}[b], as one product */")
    after.append(f"{em.real.helper_prefix}_outer_product_sums({len(sums.left)}, {len(sums.right)}, {examples}, "
                 f"{apart}, {left}, {right}, {product});")
    adds = [_Add(*out.places[k], product, a * len(sums.right) + b, summed_into,
                 "" if c == 1 else body.printer.doprint(c))
            for k, (a, b, _), c in zip(sums.stores, sums.pairs, body.coefficients)]
    after += [line for line, _ in _adds(em, adds)]
    return after, summed_into


def _lane_sums(em: FunctionEmitter, kernel: EmapKernel, body: _Body, out: _Stores) -> tuple[list, str, int]:
    """(Whole groups of lanes, each sum in the real type's lanes) each
    local's store rewritten to add into its lanes; the C that adds the
    sums into their targets, each piece with the output it writes (_adds),
    the line that adds up every sum's lanes, and how many sums."""
    examples, term_sums = em.dim(kernel.loops[body.inner]), em.namer.name(kernel.term_sums)
    lanes = em.real.lanes
    summed = set(kernel.products.stores) if kernel.products else set()
    stored = [out.places[k] for k in range(len(kernel.stores)) if k not in summed]  # where each of stores is
    adds: list[_Add] = []
    for k, (_, _, expr, local) in enumerate(out.stores):
        if local:
            number = len(adds)
            out.stores[k] = (f"into[{lanes * number} + lane]" if number else "into[lane]", "+=", expr, "")
            adds.append(_Add(*stored[k], term_sums, number, out.buffers[k]))
    sums_count = len(adds)
    # (the lanes' count passed: a float64 module compiled as float calls the float helper with its text's)
    sums_call = (f"{em.real.helper_prefix}_lane_sums(lanes, {lanes}, {sums_count}, "
                 f"{examples} - ({rows_whole(em)} - {lanes}), {term_sums});")
    return _adds(em, adds), sums_call, sums_count


def emit_emap(em: FunctionEmitter, kernel: EmapKernel) -> dict:
    """Loops over the examples; gathered rows are read through their
    index (checked at the function's entry: see entry_checks). What the
    inner loop does not change is computed before it (the loads it reads
    first: locals, which the compiler need not read again after each
    store), and sums into one row add into locals there (in the real
    type's lanes for a small body)."""
    body = _body(em, kernel)
    inner, outer = body.inner, kernel.outer
    out = _stores(em, kernel, body)
    after, summed_into = _product_stores(em, kernel, body, out)
    emitted = [e for e in body.store_exprs if e is not None] + body.factor_exprs
    size = sum(op_count(e) for _, e in body.hoisted + body.moving) + sum(op_count(e) for e in emitted)
    locals_count = sum(1 for *_, local in out.stores if local)
    # a wide body adding into locals or storing one number an example:
    # whole groups of lanes, then a scalar tail
    # (GCC's two vectorized epilogues of such a body were a third of gmm's compile)
    eights = size > LANES_MAX_OPS and all(out.in_order)
    parallel = threaded(kernel)
    whole_eights = kernel.padded and eights and not parallel
    sums_after, sums_call, sums_count = (_lane_sums(em, kernel, body, out) if whole_eights and kernel.lanes
                                         else ([], "", 0))

    def named(expr: sp.Basic) -> list[str]:
        return sorted(body.names[s] for s in expr.free_symbols if s in body.names)

    guard = None
    if kernel.guard is not None:  # (two loops: the guard's is the outer one, emap_group)
        view, loop = kernel.guard
        guard = f"{em.access(view, (LOOP_I, LOOP_J)[loop], sp.Integer(0))} == 0"
    return {
        "guard": guard,
        "rows": _computed_rows(em, kernel),
        "copies": [_copy_fields(em, copy) for copy in kernel.copies],
        "loops": [(LOOP_VARS[a], em.dim(kernel.loops[a])) for a in (outer, inner)[:len(kernel.loops)]],
        "lanes": em.real.lanes if size <= LANES_MAX_OPS else 1,
        # of two loops, an inner loop of a small body whose examples write
        # apart (and add up only in locals) carries `#pragma GCC ivdep`: GCC
        # cannot tell the workspace's buffers apart and would not vectorize it
        "independent": len(kernel.loops) == 2 and size <= LANES_MAX_OPS
        and all(adds_locally(output, inner) or writes_apart(output, inner) for output in kernel.outputs),
        "wide": size > LANES_MAX_OPS,  # its function is SYMBACKPROP_WIDE
        "wide_sums": size > LANES_MAX_OPS and locals_count >= WIDE_SUMS_NARROW,
        "eights": eights,
        "simd_sums": eights and not after and locals_count * SIMD_SUMS_OPS >= size,
        "after": after,  # inside the outer loop, after the inner one (OuterProductSums)
        "sums_after": sums_after,  # (whole groups of lanes) the sums over the examples, after the loop
        "sums_call": sums_call,
        "sums_count": sums_count,
        "lane_count": em.real.lanes,
        "lanes_scratch": em.namer.name(kernel.lanes) if kernel.lanes else "",
        "after_buffer": summed_into or None,
        "lanes_whole": em.real.lanes - 1,
        "rows_whole": rows_whole(em),
        "groups": {8: "eights", 16: "sixteens"}.get(em.real.lanes, "groups of lanes"),  # (in comments)
        "zero": [(em.namer.name(output.buffer), em.dim(sp.sympify(output.shape[0]) * output.shape[1]))
                 for output in kernel.outputs if _zeroed(kernel, output)],
        "parallel": parallel,
        # the examples in whole groups of lanes: one loop, no tail (emap_group._whole_eights)
        "padded": em.dim(kernel.loops[inner]) if kernel.padded else None,
        "whole_eights": whole_eights,
        "temps": body.temps,
        "stores": out.stores,
        "targets": out.targets,  # declared in an example's body where its stores use them
        # what each piece writes and reads, for a call that needs only some
        # outputs (cfunction.forward_only: forward through the shared function)
        "zero_buffers": [output.buffer for output in kernel.outputs if _zeroed(kernel, output)],
        "store_buffers": out.buffers,
        "temp_uses": [[] for _ in body.loaded] + [named(e) for _, e in body.hoisted + body.moving],
        "store_uses": [named(e) for e in emitted],
    }



def rows_whole(em: FunctionEmitter) -> str:
    """ROWS_WHOLE in the C: a padded loop's examples rounded up to whole
    groups of the real type's lanes: rows<lanes>, rows8 of doubles."""
    return f"rows{em.real.lanes}"


def _zeroed(kernel: EmapKernel, output: EmapOutput) -> bool:
    """Whether an output is zeroed before the loop: it adds up, or a guard
    skips examples (which then write 0, as the numpy reference)."""
    return output.accumulate or kernel.guard is not None


def _copy_fields(em: FunctionEmitter, copy: ColumnCopy) -> dict:
    """A ColumnCopy's loop: each source row read once, written down the
    columns (padded: to whole groups of lanes, the last row again past the last)."""
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
        "rows": rows_whole(em) if copy.padded else em.dim(copy.rows),
        "last": em.dim(copy.rows) if copy.padded else None,
        "inner": inner,
        "assigns": assigns,
        "source": em.namer.name(copy.source.buffer),
        "scratch": em.namer.name(copy.scratch),
    }

