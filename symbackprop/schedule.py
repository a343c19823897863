"""Turn a DAG into kernels: fused elementwise loops, products, reductions.

Elementwise maps of one shape fuse into one loop when they share arguments
and all their inputs are ready (a forward map and its local derivative so
share one CSE'd body). A map whose every user sits in its own loop is never
stored. Everything else that is stored gets a buffer; intermediates live in
a caller-provided workspace whose slots are reused once dead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import sympy as sp

from .cnames import sanitize
from .cse import cse_program
from .fusion import ExamplesGroup, MapGroup, Placement
from .ir import SCALAR, Node, Shape, is_const, placeholder, topological_order
from .ops.registry import is_view, rule
from .workspace import Slot, plan_workspace

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


def equation(lhs: str, rhs: sp.Basic) -> Equation:
    return Equation(lhs, sp.sstr(rhs), f"{latex_name(lhs)} = {latex(rhs)}")


def _map_equation(lhs: str, value: sp.Expr, readable: dict) -> Equation:
    """A fused loop's value as an equation, or, beyond MAX_EQUATION_OPS (a
    gradient of a determinant by minors: printing them took 20 s), a
    pointer to the C's temporaries."""
    if sp.count_ops(value) > MAX_EQUATION_OPS:
        return Equation(lhs, "see the temporaries in the C", rf"{latex_name(lhs)} = \text{{see the C}}")
    return equation(lhs, value.xreplace(readable))


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

    def reads(self) -> list[str]:
        return [view.buffer for _, view in self.loads]

    def writes(self) -> list[str]:
        return [out for out, _ in self.stores]

    @property
    def title(self) -> str:
        return "elementwise loop" if any(self.work()) else "copy"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): its body's (after CSE) per element."""
        per = sum((sp.count_ops(e) for _, e in self.temps), sp.Integer(0))
        per += sum((sp.count_ops(e) for _, e in self.stores), sp.Integer(0))
        return sp.Integer(0), sp.sympify(self.shape[0]) * self.shape[1] * per


# A fused elementwise loop, or the kernel an op's record builds (its `kind`
# names that op; it says which buffers it touches with reads() and writes()).
Kernel = MapKernel | Any

# The kernels of the built-in ops live beside their records (symbackprop.ops);
# these names are also read from here.
_KERNEL_HOMES = {"MatMulKernel": "matmul", "ReduceKernel": "reduce", "PackKernel": "views",
                 "EmapKernel": "emap", "EmapOutput": "emap"}


def __getattr__(name: str) -> Any:
    """MatMulKernel and the other kernels of ops.*, imported on first use (the
    op modules import this one)."""
    family = _KERNEL_HOMES.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415 (lazy: the op modules import this one)

    return getattr(importlib.import_module(f".ops.{family}", __package__), name)


class _ViewOps:
    """The ops that are views, as their records say (`op in VIEW_OPS`)."""

    def __contains__(self, op: object) -> bool:
        return isinstance(op, str) and is_view(op)


VIEW_OPS = _ViewOps()


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
            if node not in self.names and not is_view(node.op) and not is_const(node):
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
    return Scheduler(name, list(results), naming, inplace, first).run()


class Scheduler(Placement):
    """Kernels, buffers and the workspace of one function, over the plan
    that Placement groups (see schedule)."""

    def __init__(self, name: str, results: list[tuple[str, Node]], naming: Naming, inplace: frozenset[str] = frozenset(),
                 first: frozenset[str] = frozenset()):
        super().__init__(results, inplace, first)
        self.name = name
        self.naming = naming
        self.buffer_of: dict[Node, str] = {}

    def run(self) -> FunctionSchedule:
        head = self.place_all()
        bound = self._bind_results()
        counts: list[int] = [0, 0]
        kernels = self._kernels(self.plan[:len(head)], counts)
        split = None
        if self.first:  # the first results, complete: a call can stop here
            kernels += self._copies([b for b in bound if b[0] in self.first])
            split = len(kernels)
        kernels += self._kernels(self.plan[len(head):], counts)
        kernels += self._copies([b for b in bound if b[0] not in self.first])
        outputs = {name for name, _ in self.results}
        buffers = {buffer: node.shape for node, buffer in self.buffer_of.items() if buffer not in outputs}
        slots, work = plan_workspace(kernels, buffers)
        # a call that stops at the split keeps nothing for a backward pass: its own, tighter plan
        head_slots, head_work = plan_workspace(kernels[:split], buffers, only_written=True) if split is not None else ((), work)
        return FunctionSchedule(self.name, tuple(self.results), tuple(kernels), slots, work, (counts[0], counts[1]), split,
                                self.first, head_slots, head_work)

    def _kernels(self, steps: list[MapGroup | ExamplesGroup | Node], counts: list[int]) -> list[Kernel]:
        kernels: list[Kernel] = []
        for step in steps:
            if isinstance(step, MapGroup):
                kernel = self._map_kernel(step, counts)
                if kernel is not None:
                    kernels.append(kernel)
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

    # --- public accessors, for the builders of KERNEL_BUILDERS -------------

    def buffer(self, node: Node) -> str | None:
        """The buffer the node's value is stored in, or None (not stored)."""
        return self.buffer_of.get(node)

    def users_of(self, node: Node) -> list[Node]:
        """The nodes of this schedule that read `node`, in schedule order."""
        return list(self.users.get(node, ()))

    def _planned(self) -> list[Node]:
        """The nodes of the plan in the order the C computes them."""
        return [m for step in self.plan for m in (step.members if isinstance(step, (MapGroup, ExamplesGroup)) else [step])]

    def view(self, node: Node) -> View:
        """How kernels read `node`: its buffer, or a view's strides over its argument's."""
        zero, one = sp.Integer(0), sp.Integer(1)
        if is_view(node.op):
            return rule(node.op, "view").strides(self.view(node.args[0]), node)
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

    def _map_kernel(self, group: MapGroup, counts: list[int]) -> MapKernel | None:
        loads: dict[Node, sp.Symbol] = {}
        value, program = self._member_values(group, loads)
        stored = [m for m in group.members if m in self.buffer_of]
        if not stored:
            return None
        exprs = [value[m] for m in stored]
        if program:  # large shared values are named, not inlined into each user (a tree exponential in depth)
            temps, reduced = cse_program(program, exprs)
            before = sum(sp.count_ops(e) for _, e in program)
        else:
            temps, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("x", real=True), order="canonical")
            before = 0
        counts[0] += before + sum(sp.count_ops(e) for e in exprs)
        counts[1] += sum(sp.count_ops(e) for _, e in temps) + sum(sp.count_ops(e) for e in reduced)
        load_views = tuple((sym, self._broadcast_view(node, group.shape)) for node, sym in loads.items())
        readable = {sym: sp.Symbol(self.label(node)) for node, sym in loads.items()}
        equations = tuple(_map_equation(self.buffer_of[m], value[m], readable) for m in stored)
        if group.shape != SCALAR:
            equations = tuple(Equation(e.lhs, e.text, e.latex + r" \quad \text{(elementwise)}") for e in equations)
        stores = tuple((self.buffer_of[m], e) for m, e in zip(stored, reduced))
        overwrites = {out for out, _ in stores} & {view.buffer for _, view in load_views}
        return MapKernel(group.shape, load_views, tuple(temps), stores, equations, load_first=bool(overwrites))

    def _member_values(self, group: MapGroup, loads: dict[Node, sp.Symbol]) -> tuple[dict, list]:
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

    def label(self, node: Node) -> str:
        """A kernel argument as comments name it (its buffer, "A^T", "A[0,1]")."""
        if is_view(node.op):
            return rule(node.op, "view").label(self.label(node.args[0]), node)
        return self.buffer_of.get(node) or self.naming(node)

    def symbol(self, node: Node) -> sp.Basic:
        """A SymPy stand-in for a kernel's argument, named as in the C."""
        if is_view(node.op):
            return rule(node.op, "view").symbol(self.symbol(node.args[0]), node)
        name = self.buffer_of.get(node) or self.naming(node)
        return sp.Symbol(name) if node.shape == SCALAR else sp.MatrixSymbol(name, *node.shape)

    def _kernel(self, node: Node) -> Kernel:
        return rule(node.op, "kernel")(self, node, self.buffer_of[node])

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

# A map body with more operations than this is shown in comments by what it
# reads, not written out: its CSE'd temporaries in the C are the readable form.
MAX_SHOWN_OPS = 60
MAX_EQUATION_OPS = 500  # of a fused elementwise loop's value (_map_equation)


# A fused loop's value read by several of its members is substituted into
# each up to this size (an estimate: operations as a tree); beyond, it is
# named once (a determinant by minors had 87,282 operations inlined).
MAX_INLINED_OPS = 400


def kernel_writes(kernel: Kernel) -> list[str]:
    return list(kernel.writes())


def kernel_reads(kernel: Kernel) -> list[str]:
    return list(kernel.reads())


__all__ = ["FunctionSchedule", "Kernel", "Naming", "SCALAR", "schedule"]
