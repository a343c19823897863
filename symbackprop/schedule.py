"""Turn a DAG into kernels: fused elementwise loops, products, reductions.

Elementwise maps of one shape fuse into one loop when they share arguments
and all their inputs are ready (a forward map and its local derivative so
share one CSE'd body). A map whose every user sits in its own loop is never
stored. Everything else that is stored gets a buffer; intermediates live in
a caller-provided workspace whose slots are reused once dead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy as sp

from .cnames import sanitize
from .ir import SCALAR, Node, Shape, accumulates, binding_width, is_const, placeholder, row_placeholder, topological_order

VIEW_OPS = ("transpose", "element")
LOOP_I, LOOP_J = sp.Symbol("i", integer=True), sp.Symbol("j", integer=True)


@dataclass(frozen=True)
class View:
    """How a kernel reads a tensor: buffer[offset + i*row_stride + j*col_stride]."""

    buffer: str
    offset: sp.Expr
    row_stride: sp.Expr
    col_stride: sp.Expr

    def at(self, i: sp.Expr, j: sp.Expr) -> sp.Expr:
        return self.offset + i * self.row_stride + j * self.col_stride


@dataclass(frozen=True)
class Equation:
    """What a kernel computes, for comments (text) and the derivation (LaTeX)."""

    lhs: str
    text: str
    latex: str
    assign: str = "="  # "+=" where examples add into one place

    @property
    def comment(self) -> str:
        return f"{self.lhs} {self.assign} {self.text}"


def latex_name(name: str) -> str:
    """grad_x as dL/dx, dy_dx as dy/dx, other names as SymPy writes them."""
    if name.startswith("grad_") and len(name) > 5:
        return rf"\frac{{\partial L}}{{\partial {latex_name(name[5:])}}}"
    match = re.fullmatch(r"d([A-Za-z]\w*?)_d([A-Za-z]\w*)", name)
    if match:
        top, bottom = (latex_name(g) for g in match.groups())
        return rf"\frac{{\partial {top}}}{{\partial {bottom}}}"
    return sp.latex(sp.Symbol(name))


def latex(expr: sp.Basic) -> str:
    names = {s: latex_name(str(s.name)) for s in expr.atoms(sp.Symbol, sp.MatrixSymbol)}
    return sp.latex(expr, symbol_names=names)


def _equation(lhs: str, rhs: sp.Basic) -> Equation:
    return Equation(lhs, sp.sstr(rhs), f"{latex_name(lhs)} = {latex(rhs)}")


def _map_equation(lhs: str, value: sp.Expr, readable: dict) -> Equation:
    """A fused loop's value as an equation, or, beyond MAX_EQUATION_OPS (a
    gradient of a determinant by minors: printing them took 20 s), a
    pointer to the C's temporaries."""
    if sp.count_ops(value) > MAX_EQUATION_OPS:
        return Equation(lhs, "see the temporaries in the C", rf"{latex_name(lhs)} = \text{{see the C}}")
    return _equation(lhs, value.xreplace(readable))


@dataclass(frozen=True)
class MapKernel:
    """A fused elementwise loop: loads, CSE temporaries, stores."""

    shape: Shape
    loads: tuple[tuple[sp.Symbol, View], ...]
    temps: tuple[tuple[sp.Symbol, sp.Expr], ...]
    stores: tuple[tuple[str, sp.Expr], ...]  # (output buffer, value)
    equations: tuple[Equation, ...]
    load_first: bool = False  # it overwrites an input: read every input before any store
    kind: str = "map"


@dataclass(frozen=True)
class MatMulKernel:
    out: str
    a: View
    b: View
    m: object
    k: object
    n: object
    equations: tuple[Equation, ...]
    kind: str = "matmul"


@dataclass(frozen=True)
class ReduceKernel:
    """sum or logsumexp of `src` (rows x cols) over `axis`."""

    op: str
    out: str
    src: View
    rows: object
    cols: object
    axis: int
    equations: tuple[Equation, ...]
    kind: str = "reduce"


@dataclass(frozen=True)
class PackKernel:
    out: str
    size: object
    entries: tuple[tuple[int, View | sp.Expr], ...]  # (flat index, where the value is, or the value)
    equations: tuple[Equation, ...]
    kind: str = "pack"


@dataclass(frozen=True)
class EmapOutput:
    """One output of an EmapKernel: where each example writes its values."""

    buffer: str
    shape: Shape
    target: tuple  # the row the example writes, in load terms: (binding row, column 0)
    accumulate: bool  # several examples write one place: zeroed first, then added into


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
    kind: str = "emap"

    def reads(self) -> list[str]:
        return [view.buffer for _, view, _ in self.loads] + [check[0] for check in self.index_checks]

    def writes(self) -> list[str]:
        return [out.buffer for out in self.outputs]


Kernel = MapKernel | MatMulKernel | ReduceKernel | PackKernel | EmapKernel | Any  # Any: a kernel of KERNEL_BUILDERS

# Kernels of the ops that are neither maps nor one of the built-in ops above,
# one builder per op: builder(scheduler, node, output buffer) -> kernel. Such
# a kernel says which buffers it touches with `reads()` and `writes()`.
KERNEL_BUILDERS: dict[str, Callable[["_Scheduler", Node, str], Any]] = {}


@dataclass(frozen=True)
class Slot:
    """A buffer's place in the workspace. In the C it is written relative to
    its neighbour (`after`, or `reuses` a dead buffer's memory), so a change
    to one buffer moves no other declaration."""

    name: str
    shape: Shape
    offset: sp.Expr  # absolute, in elements
    after: str | None = None  # the new slot just before it (None: the start of work)
    reuses: str | None = None  # the dead buffer whose memory it takes over


@dataclass(frozen=True)
class FunctionSchedule:
    """A C function: its arguments, kernels in order and workspace plan."""

    name: str
    results: tuple[tuple[str, Node], ...]  # (output argument name, node)
    kernels: tuple[Kernel, ...]
    slots: tuple[Slot, ...]
    work_size: sp.Expr
    op_counts: tuple[int, int]  # scalar ops in map bodies before and after CSE
    split: int | None = None  # kernels before this compute the `first` results (see schedule)
    first: frozenset[str] = frozenset()
    head_slots: tuple[Slot, ...] = ()  # the workspace plan of a call that stops at the split
    head_work_size: sp.Expr = sp.Integer(0)

    @property
    def written_before_split(self) -> set[str]:
        """Buffers a call that stops at the split writes (also results
        beyond the first ones, computed in the same loops)."""
        return {b for k in self.kernels[:self.split] for b in kernel_writes(k)}

    @property
    def index_checks(self) -> tuple[tuple[str, object, object], ...]:
        """Every (Index buffer, its rows, rows of an array it gathers from)
        of the function's kernels, once each: the C checks them all at its
        entry, before any kernel writes (a failing call changes nothing)."""
        return tuple(dict.fromkeys(c for k in self.kernels for c in getattr(k, "index_checks", ())))


@dataclass
class _EmapGroup:
    """Per-example maps over the same examples that run in one loop."""

    index: int
    loops: tuple
    members: list[Node] = field(default_factory=list)
    late: bool = False


@dataclass
class _Group:
    """Members of one fused loop, in execution order."""

    index: int
    shape: Shape
    members: list[Node] = field(default_factory=list)
    late: bool = False  # writes over an input: runs after every other kernel


class Naming:
    """Readable, stable, unique names for nodes: the user's names where there
    are some, grad_<x> for the adjoint of x, d<y>_d<x> for the elementwise
    derivative of y with respect to x, and the rest numbered densely, t<k>
    (g<k> for an adjoint of a value that has no name), in the order the
    scheduler asks for them: only the values the C stores get a number, so
    the numbers that appear have no gaps, and an adjoint is named after its
    value only when that value has a name a reader can find."""

    def __init__(self, leaves: dict[str, Node], roots: Sequence[tuple[str, Node]], origins: dict[Node, tuple],
                 named: Sequence[tuple[str, Node]] = ()):
        self.origins = dict(origins)
        self.names: dict[Node, str] = {}
        self.taken: set[str] = set()
        self.counts: dict[str, int] = {}  # base -> the last suffix claimed for it
        self.numbers: dict[str, int] = {}  # numbered prefix (t, g) -> the last number claimed for it
        for name, node in leaves.items():
            self.names[node] = self.claim(name)
        for name, node in roots:
            if node not in self.names:
                self.names[node] = self.claim(name)
        # a forward value is a value, even where it is also a derivative (interned nodes)
        self.forward = set(topological_order([node for _, node in roots]))
        for name, node in named:  # the user's names of intermediates (Model(names=...))
            if node not in self.names and node.op not in VIEW_OPS and not is_const(node):
                self.names[node] = self.claim(name)

    def add_origins(self, origins: dict[Node, tuple]) -> None:
        """Where more derivative nodes come from (the first word stays)."""
        for node, origin in origins.items():
            self.origins.setdefault(node, origin)

    def claim(self, base: str) -> str:
        """`base` if free, else base_<k> for the first free k; "t0" (or "g0")
        is the next free t<k> (g<k>)."""
        numbered = _NUMBERED.fullmatch(base)
        if numbered:
            return self.number(numbered.group(1))
        name, count = base, 0
        if name in self.taken:  # the search resumes where the last one for this base stopped
            count = self.counts.get(base, 0)
        while name in self.taken:
            count += 1
            name = f"{base}_{count}"
        self.counts[base] = count
        self.taken.add(name)
        return name

    def number(self, prefix: str) -> str:
        """The next free <prefix><k>, k counting up from 0 per prefix."""
        count = self.numbers.get(prefix, -1)
        name = ""
        while not name or name in self.taken:
            count += 1
            name = f"{prefix}{count}"
        self.numbers[prefix] = count
        self.taken.add(name)
        return name

    def __call__(self, node: Node) -> str:
        name = self.names.get(node)
        if name is None:
            name = self.names[node] = self.claim(self._derive(node))
        return name

    def derived(self, node: Node) -> bool:
        """Whether the node's name is made from another's (an adjoint's,
        a local derivative's): those are named after the values they come from."""
        origin = self.origins.get(node)
        return origin is not None and origin[0] in ("adjoint", "part", "local") and node not in self.forward

    def _derive(self, node: Node) -> str:
        origin = self.origins.get(node)
        if origin is None or node in self.forward:
            return "t0"
        # made of names, sanitized as the C will have them (a user's "int" is int_, its adjoint grad_int)
        if origin[0] == "adjoint":
            return sanitize("grad_" + self.names[origin[1]]) if origin[1] in self.names else "g0"
        if origin[0] == "part":  # one term of the adjoint of origin[1]
            return sanitize(f"grad_{self.names[origin[1]]}_part") if origin[1] in self.names else "g0"
        if origin[0] == "local":
            _, fwd, index = origin
            arg = fwd.args[index]
            if fwd in self.names and arg in self.names:
                return sanitize(f"d{self.names[fwd]}_d{self.names[arg]}")
        return "t0"


_NUMBERED = re.compile(r"([tg])0")


def schedule(
    name: str,
    results: Sequence[tuple[str, Node]],
    naming: Naming,
    inplace: frozenset[str] = frozenset(),
    first: frozenset[str] = frozenset(),
) -> FunctionSchedule:
    """Plan one C function computing `results` (output name, node).

    Results named in `inplace` overwrite the input of that name (a training
    step's new parameters): they and everything computed from them run
    after every other kernel, so nothing reads an input once overwritten.
    Results named in `first` (a loss and outputs beside their gradient) and
    what they need run before everything else; `split` says where that
    part ends, so the function can stop there (a forward-only call).
    """
    return _Scheduler(name, list(results), naming, inplace, first).run()


class _Scheduler:
    def __init__(self, name: str, results: list[tuple[str, Node]], naming: Naming, inplace: frozenset[str] = frozenset(),
                 first: frozenset[str] = frozenset()):
        self.first = first
        self.name = name
        self.results = results
        self.naming = naming
        self.order = topological_order([node for _, node in results])
        overwriting = {node for out, node in results if out in inplace}
        self.late: set[Node] = set()  # in-place results and what is computed from them
        for node in self.order:
            if node in overwriting or any(a in self.late for a in node.args):
                self.late.add(node)
        self.users: dict[Node, list[Node]] = {node: [] for node in self.order}
        for node in self.order:
            for arg in dict.fromkeys(node.args):
                self.users[arg].append(node)
        self.plan: list[_Group | _EmapGroup | Node] = []
        self.group_of: dict[Node, _Group] = {}
        self.index_of: dict[Node, int] = {}
        self.buffer_of: dict[Node, str] = {}

    # --- grouping -------------------------------------------------------

    def run(self) -> FunctionSchedule:
        self.result_nodes = {node for _, node in self.results}
        self.deferred: set[Node] = set()
        for node in self.order:
            if node.op == "leaf" or node.op in VIEW_OPS or is_const(node):
                continue
            if node.op == "map":
                self._place_map(node)
            elif node.op == "emap":
                self._place_emap(node)
            else:
                self.index_of[node] = len(self.plan)
                self.plan.append(node)
        self.plan.sort(key=self._is_late)  # stable: the overwriting phase last
        head = self._first_steps()
        self.plan = [s for s in self.plan if id(s) in head] + [s for s in self.plan if id(s) not in head]
        bound = self._bind_results()
        counts: list[int] = [0, 0]
        kernels = self._kernels(self.plan[:len(head)], counts)
        split = None
        if self.first:  # the first results, complete: a call can stop here
            kernels += self._copies([b for b in bound if b[0] in self.first])
            split = len(kernels)
        kernels += self._kernels(self.plan[len(head):], counts)
        kernels += self._copies([b for b in bound if b[0] not in self.first])
        slots, work = self._plan_workspace(kernels)
        # a call that stops at the split keeps nothing for a backward pass: its own, tighter plan
        head_slots, head_work = self._plan_workspace(kernels[:split], only_written=True) if split is not None else ((), work)
        return FunctionSchedule(self.name, tuple(self.results), tuple(kernels), slots, work, (counts[0], counts[1]), split,
                                self.first, head_slots, head_work)

    def _kernels(self, steps: list[_Group | _EmapGroup | Node], counts: list[int]) -> list[Kernel]:
        kernels: list[Kernel] = []
        for step in steps:
            if isinstance(step, _Group):
                kernel = self._map_kernel(step, counts)
                if kernel is not None:
                    kernels.append(kernel)
            elif isinstance(step, _EmapGroup):
                kernels.append(self._emap_kernel(step.members))
            else:
                kernels.append(self._kernel(step))
        return kernels

    def _first_steps(self) -> set[int]:
        """The plan steps the `first` results need, closed under what any
        member of those steps reads (a fused loop may hold more than needed)."""
        if not self.first:
            return set()
        step_of: dict[Node, _Group | _EmapGroup | Node] = {}
        for planned in self.plan:
            for member in (planned.members if isinstance(planned, (_Group, _EmapGroup)) else [planned]):
                step_of[member] = planned
        todo = [node for out, node in self.results if out in self.first]
        chosen: set[int] = set()
        seen: set[Node] = set()
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            step: _Group | _EmapGroup | Node | None = step_of.get(node)
            members = [node] if step is None else (step.members if isinstance(step, (_Group, _EmapGroup)) else [step])
            if step is not None:
                chosen.add(id(step))
            for member in members:
                todo.extend(member.args)
                todo.append(member)
        return chosen

    def _is_late(self, step: _Group | _EmapGroup | Node) -> bool:
        return step.late if isinstance(step, (_Group, _EmapGroup)) else step in self.late

    def _place_emap(self, node: Node) -> None:
        """Join the latest loop over the same examples that can run it (its
        arguments are ready before that loop), else open a new one."""
        loops, late = node.attrs[2], node in self.late
        chosen: _EmapGroup | None = None
        for step in reversed(self.plan):
            if isinstance(step, _EmapGroup) and step.loops == loops and step.late == late:
                if all(self._ready_before(arg, step.index) for arg in node.args):
                    chosen = step
                break
        if chosen is None:
            chosen = _EmapGroup(len(self.plan), loops, late=late)
            self.plan.append(chosen)
        chosen.members.append(node)
        self.index_of[node] = chosen.index

    def _ready_before(self, node: Node, index: int) -> bool:
        base = self._base(node)
        return base.op == "leaf" or is_const(base) or self.index_of.get(base, index) < index

    def _base(self, node: Node) -> Node:
        while node.op in VIEW_OPS:
            node = node.args[0]
        return node

    def _single_use(self, node: Node) -> bool:
        users = self.users[node]
        return (
            node not in self.result_nodes
            and len(users) == 1
            and users[0].op == "map"
            and users[0].shape == node.shape
        )

    def _with_deferred(self, node: Node) -> list[Node]:
        """`node` preceded by the deferred maps it consumes, arguments first."""
        members: list[Node] = []
        for arg in node.args:
            if arg in self.deferred and arg not in members:
                members += [m for m in self._with_deferred(arg) if m not in members]
        return members + [node]

    def _place_map(self, node: Node) -> None:
        """Join the latest loop of the same shape that shares an argument and
        can run it; else, if its only user is a map of its shape, defer it into
        the user's loop; else open a new loop."""
        if self._single_use(node) and _is_cheap(node.attrs[0]):
            self.deferred.add(node)  # recomputing arithmetic in its user beats a buffer
            return
        members = self._with_deferred(node)
        args = [a for m in members for a in m.args if a not in members]
        chosen = None
        late = node in self.late
        for group in self._related_groups(args):  # the latest first
            if group.shape != node.shape or group.late != late:
                continue
            if all(self.group_of.get(a) is group or self._ready_before(a, group.index) for a in args):
                chosen = group
                break
        if chosen is None and self._single_use(node):
            self.deferred.add(node)
            return
        if chosen is None:
            chosen = _Group(len(self.plan), node.shape, late=late)
            self.plan.append(chosen)
        for member in members:
            chosen.members.append(member)
            self.group_of[member] = chosen
            self.index_of[member] = chosen.index

    def _related_groups(self, args: list[Node]) -> list[_Group]:
        """The loops that hold one of `args` or read one, latest first: only
        these can take a map (looking at every loop made scheduling
        quadratic in the number of loops)."""
        related: dict[int, _Group] = {}
        for arg in args:
            for holder in (arg, *self.users.get(arg, ())):
                group = self.group_of.get(holder)
                if group is not None:
                    related[group.index] = group
        return [related[k] for k in sorted(related, reverse=True)]

    # --- buffers --------------------------------------------------------

    def _stored(self, node: Node) -> bool:
        group = self.group_of.get(node)
        if group is None:
            return True
        return any(self.group_of.get(user) is not group for user in self.users[node])

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
        stored = [node for node in self._planned() if node not in self.buffer_of and self._stored(node)]
        # values first, in the order they run, then what is named after them
        for node in sorted(stored, key=self.naming.derived):
            self.buffer_of[node] = self.naming(node)
        return copies

    def _planned(self) -> list[Node]:
        """The nodes of the plan in the order the C computes them."""
        return [m for step in self.plan for m in (step.members if isinstance(step, (_Group, _EmapGroup)) else [step])]

    def view(self, node: Node) -> View:
        zero, one = sp.Integer(0), sp.Integer(1)
        if node.op == "transpose":
            inner = self.view(node.args[0])
            return View(inner.buffer, inner.offset, inner.col_stride, inner.row_stride)
        if node.op == "element":
            inner = self.view(node.args[0])
            i, j = node.attrs
            return View(inner.buffer, inner.at(sp.Integer(i), sp.Integer(j)), zero, zero)
        buffer = self.buffer_of.get(node) or self.naming(node)
        rows, cols = node.shape
        return View(buffer, zero, sp.sympify(cols) if rows != 1 else zero, one if cols != 1 else zero)

    def _broadcast_view(self, node: Node, shape: Shape) -> View:
        view = self.view(node)
        zero = sp.Integer(0)
        row = view.row_stride if node.shape[0] == shape[0] else zero
        col = view.col_stride if node.shape[1] == shape[1] else zero
        return View(view.buffer, view.offset, row, col)

    # --- kernels --------------------------------------------------------

    def _map_kernel(self, group: _Group, counts: list[int]) -> MapKernel | None:
        loads: dict[Node, sp.Symbol] = {}
        value, program = self._member_values(group, loads)
        stored = [m for m in group.members if m in self.buffer_of]
        if not stored:
            return None
        exprs = [value[m] for m in stored]
        if program:  # large shared values are named, not inlined into each user (a tree exponential in depth)
            temps, reduced = _cse_program(program, exprs)
            before = sum(sp.count_ops(e) for _, e in program)
        else:
            temps, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("x", real=True), order="canonical")
            before = 0
        counts[0] += before + sum(sp.count_ops(e) for e in exprs)
        counts[1] += sum(sp.count_ops(e) for _, e in temps) + sum(sp.count_ops(e) for e in reduced)
        load_views = tuple((sym, self._broadcast_view(node, group.shape)) for node, sym in loads.items())
        readable = {sym: sp.Symbol(self._label(node)) for node, sym in loads.items()}
        equations = tuple(_map_equation(self.buffer_of[m], value[m], readable) for m in stored)
        if group.shape != SCALAR:
            equations = tuple(Equation(e.lhs, e.text, e.latex + r" \quad \text{(elementwise)}") for e in equations)
        stores = tuple((self.buffer_of[m], e) for m, e in zip(stored, reduced))
        overwrites = {out for out, _ in stores} & {view.buffer for _, view in load_views}
        return MapKernel(group.shape, load_views, tuple(temps), stores, equations, load_first=bool(overwrites))

    def _member_values(self, group: _Group, loads: dict[Node, sp.Symbol]) -> tuple[dict, list]:
        """Each member's value over the loop's loads, the values of the
        members it reads substituted in; a value of more than
        MAX_INLINED_OPS operations read by several members becomes a named
        value of `program` instead."""
        value: dict[Node, sp.Expr] = {}
        size: dict[Node, int] = {}
        program: list[tuple[sp.Symbol, sp.Expr]] = []
        readers: dict[Node, int] = {}
        for member in group.members:
            for arg in set(member.args):
                readers[arg] = readers.get(arg, 0) + 1
        for member in group.members:
            subs = {}
            for index, arg in enumerate(member.args):
                if arg in value:
                    subs[placeholder(index)] = value[arg]
                else:
                    subs[placeholder(index)] = loads.setdefault(arg, sp.Symbol(f"_load{len(loads)}", real=True))
            body = member.attrs[0]
            size[member] = len(body.args) + 1 + sum(size.get(a, 0) for a in member.args)
            value[member] = body.xreplace(subs)
            if size[member] > MAX_INLINED_OPS and readers.get(member, 0) > 1:
                symbol = sp.Symbol(f"_p{len(program)}", real=True)
                program.append((symbol, value[member]))
                value[member], size[member] = symbol, 0
        return value, program

    def _label(self, node: Node) -> str:
        if node.op == "transpose":
            return self._label(node.args[0]) + "^T"
        if node.op == "element":
            i, j = node.attrs
            return f"{self._label(node.args[0])}[{i},{j}]"
        return self.buffer_of.get(node) or self.naming(node)

    def _symbol(self, node: Node) -> sp.Basic:
        """A SymPy stand-in for a kernel's argument, named as in the C."""
        if node.op == "transpose":
            return sp.Transpose(self._symbol(node.args[0]))
        if node.op == "element":
            return self._symbol(node.args[0])[node.attrs]
        name = self.buffer_of.get(node) or self.naming(node)
        return sp.Symbol(name) if node.shape == SCALAR else sp.MatrixSymbol(name, *node.shape)

    def _kernel(self, node: Node) -> Kernel:
        out = self.buffer_of[node]
        if node.op == "matmul":
            a, b = node.args
            rhs = latex(sp.MatMul(self._symbol(a), self._symbol(b)))
            equation = Equation(out, f"{self._label(a)} @ {self._label(b)}", f"{latex_name(out)} = {rhs}")
            return MatMulKernel(out, self.view(a), self.view(b), a.shape[0], a.shape[1], b.shape[1], (equation,))
        if node.op in ("sum", "logsumexp", "max", "min"):
            return self._reduce_kernel(node, out)
        if node.op == "pack":
            rows, cols = node.shape
            # a constant entry is its value: constants have no buffer
            entries = tuple(
                (i * cols + j, arg.attrs[0] if is_const(arg) else self.view(arg))
                for (i, j), arg in zip(node.attrs[0], node.args)
            )
            matrix = sp.zeros(rows, cols)
            for (i, j), arg in zip(node.attrs[0], node.args):
                matrix[i, j] = arg.attrs[0] if is_const(arg) else sp.Symbol(self._label(arg))
            return PackKernel(out, rows * cols, entries, (_equation(out, sp.ImmutableMatrix(matrix)),))
        builder = KERNEL_BUILDERS.get(node.op)
        if builder is None:
            raise AssertionError(f"no kernel for op {node.op}")
        return builder(self, node, out)

    def _reduce_kernel(self, node: Node, out: str) -> ReduceKernel:
        (src,) = node.args
        axis = node.attrs[0]
        arg = self._label(src)
        term = rf"\left({latex_name(arg)}\right)_{{ij}}"
        index = "i" if axis == 0 else "j"
        what = "down each column" if axis == 0 else "along each row"
        if node.op == "sum":
            text = f"sum of {arg} {what}"
            rhs = rf"\sum_{{{index}}} {term}"
        elif node.op in ("max", "min"):
            text = f"{node.op} of {arg} {what}"
            rhs = rf"\{node.op}_{{{index}}} {term}"
        else:
            text = f"log(sum(exp({arg}))) {what}, its max subtracted first"
            rhs = rf"\log \sum_{{{index}}} \exp {term}"
        equation = Equation(out, text, f"{latex_name(out)} = {rhs}")
        return ReduceKernel(node.op, out, self.view(src), src.shape[0], src.shape[1], axis, (equation,))

    def _emap_kernel(self, members: list[Node]) -> EmapKernel:
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
                    checks[(self.view(index).buffer, index.shape[0], arg.shape[0])] = None
                for col in range(binding_width(arg, bindings[p])):
                    if row_placeholder(p, col) not in free:
                        continue
                    key = (arg, bindings[p] if bindings[p][0] != "gather" else ("gather", node.args[bindings[p][1]]), col)
                    if key not in loads:
                        sym = loads[key] = sp.Symbol(f"_load{len(loads)}", real=True)
                        where = self._emap_where(node, bindings[p], col)
                        views.append((sym, self.view(arg), where))
                        readable[sym] = sp.Symbol(f"{self._label(arg)}[{_where_text(where)}]")
                    subs[row_placeholder(p, col)] = loads[key]
            if target[0] == "gather":
                index = node.args[target[1]]
                checks[(self.view(index).buffer, index.shape[0], node.shape[0])] = None
            member_program = [(subs[sym], e.xreplace(subs)) for sym, e in lets]
            member_bodies = [b.xreplace(subs) for b in node_bodies]
            program += member_program
            bodies.append(member_bodies)
            where = self._emap_where(node, target, 0)
            out = self.buffer_of[node]
            outputs.append(EmapOutput(out, node.shape, where, accumulates(target, loops)))
            equations.append(self._emap_equation(out, where, member_program, member_bodies, readable,
                                                 "+=" if outputs[-1].accumulate else "="))
        program, flat = _number_values(program, [b for member in bodies for b in member])
        temps, reduced = _cse_program(program, flat)
        stores, position = [], 0
        for number, member in enumerate(bodies):
            for col in range(len(member)):
                stores.append((number, col, reduced[position]))
                position += 1
        return EmapKernel(tuple(loops), tuple(views), tuple(temps), tuple(outputs), tuple(stores),
                          tuple(checks), tuple(equations))

    def _emap_equation(self, out: str, where: tuple, program: list, exprs: list, readable: dict, assign: str) -> Equation:
        row = _where_text(where).rsplit(",", 1)[0]
        lhs = f"{out}[{row}, :]" if len(exprs) > 1 else f"{out}[{_where_text(where)}]"
        size = sum(sp.count_ops(e) for e in exprs) + sum(sp.count_ops(e) for _, e in program)
        if size > MAX_SHOWN_OPS:  # the temporaries in the C are the readable form
            used = set().union(*(e.free_symbols for e in exprs), *(e.free_symbols for _, e in program))
            shown_loads = sorted(used & readable.keys(), key=str)
            sources = dict.fromkeys(re.sub(r", \d+\]$", ", :]", str(readable[s])) for s in shown_loads)
            values = f"{len(exprs)} value{'s' if len(exprs) > 1 else ''}"
            text = f"{values} from {', '.join(sources)}: see the temporaries"
            shown_latex = rf"\text{{{len(exprs)} values: see the C}}"
        else:
            inline = dict(program)
            shown = [_inline(e, inline).xreplace(readable) for e in exprs]
            text = sp.sstr(shown[0]) if len(shown) == 1 else "[" + ", ".join(map(sp.sstr, shown)) + "]"
            shown_latex = latex(sp.Matrix(shown).T if len(shown) > 1 else shown[0])
        return Equation(lhs, text, rf"{latex_name(out)} \mathrel{{{assign}}} {shown_latex}", assign)

    def _emap_where(self, node: Node, binding: tuple, col: int) -> tuple:
        """(row, column) of a binding: ("loop", a), ("gather", index buffer, a), ("const", n)."""
        if binding[0] == "row":
            return ("loop", binding[1]), ("const", col)
        if binding[0] == "gather":
            return ("gather", self.view(node.args[binding[1]]).buffer, binding[2]), ("const", col)
        if binding[0] == "cell":
            return ("loop", 0), ("loop", 1)
        return ("const", 0), ("const", col)

    def _copies(self, bound: list[tuple[str, Node]]) -> list[Kernel]:
        kernels: list[Kernel] = []
        for out_name, node in bound:
            if is_const(node):
                value = node.attrs[0]
                kernels.append(MapKernel(node.shape, (), (), ((out_name, value),), (_equation(out_name, value),)))
                continue
            sym = sp.Symbol("_load0", real=True)
            equation = _equation(out_name, sp.Symbol(self._label(node)))
            kernels.append(MapKernel(node.shape, ((sym, self.view(node)),), (), ((out_name, sym),), (equation,)))
        return kernels

    def _plan_workspace(self, kernels: list[Kernel], only_written: bool = False) -> tuple[tuple[Slot, ...], sp.Expr]:
        """Give each intermediate a workspace slot; reuse same-size slots
        whose last reader has already run. `only_written`: only the buffers
        these kernels write (a plan for the first part of a function)."""
        outputs = {name for name, _ in self.results}
        written = {b for kernel in kernels for b in kernel_writes(kernel)}
        sizes: dict[str, sp.Expr] = {}
        shapes: dict[str, Shape] = {}
        for node, buffer in self.buffer_of.items():
            if buffer not in outputs and (buffer in written or not only_written):
                sizes[buffer] = sp.sympify(node.shape[0]) * node.shape[1]
                shapes[buffer] = node.shape
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        written_at: dict[str, int] = {}  # declared in the order written (as the comments list them), not by name
        for index, kernel in enumerate(kernels):
            for buffer in kernel_writes(kernel):
                first.setdefault(buffer, index)
                written_at.setdefault(buffer, len(written_at))
            for buffer in kernel_reads(kernel):
                last[buffer] = index
        free: list[str] = []  # buffers whose last reader has run
        releases: dict[int, list[str]] = {}
        slots: list[Slot] = []
        offset_of: dict[str, sp.Expr] = {}
        end, previous = sp.Integer(0), None
        for buffer in sorted(sizes, key=lambda b: (first.get(b, 0), written_at.get(b, 0), b)):
            start = first.get(buffer, 0)
            for index in sorted(k for k in releases if k < start):
                free += releases.pop(index)
            reuse = next((gone for gone in free if sizes[gone] == sizes[buffer]), None)
            if reuse is not None:
                free.remove(reuse)
                offset_of[buffer] = offset_of[reuse]
                slots.append(Slot(buffer, shapes[buffer], offset_of[buffer], reuses=reuse))
            else:
                offset_of[buffer] = end
                end = end + sizes[buffer]
                slots.append(Slot(buffer, shapes[buffer], offset_of[buffer], after=previous))
                previous = buffer
            releases.setdefault(last.get(buffer, start), []).append(buffer)
        return tuple(slots), sp.expand(end)


# A map body with more operations than this is shown in comments by what it
# reads, not written out: its CSE'd temporaries in the C are the readable form.
MAX_SHOWN_OPS = 60
MAX_EQUATION_OPS = 500  # of a fused elementwise loop's value (_map_equation)


def _inline(expr: sp.Expr, lets: dict[sp.Symbol, sp.Expr]) -> sp.Expr:
    """`expr` with the local values of a (small) program substituted back."""
    while expr.free_symbols & lets.keys():
        expr = expr.xreplace(lets)
    return expr


def _number_values(program: list, outputs: list) -> tuple[list, list]:
    """Value numbering over a straight-line program: a value computed again
    (the forward pass inside each of several derivatives) becomes the first."""
    seen: dict[sp.Basic, sp.Symbol] = {}
    alias: dict[sp.Symbol, sp.Basic] = {}
    kept = []
    for sym, expr in program:
        expr = expr.xreplace(alias)
        if expr in seen:
            alias[sym] = seen[expr]
        else:
            seen[expr] = sym
            kept.append((sym, expr))
    return kept, [e.xreplace(alias) for e in outputs]


def _cse_program(program: list[tuple[sp.Symbol, sp.Expr]], outputs: list[sp.Expr]) -> tuple[list, list]:
    """One CSE over a straight-line program and its outputs: the common
    subexpressions and the program's own values as one list of temporaries,
    each after what it uses, named x0, x1, ... in order."""
    replacements, reduced = sp.cse([e for _, e in program] + outputs, symbols=sp.numbered_symbols("_c", real=True),
                                   order="none")
    definitions = dict(replacements)
    definitions.update({sym: e for (sym, _), e in zip(program, reduced)})
    # copies (x1 = x0) and negations of a value are substituted, not named
    copies = _copies_of(definitions)
    while any(e.free_symbols & copies.keys() for e in copies.values()):  # chains of copies: to their ends
        copies = {sym: e.xreplace(copies) for sym, e in copies.items()}
    definitions = {sym: e.xreplace(copies) for sym, e in definitions.items() if sym not in copies}
    reduced = [e.xreplace(copies) for e in reduced]
    ordered: list[sp.Symbol] = []
    placed: set[sp.Symbol] = set()

    def place(symbol: sp.Symbol) -> None:  # depth first: what it uses comes first
        stack = [(symbol, False)]
        while stack:
            sym, expanded = stack.pop()
            if sym in placed:
                continue
            if expanded:
                placed.add(sym)
                ordered.append(sym)
                continue
            stack.append((sym, True))
            for used in sorted(definitions[sym].free_symbols & definitions.keys(), key=str, reverse=True):
                if used not in placed:
                    stack.append((used, False))

    outputs = reduced[len(program):]
    position = {sym: k for k, (sym, _) in enumerate(program)}
    for expr in outputs:
        for sym in sorted(expr.free_symbols & definitions.keys(), key=lambda s: _definition_order(s, position)):
            place(sym)
    names = {sym: sp.Symbol(f"x{k}", real=True) for k, sym in enumerate(ordered)}
    temps = [(names[sym], definitions[sym].xreplace(names)) for sym in ordered]
    return temps, [e.xreplace(names) for e in outputs]


def _copies_of(definitions: dict[sp.Symbol, sp.Basic]) -> dict[sp.Symbol, sp.Basic]:
    return {sym: e for sym, e in definitions.items() if e.is_Atom or (isinstance(e, sp.Expr) and (-e).is_Atom)}


def _definition_order(symbol: sp.Symbol, position: dict[sp.Symbol, int]) -> tuple:
    """Program values in program order, CSE temporaries after them by number."""
    if symbol in position:
        return (0, position[symbol])
    return (1, int(symbol.name[2:]))


def _where_text(where: tuple) -> str:
    """(row, column) of an emap load as text: "i, 3", "cam[i], 0"."""
    def part(spec: tuple) -> str:
        if spec[0] == "loop":
            return "ij"[spec[1]]
        if spec[0] == "gather":
            return f"{spec[1]}[{'ij'[spec[2]]}]"
        return str(spec[1])
    return ", ".join(part(spec) for spec in where)


# A fused loop's value read by several of its members is substituted into
# each up to this size (an estimate: operations as a tree); beyond, it is
# named once (a determinant by minors had 87,282 operations inlined).
MAX_INLINED_OPS = 400


def _is_cheap(body: sp.Expr) -> bool:
    """Arithmetic only (no function calls, no non-integer powers)."""
    return not any(
        isinstance(sub, sp.Function) or (isinstance(sub, sp.Pow) and not sub.exp.is_Integer)
        for sub in sp.preorder_traversal(body)
    )


def kernel_writes(kernel: Kernel) -> list[str]:
    if isinstance(kernel, MapKernel):
        return [out for out, _ in kernel.stores]
    if isinstance(kernel, (MatMulKernel, ReduceKernel, PackKernel)):
        return [kernel.out]
    return list(kernel.writes())


def kernel_reads(kernel: Kernel) -> list[str]:
    if isinstance(kernel, MapKernel):
        return [view.buffer for _, view in kernel.loads]
    if isinstance(kernel, MatMulKernel):
        return [kernel.a.buffer, kernel.b.buffer]
    if isinstance(kernel, ReduceKernel):
        return [kernel.src.buffer]
    if isinstance(kernel, PackKernel):
        return [view.buffer for _, view in kernel.entries if isinstance(view, View)]
    return list(kernel.reads())


__all__ = ["FunctionSchedule", "Kernel", "Naming", "SCALAR", "schedule"]
