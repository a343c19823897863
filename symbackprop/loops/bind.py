"""What a scan's loop binds, as the kernel builders describe it to the
emitter: pointers into buffers, rows or wholes gathered into scratch, the
loops and the ScanKernel itself, and the names and bindings of a loop's
scope (InnerNames, Binder)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.ir.node import Node
from symbackprop.loops.declare import blocks, entries
from symbackprop.loops.graph import ScanStep, binding
from symbackprop.schedule.kernel import Equation, View
from symbackprop.schedule.naming import Naming
from symbackprop.schedule.scheduler import FunctionSchedule, Scheduler

STEP = sp.Symbol("_step", integer=True)  # the step t in offsets, until printed
U = sp.Symbol("_u", integer=True)  # the step within a checkpoint segment


@dataclass(frozen=True)
class Pointer:
    """A local pointer into a buffer: `name = base + offset` (offset may use STEP)."""

    name: str  # inner name
    base: str  # inner name of a local, or outer buffer (bound)
    offset: Any
    writable: bool


@dataclass(frozen=True)
class Fill:
    """Scratch `name` (of `shape`) filled from a strided view or a constant,
    before the loop (whole) or at each step (a row: view at row STEP)."""

    name: str
    base: str
    offset: Any  # in the base
    shape: tuple
    source: View | sp.Expr
    row: bool


@dataclass(frozen=True)
class Loop:
    """One pass over steps running one scheduled step graph."""

    schedule: FunctionSchedule
    region: Any  # where its slots begin in the scratch
    pointers: tuple[Pointer | Fill, ...]  # declared at each step, only if its kernels use them
    fills: tuple[Pointer | Fill, ...]  # rows gathered at each step


@dataclass(frozen=True)
class ScanKernel:
    """The loop of a scan (mode "forward") or of its backward pass ("backward")."""

    mode: str
    scope: str  # the scratch buffer: prefixes every local name
    scratch: str
    bound: tuple[tuple[str, str], ...]  # inner name -> outer buffer
    length: Any
    every: int
    width: Any
    offsets: tuple[Any, ...]
    sizes: tuple[Any, ...]
    names: dict  # the kernel's own locals: role -> inner name
    wholes: tuple[Pointer | Fill, ...]  # bound before the loop
    starts: tuple[tuple[Any, Any, View | sp.Expr, tuple], ...]  # (state offset, size, source, shape) copied in
    kept: str | None  # the buffer of kept states (rows of `width`)
    loops: tuple[Loop, ...]  # forward: (step,); backward: (recompute, step) or (step,)
    finals: tuple[tuple[str, Any, Any], ...]  # (buffer, state offset, size) copied out after the loop
    zeroed: tuple[tuple[str, Any], ...]  # accumulators set to 0 first: (buffer, size)
    equations: tuple[Equation, ...]
    reads_: tuple[str, ...]
    writes_: tuple[str, ...]
    kind: str = "scan"
    recompute_last: bool = False  # the recompute loop also runs the segment's last step (for its products)
    reverse: bool = False  # the step's rows run T-1 .. 0 (and its backward pass 0 .. T-1)
    until: tuple | None = None  # a fixed point's forward loop: (tol, entries tested, inner name of the count or None)
    count: View | None = None  # an unrolled fixed point's backward loop: the count of steps run (its length)

    def reads(self) -> tuple[str, ...]:
        return self.reads_

    def writes(self) -> tuple[str, ...]:
        return self.writes_

    title = "scan loop"

    def divides(self) -> tuple[tuple[sp.Expr, sp.Expr], ...]:
        """(rows, batch) pairs the call must check first: a batched scan
        runs rows / batch steps, which must be whole (else the last rows
        would be left unread and their outputs unwritten)."""
        return tuple(b.args for b in sp.sympify(self.length).atoms(blocks))

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): each loop over the steps runs
        its step's kernels once a step."""
        madds, ops = sp.Integer(0), sp.Integer(0)
        for loop in self.loops:
            for inner in loop.schedule.kernels:
                m, o = inner.work()
                madds, ops = madds + m, ops + o
        return sp.expand(self.length * madds), sp.expand(self.length * ops)


@dataclass(frozen=True)
class PartKernel:
    """Nothing to run: the scan's loop wrote this part. Only a comment."""

    text: str
    equations: tuple[Equation, ...] = ()
    kind: str = "scan_part"

    def reads(self) -> tuple[str, ...]:
        return ()

    def writes(self) -> tuple[str, ...]:
        return ()

    title = "scan output"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """Nothing: the loop did the work."""
        return sp.Integer(0), sp.Integer(0)


class InnerNames:
    """Names in a loop's scope: placeholders, results, the kernel's locals
    and the step's intermediates, unique among themselves; `bound` maps the
    ones that are outer buffers."""

    def __init__(self, origins: Sequence[tuple[Node, tuple]] = ()):
        self.naming = Naming({}, [], dict(origins))
        self.bound: dict[str, str] = {}

    def claim(self, base: str, node: Node | None = None, outer: str | None = None) -> str:
        name = self.naming.claim(base)
        if node is not None:
            self.naming.names[node] = name
        if outer is not None:
            self.bound[name] = outer
        return name

    def prename(self, roots: Sequence[Node]) -> None:
        """Nothing: the step's values are named as the scheduler stores them (densely)."""


def natural_layout(view: View, shape: tuple, rows: bool) -> bool:
    """Whether the view's entries lie as a contiguous row-major array would
    (for rows: whether each row is contiguous)."""
    r, c = shape
    if c != 1 and sp.sympify(view.col_stride) != 1:
        return False
    if rows or r == 1:
        return True
    return sp.sympify(view.row_stride) == (sp.sympify(c) if c != 1 else 1)


class Binder:
    """Binds a loop's arguments to names: aliases, scratch copies, constants."""

    def __init__(self, sched: Scheduler, inner: InnerNames, scratch: str, at: sp.Expr):
        self.sched, self.inner, self.scratch, self.at = sched, inner, scratch, at
        self.reads: list[str] = []

    def outer(self, arg: Node) -> View:
        view = self.sched.view(arg)
        self.reads.append(view.buffer)
        return view

    def room(self, size: sp.Expr) -> sp.Expr:
        at, self.at = self.at, sp.expand(self.at + size)
        return at

    def whole(self, placeholder_leaf: Node, arg: Node) -> Pointer | Fill:
        kind = binding(arg, rows=False)
        if kind == "alias":
            view = self.outer(arg)
            if not natural_layout(view, arg.shape, rows=False):
                raise AssertionError(f"scan: a strided view {view} was taken for contiguous")
            if sp.sympify(view.offset) == 0:
                self.inner.claim(view.buffer, placeholder_leaf, outer=view.buffer)
                return Pointer("", "", 0, False)  # nothing to declare: the outer buffer itself
            name = self.inner.claim(placeholder_leaf.attrs[0], placeholder_leaf)
            outer = self.inner.claim(view.buffer, outer=view.buffer)
            return Pointer(name, outer, view.offset, False)
        name = self.inner.claim(placeholder_leaf.attrs[0], placeholder_leaf)
        source = arg.attrs[0] if kind == "const" else self.outer(arg)
        return Fill(name, self.scratch, self.room(entries(arg.shape)), arg.shape, source, row=False)

    def rows(self, placeholder_leaf: Node, arg: Node, writable: bool = False) -> Pointer | Fill:
        """Row STEP of `arg` as the placeholder (a pointer, or a row gathered at each step)."""
        kind = binding(arg, rows=True)
        name = self.inner.claim(placeholder_leaf.attrs[0], placeholder_leaf)
        if kind == "alias":
            view = self.outer(arg)
            if not natural_layout(view, arg.shape, rows=True):
                raise AssertionError(f"scan: a strided view {view} was taken for contiguous rows")
            outer = self.inner.claim(view.buffer, outer=view.buffer)
            return Pointer(name, outer, view.offset + STEP * view.row_stride, writable)
        row_shape = (1, arg.shape[1])
        source = arg.attrs[0] if kind == "const" else self.outer(arg)
        if isinstance(source, View):
            source = View(source.buffer, source.offset + STEP * source.row_stride, 0, source.col_stride)
        return Fill(name, self.scratch, self.room(row_shape[1]), row_shape, source, row=True)


def fits(fs: FunctionSchedule, room: sp.Expr) -> FunctionSchedule:
    """The step's slots fit the room the scan node reserved for them."""
    over = sp.sympify(fs.work_size - room)
    if over.is_Number and over > 0:
        raise AssertionError(f"scan: the step needs {fs.work_size} entries of scratch, {room} were reserved")
    return fs


def part_buffers(sched: Scheduler, node: Node) -> dict[tuple[str, int], str]:
    """The buffers of the parts of a scan (or scan_vjp) node that the
    schedule reads, by (kind, index): the loop writes them."""
    buffers = {}
    for user in sched.users_of(node):
        if user.op == "scan_part":
            buffer = sched.buffer(user)
            if buffer is None:
                raise AssertionError(f"scan: a part without a buffer: {user}")
            buffers[user.attrs] = buffer
    return buffers


def state_pointers(step: ScanStep, names: Sequence[str], base: str, row: Any, writable: bool) -> list[Pointer]:
    return [Pointer(name, base, row + off, writable) for name, off in zip(names, step.offsets)]


