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
from typing import Sequence

import sympy as sp

from .ir import SCALAR, Node, Shape, is_const, placeholder, topological_order

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

    @property
    def comment(self) -> str:
        return f"{self.lhs} = {self.text}"


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


Kernel = MapKernel | MatMulKernel | ReduceKernel | PackKernel


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


@dataclass
class _Group:
    """Members of one fused loop, in execution order."""

    index: int
    shape: Shape
    members: list[Node] = field(default_factory=list)
    late: bool = False  # writes over an input: runs after every other kernel


class Naming:
    """Readable, stable, unique names for nodes: the user's names where there
    are some, t<k> for forward intermediates, grad_<x> for the adjoint of x,
    d<y>_d<x> for the elementwise derivative of y with respect to x."""

    def __init__(self, leaves: dict[str, Node], roots: Sequence[tuple[str, Node]], origins: dict[Node, tuple]):
        self.origins = dict(origins)
        self.names: dict[Node, str] = {}
        self.taken: set[str] = set()
        for name, node in leaves.items():
            self.names[node] = self.claim(name)
        for name, node in roots:
            if node not in self.names:
                self.names[node] = self.claim(name)
        for node in topological_order([node for _, node in roots]):
            if node not in self.names and node.op not in VIEW_OPS and not is_const(node):
                self.names[node] = self.claim("t0")

    def add_origins(self, origins: dict[Node, tuple]) -> None:
        """Where more derivative nodes come from (the first word stays)."""
        for node, origin in origins.items():
            self.origins.setdefault(node, origin)

    def claim(self, base: str) -> str:
        """`base` if free, else the next free t<k> (for "t0") or base_<k>."""
        numbered = base == "t0"
        name, count = base, 0
        while name in self.taken:
            count += 1
            name = f"t{count}" if numbered else f"{base}_{count}"
        self.taken.add(name)
        return name

    def __call__(self, node: Node) -> str:
        name = self.names.get(node)
        if name is None:
            name = self.names[node] = self.claim(self._derive(node))
        return name

    def _derive(self, node: Node) -> str:
        origin = self.origins.get(node)
        if origin is not None and origin[0] == "adjoint" and origin[1] in self.names:
            return "grad_" + self.names[origin[1]]
        if origin is not None and origin[0] == "local":
            _, fwd, index = origin
            arg = fwd.args[index]
            return f"d{self(fwd)}_d{self.names.get(arg, f'arg{index}')}"
        return "tmp1"


def schedule(
    name: str,
    results: Sequence[tuple[str, Node]],
    naming: Naming,
    inplace: frozenset[str] = frozenset(),
) -> FunctionSchedule:
    """Plan one C function computing `results` (output name, node).

    Results named in `inplace` overwrite the input of that name (a training
    step's new parameters): they and everything computed from them run
    after every other kernel, so nothing reads an input once overwritten.
    """
    return _Scheduler(name, list(results), naming, inplace).run()


class _Scheduler:
    def __init__(self, name: str, results: list[tuple[str, Node]], naming: Naming, inplace: frozenset[str] = frozenset()):
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
        self.plan: list[_Group | Node] = []
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
            else:
                self.index_of[node] = len(self.plan)
                self.plan.append(node)
        self.plan.sort(key=self._is_late)  # stable: the overwriting phase last
        bound = self._bind_results()
        kernels: list[Kernel] = []
        counts = [0, 0]
        for step in self.plan:
            if isinstance(step, _Group):
                kernel = self._map_kernel(step, counts)
                if kernel is not None:
                    kernels.append(kernel)
            else:
                kernels.append(self._kernel(step))
        kernels += self._copies(bound)
        slots, work = self._plan_workspace(kernels)
        return FunctionSchedule(self.name, tuple(self.results), tuple(kernels), slots, work, tuple(counts))

    def _is_late(self, step: _Group | Node) -> bool:
        return step.late if isinstance(step, _Group) else step in self.late

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
        for group in reversed([s for s in self.plan if isinstance(s, _Group)]):
            if group.shape != node.shape or group.late != late:
                continue
            related = any(a in group.members or self._feeds(a, group) for a in args)
            ready = all(a in group.members or self._ready_before(a, group.index) for a in args)
            if related and ready:
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

    def _feeds(self, arg: Node, group: _Group) -> bool:
        return any(arg in member.args for member in group.members)

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
        for node in self.index_of:
            if node not in self.buffer_of and self._stored(node):
                self.buffer_of[node] = self.naming(node)
        return copies

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
        value: dict[Node, sp.Expr] = {}
        for member in group.members:
            subs = {}
            for index, arg in enumerate(member.args):
                if arg in value:
                    subs[placeholder(index)] = value[arg]
                else:
                    subs[placeholder(index)] = loads.setdefault(arg, sp.Symbol(f"_load{len(loads)}", real=True))
            value[member] = member.attrs[0].xreplace(subs)
        stored = [m for m in group.members if m in self.buffer_of]
        if not stored:
            return None
        exprs = [value[m] for m in stored]
        temps, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("x", real=True), order="canonical")
        counts[0] += sum(sp.count_ops(e) for e in exprs)
        counts[1] += sum(sp.count_ops(e) for _, e in temps) + sum(sp.count_ops(e) for e in reduced)
        load_views = tuple((sym, self._broadcast_view(node, group.shape)) for node, sym in loads.items())
        readable = {sym: sp.Symbol(self._label(node)) for node, sym in loads.items()}
        equations = tuple(_equation(self.buffer_of[m], value[m].xreplace(readable)) for m in stored)
        if group.shape != SCALAR:
            equations = tuple(Equation(e.lhs, e.text, e.latex + r" \quad \text{(elementwise)}") for e in equations)
        stores = tuple((self.buffer_of[m], e) for m, e in zip(stored, reduced))
        overwrites = {out for out, _ in stores} & {view.buffer for _, view in load_views}
        return MapKernel(group.shape, load_views, tuple(temps), stores, equations, load_first=bool(overwrites))

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
        if node.op in ("sum", "logsumexp"):
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
        raise AssertionError(f"no kernel for op {node.op}")

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
        else:
            text = f"log(sum(exp({arg}))) {what}, its max subtracted first"
            rhs = rf"\log \sum_{{{index}}} \exp {term}"
        equation = Equation(out, text, f"{latex_name(out)} = {rhs}")
        return ReduceKernel(node.op, out, self.view(src), src.shape[0], src.shape[1], axis, (equation,))

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

    def _plan_workspace(self, kernels: list[Kernel]) -> tuple[tuple[Slot, ...], sp.Expr]:
        """Give each intermediate a workspace slot; reuse same-size slots
        whose last reader has already run."""
        outputs = {name for name, _ in self.results}
        sizes: dict[str, sp.Expr] = {}
        shapes: dict[str, Shape] = {}
        for node, buffer in self.buffer_of.items():
            if buffer not in outputs:
                sizes[buffer] = sp.sympify(node.shape[0]) * node.shape[1]
                shapes[buffer] = node.shape
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for index, kernel in enumerate(kernels):
            for buffer in kernel_writes(kernel):
                first.setdefault(buffer, index)
            for buffer in kernel_reads(kernel):
                last[buffer] = index
        free: list[str] = []  # buffers whose last reader has run
        releases: dict[int, list[str]] = {}
        slots: list[Slot] = []
        offset_of: dict[str, sp.Expr] = {}
        end, previous = sp.Integer(0), None
        for buffer in sorted(sizes, key=lambda b: (first.get(b, 0), b)):
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


def _is_cheap(body: sp.Expr) -> bool:
    """Arithmetic only (no function calls, no non-integer powers)."""
    return not any(
        isinstance(sub, sp.Function) or (isinstance(sub, sp.Pow) and not sub.exp.is_Integer)
        for sub in sp.preorder_traversal(body)
    )


def kernel_writes(kernel: Kernel) -> list[str]:
    if isinstance(kernel, MapKernel):
        return [out for out, _ in kernel.stores]
    return [kernel.out]


def kernel_reads(kernel: Kernel) -> list[str]:
    if isinstance(kernel, MapKernel):
        return [view.buffer for _, view in kernel.loads]
    if isinstance(kernel, MatMulKernel):
        return [kernel.a.buffer, kernel.b.buffer]
    if isinstance(kernel, ReduceKernel):
        return [kernel.src.buffer]
    return [view.buffer for _, view in kernel.entries if isinstance(view, View)]


__all__ = ["FunctionSchedule", "Kernel", "Naming", "SCALAR", "schedule"]
