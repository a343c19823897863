"""A scan in the IR: the step as a small graph (ScanStep, the attrs of a
"scan" node), its backward pass (ScanBack, the attrs of a "scan_vjp" node),
the "scan_part" nodes that read what a loop computes, and the scratch each
loop reserves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.base.registry import is_view
from symbackprop.ir.construct import is_const, leaf
from symbackprop.ir.node import Node, op_node, topological_order
from symbackprop.loops.declare import ceildiv, entries, is_vector
from symbackprop.schedule.workspace import ALIGN  # the room a loop needs to start its scratch on a 64-byte line


@dataclass(frozen=True)
class Until:
    """A loop that may stop early (a fixed point, loops/fixpoint.py): after
    each step, it stops when the largest absolute change of the first
    `watch` entries of the state is <= tol, or NaN; `length` is max_iter."""

    tol: float
    mode: str  # how it is differentiated: "implicit" or "unrolled" (fixpoint.MODES)
    watch: Any  # the entries of the state the test reads (from offset 0)


@dataclass(frozen=True)
class ScanStep:
    """One step as a graph over placeholder leaves (the attrs of a scan node,
    whose args are the inits, the sequences and the captured values, in
    that order)."""

    states: tuple[Node, ...]  # the state at step t
    inputs: tuple[Node, ...]  # row t of each sequence
    captures: tuple[Node, ...]  # the outer values the step reads
    next_states: tuple[Node, ...]
    outputs: tuple[Node, ...]
    every: int  # a state kept every `every` steps for the backward pass
    length: Any  # T (a fixed point's max_iter)
    reverse: bool = False  # rows T-1 .. 0 (a backward pass as a scan, loops/again.py)
    until: Until | None = None  # None: a scan, which runs `length` steps

    @property
    def sizes(self) -> tuple[sp.Expr, ...]:
        return tuple(entries(s.shape) for s in self.states)

    @property
    def offsets(self) -> tuple[sp.Expr, ...]:
        out, at = [], sp.Integer(0)
        for size in self.sizes:
            out.append(at)
            at = at + size
        return tuple(out)

    @property
    def width(self) -> sp.Expr:
        return sp.expand(sum(self.sizes, sp.Integer(0)))

    def split(self, args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
        s, x = len(self.states), len(self.inputs)
        return tuple(args[:s]), tuple(args[s:s + x]), tuple(args[s + x:])

    @property
    def segment(self) -> sp.Expr:
        """The rows of a checkpoint segment's buffers: `every`, or the steps
        where there are fewer (a 5-step sequence with every=10**6 needs 5,
        not a million); an integer min in the C for a symbolic length."""
        length = sp.sympify(self.length)
        if length.is_Integer:
            return sp.Integer(min(self.every, int(length)))
        return sp.Min(sp.Integer(self.every), length)

    def kept_rows(self) -> sp.Expr:
        return ceildiv(sp.sympify(self.length), self.every)


@dataclass(frozen=True)
class ScanBack:
    """The backward pass of a scan (the attrs of a scan_vjp node, whose args
    are the kept states, the sequences, the captures, then the adjoints of
    the outputs and of the final states that are given)."""

    step: ScanStep
    grad_next: tuple[Node, ...]  # placeholders: the adjoint of state_{t+1}, per state
    grad_outputs: tuple[tuple[int, Node], ...]  # (output, placeholder of its adjoint's row t)
    grad_finals: tuple[int, ...]  # states whose final value has an adjoint
    grad_states: tuple[Node, ...]  # the adjoint of state_t, per state
    grad_inputs: tuple[tuple[int, Node], ...]  # (input, adjoint of its row t), where needed
    accumulate: tuple[tuple[int, Node, Node], ...]  # (capture, accumulator placeholder, accumulator + adjoint)
    grad_inits: tuple[int, ...]  # states whose init needs its adjoint
    origins: tuple[tuple[Node, tuple], ...]  # for naming the backward nodes
    counted: bool = False  # a fixed point's: its last arg is the count of steps run (the loop's length)

    def split(self, args: Sequence[Node]) -> tuple[Node, tuple, tuple, tuple, tuple]:
        x, c, y = len(self.step.inputs), len(self.step.captures), len(self.grad_outputs)
        at = 1 + x + c + y
        return (args[0], tuple(args[1:1 + x]), tuple(args[1 + x:1 + x + c]),
                tuple(args[1 + x + c:at]), tuple(args[at:at + len(self.grad_finals)]))


class FreshLeaves:
    """Placeholders for a step's derivative, named apart from every leaf
    the step already has: a backward pass's own backward pass (again.py)
    would otherwise get the same placeholder (name, shape, role) for two
    different values ("grad_out0" for the adjoint it reads and the one it
    computes)."""

    def __init__(self, step: ScanStep):
        roots = step.states + step.inputs + step.captures + step.next_states + step.outputs
        self.taken = {node.attrs[0] for node in topological_order(roots) if node.op == "leaf"}

    def __call__(self, name: str, shape: tuple, role: str) -> Node:
        fresh, k = name, 1
        while fresh in self.taken:
            fresh, k = f"{name}_{k}", k + 1
        self.taken.add(fresh)
        return leaf(fresh, shape, role)


def scan_part(carrier: Node, kind: str, index: int, shape: tuple) -> Node:
    """What a scan (or scan_vjp) node computes besides its scratch: kind
    "output", "final" or "states" of a scan; "grad_init", "grad_seq" or
    "grad_capture" of a scan_vjp."""
    return op_node("scan_part", (carrier,), shape, (kind, index))


def _stored_size(roots: Sequence[Node], results: Sequence[Node] = ()) -> sp.Expr:
    """An upper bound on the scratch any schedule of these roots needs: every
    node that is not a leaf, a view, a constant or one of `results` (which
    the scheduler writes into their result buffers: they are results of
    every schedule of the step that reaches them)."""
    total, written = sp.Integer(0), set(results)
    for node in topological_order(roots):
        if node.op != "leaf" and not is_view(node.op) and not is_const(node) and node not in written:
            total += entries(node.shape)
    return sp.expand(total)


def step_scratch(step: ScanStep) -> sp.Expr:
    """The step's intermediates, whichever of its outputs are computed."""
    return _stored_size(step.next_states + step.outputs, step.next_states)


def reverse_scratch(back: ScanBack) -> sp.Expr:
    """The reverse step's intermediates (and, with checkpoints, the
    recompute step's, which runs at other times: the same memory)."""
    accumulated = tuple(n for _, _, n in back.accumulate)
    results = back.grad_states + tuple(n for _, n in back.grad_inputs) + accumulated
    size = _stored_size(results, back.grad_states + accumulated)
    if back.step.every > 1:
        size = _roomiest(step_scratch(back.step), size)
    return size


def binding(arg: Node, rows: bool) -> str:
    """How the loop reads an argument, from its structure: "alias" (in place:
    its rows, or the whole, are contiguous), "copy" (a strided view: copied
    whole before the loop, or row by row at each step) or "const"."""
    if is_const(arg):
        return "const"
    if arg.op in ("element", "reshape") or not is_view(arg.op):  # a reshape is row-major
        return "alias"
    if arg.op == "transpose":
        if rows:
            return "alias" if arg.shape[1] == 1 else "copy"
        return "alias" if is_vector(arg.shape) else "copy"
    return "copy"


def _binding_size(arg: Node, rows: bool) -> sp.Expr:
    if binding(arg, rows) == "alias":
        return sp.Integer(0)
    return sp.sympify(arg.shape[1]) if rows else entries(arg.shape)


def _forward_scratch(step: ScanStep, args: Sequence[Node]) -> sp.Expr:
    _, seqs, caps = step.split(args)
    total = 2 * step.width + step_scratch(step)
    total += sum((_binding_size(a, True) for a in seqs), sp.Integer(0))
    total += sum((_binding_size(a, False) for a in caps), sp.Integer(0))
    return sp.expand(total + ALIGN)  # the loop aligns its scratch first


def _roomiest(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    if a.is_Number and b.is_Number:
        return sp.Max(a, b)
    return a + b


def backward_scratch(back: ScanBack, args: Sequence[Node]) -> sp.Expr:
    step = back.step
    _, seqs, caps, gys, _ = back.split(args)
    total = 2 * step.width + reverse_scratch(back)
    if step.every > 1:  # a segment of states, and rows for the outputs recomputed with them
        total += step.segment * step.width + sum((entries(o.shape) for o in step.outputs), sp.Integer(0))
        cached = cached_products(back)
        if cached:  # one more state row, and the segment's products
            total += step.width + step.segment * cached_width(cached)
    total += sum((_binding_size(a, True) for a in seqs + gys), sp.Integer(0))
    total += sum((_binding_size(a, False) for a in caps), sp.Integer(0))
    total += ALIGN  # the loop aligns its scratch first
    return sp.expand(total)  # gfs: read straight into the adjoint state


def reverse_roots(back: ScanBack) -> tuple[Node, ...]:
    return back.grad_states + tuple(n for _, n in back.grad_inputs) + tuple(n for _, _, n in back.accumulate)


def cached_products(back: ScanBack) -> tuple[Node, ...]:
    """With checkpoints, the step's products (of its state or inputs) that
    the reverse step needs: the recompute loop keeps them for each step of
    the segment, so that the reverse step reads them instead of computing
    them again (the same values: the same products of the same rows)."""
    step = back.step
    if step.every <= 1:
        return ()
    varying = set(step.states) | set(step.inputs)
    for node in topological_order(step.next_states):
        if any(a in varying for a in node.args):
            varying.add(node)
    recomputed = set(topological_order(step.next_states))
    return tuple(node for node in topological_order(reverse_roots(back))
                 if node.op == "matmul" and node in recomputed and node in varying and entries(node.shape).is_Integer)


def cached_width(cached: Sequence[Node]) -> sp.Expr:
    return sp.expand(sum((entries(n.shape) for n in cached), sp.Integer(0)))


def node_offsets(nodes: Sequence[Node]) -> list[sp.Expr]:
    out, at = [], sp.Integer(0)
    for node in nodes:
        out.append(at)
        at = at + entries(node.shape)
    return out


def substitute(roots: Sequence[Node], mapping: dict[Node, Node]) -> list[Node]:
    """The graph of `roots` with the nodes of `mapping` replaced."""
    memo = dict(mapping)
    for node in topological_order(roots):
        if node in memo:
            continue
        args = tuple(memo.get(a, a) for a in node.args)
        memo[node] = node if args == node.args else op_node(node.op, args, node.shape, node.attrs)
    return [memo[r] for r in roots]


def scan_node(step: ScanStep, args: Sequence[Node]) -> Node:
    """The loop of `step`: a "scan", or a "fixed_point" when it may stop early."""
    op = "scan" if step.until is None else "fixed_point"
    return op_node(op, tuple(args), (_forward_scratch(step, args), 1), (step,))

