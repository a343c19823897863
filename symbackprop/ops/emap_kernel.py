"""What one emap loop is (EmapKernel: its loads, program and outputs, and
the copies and sums it is given), and what both its grouping
(ops/emap_group.py) and its C (ops/emap_c.py) ask of it: which loop runs
outside, which outputs add up in locals, what the inner loop does not
change, whether it runs on threads."""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from symbackprop.emit.codegen import worth_threads
from symbackprop.emit.emitted import MOST_LANES
from symbackprop.ir.node import Shape
from symbackprop.schedule.kernel import Equation, View, count_ops, loop_index


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
    # to whole groups of lanes of rows (ROWS_WHOLE apart): past the last example, the last again
    padded: bool = False
    across: sp.Expr | None = None  # of two loops, every column: the outer loop's (then columns is empty)

    @property
    def view(self) -> View:
        """How the loop reads the copy: example r's k-th column at k*rows + r."""
        return View(self.scratch, sp.Integer(0), sp.Integer(1), ROWS_WHOLE if self.padded else sp.sympify(self.rows))


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
    outer: int = 0  # of two loops, the one that runs outside (see outer_loop)
    products: OuterProductSums | None = None
    padded: bool = False  # its examples in whole groups of lanes (emap_group._whole_eights)
    lanes: str = ""  # where padded: each sum's lanes, and apart the last group of examples' (MOST_LANES room)
    term_sums: str = ""  # and each sum, its lanes added up after the loop
    kind: str = "emap"
    computed: tuple[str, ...] = ()  # index buffers that kernels computed (real numbers, read as integers)
    guard: tuple[View, int] | None = None  # a column, and the loop (outer) whose examples it skips where 0

    def reads(self) -> list[str]:
        return ([copy.source.buffer for copy in self.copies] + [view.buffer for _, view, _ in self.loads]
                + [check[0] for check in self.index_checks] + list(self.computed)
                + ([self.guard[0].buffer] if self.guard else []))

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


# Accumulators of a body at most this large (sympy operations an example)
# run in lanes, one vector register's (the real type's RealType.lanes:
# emap_c), which the compiler vectorizes; a larger body stays one scalar
# lane, the compile time of a vectorized wide body being large.
LANES_MAX_OPS = 200
# A wide body whose examples only add into sums and read rows it can copy
# runs over whole groups of lanes of examples ("whole eights", eight doubles
# a group: emap_group._whole_eights): its copies (ColumnCopy) and factors
# (OuterProductSums) are ROWS_WHOLE rows apart, the rows past the last
# example its last again, so that GCC writes the body once, with no second
# copy for the last examples (SYMBACKPROP_SCALAR_TAIL).
ROWS_WHOLE = loop_index("rows_whole")  # the examples rounded up to whole lanes (in C rows8, rows16: emap_c)
# A padded buffer's rows past the examples: at most lanes - 1 are used. The
# schedule does not know the real type (and a float64 module may be
# compiled as float): room for the most lanes of any, MOST_LANES, a whole
# 64-byte line of floats, which keeps what follows it as aligned as before
# (its vector loads would otherwise cross cache lines).
PAD_ROWS = MOST_LANES


def loop_uses(kernel: EmapKernel) -> dict[sp.Symbol, frozenset]:
    """The loops (0, 1) each load and temporary depends on."""
    uses: dict[sp.Symbol, frozenset] = {}
    for sym, _, where in kernel.loads:
        uses[sym] = frozenset(spec[-1] for spec in where if spec[0] in ("loop", "gather"))
    for sym, expr in kernel.temps:
        uses[sym] = frozenset().union(*(uses.get(s, frozenset()) for s in expr.free_symbols))
    return uses


def varies(expr: sp.Basic, uses: dict, inner: int) -> bool:
    return any(inner in uses.get(s, ()) for s in expr.free_symbols)


def worth_a_temporary(expr: sp.Basic) -> bool:
    """Not a symbol or number, nor a multiple of one (a negation)."""
    if expr.is_Atom or not isinstance(expr, sp.Expr):  # not a condition or a piece
        return False
    return not (expr.is_Mul and len(expr.args) == 2 and expr.args[0].is_Number and expr.args[1].is_Atom)



def _fixed_ops(expr: sp.Basic, uses: dict, inner: int) -> int:
    """About how many operations of expr emap_c._hoist would take out of the inner loop."""
    if not expr.args:
        return 0
    if not varies(expr, uses, inner):
        return op_count(expr) if worth_a_temporary(expr) else 0
    return sum(_fixed_ops(a, uses, inner) for a in expr.args)


def op_count(expr: sp.Basic) -> int:
    """Operations in expr, about (count_ops without its cost)."""
    return sum(max(len(node.args) - 1, 1) for node in sp.preorder_traversal(expr) if node.args)


def outer_loop(kernel: EmapKernel, uses: dict) -> int:
    """Which of two loops runs outside: the one whose rows the sums add
    into (the inner loop then adds into locals), else the one under which
    more of the body is computed once (exp of a parameter row, ...)."""
    if len(kernel.loops) == 1:
        return 0
    local = [sum(int(out.shape[1]) for out in kernel.outputs if adds_locally(out, 1 - outer)) for outer in (0, 1)]
    if local[1] != local[0]:  # settled without counting the body (a walk over all of it)
        return 1 if local[1] > local[0] else 0
    exprs = [e for _, e in kernel.temps] + [e for *_, e in kernel.stores]

    def fixed(outer: int) -> int:
        return sum(_fixed_ops(e, uses, 1 - outer) for e in exprs)

    return 1 if fixed(1) > fixed(0) else 0


def adds_locally(out: EmapOutput, inner: int) -> bool:
    """Whether an output adds into one row during the whole inner loop:
    then it adds into a local there, and into memory once after."""
    row = out.target[0]
    return out.accumulate and (row[0] == "const" or (row[0] in ("loop", "gather") and row[-1] != inner))


def writes_apart(out: EmapOutput, inner: int) -> bool:
    """Whether each example of the inner loop writes its own place (not
    through an index, where two examples may choose one row)."""
    return ("loop", inner) in out.target and not any(s[0] == "gather" and s[-1] == inner for s in out.target)



def threaded(kernel: EmapKernel) -> bool:
    """Whether its outer loop runs on threads: only where no two examples
    of different threads add into one place (and not where the examples'
    factors go through one scratch: OuterProductSums), and the loop is
    long enough. A padded kernel so threaded keeps its scalar tail."""
    safe = kernel.products is None and all(not out.accumulate or out.target[0] == ("loop", kernel.outer)
                                           for out in kernel.outputs)
    return safe and worth_threads(kernel.loops[kernel.outer])


def contiguous(out: EmapOutput, inner: int) -> bool:
    """Whether each example of the inner loop stores one number, next to
    the previous example's (a store GCC vectorizes)."""
    return out.target[0] == ("loop", inner) and out.shape[1] == 1 and not out.accumulate
