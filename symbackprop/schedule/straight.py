"""A long loop-free kernel is cut into several, where few values cross.

A fused scalar step of hundreds of values (a determinant's forward minors,
their adjoints) is one straight-line C body, and GCC's time on it (register
allocation, reloads) is one process's, however many cores there are. Cut
into kernels of about CUT_STATEMENTS statements, each is a part of its own
(emit.cparts), and a module split into translation units (emit.cunits)
compiles the pieces at once (det ell=9: the adjoint's 1.0-1.5 s of GCC, the
longest unit, in two).

Each cut is placed, near its share of the statements, where the fewest
temporaries are live across it: a value computed before the cut and read
after it is handed over in a 1 x 1 workspace buffer (`<temporary>_kept`),
or read back from where the kernel stores it anyway (a stored minor). The
values and the order of their arithmetic are the same (det ell=9: the same
bits); only a product handed over is rounded before the sum that reads it,
where FMA contraction could fuse them in one body. Each piece is a kernel
as any other (its loads, temporaries, stores and the equations of what it
stores); the first carries the op counts of the whole.

A long loop-free kernel whose every value is a polynomial in its loads and
values (a determinant's minors and their adjoints) is not cut: it runs from
a table (`as_table`; the C: ops/elementwise.py `_table`), one row of two
indices a product, which GCC reads as data. Written out, each statement
cost GCC about 1 ms of CPU (det ell=9's 1,558: 1.6 s in four units); the
table costs it almost nothing, and the call reads indices where the
straight body had them in its code (det ell=9's gradient 1.8x as long).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import TypeAlias

import sympy as sp

from symbackprop.ir.node import SCALAR
from symbackprop.schedule.kernel import MapKernel, View

# A loop-free kernel of more statements (temporaries and stores) than this is
# cut into ceil(statements / CUT_STATEMENTS) kernels. Each piece keeps more
# than ops.elementwise.STRAIGHT_MIN_STATEMENTS (200), so it is still compiled
# as a straight-line body (SYMBACKPROP_STRAIGHT).
CUT_STATEMENTS = 500
# A cut may move this fraction of a piece's statements either way, to where
# fewer values are live.
CUT_WINDOW = 0.1


# A loop-free kernel of more statements than this, each value a sum of
# products, runs from a table (as_table); a shorter one is written out (its
# call is faster, and GCC's time on it small).
TABLE_MIN_STATEMENTS = 500
# At most this many values in a table's kernel (a 1, its loads, its
# constants, its values): the C keeps them and their negations in a local
# array (at most 256 KB of stack) indexed by 16-bit integers. A longer
# kernel is cut (cut_straight).
TABLE_MAX_VALUES = 16383

# A factor of a table's product: one of the kernel's loads or temporaries, a
# constant (a positive number other than 1), or (an int) the index of an
# earlier row of the same value's rows.
Factor: TypeAlias = sp.Symbol | sp.Number | int
# One row: a sum of signed products (+1 or -1, at most two factors).
Row: TypeAlias = list[tuple[int, tuple[Factor, ...]]]


def as_table(kernel: MapKernel) -> MapKernel | None:
    """The kernel marked to run from a table (MapKernel.table), if it is
    long, loop-free, and every value it computes or stores is a polynomial
    in its loads and temporaries (table_rows); else None."""
    count = len(kernel.temps) + len(kernel.stores)
    if kernel.shape != SCALAR or kernel.load_first or kernel.guards or count <= TABLE_MIN_STATEMENTS \
            or any(type(view) is not View for _, view in kernel.loads):  # (a moved read: schedule.shifted)
        return None
    known = {sym for sym, _ in kernel.loads}
    found: list[list[Row] | None] = []  # each temporary's rows, then each store's (None: stored as it is)
    for sym, expr in kernel.temps:
        temp_rows = table_rows(expr, known)
        if temp_rows is None:
            return None
        found.append(temp_rows)
        known.add(sym)
    for _, expr in kernel.stores:
        store_rows = None if expr in known else table_rows(expr, known)
        if store_rows is None and expr not in known:
            return None
        found.append(store_rows)
    rows = [row for each in found if each for row in each]
    if not rows:  # nothing to compute (copies only): no table (C has no empty initializer)
        return None
    constants = {f for row in rows for _, factors in row for f in factors if isinstance(f, sp.Number)}
    values = 1 + len(kernel.loads) + len(constants) + len(rows)
    return replace(kernel, table=tuple(found)) if values <= TABLE_MAX_VALUES else None


def table_rows(expr: sp.Expr, known: set) -> list[Row] | None:
    """expr as the rows of a table, its own last: a sum of signed products
    of at most two factors each. A coefficient other than +-1 is a factor
    (a constant); a factor that is itself a sum or a product (a minor read
    once, inlined into the sum that reads it) an earlier row; a product of
    more factors a chain of rows; x**k (k <= 4) a product of k x's. None if
    expr has anything else (a function, a division, a symbol not in
    `known`)."""
    rows: list[Row] = []

    def factor(f: sp.Expr) -> Factor | None:
        if f in known:
            return f
        if f.is_Add or f.is_Mul:
            found = products(f)
            if found is None:
                return None
            rows.append(found)
            return len(rows) - 1
        return None

    def products(e: sp.Expr) -> Row | None:
        found: Row = []
        for term in sp.Add.make_args(e):
            coefficient, product = term.as_coeff_Mul()  # (any number, Float too; the rest)
            rest = () if product == 1 else sp.Mul.make_args(product)
            if not (coefficient.is_Rational or coefficient.is_Float) or (coefficient == 0 and rest) \
                    or len(found) >= TABLE_MAX_VALUES:
                return None
            sign, size = (-1, -coefficient) if coefficient.is_negative else (1, coefficient)  # (not `< 0`: sympify)
            factors: list[Factor] = [] if size == 1 else [size]
            for f in rest:
                power = int(f.exp) if f.is_Pow and f.exp.is_Integer else 1
                one = factor(f.base if power > 1 else f) if 1 <= power <= 4 else None  # (not 1/x, nor x**5)
                if one is None:
                    return None
                factors += [one] * power
            while len(factors) > 2:  # a*b*c: a*b first, a row of its own
                rows.append([(1, (factors[0], factors[1]))])
                factors = [len(rows) - 1, *factors[2:]]
            found.append((sign, tuple(factors)))
        return found

    own = products(expr)
    return None if own is None else [*rows, own]


def cut_straight(kernel: MapKernel, claim: Callable[[str], str]) -> list[MapKernel]:
    """The kernel, or its pieces in order where it is long and loop-free;
    `claim(base)` names a 1 x 1 workspace buffer for a value handed from
    one piece to a later one."""
    count = len(kernel.temps) + len(kernel.stores)
    if kernel.shape != SCALAR or kernel.load_first or kernel.guards or count <= CUT_STATEMENTS:
        return [kernel]
    rank = {sym: k for k, (sym, _) in enumerate(kernel.temps)}
    temp_symbols = [_symbols(expr) for _, expr in kernel.temps]
    store_symbols = [_symbols(expr) for _, expr in kernel.stores]
    temp_reads = [[rank[s] for s in symbols if s in rank] for symbols in temp_symbols]
    store_reads = [[rank[s] for s in symbols if s in rank] for symbols in store_symbols]
    store_after = [max(reads, default=-1) for reads in store_reads]  # stored after its last temporary (elementwise)
    stored_as: dict[sp.Symbol, str] = {}  # a temporary stored as it is: a later piece reads it back from there
    for out, expr in kernel.stores:
        if expr in rank and expr not in stored_as:
            stored_as[expr] = out
    last_use = list(range(len(kernel.temps)))
    for k, reads in enumerate(temp_reads):
        for r in reads:
            last_use[r] = max(last_use[r], k)
    for after, reads in zip(store_after, store_reads):
        for r in reads:
            last_use[r] = max(last_use[r], after)
    cuts = _cuts(kernel, store_after, last_use, stored_as, count)
    if not cuts:
        return [kernel]
    kept: dict[sp.Basic, str] = {}  # temporary -> the buffer a later piece reads it from
    bounds = [0, *cuts, len(kernel.temps)]
    for start, end in itertools.pairwise(bounds):
        for k in range(start, end):
            sym = kernel.temps[k][0]
            if last_use[k] >= end and sym not in kept:
                kept[sym] = stored_as.get(sym) or claim(f"{sym}_kept")
    pieces = []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        temps = kernel.temps[start:end]
        mine = [k for k, after in enumerate(store_after) if start <= after < end or (index == 0 and after < 0)]
        stores = [kernel.stores[k] for k in mine]
        handed = [(kept[sym], sym) for k, (sym, _) in enumerate(temps, start)
                  if last_use[k] >= end and kept[sym] != stored_as.get(sym)]
        read = set().union(*temp_symbols[start:end], *(store_symbols[k] for k in mine))
        earlier = sorted(rank[s] for s in read if s in rank and rank[s] < start)
        piece_loads = tuple((sym, view) for sym, view in kernel.loads if sym in read)
        piece_loads += tuple((kernel.temps[k][0], _whole(kept[kernel.temps[k][0]])) for k in earlier)
        written = {out for out, _ in stores}
        pieces.append(MapKernel(
            kernel.shape, piece_loads, tuple(temps), tuple(stores) + tuple(handed),
            tuple(e for e in kernel.equations if e.lhs in written),
            kind=kernel.kind, before_cse=kernel.before_cse if index == 0 else ()))
    return pieces


def _symbols(expr: sp.Basic) -> set:
    """expr.free_symbols; a sum or product of symbols and products of
    symbols and numbers (a minor, an adjoint) read directly (SymPy's walk
    was most of the cut's time)."""
    if expr.is_Symbol:
        return {expr}
    if not (expr.is_Add or expr.is_Mul):
        return expr.free_symbols
    found = set()
    for arg in expr.args:
        if arg.is_Symbol:
            found.add(arg)
        elif arg.is_Mul and all(f.is_Symbol or f.is_Number for f in arg.args):
            found.update(f for f in arg.args if f.is_Symbol)
        elif not arg.is_Number:
            found |= arg.free_symbols
    return found


def _whole(buffer: str) -> View:
    zero = sp.Integer(0)
    return View(buffer, zero, zero, zero)


def _cuts(kernel: MapKernel, store_after: list[int], last_use: list[int], stored_as: dict, count: int) -> list[int]:
    """Where the temporaries are cut (the index of each piece's first one):
    each near its share of the statements, where the fewest values that
    must be handed over are live (then the nearest, then the first)."""
    n = len(kernel.temps)
    pieces = -(-count // CUT_STATEMENTS)
    before = [0] * (n + 1)  # statements before a cut at temporary c: c temporaries and their stores
    stores_by = [0] * (n + 1)
    for after in store_after:
        stores_by[after + 1] += 1
    running = 0
    for c in range(n + 1):
        running += stores_by[c]
        before[c] = c + running
    live = [0] * (n + 2)  # values a cut at c hands over: computed before c, read at or after it
    for k, last in enumerate(last_use):
        if last > k and kernel.temps[k][0] not in stored_as:
            live[k + 1] += 1
            live[last + 1] -= 1
    for c in range(1, n + 2):
        live[c] += live[c - 1]
    share = count / pieces
    cuts: list[int] = []
    for p in range(1, pieces):
        target = share * p
        window = [c for c in range(max(1, (cuts[-1] + 1) if cuts else 1), n)
                  if abs(before[c] - target) <= CUT_WINDOW * share]
        if not window:
            return []
        cuts.append(min(window, key=lambda c: (live[c], abs(before[c] - target), c)))
    return cuts
