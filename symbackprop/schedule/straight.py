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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

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
