"""Turn a DAG into kernels: fused elementwise loops, products, reductions.

Elementwise maps of one shape fuse into one loop when they share arguments
and all their inputs are ready (a forward map and its local derivative so
share one CSE'd body). A map whose every user sits in its own loop is never
stored. Everything else that is stored gets a buffer; intermediates live in
a caller-provided workspace whose slots are reused once dead."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import sympy as sp

from symbackprop.base.exprdag import shared_xreplace
from symbackprop.base.registry import is_view, rule
from symbackprop.ir.construct import is_const
from symbackprop.ir.node import SCALAR, Node, Shape, placeholder
from symbackprop.schedule.cse import cse_program, share_powers
from symbackprop.schedule.dagcse import dag_cse
from symbackprop.schedule.fusion import ExamplesGroup, MapGroup, Placement, step_nodes
from symbackprop.schedule.inplace import over_dead_inputs, stores_last
from symbackprop.schedule.kernel import (
    MAX_INLINED_OPS,
    SEE_THE_C,
    Equation,
    Kernel,
    MapKernel,
    View,
    equation,
    kernel_reads,
    kernel_writes,
    map_equations,
)
from symbackprop.schedule.naming import Naming
from symbackprop.schedule.shifted import ShiftedView, inside, moved_view, offset_label, signed_k
from symbackprop.schedule.straight import as_table, cut_straight
from symbackprop.schedule.workspace import Slot, plan_workspace


@dataclass(frozen=True)
class FunctionSchedule:
    """A C function: its arguments, kernels in order and workspace plan."""

    name: str
    results: tuple[tuple[str, Node], ...]  # (output argument name, node)
    kernels: tuple[Kernel, ...]
    slots: tuple[Slot, ...]
    work_size: sp.Expr
    split: int | None = None  # kernels before this compute the `first` results (see schedule)
    first: frozenset[str] = frozenset()
    head_slots: tuple[Slot, ...] = ()  # the workspace plan of a call that stops at the split
    head_work_size: sp.Expr = sp.Integer(0)  # noqa: RUF009 (a SymPy Integer is immutable)

    @functools.cached_property
    def op_counts(self) -> tuple[int, int]:
        """Scalar operations in its fused loops' bodies, before and after CSE:
        counted when asked (the log, the derivation), never for a scan's step."""
        counted = [k.op_counts() for k in self.kernels if isinstance(k, MapKernel) and k.before_cse is not None]
        return sum(b for b, _ in counted), sum(a for _, a in counted)

    @property
    def written_before_split(self) -> set[str]:
        """Buffers a call that stops at the split writes (also results
        beyond the first ones, computed in the same loops)."""
        return {b for k in self.kernels[:self.split] for b in kernel_writes(k)}

    @property
    def needed_before_split(self) -> set[str]:
        """Buffers the `first` results need (they and what they read, back
        through the kernels before the split)."""
        needed = set(self.first)
        for kernel in reversed(self.kernels[:self.split]):
            if needed & set(kernel_writes(kernel)):
                needed |= set(kernel_reads(kernel))
        return needed

    @property
    def index_checks(self) -> tuple[tuple[str, object, object], ...]:
        """Every (Index buffer, its rows, rows of an array it gathers from)
        of the function's kernels, once each: the C checks them all at its
        entry, before any kernel writes (a failing call changes nothing)."""
        return tuple(dict.fromkeys(c for k in self.kernels for c in getattr(k, "index_checks", ())))



def schedule(
    name: str,
    results: Sequence[tuple[str, Node]],
    naming: Naming,
    inplace: frozenset[str] = frozenset(),
    first: frozenset[str] = frozenset(),
    sum_products: bool = True,
) -> FunctionSchedule:
    """Plan one C function computing `results` (output name, node).

    Results named in `inplace` overwrite the input of that name (a training
    step's new parameters): they and everything computed from them run
    after every other kernel, so nothing reads an input once overwritten.
    Results named in `first` (a loss and outputs beside their gradient) and
    what they need run before everything else; `split` says where that
    part ends, so the function can stop there (a forward-only call).
    `sum_products`: a sum of products adds them up in one buffer (see
    fusion.ProductSum); off in a scan's steps, where the forward step and
    its recomputation in a checkpointed backward must round alike, and the
    recomputation keeps each product for the reverse step.
    """
    return Scheduler(name, list(results), naming, inplace, first, sum_products).run()


class Scheduler(Placement):
    """Kernels, buffers and the workspace of one function, over the plan
    that Placement groups (see schedule)."""

    def __init__(self, name: str, results: list[tuple[str, Node]], naming: Naming, inplace: frozenset[str] = frozenset(),
                 first: frozenset[str] = frozenset(), sum_products: bool = True):
        super().__init__(results, inplace, first, sum_products)
        self.name = name
        self.naming = naming
        self.buffer_of: dict[Node, str] = {}
        self.scratch: dict[str, Shape] = {}  # buffers a kernel uses inside itself (no node's value)
        self.summed_by = {p: summed for summed in self.summed.values() for p in summed.products}
        self.summing: set[str] = set()  # the buffers of sums of products that a kernel has written
        self.extra_rows: dict[str, int] = {}  # workspace buffers given rows past their last (pad_rows)

    def claim_scratch(self, base: str, shape: Shape) -> str:
        """A workspace buffer of `shape` that a kernel writes and reads itself."""
        name = self.naming.claim(base)
        self.scratch[name] = shape
        return name

    def pad_rows(self, buffer: str, extra: int) -> None:
        """Room for `extra` rows past a workspace buffer's last, which a
        kernel may write (a loop over whole eights of examples: ops/emap.py)."""
        self.extra_rows[buffer] = max(extra, self.extra_rows.get(buffer, 0))

    def run(self) -> FunctionSchedule:
        head = len(self.place_all())
        bound = self._bind_results()
        kernels = self._kernels(self.plan[:head])
        split = None
        if self.first:  # the first results, complete: a call can stop here
            kernels += self._copies([b for b in bound if b[0] in self.first])
            split = len(kernels)
        kernels += self._kernels(self.plan[head:])
        kernels += self._copies([b for b in bound if b[0] not in self.first])
        outputs = {name for name, _ in self.results}
        buffers = {buffer: node.shape for node, buffer in self.buffer_of.items() if buffer not in outputs}
        buffers.update(self.scratch)
        for buffer, extra in self.extra_rows.items():
            rows, cols = buffers[buffer]
            buffers[buffer] = (sp.sympify(rows) + extra, cols)
        slots, work = plan_workspace(kernels, buffers)
        # a call that stops at the split keeps nothing for a backward pass: its own, tighter plan
        head_slots, head_work = plan_workspace(kernels[:split], buffers, only_written=True) if split is not None else ((), work)
        return FunctionSchedule(self.name, tuple(self.results), tuple(kernels), slots, work, split,
                                self.first, head_slots, head_work)

    def _kernels(self, steps: list[MapGroup | ExamplesGroup | Node]) -> list[Kernel]:
        kernels: list[Kernel] = []
        for step in steps:
            if isinstance(step, MapGroup):
                kernel = self._map_kernel(step)
                if kernel is not None:  # a long loop-free one from a table, or in pieces (schedule.straight)
                    table = as_table(kernel)
                    kernels += [table] if table else cut_straight(kernel, lambda base: self.claim_scratch(base, SCALAR))
            elif isinstance(step, ExamplesGroup):
                kernels.append(rule(step.members[0].op, "group_kernel")(self, step.members))
            else:
                kernels.append(self._kernel(step))
        return kernels

    # --- buffers --------------------------------------------------------

    def _stored(self, node: Node) -> bool:
        group = self.group_of.get(node)
        if group is None:
            return True
        return any((self.group_of.get(reader) or self.sum_group.get(reader)) is not group for reader in self.readers(node))

    def _bind_results(self) -> list[tuple[str, Node]]:
        """Write each result straight into its output where possible; the
        rest (leaves, views, constants, repeats) are copied at the end."""
        copies = []
        for out_name, node in self.results:
            produced = node in self.index_of and node not in self.buffer_of
            if produced:
                self.buffer_of[node] = out_name
            else:
                copies.append((out_name, node))
        holders: dict[Node, Node] = {}  # each sum's products -> the node whose buffer they share
        stored = [node for node in self._named_in_plan(holders) if node not in self.buffer_of and self._stored(node)]
        over = over_dead_inputs(self, stored)  # written over an input nothing reads after: no buffer (name) of its own
        # values first, in the order they run, then what is named after them
        for node in sorted((n for n in stored if n not in over), key=self.naming.derived):
            self.buffer_of[node] = self.naming(node)
        for node in stored:  # in the order they run: a chain takes the first one's buffer
            if node in over:
                self.buffer_of[node] = self.buffer_of[over[node]]
        for product, holder in holders.items():
            self.buffer_of[product] = self.buffer_of[holder]
        return copies

    def _named_in_plan(self, holders: dict[Node, Node]) -> list[Node]:
        """The planned nodes that may need a buffer of their own, in plan
        order, where a sum's products share one (see ProductSum): a pure
        sum's, named after it where its first product runs, or else the
        first product's; `holders` gets each product's holder."""
        named = []
        for node in self._planned():
            summed = self.summed_by.get(node)
            if summed is None:
                named.append(node)
                continue
            if node not in holders:  # the first of its sum's products to run
                holder = summed.total if summed.pure else node
                holders.update(dict.fromkeys(summed.products, holder))
                named.append(holder)
        return named

    # --- public accessors, for the builders of KERNEL_BUILDERS -------------

    def buffer(self, node: Node) -> str | None:
        """The buffer the node's value is stored in, or None (not stored)."""
        return self.buffer_of.get(node)

    def users_of(self, node: Node) -> list[Node]:
        """The nodes of this schedule that read `node`, in schedule order."""
        return list(self.users.get(node, ()))

    def _planned(self) -> list[Node]:
        """The nodes of the plan in the order the C computes them."""
        return [m for step in self.plan for m in step_nodes(step)]

    def view(self, node: Node) -> View:
        """How kernels read `node`: its buffer, or a view's strides over its argument's."""
        zero, one = sp.Integer(0), sp.Integer(1)
        if node in self.through:
            return moved_view(self.view(node.args[0]), signed_k(node), node.attrs[3], node.shape[node.attrs[0]])
        if is_view(node.op):
            return rule(node.op, "view").strides(self.view(node.args[0]), node)
        if node in self.spreads:
            return self._broadcast_view(node.args[0], node.shape)
        buffer = self.buffer_of.get(node) or self.naming(node)
        rows, cols = node.shape
        return View(buffer, zero, sp.sympify(cols) if rows != 1 else zero, one if cols != 1 else zero)

    def _broadcast_view(self, node: Node, shape: Shape) -> View:
        view = self.view(node)
        zero = sp.Integer(0)
        row = view.row_stride if node.shape[0] == shape[0] else zero
        col = view.col_stride if node.shape[1] == shape[1] else zero
        return replace(view, row_stride=row, col_stride=col)

    # --- kernels --------------------------------------------------------

    def _map_kernel(self, group: MapGroup) -> MapKernel | None:
        loads: dict[View, tuple[sp.Symbol, View, str]] = {}
        stored = [m for m in group.members if m in self.buffer_of]
        summed = [total.args[0] for total in group.sums]  # the members its column sums add up
        if not stored and not summed:
            return None
        guards: set[int] = set()
        value, program = self._member_values(group, list(dict.fromkeys(stored + summed)), loads, guards)
        exprs = [value[m, 0] for m in stored] + [value[m, 0] for m in summed]
        if program:  # large shared values are named, not inlined into each user (a tree exponential in depth)
            temps, reduced = cse_program(program, exprs)
        else:
            temps, reduced = share_powers(*dag_cse(exprs))
        load_views = tuple((sym, view) for sym, view, _ in loads.values())
        readable = {sym: sp.Symbol(label, real=True) for sym, _, label in loads.values()}  # as the loads: the same forms
        readable.update({inside(k): sp.true for k in guards})  # the equations show the middle part
        equations = map_equations([(self.buffer_of[m], value[m, 0]) for m in stored], readable)
        if group.shape != SCALAR:
            equations = tuple(Equation(e.lhs, e.text, _elementwise_latex(e)) for e in equations)
        sums_of = [(self.buffer_of[total], value[m, 0]) for total, m in zip(group.sums, summed)]
        equations += tuple(_column_sum(e) for e in map_equations(sums_of, readable))
        stores = tuple((self.buffer_of[m], e) for m, e in zip(stored, reduced))
        sums = tuple((out, e) for (out, _), e in zip(sums_of, reduced[len(stored):]))
        overwrites = {out for out, _ in stores} & {view.buffer for _, view in load_views}
        if overwrites and not group.late:  # over an input read at its own entries only (schedule.inplace)
            stores, overwrites = stores_last(stores, overwrites), set()
        if overwrites & {view.buffer for _, view in load_views if isinstance(view, ShiftedView)}:
            raise RuntimeError(f"internal: a loop reads {sorted(overwrites)} moved while it overwrites it")
        if sums and (guards or any(isinstance(view, ShiftedView) for _, view in load_views)):
            raise RuntimeError(f"internal: a loop with column sums {[out for out, _ in sums]} reads a moved vector")
        return MapKernel(group.shape, load_views, tuple(temps), stores, equations, load_first=bool(overwrites),
                         before_cse=tuple(e for _, e in program) + tuple(exprs), guards=tuple(sorted(guards)),
                         sums=sums)

    def _member_values(self, group: MapGroup, stored: list[Node], loads: dict, guards: set[int]) -> tuple[dict, list]:
        """Each member's value at the entries the stored ones need it (i - k:
        key (member, k); see schedule.shifted), over the loop's `loads`
        (key (node, k, fill) -> (symbol, view, label)) and `guards` (the k
        of each inside(k) they test), the values of the
        members it reads substituted in; a value of more than
        MAX_INLINED_OPS operations read by several members becomes a named
        value of `program` instead."""
        members = set(group.members)
        wanted: dict[Node, set[int]] = {m: {0} for m in stored}
        for member in reversed(group.members):  # which entries of each member are read, from the stored ones back
            for k in wanted.get(member, ()):
                for arg in member.args:
                    source, moved = self.source(arg)
                    if source in members:
                        wanted.setdefault(source, set()).add(k + moved)
        value: dict[tuple[Node, int], sp.Expr] = {}
        size: dict[tuple[Node, int], int] = {}
        program: list[tuple[sp.Symbol, sp.Expr]] = []
        reads: dict[Node, int] = {}
        read: dict[tuple, sp.Symbol] = {}  # each load's symbol by (node, k, fill): a matrix entry is read by hundreds
        for member in group.members:
            for arg in set(member.args):
                reads[arg] = reads.get(arg, 0) + 1
        for member in group.members:
            summed = self.summed.get(member)
            added = set(summed.products[1:]) if summed is not None else set()  # in the first's buffer: read once
            for k in sorted(wanted.get(member, ())):
                subs = {placeholder(index): sp.Integer(0) if arg in added else
                        self._read(arg, k, members, value, loads, guards, group.shape, read)
                        for index, arg in enumerate(member.args)}
                body = member.attrs[0]
                size[member, k] = len(body.args) + 1 + sum(size.get((a, k), 0) for a in member.args)
                value[member, k] = shared_xreplace(body, subs, {})  # selects as they stand: the body's own, evaluated
                if size[member, k] > MAX_INLINED_OPS and reads.get(member, 0) > 1:
                    symbol = sp.Symbol(f"_p{len(program)}", real=True)
                    program.append((symbol, value[member, k]))
                    value[member, k], size[member, k] = symbol, 0
        return value, program

    def _read(self, arg: Node, k: int, members: set[Node], value: dict, loads: dict, guards: set[int],
              shape: Shape, read: dict[tuple, sp.Symbol]) -> sp.Expr:
        """What a member at entry i - k reads of `arg`: a member's value there,
        a shift's (its argument's value k' further back, or the fill outside
        the vector), or a load (its symbol kept in `read`)."""
        source, moved = self.source(arg)
        fill = arg.attrs[3] if moved else sp.Integer(0)
        at = k + moved
        if source not in members:
            symbol = read.get((source, at, fill))
            if symbol is None:
                symbol = read[source, at, fill] = self._load(source, at, fill, loads, shape)
            return symbol
        if at == 0 or not moved:
            return value[source, at]
        guards.add(at)
        return sp.Piecewise((value[source, at], inside(at)), (fill, True))

    def _load(self, node: Node, k: int, fill: sp.Expr, loads: dict, shape: Shape) -> sp.Symbol:
        """The symbol of `node` read at entry i - k of a loop of `shape` (the
        fill outside the vector: only a shift's is ever read)."""
        view = self._broadcast_view(node, shape)
        axis = 0 if shape[0] != 1 else 1
        if k == 0 or (view.row_stride, view.col_stride)[axis] == 0:  # read where it is, or broadcast along the loop
            k, fill = 0, sp.Integer(0)
        read = moved_view(view, k, fill, shape[axis]) if k else view
        if read not in loads:  # keyed on what is read: a spread broadcast of h and h itself are one load
            loads[read] = (sp.Symbol(f"_load{len(loads)}", real=True), read, offset_label(self.label(node), k, axis))
        return loads[read][0]

    def label(self, node: Node) -> str:
        """A kernel argument as comments name it (its buffer, "A^T", "A[0,1]", "t5[i-1]")."""
        if node in self.through:
            return offset_label(self.label(node.args[0]), signed_k(node), node.attrs[0])
        if is_view(node.op):
            return rule(node.op, "view").label(self.label(node.args[0]), node)
        if node in self.spreads:  # broadcasting, as the comments' arithmetic reads
            return self.label(node.args[0])
        return self.buffer_of.get(node) or self.naming(node)

    def symbol(self, node: Node) -> sp.Basic:
        """A SymPy stand-in for a kernel's argument, named as in the C."""
        if is_view(node.op):
            return rule(node.op, "view").symbol(self.symbol(node.args[0]), node)
        name = self.buffer_of.get(node) or self.naming(node)
        return sp.Symbol(name) if node.shape == SCALAR else sp.MatrixSymbol(name, *node.shape)

    def _kernel(self, node: Node) -> Kernel:
        out = self.buffer_of[node]
        kernel = rule(node.op, "kernel")(self, node, out)
        summed = self.summed_by.get(node)
        if summed is not None:  # a product of a sum: the first to run writes, the rest add
            kernel = kernel.summed(len(summed.products), first=out not in self.summing)
            self.summing.add(out)
        return kernel

    def _copies(self, bound: list[tuple[str, Node]]) -> list[Kernel]:
        kernels: list[Kernel] = []
        for out_name, node in bound:
            if is_const(node):
                value = node.attrs[0]
                kernels.append(MapKernel(node.shape, (), (), ((out_name, value),), (equation(out_name, value),)))
                continue
            sym = sp.Symbol("_load0", real=True)
            copied = equation(out_name, sp.Symbol(self.label(node)))
            kernels.append(MapKernel(node.shape, ((sym, self.view(node)),), (), ((out_name, sym),), (copied,)))
        return kernels


def _column_sum(equation: Equation) -> Equation:
    """A loop's column sum's equation, from that of the value it adds up."""
    if equation.text == SEE_THE_C:
        return equation
    return Equation(equation.lhs, f"sum of {equation.text} down each column",
                    lambda: equation.latex.replace(" = ", r" = \sum_i \left(", 1) + r"\right)_{ij}")


def _elementwise_latex(equation: Equation) -> Callable[[], str]:
    """What writes an elementwise kernel's LaTeX, when the derivation asks."""
    return lambda: equation.latex + r" \quad \text{(elementwise)}"
