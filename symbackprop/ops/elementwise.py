"""map: a scalar body applied elementwise, its arguments broadcast along
axes of size 1. The scheduler fuses maps of one shape into shared loops
(schedule._map_kernel); this module holds the rest of the op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import sympy as sp
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction

from symbackprop.base.cnames import comment_text
from symbackprop.base.registry import OpRecord, register
from symbackprop.base.stable import sigmoid, softplus
from symbackprop.diff.autodiff import local_derivative, unbroadcast
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, worth_threads
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, is_const, map_
from symbackprop.ir.interpret import Context, apply_body
from symbackprop.ir.lower import scalar_atoms, shape_of
from symbackprop.ir.node import SCALAR, Node, placeholder
from symbackprop.messages import short
from symbackprop.schedule.kernel import MapKernel, View
from symbackprop.schedule.shifted import ShiftedView, guard_text, inside
from symbackprop.schedule.straight import Row

A0, A1 = placeholder(0), placeholder(1)


# --- derivatives ------------------------------------------------------------


def _vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    adjoints: list[Node | None] = []
    for index, arg in enumerate(node.args):
        if not needed[index]:
            adjoints.append(None)
            continue
        product = map_(A0 * A1, [g, local_derivative(node, index)])
        adjoints.append(unbroadcast(product, arg.shape))
    return tuple(adjoints)


def _jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """sum_i (d node / d arg_i) * tangent_i as one map over the local
    derivatives and the tangents: one node, not a product per argument and
    a sum of them (forward over reverse on a graph of many-argument maps,
    as an explicit bone chain lowers to, had five times the nodes of the
    gradient, nearly all of them those products). None where every local
    derivative is 0 (a stop_gradient, a floor): no forward-mode code for
    what it stops."""
    args: list[Node] = []
    terms = []
    for index, tangent in enumerate(tangents):
        if tangent is None:
            continue
        local = local_derivative(node, index)
        if is_const(local) and local.attrs[0] == 0:
            continue
        args += [local, tangent]
        terms.append(placeholder(len(args) - 2) * placeholder(len(args) - 1))
    return map_(sp.Add(*terms), args, node.shape) if terms else None


# --- numpy reference --------------------------------------------------------


def _evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    symbols = tuple(placeholder(i) for i in range(len(args)))
    return np.array(np.broadcast_to(apply_body(node.attrs[0], symbols, args, context), context.shape(node)))


# --- C ----------------------------------------------------------------------


# A loop-free body of more statements than this makes its function
# SYMBACKPROP_STRAIGHT (the runtime header: GCC vectorizes no basic block).
STRAIGHT_MIN_STATEMENTS = 200
# A loop with column sums (MapKernel.sums) runs over blocks of this many
# vectors' worth of columns (8 KB of a row: 2048 floats), each block's
# rows in order: each column is added up down the rows, whatever the
# thread count, and a thread takes whole blocks. Blocks of 256 floats
# measured level with the sums apart on the float32 ResNet (each row's
# piece too short for the prefetchers), 2048 about 3% faster.
SUMS_BLOCK_VECTORS = 128


def _emit(em: FunctionEmitter, kernel: MapKernel) -> dict:
    if kernel.table is not None:
        return {"loops": [], "hoisted": [], "parallel": False, "straight": False, "table": _table(em, kernel)}
    loops, i, j = em.loops(kernel.shape)
    shifted = {sym: view for sym, view in kernel.loads if isinstance(view, ShiftedView)}
    text = {sym: em.access(view, i, j) for sym, view in kernel.loads if sym not in shifted}
    first = []
    if kernel.load_first:  # what the loop overwrites is read into locals before any store
        overwritten = {out for out, _ in kernel.stores}
        for sym, view in kernel.loads:
            if view.buffer in overwritten and sym not in shifted:
                local = em.namer.name(f"\0{view.buffer} in")
                first.append((local, text[sym]))
                text[sym] = local
    # a value the same for every element (a loss, a bias of one entry) is read
    # once, before the loop: read inside, the compiler must assume a store
    # may change it, and does not vectorize the loop
    hoisted = []
    overwritten = {out for out, _ in kernel.stores}
    for sym, view in kernel.loads:
        invariant = (view.row_stride == 0 or kernel.shape[0] == 1) and (view.col_stride == 0 or kernel.shape[1] == 1)
        if loops and invariant and view.buffer not in overwritten:
            at = "" if view.offset == 0 else f" {view.offset}"
            local = em.namer.name(f"\0{view.buffer}{at} value")
            hoisted.append((local, text[sym]))
            text[sym] = local
    text.update({d: f"(({em.real.c}){c})" for d, c in em.dims.items()})
    temps_text = {sym: str(sym) for sym, _ in kernel.temps}
    cols = kernel.shape[1]
    out_index = sp.expand(i * (cols if kernel.shape[0] != 1 else 0) + j)
    out_index_text = em.index.doprint(out_index)
    parallel = worth_threads(kernel.shape[0]) and len(loops) > 0 and loops[0][0] == "i"

    def body(loads_text: dict, guards_text: dict | None = None) -> dict:
        """The loop's statements, its moved loads read as `loads_text`; its
        guards tested as `guards_text`, or (None) true, dropped."""
        printer = CheckedPrinter(ScalarPrinter({**text, **loads_text, **temps_text, **(guards_text or {})}, em.real),
                                 kernel)
        true = {} if guards_text is not None else {inside(k): sp.true for k in kernel.guards}

        def write(expr: sp.Expr) -> str:
            return printer.doprint(expr.xreplace(true) if true else expr)

        temps = first + [(str(sym), write(expr)) for sym, expr in kernel.temps]
        stores = [(f"{em.namer.name(out)}[{out_index_text}]", write(expr)) for out, expr in kernel.stores]
        if kernel.sums:  # each added into its column's entry (map_sums_loops)
            sums = [(f"{em.namer.name(out)}[{em.index.doprint(j)}]", write(expr)) for out, expr in kernel.sums]
            return {"temps": temps, "stores": stores, "sums": sums, "sums_block": SUMS_BLOCK_VECTORS * em.real.lanes}
        if not straight or kernel.load_first:
            return {"temps": temps, "stores": stores}
        return {"statements": _stores_early(kernel, temps, stores)}

    straight = not loops and len(kernel.temps) + len(kernel.stores) > STRAIGHT_MIN_STATEMENTS
    fields = {"loops": loops, "hoisted": hoisted, "parallel": parallel, "straight": straight}
    if shifted or kernel.guards:
        fields["parts"] = _shifted_parts(em, loops, i, j, shifted, kernel.guards, body)
    else:
        fields.update(body({}))
    return fields


def _table(em: FunctionEmitter, kernel: MapKernel) -> dict:
    """A long loop-free kernel as data (schedule.straight.as_table): its
    values in one local array (a 1, its loads, its constants, then each
    value it computes), followed by their negations, each computed value a
    sum of products of two entries, one row (their indices) of a table a
    product; a product subtracted reads a negation. The values are computed
    level by level (each after every value it reads), and within a level by
    their number of products: runs of values of as many products each (a
    determinant's minors of one size) keep the loop over a value's products
    predictable. Each value's products are one line of the table, after its
    equation in a comment."""
    zero = sp.Integer(0)
    text = {sym: em.access(view, zero, zero) for sym, view in kernel.loads}
    printer = CheckedPrinter(ScalarPrinter({**text, **{sym: str(sym) for sym, _ in kernel.temps}}, em.real), kernel)
    loads = {sym: k for k, (sym, _) in enumerate(kernel.loads, start=1)}
    entry_of: dict[sp.Symbol, int] = {}  # a temporary -> its entry
    entries: list[tuple[Row, list[int], str]] = []  # (its products, the entries they read, its equation or "")
    constants: dict[sp.Number, int] = {}  # -> its place

    def add(name: str, expr: sp.Expr, rows: list[Row]) -> int:
        """The entry of expr (its rows: straight.table_rows), after those of the sums inside it."""
        start = len(entries)
        for k, row in enumerate(rows):
            row = [(sign, tuple(start + f if isinstance(f, int) else f for f in factors)) for sign, factors in row]
            reads = [f if isinstance(f, int) else entry_of[f] for _, factors in row for f in factors
                     if isinstance(f, int) or f in entry_of]
            for _, factors in row:
                for f in factors:
                    if isinstance(f, sp.Number):
                        constants.setdefault(f, len(loads) + 1 + len(constants))
            equation = comment_text(f"{name} = {printer.doprint(expr)}") if k == len(rows) - 1 else ""
            entries.append((row, reads, equation))
        return len(entries) - 1

    assert kernel.table is not None
    found = iter(kernel.table)  # each temporary's rows, then each store's (None: stored as it is)
    for sym, expr in kernel.temps:
        entry_of[sym] = add(str(sym), expr, next(found))
    store_entries = [None if rows is None else add(f"{em.namer.name(out)}[0]", expr, rows)
                     for (out, expr), rows in zip(kernel.stores, found)]
    first = len(loads) + len(constants) + 1  # the place of the first value computed
    negated = first + len(entries)  # where the negations start
    order, level = _table_order(entries)
    place = {e: first + position for position, e in enumerate(order)}

    def at(f: object) -> int:
        if isinstance(f, int):
            return place[f]
        return constants[f] if isinstance(f, sp.Number) else loads[f] if f in loads else place[entry_of[f]]

    lines: list[tuple[str, str]] = []  # (a value's products, its equation)
    batches: list[list[int]] = []  # runs of values of one level and as many products: [products, values]
    for position, e in enumerate(order):
        row, _, equation = entries[e]
        lines.append((", ".join(_product_text([at(f) for f in factors], sign, negated) for sign, factors in row),
                      equation))
        # a run never spans two levels: the loop computes four of its values at once, so
        # none may read another (a run across levels did: x**6 read x**5 in the same four)
        if position and batches[-1][0] == len(row) and level[e] == level[order[position - 1]]:
            batches[-1][1] += 1
        else:
            batches.append([len(row), 1])
    stores = [(out, at(expr) if entry is None else place[entry])
              for (out, expr), entry in zip(kernel.stores, store_entries)]
    number = ScalarPrinter({}, em.real)
    loose_loads, load_groups = _copies(em, [(view.buffer, view.offset, loads[sym]) for sym, view in kernel.loads], "from")
    loose_stores, store_groups = _copies(em, [(out, zero, k) for out, k in stores], "to")
    return {"loads": loose_loads, "load_groups": load_groups, "stores": loose_stores, "store_groups": store_groups,
            "constants": [(k, number.doprint(c)) for c, k in constants.items()],
            "lines": lines, "batches": len(batches), "batch_lines": _pairs_text(batches),
            "value_count": len(entries), "first": first, "negated": negated, "size": 2 * negated,
            "values_name": em.namer.name("\0table values"), "products_name": em.namer.name("\0table products"),
            "batches_name": em.namer.name("\0table batches"), "row": em.namer.name("\0table row"),
            "value": em.namer.name("\0table value"), "count": em.namer.name("\0table count")}


def _table_order(entries: list[tuple[Row, list[int], str]]) -> tuple[list[int], list[int]]:
    """The entries (products, the entries they read, equation) in the order
    the table computes them: by level (one more than the highest level they
    read: the values of one level read none of each other), then by number
    of products, then as given; and each entry's level."""
    level: list[int] = []
    for _, reads, _ in entries:
        level.append(1 + max((level[e] for e in reads), default=0))
    return sorted(range(len(entries)), key=lambda e: (level[e], len(entries[e][0]), e)), level


def _product_text(places: list[int], sign: int, negated: int) -> str:
    """One row of a table's products: its two factors' places (1's place, 0,
    for a missing one), the first's negation for a product subtracted."""
    left, right = (places + [0, 0])[:2]
    return f"{{{left + negated if sign < 0 else left}, {right}}}"


def _copies(em: FunctionEmitter, places: list[tuple[str, sp.Expr, int]], way: str) -> tuple[list, list]:
    """A table's loads or stores (buffer, offset, value index): those at a
    constant place of one array (an input, an output, `work` for the
    workspace's buffers: cfunction.work_offsets) as one loop over a table of
    (value index, place) each; the rest one statement each,
    (buffer[offset], value index). Hundreds of copies written out, between
    a local array and as many workspace buffers, cost GCC 0.8 s of its
    alias walks (det ell=9's adjoint reads 491 minors)."""
    loose: list[tuple[str, int]] = []
    groups: dict[str, list[tuple[int, int]]] = {}
    for buffer, offset, k in places:
        base, place = ("work", em.work_offsets[buffer]) if buffer in em.work_offsets else (em.namer.name(buffer), 0)
        if offset.is_Integer:
            groups.setdefault(base, []).append((k, place + int(offset)))
        else:
            loose.append((em.access(View(buffer, offset, sp.Integer(0), sp.Integer(0)), sp.Integer(0),
                                    sp.Integer(0)), k))
    named = [(base, em.namer.name(f"\0table {way} {base}"), len(rows), _pairs_text(rows)) for base, rows in groups.items()]
    return loose, named


def _pairs_text(pairs: list) -> list[str]:
    """Pairs of integers as lines of a C initializer, eight a line."""
    return [", ".join(f"{{{a}, {b}}}" for a, b in pairs[k:k + 8]) + "," for k in range(0, len(pairs), 8)]


def _stores_early(kernel: MapKernel, temps: list, stores: list) -> list[tuple[bool, str, str]]:
    """A loop-free kernel's statements, (is a store, target or name, value),
    each store right after the last temporary it reads (in the kernel's
    order otherwise). With every store at the end, each stored value (a
    determinant's 500 minors, the gradient's entries) stayed live across
    the whole function, and GCC's register allocation and reloads over
    those hundreds of spilled values were most of its time (det ell=9's
    model C 1.9 -> 1.5 s). The values and the order of their arithmetic
    are the same; no store reads what another writes (load_first kernels
    keep theirs last), and outputs do not overlap inputs (module.h)."""
    rank = {sym: k for k, (sym, _) in enumerate(kernel.temps)}
    after: dict[int, list[tuple[bool, str, str]]] = {}
    for (_, value), (target, text) in zip(kernel.stores, stores):
        last = max((rank[s] for s in value.free_symbols if s in rank), default=-1)
        after.setdefault(last, []).append((True, target, text))
    statements = after.pop(-1, [])
    for k, (name, text) in enumerate(temps):
        statements.append((False, name, text))
        statements.extend(after.pop(k, ()))
    return statements


def _shifted_parts(em: FunctionEmitter, loops: list, i: sp.Expr, j: sp.Expr, shifted: dict, guards: tuple,
                   body: Callable) -> list:
    """The loop of a vector split where its moved loads and guards
    (schedule.shifted) run out: [0, K+) and [max(K+, N - K-), N) test each
    moved entry and read the fill outside the vector; [K+, N - K-), between
    them, reads straight (the main part: the one run on threads, where the
    loop is)."""
    ((var, length),) = loops
    index = i if var == "i" else j
    fill_printer = ScalarPrinter({}, em.real)
    ahead = max([v.k for v in shifted.values()] + list(guards) + [0])
    behind = max([-v.k for v in shifted.values()] + [-k for k in guards] + [0])

    def read(view: ShiftedView) -> str:
        return em.access(view, index - view.k, j) if var == "i" else em.access(view, i, index - view.k)

    def guarded(view: ShiftedView) -> str:
        return f"(({guard_text(view.k, var, length)}) ? {read(view)} : {fill_printer.doprint(view.fill)})"

    def edge() -> dict:
        return body({sym: guarded(v) for sym, v in shifted.items()},
                    {inside(k): guard_text(k, var, length) for k in guards})

    parts = []
    if ahead:
        parts.append({"var": var, "start": "0", "end": f"({ahead} < {length} ? {ahead} : {length})", "main": False,
                      **edge()})
    parts.append({"var": var, "start": str(ahead), "end": f"{length} - {behind}" if behind else length,
                  "main": True, **body({sym: read(v) for sym, v in shifted.items()})})
    if behind:
        start = f"({ahead} > {length} - {behind} ? {ahead} : {length} - {behind})"  # never before 0, nor the head
        parts.append({"var": var, "start": start, "end": length, "main": False, **edge()})
    return parts


# --- the grad_fn graph --------------------------------------------------------

ELEMENTWISE_NAMES = {
    sigmoid(A0): "Sigmoid",
    sp.tanh(A0): "Tanh",
    sp.Max(A0, 0): "Relu",
    softplus(A0): "Softplus",
    -softplus(-A0): "LogSigmoid",
    sp.exp(A0): "Exp",
    sp.log(A0): "Log",
    sp.sin(A0): "Sin",
    sp.cos(A0): "Cos",
    sp.sqrt(A0): "Sqrt",
    A0**2: "Square",
    -A0: "Neg",
    A0 + A1: "Add",
    A0 * A1: "Mul",
}


def _grad_fn(node: Node) -> tuple[str, list[Node]]:
    """Common compositions by their PyTorch names (MseLoss, MatMulWithBias,
    ...), the rest by their function, or Elementwise[body]. Only operations
    of the forward expression are shown (a weight's gradient through a
    product is computed with the other operand transposed, but the model
    transposes nothing, so no Transpose node)."""
    plain = list(node.args)
    for name, recognise in (("MseLoss", _mse), ("SoftmaxCrossEntropyLoss", _softmax_cross_entropy), ("Mean", _mean)):
        operand = recognise(node)
        if operand is not None:
            return name, [operand]
    body = node.attrs[0]
    if body == A0 + A1 and any(a.op == "matmul" for a in node.args):
        product = next(a for a in node.args if a.op == "matmul")
        return "MatMulWithBias", [_unbroadcast(a) for a in node.args if a is not product] + list(product.args)
    if body == A0 and node.args[0].shape != node.shape:
        return "Broadcast", plain
    return ELEMENTWISE_NAMES.get(body, f"Elementwise[{sp.sstr(body).replace('_a', 'x')}]"), plain


def _is_scaling(body: sp.Expr) -> bool:
    """body is c * A0, c free of A0 (not A0 itself). A body that is no
    polynomial in A0 (tanh(A0), exp(A0), ...) is taken for no scaling
    without simplify, which took 20-40 ms on each (a 150-layer MLP's graph:
    5 s of simplify); a mean lowers to a product c * A0."""
    return body != A0 and body.is_polynomial(A0) and sp.simplify(body / A0).free_symbols.isdisjoint({A0})


def _strip_mean(node: Node) -> Node:
    """Below a constant scaling (the 1/count of a mean) and sums."""
    body = node.attrs[0] if node.op == "map" else None
    if body is not None and len(node.args) == 1 and _is_scaling(body):
        node = node.args[0]
    while node.op == "sum":
        node = node.args[0]
    return node


def _is_negated(node: Node) -> bool:
    return node.op == "map" and node.attrs[0] == -A0


def _mse(node: Node) -> Node | None:
    """The prediction under a mean of squared differences, if node is one."""
    inner = _strip_mean(node)
    if inner is node or inner.op != "map" or len(inner.args) != 1 or inner.attrs[0] != A0**2:
        return None
    difference = inner.args[0]
    if difference.op == "map" and difference.attrs[0] == A0 + A1:
        kept = [a for a in difference.args if not _is_negated(a)]
        return kept[0] if len(kept) == 1 else difference
    return difference


def _softmax_cross_entropy(node: Node) -> Node | None:
    """The logits under -mean(sum(T * log_softmax(Z))) or -mean(pick(log_softmax(Z), y))
    (or their sums), if node is one."""
    inner, sign = node, 1
    while True:
        if inner.op == "sum":
            inner = inner.args[0]
        elif inner.op == "map" and len(inner.args) == 1 and _is_scaling(inner.attrs[0]):
            sign *= -1 if sp.simplify(inner.attrs[0] / A0).is_negative else 1
            inner = inner.args[0]
        else:
            break
    if inner is node or sign > 0:
        return None
    if inner.op == "map" and inner.attrs[0] == A0 * A1:
        inner = next((a for a in inner.args if a.op == "log_softmax_axis"), inner)
    elif inner.op == "pick":
        inner = inner.args[0]
    return inner.args[0] if inner.op == "log_softmax_axis" else None


def _mean(node: Node) -> Node | None:
    """The operand of a mean (a sum scaled by 1/count, as a mean lowers), if
    node is one: shown as the Mean the model wrote, not a sum and a scale."""
    if node.op != "map" or len(node.args) != 1 or node.args[0].op != "sum":
        return None
    inner, count = node.args[0], sp.Integer(1)
    while inner.op == "sum":
        count *= inner.args[0].shape[inner.attrs[0]]
        inner = inner.args[0]
    return inner if sp.simplify(node.attrs[0] - A0 / count) == 0 else None


def _unbroadcast(node: Node) -> Node:
    if node.op == "map" and node.attrs[0] == A0 and node.args[0].shape != node.shape:
        return node.args[0]
    return node


# --- lowering from SymPy --------------------------------------------------------


def _mat_add(lowerer, expr: sp.MatAdd) -> Node:
    # SymPy flattens x + a + b: a residual stream's sum of every earlier
    # term. A sum lowered inside the terms (x) is reused, the largest
    # first: each block adds its terms to it, and its gradient flows back
    # once a block (not read again by every later block).
    for term in expr.args:  # the terms first: the earlier sums inside them are lowered then
        lowerer.lower(term)
    sums = lowerer.cache("sums")
    if not sums:
        sums["index"] = _SumIndex(lowerer.named_sums)
    index = sums["index"]
    # a sum among the terms (one the others are computed from, kept whole:
    # declare/sums.py) first, as regroup puts an earlier sum it finds
    inner = [t for t in expr.args if isinstance(t, sp.MatAdd)]
    parts = inner + index.regroup([t for t in expr.args if not isinstance(t, sp.MatAdd)], expr)
    index.add(expr)
    terms = [lowerer.lower(t) for t in parts]
    shape = lowerer.shape(expr)
    for part, term in zip(parts, terms):
        if term.shape != shape:  # SymPy's sums need equal shapes: no implicit broadcast
            raise ModelError(f"{short(part)} has shape {term.shape} in the sum {short(expr)} of shape {shape}: the terms "
                             "of a sum need equal shapes (a row b broadcasts as OneMatrix(rows, 1)*b)")
    body = sp.Add(*[placeholder(i) for i in range(len(terms))])
    return map_(body, terms, shape)


class _SumIndex:
    """The sums a sum's terms may be regrouped into: the named ones (in
    their order), then those lowered before, the largest first (the
    earlier of equal size first); each found through its terms, so that
    a sum looks only at the sums that share a term with it (all of them,
    each compared as a tree, made lowering a 1,000-layer stack cubic)."""

    def __init__(self, named: list[sp.MatAdd]):
        self.rank: dict[sp.Basic, tuple] = {}
        self.by_term: dict[sp.Basic, list[sp.Basic]] = {}
        for k, sub in enumerate(named):
            self._index(sub, (0, k))

    def _index(self, sub: sp.Basic, rank: tuple) -> None:
        if sub in self.rank:
            return
        self.rank[sub] = rank
        for term in set(sub.args):
            self.by_term.setdefault(term, []).append(sub)

    def add(self, lowered: sp.Basic) -> None:
        self._index(lowered, (1, -len(lowered.args), len(self.rank)))

    def regroup(self, terms: list[sp.Basic], whole: sp.Basic) -> list[sp.Basic]:
        """Terms with those of each indexed sum contained in them replaced by it."""
        grouped: list[sp.Basic] = []
        while True:
            candidates = {sub for term in terms for sub in self.by_term.get(term, ())}
            present = set(terms)
            for sub in sorted(candidates, key=self.rank.__getitem__):
                if not present.issuperset(sub.args) or (hash(sub) == hash(whole) and sub == whole):
                    continue  # (an unrolled network's gates share terms with every step's: most are not in)
                rest = _without(terms, sub.args)
                if rest is not None:
                    grouped.append(sub)
                    terms = rest
                    break
            else:
                return grouped + terms


def _without(terms: list[sp.Basic], remove: tuple) -> list[sp.Basic] | None:
    """terms less one occurrence of each of `remove` (the first), in their
    order; None where one is not among them."""
    left = Counter(remove)
    rest = []
    for term in terms:
        if left.get(term):
            left[term] -= 1
        else:
            rest.append(term)
    return None if any(left.values()) else rest


def _hadamard_product(lowerer, expr: sp.HadamardProduct) -> Node:
    """The product in its written order; but SymPy rebuilds a product sorted
    inside another expression (an LSTM's h = o * tanh(c) as written, (tanh(c)
    * o) @ V read from it), so the first product lowered of the same factors,
    in any order, is every one's: one node, one buffer, one gradient. (Not
    sorted by a key: the keys see a step's own inputs, and an unrolled
    network's steps would sort unlike each other.)"""
    factors = [lowerer.lower(f) for f in expr.args]
    products = lowerer.cache("hadamard_products")
    key = frozenset(Counter(factors).items())  # the factors, in any order
    node = products.get(key)
    if node is None or node.shape != lowerer.shape(expr):
        body = sp.Mul(*[placeholder(i) for i in range(len(factors))])
        node = products[key] = map_(body, factors, lowerer.shape(expr))
    return node


def _hadamard_power(lowerer, expr: sp.HadamardPower) -> Node:
    base, exponent = expr.args
    return map_(A0**A1, [lowerer.lower(base), lowerer.lower(exponent)])


def _apply_function(lowerer, expr: ElementwiseApplyFunction) -> Node:
    function = expr.function
    value = function(A0)
    if not isinstance(value, sp.Expr):
        raise ModelError(f"elementwise function {function} does not give a scalar")
    inner = lowerer.lower(expr.expr)
    scalar_atoms(value)  # only supported scalar operations
    free = value.free_symbols - {A0} - lowerer.dims
    if free:
        raise ModelError(f"elementwise function {function} uses undeclared {sorted(map(str, free))}")
    return map_(value, [inner], inner.shape)


def _identity(lowerer, expr: sp.Identity) -> Node:
    """Only 1x1, which SymPy makes of OneMatrix(1, 1) in sums."""
    if shape_of(expr) != SCALAR:
        raise ModelError(f"unsupported matrix operation Identity of shape {expr.shape} (only 1x1): {short(expr)}")
    return const(1, SCALAR)


register(OpRecord(
    "map",
    vjp=_vjp,
    jvp=_jvp,
    evaluate=_evaluate,
    fused="elementwise",
    emit=_emit,
    template="map_kernel",
    grad_fn=_grad_fn,
    lowering=(
        (sp.MatAdd, _mat_add),
        (sp.HadamardProduct, _hadamard_product),
        (sp.HadamardPower, _hadamard_power),
        (ElementwiseApplyFunction, _apply_function),
        (sp.Identity, _identity),
        (sp.OneMatrix, lambda lowerer, expr: const(1, shape_of(expr))),
        (sp.ZeroMatrix, lambda lowerer, expr: const(0, shape_of(expr))),
    ),
    shapes=(
        (sp.MatAdd, lambda e, of: of(e.args[0])),
        (sp.HadamardProduct, lambda e, of: of(e.args[0])),
        (sp.HadamardPower, lambda e, of: of(e.args[0])),
        (ElementwiseApplyFunction, lambda e, of: of(e.expr)),
    ),
))
