"""Recurrence over a sequence (scan): a step declared in SymPy, run as a C loop.

    Y = symbackprop.scan(step_state, step_output, state, inp, init, sequence)

`state` (a MatrixSymbol, or a tuple of them, e.g. an LSTM's (h, c)) stands
for the state carried from step to step and `inp` for one row of
`sequence` (T x D, T a symbolic dimension bound at call time). At step t,
with state = state_t and inp = sequence[t],

    state_{t+1} = step_state           Y[t] = step_output

for t = 0 .. T-1 from state_0 = init. The step may also use the model's
inputs and params; `Y` (T x O, one row a step) is an ordinary SymPy matrix
expression for the rest of the loss, and `final_state(Y)` the state after
the last step. Vectors may be rows (1 x n) or columns (n x 1); the step's
shapes never depend on T, and neither does the generated C: the step is
scheduled once (fused, CSE'd) and emitted inside a `for` loop over t.

The pipeline, all in this module and hooked in through the registries:

- lowering (ir._MATRIX_RULES): a "scan" node whose args are the initial
  states, the sequences and the outer leaves the step reads (captures);
  its attrs hold the step as its own small graph over placeholder leaves.
  The node's own value is the loop's scratch memory; what it computes is
  read through "scan_part" nodes: the outputs, the final states, and the
  states kept for the backward pass.
- reverse mode (autodiff.rules): a "scan_vjp" node, whose kernel runs the
  loop backwards over the kept states with the step's VJP graph (the
  step's forward values are recomputed from its state, so only states are
  kept), accumulating the adjoints of the captures. With
  `checkpoint_every=k` the forward pass keeps every k-th state only
  (ceil(T/k) rows instead of T) and the backward pass recomputes each
  segment of k states from its checkpoint into a k-row buffer first,
  keeping the step's products of its state and inputs (an LSTM's gate
  products) for each step of the segment too, so that the reverse step
  reads them rather than computing them a third time.
- forward mode: the tangent of a scan is a scan over (state, tangent)
  pairs. Forward-over-reverse (hvp, hessian) through a scan is not
  supported and says so.
- kernels (schedule.KERNEL_BUILDERS, codegen.KERNEL_EMITTERS): the step's
  graph is scheduled with the ordinary scheduler; its kernels are emitted
  with buffer names scoped to the loop, inside templates/kernel_scan.c.j2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from . import ir
from . import schedule as _schedule
from .autodiff import jvp as _jvp
from .autodiff import rules
from .autodiff import vjp as _vjp
from .cnames import CNamer, comment_text
from .codegen import KERNEL_EMITTERS, LOOP_K, CKernel, FunctionEmitter, ScalarPrinter
from .errors import ModelError
from .ir import Node, const, is_const, leaf, map_, placeholder, topological_order
from .schedule import (
    KERNEL_BUILDERS,
    LOOP_I,
    LOOP_J,
    VIEW_OPS,
    Equation,
    FunctionSchedule,
    MapKernel,
    MatMulKernel,
    Naming,
    View,
    kernel_reads,
    kernel_writes,
    latex_name,
)

# --- the SymPy side ---------------------------------------------------------


class ceildiv(sp.Function):
    """ceil(n / k) for positive integers; C integer arithmetic in the C."""

    is_integer = True
    is_positive = True

    @classmethod
    def eval(cls, n: sp.Expr, k: sp.Expr) -> sp.Expr | None:
        if k == 1:
            return n
        if n.is_Integer and k.is_Integer:
            return sp.Integer(-(-int(n) // int(k)))
        return None

    def _ccode(self, printer: Any, **kwargs: Any) -> str:
        n, k = self.args
        return f"(({printer._print(n)} + {int(k) - 1})/{int(k)})"


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _shape(expr: Any) -> tuple[sp.Expr, sp.Expr]:
    if isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)):
        return (sp.sympify(expr.shape[0]), sp.sympify(expr.shape[1]))
    return (sp.Integer(1), sp.Integer(1))


def _size(shape: tuple) -> sp.Expr:
    return sp.sympify(shape[0]) * shape[1]


def _is_vector(shape: tuple) -> bool:
    return shape[0] == 1 or shape[1] == 1


def _same_layout(a: tuple, b: tuple) -> bool:
    """Equal shapes, or vectors of one length (a row and a column)."""
    return tuple(a) == tuple(b) or (_is_vector(a) and _is_vector(b) and _size(a) == _size(b))


def _name(symbol: Any) -> str:
    return str(symbol.name)


class ScanSpec(sp.Basic):
    """What `scan` was given, as one SymPy object (hashed with the model)."""

    def __new__(cls, states, inputs, next_states, outputs, inits, sequences, every) -> "ScanSpec":
        return sp.Basic.__new__(
            cls, sp.Tuple(*states), sp.Tuple(*inputs), sp.Tuple(*next_states), sp.Tuple(*outputs),
            sp.Tuple(*inits), sp.Tuple(*sequences), sp.Integer(every),
        )

    states = property(lambda self: tuple(self.args[0]))
    inputs = property(lambda self: tuple(self.args[1]))
    next_states = property(lambda self: tuple(self.args[2]))
    outputs = property(lambda self: tuple(self.args[3]))
    inits = property(lambda self: tuple(self.args[4]))
    sequences = property(lambda self: tuple(self.args[5]))
    every = property(lambda self: int(self.args[6]))

    @property
    def length(self) -> sp.Expr:
        return _shape(self.sequences[0])[0]

    def _sympystr(self, printer: Any) -> str:
        seqs = ", ".join(printer._print(s) for s in self.sequences)
        states = ", ".join(printer._print(s) for s in self.states)
        return f"scan[{states}]({seqs})"


class ScanOutput(sp.MatrixExpr):
    """The outputs of a scan: row t is the step's output at step t (T x O)."""

    def __new__(cls, spec: ScanSpec, index: int) -> "ScanOutput":
        return sp.Basic.__new__(cls, spec, sp.Integer(index))

    spec = property(lambda self: self.args[0])
    index = property(lambda self: int(self.args[1]))

    @property
    def shape(self) -> tuple:
        return (self.spec.length, _size(_shape(self.spec.outputs[self.index])))

    def _entry(self, i: Any, j: Any, **kwargs: Any) -> sp.Expr:
        return MatrixElement(self, i, j)

    @property
    def final_state(self) -> Any:
        """The state after the last step (a tuple for a tuple of states)."""
        return final_state(self)

    def _sympystr(self, printer: Any) -> str:
        return f"{printer._print(self.spec)}.outputs[{self.index}]"


class ScanFinal(sp.MatrixExpr):
    """The state after the last step of a scan (shaped like the state)."""

    def __new__(cls, spec: ScanSpec, index: int) -> "ScanFinal":
        return sp.Basic.__new__(cls, spec, sp.Integer(index))

    spec = property(lambda self: self.args[0])
    index = property(lambda self: int(self.args[1]))

    @property
    def shape(self) -> tuple:
        return _shape(self.spec.states[self.index])

    def _entry(self, i: Any, j: Any, **kwargs: Any) -> sp.Expr:
        return MatrixElement(self, i, j)

    def _sympystr(self, printer: Any) -> str:
        return f"{printer._print(self.spec)}.final[{self.index}]"


def scan(step_state: Any, step_output: Any, state: Any, inp: Any, init: Any, sequence: Any,
         checkpoint_every: int | None = None) -> Any:
    """A recurrence over the rows of `sequence`, run as a loop in the C.

    Args:
        step_state: the next state, a SymPy expression of `state`, `inp` and
            the model's inputs and params; a tuple with a tuple of states.
        step_output: the step's output (a vector, or a tuple of them), or
            None for a scan used through its final state only.
        state: MatrixSymbol (or Symbol) standing for the state; a tuple for
            several (an LSTM's h and c). Not an input or param of the model.
        inp: MatrixSymbol (or Symbol) standing for one row of `sequence`, a
            vector of D entries; a tuple, with a tuple of sequences.
        init: the state before the first step: an expression of the
            model's inputs and params shaped like `state` (a tuple likewise).
        sequence: a T x D matrix expression (usually an input); T may be a
            symbolic dimension, bound at call time.
        checkpoint_every: keep every k-th state for the backward pass and
            recompute the others (memory ~ T/k + k states instead of T);
            None keeps every state.

    Returns:
        The outputs as a (T x O) ScanOutput (a SymPy matrix expression), a
        tuple of them for a tuple of outputs, or, when step_output is None,
        the final state (see `final_state`).

    Raises:
        ModelError: mismatched lengths or shapes, a state or input that is
            not a symbol, or a bad checkpoint interval. Undeclared symbols
            in the step are reported when the model is compiled.
    """
    states, next_states, inits = _as_tuple(state), _as_tuple(step_state), _as_tuple(init)
    inputs, sequences = _as_tuple(inp), _as_tuple(sequence)
    outputs = () if step_output is None else _as_tuple(step_output)
    every = 1 if checkpoint_every is None else checkpoint_every
    if isinstance(every, bool) or not isinstance(every, (int, sp.Integer)) or int(every) < 1:
        raise ModelError(f"scan: checkpoint_every must be a positive integer or None; got {checkpoint_every!r}")
    if not states:
        raise ModelError("scan needs at least one state")
    if not sequences:
        raise ModelError("scan needs at least one sequence (its rows set the number of steps)")
    for what, symbols in (("state", states), ("inp", inputs)):
        for symbol in symbols:
            if not isinstance(symbol, (sp.MatrixSymbol, sp.Symbol)):
                raise ModelError(f"scan: {what} must be MatrixSymbols or Symbols standing for it; got {symbol!r}")
    names = [_name(s) for s in states + inputs]
    for name in names:
        if names.count(name) > 1:
            raise ModelError(f"scan: the name {name!r} is given to two of its states and inputs")
    if len(next_states) != len(states) or len(inits) != len(states):
        raise ModelError(
            f"scan: {len(states)} states need as many step_state expressions and inits; "
            f"got {len(next_states)} and {len(inits)}"
        )
    if len(sequences) != len(inputs):
        raise ModelError(f"scan: {len(inputs)} inputs need as many sequences; got {len(sequences)}")
    for symbol, nxt, start in zip(states, next_states, inits):
        want = _shape(symbol)
        if _shape(nxt) != want:
            raise ModelError(
                f"scan: the state {symbol} has shape {want} but its step_state has shape {_shape(nxt)}: {nxt}"
            )
        if not _same_layout(_shape(start), want):
            raise ModelError(f"scan: the state {symbol} has shape {want} but its init has shape {_shape(start)}")
    length = _shape(sequences[0])[0]
    for symbol, seq in zip(inputs, sequences):
        rows, cols = _shape(seq)
        if not _is_vector(_shape(symbol)) or _size(_shape(symbol)) != cols:
            raise ModelError(
                f"scan: the input {symbol} (shape {_shape(symbol)}) stands for one row of the sequence {seq} "
                f"(shape {(rows, cols)}): it must be a vector of {cols} entries"
            )
        if rows != length:
            raise ModelError(f"scan: the sequences have different numbers of rows ({length} and {rows})")
    for out in outputs:
        if not _is_vector(_shape(out)):
            raise ModelError(f"scan: a step output must be a vector (one row of the outputs); got shape {_shape(out)}")
    spec = ScanSpec(states, inputs, next_states, outputs, inits, sequences, int(every))
    if not outputs:
        return final_state(ScanFinal(spec, 0))
    results = tuple(ScanOutput(spec, k) for k in range(len(outputs)))
    return results if isinstance(step_output, (tuple, list)) else results[0]


def final_state(result: Any) -> Any:
    """The state after the last step of a scan.

    Args:
        result: what `scan` returned (one of its outputs, or a final state).

    Returns:
        A ScanFinal matrix expression shaped like the state; a tuple of them
        for a tuple of states.

    Raises:
        ModelError: `result` does not come from `scan`.
    """
    spec = getattr(result, "spec", None)
    if not isinstance(result, (ScanOutput, ScanFinal)) or not isinstance(spec, ScanSpec):
        raise ModelError(f"final_state needs the result of symbackprop.scan; got {result!r}")
    finals = tuple(ScanFinal(spec, k) for k in range(len(spec.states)))
    return finals if len(finals) > 1 else finals[0]


# --- the graph ----------------------------------------------------------------


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
    length: Any  # T

    @property
    def sizes(self) -> tuple[sp.Expr, ...]:
        return tuple(_size(s.shape) for s in self.states)

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

    def split(self, args: Sequence[Node]) -> tuple[Node, tuple, tuple, tuple, tuple]:
        x, c, y = len(self.step.inputs), len(self.step.captures), len(self.grad_outputs)
        return (args[0], tuple(args[1:1 + x]), tuple(args[1 + x:1 + x + c]),
                tuple(args[1 + x + c:1 + x + c + y]), tuple(args[1 + x + c + y:]))


def scan_part(carrier: Node, kind: str, index: int, shape: tuple) -> Node:
    """What a scan (or scan_vjp) node computes besides its scratch: kind
    "output", "final" or "states" of a scan; "grad_init", "grad_seq" or
    "grad_capture" of a scan_vjp."""
    return ir._node("scan_part", (carrier,), shape, (kind, index))


def _stored_size(roots: Sequence[Node], results: Sequence[Node] = ()) -> sp.Expr:
    """An upper bound on the scratch any schedule of these roots needs: every
    node that is not a leaf, a view, a constant or one of `results` (which
    the scheduler writes into their result buffers: they are results of
    every schedule of the step that reaches them)."""
    total, written = sp.Integer(0), set(results)
    for node in topological_order(roots):
        if node.op != "leaf" and node.op not in VIEW_OPS and not is_const(node) and node not in written:
            total += _size(node.shape)
    return sp.expand(total)


def _step_scratch(step: ScanStep) -> sp.Expr:
    """The step's intermediates, whichever of its outputs are computed."""
    return _stored_size(step.next_states + step.outputs, step.next_states)


def _reverse_scratch(back: ScanBack) -> sp.Expr:
    """The reverse step's intermediates (and, with checkpoints, the
    recompute step's, which runs at other times: the same memory)."""
    accumulated = tuple(n for _, _, n in back.accumulate)
    results = back.grad_states + tuple(n for _, n in back.grad_inputs) + accumulated
    size = _stored_size(results, back.grad_states + accumulated)
    if back.step.every > 1:
        size = _roomiest(_step_scratch(back.step), size)
    return size


def _binding(arg: Node, rows: bool) -> str:
    """How the loop reads an argument, from its structure: "alias" (in place:
    its rows, or the whole, are contiguous), "copy" (a strided view: copied
    whole before the loop, or row by row at each step) or "const"."""
    if is_const(arg):
        return "const"
    if arg.op == "element" or arg.op not in VIEW_OPS:
        return "alias"
    if arg.op == "transpose":
        if rows:
            return "alias" if arg.shape[1] == 1 else "copy"
        return "alias" if _is_vector(arg.shape) else "copy"
    return "copy"


def _binding_size(arg: Node, rows: bool) -> sp.Expr:
    if _binding(arg, rows) == "alias":
        return sp.Integer(0)
    return sp.sympify(arg.shape[1]) if rows else _size(arg.shape)


def _forward_scratch(step: ScanStep, args: Sequence[Node]) -> sp.Expr:
    _, seqs, caps = step.split(args)
    total = 2 * step.width + _step_scratch(step)
    total += sum((_binding_size(a, True) for a in seqs), sp.Integer(0))
    total += sum((_binding_size(a, False) for a in caps), sp.Integer(0))
    return sp.expand(total + ALIGN)  # the loop aligns its scratch first


def _roomiest(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    if a.is_Number and b.is_Number:
        return sp.Max(a, b)
    return a + b


def _backward_scratch(back: ScanBack, args: Sequence[Node]) -> sp.Expr:
    step = back.step
    _, seqs, caps, gys, _ = back.split(args)
    total = 2 * step.width + _reverse_scratch(back)
    if step.every > 1:  # a segment of states, and rows for the outputs recomputed with them
        total += step.every * step.width + sum((_size(o.shape) for o in step.outputs), sp.Integer(0))
        cached = _cached_products(back)
        if cached:  # one more state row, and the segment's products
            total += step.width + step.every * _cached_width(cached)
    total += sum((_binding_size(a, True) for a in seqs + gys), sp.Integer(0))
    total += sum((_binding_size(a, False) for a in caps), sp.Integer(0))
    total += ALIGN  # the loop aligns its scratch first
    return sp.expand(total)  # gfs: read straight into the adjoint state


ALIGN = 16  # entries of room for a loop to start its scratch on a 64-byte boundary (16 floats)


def _reverse_roots(back: ScanBack) -> tuple[Node, ...]:
    return back.grad_states + tuple(n for _, n in back.grad_inputs) + tuple(n for _, _, n in back.accumulate)


def _cached_products(back: ScanBack) -> tuple[Node, ...]:
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
    return tuple(node for node in topological_order(_reverse_roots(back))
                 if node.op == "matmul" and node in recomputed and node in varying and _size(node.shape).is_Integer)


def _cached_width(cached: Sequence[Node]) -> sp.Expr:
    return sp.expand(sum((_size(n.shape) for n in cached), sp.Integer(0)))


def _offsets(nodes: Sequence[Node]) -> list[sp.Expr]:
    out, at = [], sp.Integer(0)
    for node in nodes:
        out.append(at)
        at = at + _size(node.shape)
    return out


def _substitute(roots: Sequence[Node], mapping: dict[Node, Node]) -> list[Node]:
    """The graph of `roots` with the nodes of `mapping` replaced."""
    memo = dict(mapping)
    for node in topological_order(roots):
        if node in memo:
            continue
        args = tuple(memo.get(a, a) for a in node.args)
        memo[node] = node if args == node.args else ir._node(node.op, args, node.shape, node.attrs)
    return [memo[r] for r in roots]


def scan_node(step: ScanStep, args: Sequence[Node]) -> Node:
    return ir._node("scan", tuple(args), (_forward_scratch(step, args), 1), (step,))


# --- lowering -------------------------------------------------------------------


def _lower_spec(lowerer: Any, spec: ScanSpec) -> Node:
    if getattr(lowerer, "_scan_step", False):
        raise ModelError("scan: a scan inside the step of another scan is not supported")
    cache = lowerer.__dict__.setdefault("_scans", {})
    found = cache.get(spec)
    if found is None:
        found = cache[spec] = _build_scan(lowerer, spec)
    return found


def _build_scan(lowerer: Any, spec: ScanSpec) -> Node:
    outer: dict = lowerer.leaves
    outer_names = {_name(sym) for sym in outer}
    for sym in spec.states + spec.inputs:
        if sym in outer or _name(sym) in outer_names:
            raise ModelError(
                f"scan: {sym} stands for the scan's state or input and cannot also be an input or param of the model"
            )
    inits = [lowerer.lower(e) for e in spec.inits]
    seqs = [lowerer.lower(e) for e in spec.sequences]
    state_leaves = {sym: leaf(_name(sym), ir.shape_of(sym), "scan_state") for sym in spec.states}
    input_leaves = {sym: leaf(_name(sym), ir.shape_of(sym), "scan_input") for sym in spec.inputs}
    capture_leaves = {sym: leaf(_name(sym), node.shape, "scan_capture") for sym, node in outer.items()}
    for sym, init in zip(spec.states, inits):
        if not _same_layout(init.shape, state_leaves[sym].shape):
            raise ModelError(f"scan: the state {sym} has shape {state_leaves[sym].shape} but its init has shape "
                             f"{init.shape}")
    length = seqs[0].shape[0]
    for sym, seq in zip(spec.inputs, seqs):
        if seq.shape[0] != length:
            raise ModelError(f"scan: the sequences have different numbers of rows ({length} and {seq.shape[0]})")
        if _size(input_leaves[sym].shape) != seq.shape[1]:
            raise ModelError(f"scan: the input {sym} has {_size(input_leaves[sym].shape)} entries but the rows of "
                             f"its sequence have {seq.shape[1]}")
    sub = ir._Lowerer({**capture_leaves, **state_leaves, **input_leaves}, tuple(lowerer.dims))
    sub._scan_step = True  # type: ignore[attr-defined]
    allowed = ", ".join(_name(s) for s in spec.states + spec.inputs)
    try:
        next_states = tuple(sub.lower(e) for e in spec.next_states)
        outputs = tuple(sub.lower(e) for e in spec.outputs)
    except ModelError as exc:
        if "a scan inside the step" in str(exc):
            raise
        raise ModelError(f"in the step of a scan (which may use {allowed} and the model's inputs and params): "
                         f"{exc}") from None
    for sym, nxt in zip(spec.states, next_states):
        if nxt.shape != state_leaves[sym].shape:
            raise ModelError(f"scan: the state {sym} has shape {state_leaves[sym].shape} but its step_state has "
                             f"shape {nxt.shape}")
    for out in outputs:
        if not _is_vector(out.shape):
            raise ModelError(f"scan: a step output must be a vector; got shape {out.shape}")
    order = topological_order(next_states + outputs)
    if any(node.op in ("scan", "scan_vjp") for node in order):
        raise ModelError("scan: a scan inside the step of another scan is not supported")
    reached = set(order)
    captured = [(sym, c) for sym, c in capture_leaves.items() if c in reached]
    step = ScanStep(
        states=tuple(state_leaves.values()),
        inputs=tuple(input_leaves.values()),
        captures=tuple(c for _, c in captured),
        next_states=next_states,
        outputs=outputs,
        every=spec.every,
        length=length,
    )
    return scan_node(step, inits + seqs + [outer[sym] for sym, _ in captured])


def _lower_output(lowerer: Any, expr: ScanOutput) -> Node:
    carrier = _lower_spec(lowerer, expr.spec)
    step: ScanStep = carrier.attrs[0]
    out = step.outputs[expr.index]
    return scan_part(carrier, "output", expr.index, (step.length, _size(out.shape)))


def _lower_final(lowerer: Any, expr: ScanFinal) -> Node:
    carrier = _lower_spec(lowerer, expr.spec)
    step: ScanStep = carrier.attrs[0]
    return scan_part(carrier, "final", expr.index, step.states[expr.index].shape)


ir._MATRIX_RULES[ScanOutput] = _lower_output
ir._MATRIX_RULES[ScanFinal] = _lower_final


# --- derivatives ----------------------------------------------------------------

NO_SECOND_ORDER = (
    "forward-over-reverse differentiation (hvp, hessian) through a scan is not supported; "
    "use value_and_grad, vjp or jvp"
)


def _part_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    kind, index = node.attrs
    if kind not in ("output", "final"):
        raise ModelError(f"scan: the {kind} of a scan cannot be differentiated ({NO_SECOND_ORDER})")
    carrier = node.args[0]
    return (ir._node("scan_seed", (g,), carrier.shape, (kind, index)),)


def _part_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    kind, index = node.attrs
    tangent = tangents[0]
    if tangent is None:
        return None
    if kind not in ("output", "final"):
        raise ModelError(NO_SECOND_ORDER)
    step: ScanStep = node.args[0].attrs[0]
    shift = len(step.outputs) if kind == "output" else len(step.states)
    return scan_part(tangent, kind, index + shift, node.shape)


def _seeds(g: Node) -> dict[tuple[str, int], Node]:
    """The adjoints of a scan's parts, from the sum autodiff made of them."""
    parts = [g] if g.op == "scan_seed" else list(g.args)
    if g.op != "scan_seed" and (g.op != "map" or g.attrs[0] != sp.Add(*[placeholder(i) for i in range(len(parts))])):
        raise AssertionError(f"unexpected adjoint of a scan: {g}")
    seeds: dict[tuple[str, int], Node] = {}
    for part in parts:
        if part.op != "scan_seed":
            raise AssertionError(f"unexpected adjoint of a scan: {part}")
        seeds[part.attrs] = part.args[0]
    return seeds


def _scan_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    seeds = _seeds(g)
    n_states, n_inputs = len(step.states), len(step.inputs)
    grad_next = tuple(leaf(f"grad_{s.attrs[0]}_next", s.shape, "scan_adjoint") for s in step.states)
    grad_outputs = tuple(
        (o, leaf(f"grad_out{o}", out.shape, "scan_adjoint"))
        for o, out in enumerate(step.outputs) if ("output", o) in seeds
    )
    roots = [(nxt, gn) for nxt, gn in zip(step.next_states, grad_next)]
    roots += [(step.outputs[o], gy) for o, gy in grad_outputs]
    want_inputs = [j for j in range(n_inputs) if needed[n_states + j]]
    want_caps = [m for m in range(len(caps)) if needed[n_states + n_inputs + m]]
    wrt = list(step.states) + [step.inputs[j] for j in want_inputs] + [step.captures[m] for m in want_caps]
    grads, origins = _vjp(roots, wrt)
    grad_states = tuple(grads[:n_states])
    grad_inputs = tuple(
        (j, g_) for j, g_ in zip(want_inputs, grads[n_states:n_states + len(want_inputs)]) if not _zero(g_)
    )
    accumulate = []
    for m, g_ in zip(want_caps, grads[n_states + len(want_inputs):]):
        if _zero(g_):
            continue
        cap = step.captures[m]
        acc = leaf(f"grad_{cap.attrs[0]}", cap.shape, "scan_accumulator")
        accumulate.append((m, acc, map_(placeholder(0) + placeholder(1), [acc, g_], cap.shape)))
    grad_finals = tuple(i for i in range(n_states) if ("final", i) in seeds)
    back = ScanBack(
        step=step,
        grad_next=grad_next,
        grad_outputs=grad_outputs,
        grad_finals=grad_finals,
        grad_states=grad_states,
        grad_inputs=grad_inputs,
        accumulate=tuple(accumulate),
        grad_inits=tuple(i for i in range(n_states) if needed[i]),
        origins=tuple(origins.items()),
    )
    kept = scan_part(node, "states", 0, (step.kept_rows(), step.width))
    args = (kept, *seqs, *caps, *[seeds[("output", o)] for o, _ in grad_outputs],
            *[seeds[("final", i)] for i in grad_finals])
    backward = ir._node("scan_vjp", args, (_backward_scratch(back, args), 1), (back,))
    adjoints: list[Node | None] = [scan_part(backward, "grad_init", i, inits[i].shape) if needed[i] else None
                                   for i in range(n_states)]
    have_inputs = {j for j, _ in back.grad_inputs}
    adjoints += [scan_part(backward, "grad_seq", j, seqs[j].shape) if j in have_inputs else None
                 for j in range(n_inputs)]
    have_caps = {m for m, _, _ in back.accumulate}
    adjoints += [scan_part(backward, "grad_capture", m, caps[m].shape) if m in have_caps else None
                 for m in range(len(caps))]
    return tuple(adjoints)


def _zero(node: Node) -> bool:
    return is_const(node) and node.attrs[0] == 0


def _scan_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """The tangent of a scan is a scan over (state, tangent) pairs; its
    parts "output" len(outputs)+o and "final" len(states)+i are the tangents
    of output o and final state i (see _part_jvp)."""
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    t_inits, t_seqs, t_caps = step.split(list(tangents))
    d_states = tuple(leaf(f"d{s.attrs[0]}", s.shape, "scan_tangent") for s in step.states)
    given = {s: d for s, d in zip(step.states, d_states)}
    d_inputs, d_seqs = [], []
    for x, seq, t in zip(step.inputs, seqs, t_seqs):
        if t is not None:
            d = leaf(f"d{x.attrs[0]}", x.shape, "scan_tangent")
            given[x] = d
            d_inputs.append(d)
            d_seqs.append(t)
    d_caps, d_cap_args = [], []
    for c, t in zip(step.captures, t_caps):
        if t is not None:
            d = leaf(f"d{c.attrs[0]}", c.shape, "scan_tangent_capture")
            given[c] = d
            d_caps.append(d)
            d_cap_args.append(t)
    roots = step.next_states + step.outputs
    derived = _jvp(list(roots), given)
    augmented = ScanStep(
        states=step.states + d_states,
        inputs=step.inputs + tuple(d_inputs),
        captures=step.captures + tuple(d_caps),
        next_states=step.next_states + tuple(derived[:len(step.states)]),
        outputs=step.outputs + tuple(derived[len(step.states):]),
        every=step.every,
        length=step.length,
    )
    d_inits = [t if t is not None else const(0, init.shape) for init, t in zip(inits, t_inits)]
    args = (*inits, *d_inits, *seqs, *d_seqs, *caps, *d_cap_args)
    return scan_node(augmented, args)


def _unsupported_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    raise ModelError(f"scan: {node.op} cannot be differentiated again ({NO_SECOND_ORDER})")


def _unsupported_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    raise ModelError(NO_SECOND_ORDER)


rules("scan", _scan_vjp, _scan_jvp)
rules("scan_part", _part_vjp, _part_jvp)
rules("scan_vjp", _unsupported_vjp, _unsupported_jvp)
rules("scan_seed", _unsupported_vjp, _unsupported_jvp)


# --- kernels --------------------------------------------------------------------

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

    def reads(self) -> tuple[str, ...]:
        return self.reads_

    def writes(self) -> tuple[str, ...]:
        return self.writes_


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


class _Inner:
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


def _natural(view: View, shape: tuple, rows: bool) -> bool:
    """Whether the view's entries lie as a contiguous row-major array would
    (for rows: whether each row is contiguous)."""
    r, c = shape
    if c != 1 and sp.sympify(view.col_stride) != 1:
        return False
    if rows or r == 1:
        return True
    return sp.sympify(view.row_stride) == (sp.sympify(c) if c != 1 else 1)


class _Binder:
    """Binds a loop's arguments to names: aliases, scratch copies, constants."""

    def __init__(self, sched: Any, inner: _Inner, scratch: str, at: sp.Expr):
        self.sched, self.inner, self.scratch, self.at = sched, inner, scratch, at
        self.reads: list[str] = []

    def _outer(self, arg: Node) -> View:
        view = self.sched.view(arg)
        self.reads.append(view.buffer)
        return view

    def _room(self, size: sp.Expr) -> sp.Expr:
        at, self.at = self.at, sp.expand(self.at + size)
        return at

    def whole(self, placeholder_leaf: Node, arg: Node) -> Pointer | Fill:
        kind = _binding(arg, rows=False)
        if kind == "alias":
            view = self._outer(arg)
            if not _natural(view, arg.shape, rows=False):
                raise AssertionError(f"scan: a strided view {view} was taken for contiguous")
            if sp.sympify(view.offset) == 0:
                self.inner.claim(view.buffer, placeholder_leaf, outer=view.buffer)
                return Pointer("", "", 0, False)  # nothing to declare: the outer buffer itself
            name = self.inner.claim(placeholder_leaf.attrs[0], placeholder_leaf)
            outer = self.inner.claim(view.buffer, outer=view.buffer)
            return Pointer(name, outer, view.offset, False)
        name = self.inner.claim(placeholder_leaf.attrs[0], placeholder_leaf)
        source = arg.attrs[0] if kind == "const" else self._outer(arg)
        return Fill(name, self.scratch, self._room(_size(arg.shape)), arg.shape, source, row=False)

    def rows(self, placeholder_leaf: Node, arg: Node, writable: bool = False) -> Pointer | Fill:
        """Row STEP of `arg` as the placeholder (a pointer, or a row gathered at each step)."""
        kind = _binding(arg, rows=True)
        name = self.inner.claim(placeholder_leaf.attrs[0], placeholder_leaf)
        if kind == "alias":
            view = self._outer(arg)
            if not _natural(view, arg.shape, rows=True):
                raise AssertionError(f"scan: a strided view {view} was taken for contiguous rows")
            outer = self.inner.claim(view.buffer, outer=view.buffer)
            return Pointer(name, outer, view.offset + STEP * view.row_stride, writable)
        row_shape = (1, arg.shape[1])
        source = arg.attrs[0] if kind == "const" else self._outer(arg)
        if isinstance(source, View):
            source = View(source.buffer, source.offset + STEP * source.row_stride, 0, source.col_stride)
        return Fill(name, self.scratch, self._room(row_shape[1]), row_shape, source, row=True)


def _fits(fs: FunctionSchedule, room: sp.Expr) -> FunctionSchedule:
    """The step's slots fit the room the scan node reserved for them."""
    over = sp.sympify(fs.work_size - room)
    if over.is_Number and over > 0:
        raise AssertionError(f"scan: the step needs {fs.work_size} entries of scratch, {room} were reserved")
    return fs


def _parts(sched: Any, node: Node) -> dict[tuple[str, int], str]:
    return {user.attrs: sched.buffer_of[user] for user in sched.users[node] if user.op == "scan_part"}


def _state_pointers(step: ScanStep, names: Sequence[str], base: str, row: Any, writable: bool) -> list[Pointer]:
    return [Pointer(name, base, row + off, writable) for name, off in zip(names, step.offsets)]


def _states_text(step: ScanStep) -> str:
    return ", ".join(s.attrs[0] for s in step.states)


def _build_forward(sched: Any, node: Node, out: str) -> ScanKernel:
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    parts = _parts(sched, node)
    inner = _Inner()
    names = {role: inner.claim(role) for role in ("t", "cur", "nxt", "swap", "i", "j", "base")}
    scratch = inner.claim(out, outer=out)
    width = step.width
    binder = _Binder(sched, inner, scratch, 2 * width + _step_scratch(step))
    state_names = [inner.claim(s.attrs[0], s) for s in step.states]
    next_names = [inner.claim(f"{s.attrs[0]}_next") for s in step.states]
    wholes = [binder.whole(c, a) for c, a in zip(step.captures, caps)]
    step_fills: list[Pointer | Fill] = []
    pointers: list[Pointer | Fill] = []
    for x, seq in zip(step.inputs, seqs):
        bound = binder.rows(x, seq)
        (pointers if isinstance(bound, Pointer) else step_fills).append(bound)
    results = list(zip(next_names, step.next_states))
    writes = [out]
    for o, root in enumerate(step.outputs):
        buffer = parts.get(("output", o))
        if buffer is None:
            continue
        row = inner.claim(f"{buffer}_row")
        outer = inner.claim(buffer, outer=buffer)
        pointers.append(Pointer(row, outer, STEP * _size(root.shape), True))
        results.append((row, root))
        writes.append(buffer)
    pointers += _state_pointers(step, state_names, names["cur"], 0, False)
    pointers += _state_pointers(step, next_names, names["nxt"], 0, True)
    inner.prename([root for _, root in results])
    fs = _fits(_schedule.schedule(f"{out} step", results, inner.naming), _step_scratch(step))
    kept = parts.get(("states", 0))
    if kept is not None:
        kept = inner.claim(kept, outer=kept)
        writes.append(inner.bound[kept])
    finals = []
    for (kind, index), buffer in parts.items():
        if kind == "final":
            finals.append((inner.claim(buffer, outer=buffer), step.offsets[index], step.sizes[index]))
            writes.append(buffer)
    starts = []
    for off, size, init, s in zip(step.offsets, step.sizes, inits, step.states):
        source = init.attrs[0] if is_const(init) else binder._outer(init)
        starts.append((off, size, source, init.shape))
    outputs = [parts[("output", o)] for o in range(len(step.outputs)) if ("output", o) in parts]
    text = (f"scan over {names['t']} < {step.length}: ({_states_text(step)}) = step({_states_text(step)}, "
            f"{', '.join(x.attrs[0] for x in step.inputs)} = row {names['t']})"
            + (f"; outputs in rows of {', '.join(outputs)}" if outputs else "")
            + (f"; one state in {step.every} kept in {inner.bound[kept]}" if kept and step.every > 1 else "")
            + (f"; states kept in {inner.bound[kept]}" if kept and step.every == 1 else ""))
    made = "".join(rf", \ {latex_name(o)}_t" for o in outputs)
    latex = (rf"({_states_text(step)})_{{t+1}}{made} = \mathrm{{step}}(({_states_text(step)})_t, x_t)"
             rf" \quad \text{{for }} t < {sp.latex(step.length)}")
    return ScanKernel(
        mode="forward", scope=out, scratch=scratch, bound=tuple(inner.bound.items()), length=step.length,
        every=step.every, width=width, offsets=step.offsets, sizes=step.sizes, names=names,
        wholes=tuple(w for w in wholes if w.name), starts=tuple(starts), kept=kept,
        loops=(Loop(fs, 2 * width, tuple(pointers), tuple(step_fills)),),
        finals=tuple(finals), zeroed=(), equations=(Equation(out, text, latex),),
        reads_=tuple(dict.fromkeys(binder.reads)), writes_=tuple(dict.fromkeys(writes)),
    )


def _build_backward(sched: Any, node: Node, out: str) -> ScanKernel:
    back: ScanBack = node.attrs[0]
    step = back.step
    kept_arg, seqs, caps, gys, gfs = back.split(node.args)
    parts = _parts(sched, node)
    inner = _Inner(back.origins)
    roles = ["t", "cur", "nxt", "swap", "i", "j", "base"] + (["seg", "s", "t0", "len", "u"] if step.every > 1 else [])
    names = {role: inner.claim(role) for role in roles}
    scratch = inner.claim(out, outer=out)
    width, every = step.width, step.every
    cached = _cached_products(back)
    cached_at = 2 * width + (every + 1) * width  # the products of the segment's steps, after its states
    cached_offsets = [cached_at + off for off in _offsets(cached)]
    cw = _cached_width(cached)
    region = 2 * width + (every * width if every > 1 else 0) + (width + every * cw if cached else 0)
    binder = _Binder(sched, inner, scratch, region + _reverse_scratch(back))
    state_names = [inner.claim(s.attrs[0], s) for s in step.states]
    kept_view = binder._outer(kept_arg)
    kept = inner.claim(kept_view.buffer, outer=kept_view.buffer)
    wholes = [binder.whole(c, a) for c, a in zip(step.captures, caps)]
    row_pointers: list[Pointer | Fill] = []
    row_fills: list[Pointer | Fill] = []
    for x, seq in zip(step.inputs, seqs):
        bound = binder.rows(x, seq)
        (row_pointers if isinstance(bound, Pointer) else row_fills).append(bound)
    # the recompute loop of a segment: state u-1 -> state u, inputs at row t = t0 + u - 1
    loops = []
    if every > 1:
        next_names = [inner.claim(f"{s.attrs[0]}_next") for s in step.states]
        pointers = list(row_pointers)
        pointers += _state_pointers(step, state_names, names["seg"], (U - 1) * width, False)
        pointers += _state_pointers(step, next_names, names["seg"], U * width, True)
        results = list(zip(next_names, step.next_states))
        # the outputs the forward loop computed too (into a scratch row), so
        # that the recomputed states are the forward's to the last bit
        computed = _parts(sched, kept_arg.args[0])
        for o, root in enumerate(step.outputs):
            if ("output", o) in computed:
                row = inner.claim(f"out{o}_row")
                pointers.append(Pointer(row, scratch, binder._room(_size(root.shape)), True))
                results.append((row, root))
        inner.prename([root for _, root in results])
        for product, at in zip(cached, cached_offsets):
            name = inner.claim(f"{inner.naming(product)}_kept")
            pointers.append(Pointer(name, scratch, at + (U - 1) * cw, True))
            results.append((name, product))
        fs = _fits(_schedule.schedule(f"{out} recompute", results, inner.naming), _reverse_scratch(back))
        loops.append(Loop(fs, region, tuple(pointers), tuple(row_fills)))
    # the reverse loop
    grad_next = [inner.claim(g.attrs[0], g) for g in back.grad_next]
    grad_state = [inner.claim(f"grad_{s.attrs[0]}") for s in step.states]
    pointers = list(row_pointers)
    fills = list(row_fills)
    state_row = (U * width) if every > 1 else STEP * width
    pointers += _state_pointers(step, state_names, names["seg"] if every > 1 else kept, state_row, False)
    pointers += _state_pointers(step, grad_next, names["cur"], 0, False)
    pointers += _state_pointers(step, grad_state, names["nxt"], 0, True)
    kept_leaves = {}
    for product, at in zip(cached, cached_offsets):
        kept_leaf = leaf(f"{inner.naming(product)}_kept", product.shape, "scan_kept")
        kept_leaves[product] = kept_leaf
        pointers.append(Pointer(inner.claim(kept_leaf.attrs[0], kept_leaf), scratch, at + U * cw, False))
    roots = _substitute(_reverse_roots(back), kept_leaves)
    n_states, n_inputs = len(back.grad_states), len(back.grad_inputs)
    grad_states = roots[:n_states]
    grad_inputs = [(j, g) for (j, _), g in zip(back.grad_inputs, roots[n_states:n_states + n_inputs])]
    totals = roots[n_states + n_inputs:]
    results = list(zip(grad_state, grad_states))
    for (o, gy_leaf), gy in zip(back.grad_outputs, gys):
        bound = binder.rows(gy_leaf, gy)
        (pointers if isinstance(bound, Pointer) else fills).append(bound)
    writes = [out]
    for j, grad in grad_inputs:
        buffer = parts.get(("grad_seq", j))
        if buffer is None:
            continue
        row = inner.claim(f"{buffer}_row")
        outer = inner.claim(buffer, outer=buffer)
        pointers.append(Pointer(row, outer, STEP * seqs[j].shape[1], True))
        results.append((row, grad))
        writes.append(buffer)
    zeroed = []
    for (m, acc, _), total in zip(back.accumulate, totals):
        buffer = parts.get(("grad_capture", m))
        if buffer is None:
            continue
        name = inner.claim(buffer, acc, outer=buffer)
        results.append((name, total))
        zeroed.append((name, _size(acc.shape)))
        writes.append(buffer)
    inner.prename(list(step.next_states) + list(step.outputs))
    inner.prename([root for _, root in results])
    fs = _fits(_schedule.schedule(f"{out} reverse", results, inner.naming), _reverse_scratch(back))
    loops.append(Loop(fs, region, tuple(pointers), tuple(fills)))
    starts = []
    for i, gf in zip(back.grad_finals, gfs):
        source = gf.attrs[0] if is_const(gf) else binder._outer(gf)
        starts.append((step.offsets[i], step.sizes[i], source, gf.shape))
    have = set(back.grad_finals)
    for i in range(len(step.states)):
        if i not in have:
            starts.append((step.offsets[i], step.sizes[i], sp.Integer(0), step.states[i].shape))
    finals = []
    for (kind, index), buffer in parts.items():
        if kind == "grad_init":
            finals.append((inner.claim(buffer, outer=buffer), step.offsets[index], step.sizes[index]))
            writes.append(buffer)
    text = (f"backward scan over {names['t']} = {step.length}-1 .. 0: adjoints of ({_states_text(step)}) and of "
            f"the step's inputs and params, from the states kept in {kept_view.buffer}"
            + (f", each segment of {every} steps recomputed from its checkpoint" if every > 1 else ""))
    latex = (rf"\bar{{s}}_t = \bar{{s}}_{{t+1}} \frac{{\partial s_{{t+1}}}}{{\partial s_t}} + \bar{{y}}_t "
             rf"\frac{{\partial y_t}}{{\partial s_t}} \quad \text{{for }} t = {sp.latex(step.length)}-1, \ldots, 0")
    return ScanKernel(
        mode="backward", scope=out, scratch=scratch, bound=tuple(inner.bound.items()), length=step.length,
        every=every, width=width, offsets=step.offsets, sizes=step.sizes, names=names,
        wholes=tuple(w for w in wholes if w.name), starts=tuple(starts), kept=kept, loops=tuple(loops),
        finals=tuple(finals), zeroed=tuple(zeroed), equations=(Equation(out, text, latex),),
        reads_=tuple(dict.fromkeys(binder.reads)), writes_=tuple(dict.fromkeys(writes)),
        recompute_last=bool(cached),
    )


def _build_part(sched: Any, node: Node, out: str) -> PartKernel:
    kind, index = node.attrs
    carrier = sched.buffer_of.get(node.args[0], "?")
    what = {"output": f"output {index}", "final": f"final state {index}", "states": "kept states",
            "grad_init": f"adjoint of init {index}", "grad_seq": f"adjoint of sequence {index}",
            "grad_capture": f"adjoint of captured value {index}"}[kind]
    return PartKernel(f"{out}: the {what} of the loop of {carrier}, written by it")


KERNEL_BUILDERS["scan"] = _build_forward
KERNEL_BUILDERS["scan_vjp"] = _build_backward
KERNEL_BUILDERS["scan_part"] = _build_part


# --- emission -------------------------------------------------------------------


class _ScopedNamer(CNamer):
    """C names for a loop's inner names: outer buffers keep theirs; the rest
    are prefixed with the scope (unique in the C function)."""

    def __init__(self, outer: Any, scope: str, bound: dict[str, str]):
        super().__init__()
        self.outer, self.scope, self.bound = outer, scope, bound

    def name(self, logical: str) -> str:
        if logical in self.bound:
            return self.outer.name(self.bound[logical])
        return self.outer.name(f"\0{self.scope} {logical}")


def _inner_kernel(em: FunctionEmitter, kernel: Any) -> CKernel:
    """A step kernel's template data: loops run on one thread (the loop over
    steps is sequential) and products inline (the module's matmul helper is
    emitted only for products outside loops)."""
    ck = em.kernel(kernel)
    if ck.kind == "map" and ck.fields.get("parallel"):
        ck = replace(ck, fields={**ck.fields, "parallel": False})
    if ck.kind == "matmul" and ck.fields.get("call") and isinstance(kernel, MatMulKernel):
        ck = replace(ck, fields=_matmul_loops(em, kernel))
    return ck


def _matmul_loops(em: FunctionEmitter, kernel: MatMulKernel) -> dict:
    b_rows_contiguous = kernel.b.col_stride == 1 or kernel.n == 1
    out = View(kernel.out, sp.Integer(0), sp.sympify(kernel.n), sp.Integer(1))
    return {
        "call": None,
        "order": "ikj" if b_rows_contiguous else "ijk",
        "m": em.dim(kernel.m),
        "k": em.dim(kernel.k),
        "n": em.dim(kernel.n),
        "a": em.access(kernel.a, LOOP_I, LOOP_K),
        "b": em.access(kernel.b, LOOP_K, LOOP_J),
        "c": em.access(out, LOOP_I, LOOP_J),
    }


@dataclass(frozen=True)
class _AddProduct:
    """acc += a @ b, an outer product (a: m x 1, b: 1 x n) added straight
    into an accumulator: a MatMulKernel with k = 1 and the MapKernel
    `acc = acc + product` that was its only reader, as one loop nest."""

    acc: str
    a: View
    b: View
    m: Any
    n: Any
    equations: tuple[Equation, ...]

    def reads(self) -> tuple[str, ...]:
        return (self.acc, self.a.buffer, self.b.buffer)

    def writes(self) -> tuple[str, ...]:
        return (self.acc,)


def _added_product(kernel: Any, products: dict[str, MatMulKernel]) -> tuple[str, MatMulKernel] | None:
    """(acc, product) when `kernel` is `acc = acc + product` over the whole
    of an outer product, both laid out row-major from offset 0."""
    if not isinstance(kernel, MapKernel) or kernel.temps or len(kernel.stores) != 1 or len(kernel.loads) != 2:
        return None
    acc, expr = kernel.stores[0]
    views = {view.buffer: (symbol, view) for symbol, view in kernel.loads}
    others = [buffer for buffer in views if buffer != acc]
    if acc not in views or len(others) != 1 or others[0] not in products:
        return None
    product = products[others[0]]
    shape = (sp.sympify(product.m), sp.sympify(product.n))
    if tuple(sp.sympify(d) for d in kernel.shape) != shape or sp.sympify(expr - views[acc][0] - views[others[0]][0]) != 0:
        return None
    if any(sp.sympify(view.offset) != 0 or not _natural(view, shape, rows=False) for _, view in views.values()):
        return None
    return acc, product


def _fuse_accumulations(kernels: Sequence[Any]) -> list[Any]:
    """The step's kernels, with each outer product that is only added into
    an accumulator (a weight's adjoint: x^T @ delta) added into it directly,
    at the product's place (the accumulator is read and written by that
    addition only)."""
    products = {k.out: k for k in kernels if isinstance(k, MatMulKernel) and sp.sympify(k.k) == 1}
    fused: dict[int, _AddProduct] = {}
    dropped: set[int] = set()
    for at, kernel in enumerate(kernels):
        found = _added_product(kernel, products)
        if found is None:
            continue
        acc, product = found
        touching = [n for n, k in enumerate(kernels) if n != at and (
            {acc, product.out} & set(kernel_reads(k) + kernel_writes(k)))]
        where = kernels.index(product)
        if touching != [where] or where > at or acc in (product.a.buffer, product.b.buffer):
            continue
        lhs = kernel.equations[0].lhs if kernel.equations else acc
        text = product.equations[0].text if product.equations else "product"
        fused[where] = _AddProduct(acc, product.a, product.b, product.m, product.n,
                                   (Equation(lhs, text, "", "+="),))
        dropped.add(at)
    return [fused.get(n, k) for n, k in enumerate(kernels) if n not in dropped]


class _ScanEmitter:
    """Prints one ScanKernel as lines of C and nested step kernels."""

    def __init__(self, em: FunctionEmitter, k: ScanKernel):
        self.k = k
        self.outer = em
        self.sub = FunctionEmitter(_ScopedNamer(em.namer, k.scope, dict(k.bound)), em.dims, em.real)
        self.c = self.sub.namer.name
        self.real = em.real.c
        self.names = {role: self.c(name) for role, name in k.names.items()}
        self.loop_var = {STEP: sp.Symbol(self.names["t"], integer=True)}
        if "u" in self.names:
            self.loop_var[U] = sp.Symbol(self.names["u"], integer=True)
        self.unaligned = self.c(k.scratch)
        self.scratch = self.names["base"]  # the scratch from its first 64-byte boundary
        self.lines: list[tuple[str, int, Any]] = []
        self.used: set[str] = set()
        for loop in k.loops:
            for kernel in loop.schedule.kernels:
                self.used.update(kernel_reads(kernel))
                self.used.update(kernel_writes(kernel))

    def line(self, depth: int, text: str) -> None:
        self.lines.append(("line", depth, text))

    def index(self, expr: Any) -> str:
        return self.sub.dim(sp.sympify(expr).xreplace(self.loop_var))

    def at(self, base: str, offset: Any) -> str:
        text = self.index(offset)
        return base if text == "0" else f"{base} + {text}"

    def value(self, source: View | sp.Expr, i: Any, j: Any) -> str:
        if isinstance(source, View):
            offset = sp.sympify(source.offset).xreplace(self.loop_var)  # an outer buffer: its own C name
            return self.outer.access(View(source.buffer, offset, source.row_stride, source.col_stride), i, j)
        return ScalarPrinter({}, self.sub.real).doprint(sp.sympify(source))

    def copy(self, depth: int, target: str, shape: tuple, source: View | sp.Expr) -> None:
        """target[0 .. size) = source (of `shape`), in row-major order."""
        i, j = sp.Symbol(self.names["i"], integer=True), sp.Symbol(self.names["j"], integer=True)
        rows, cols = shape
        if rows == 1 or cols == 1:
            size = self.index(_size(shape))
            ij = (sp.Integer(0), i) if rows == 1 else (i, sp.Integer(0))
            self.line(depth, f"for (int64_t {i} = 0; {i} < {size}; ++{i}) {{")
            self.line(depth + 1, f"{target}[{i}] = {self.value(source, *ij)};")
            self.line(depth, "}")
            return
        self.line(depth, f"for (int64_t {i} = 0; {i} < {self.index(rows)}; ++{i}) {{")
        self.line(depth + 1, f"for (int64_t {j} = 0; {j} < {self.index(cols)}; ++{j}) {{")
        self.line(depth + 2, f"{target}[{i}*{self.index(cols)} + {j}] = {self.value(source, i, j)};")
        self.line(depth + 1, "}")
        self.line(depth, "}")

    def base(self, inner: str) -> str:
        return self.scratch if inner == self.k.scratch else self.c(inner)

    def bind(self, depth: int, bound: Pointer | Fill, used: set[str]) -> None:
        if bound.name not in used:
            return
        if isinstance(bound, Pointer):
            qualifier = "" if bound.writable else "const "
            self.line(depth, f"{qualifier}{self.real} *{self.c(bound.name)} = {self.at(self.base(bound.base), bound.offset)};")
            return
        name = self.c(bound.name)
        self.line(depth, f"{self.real} *{name} = {self.at(self.base(bound.base), bound.offset)};")
        self.copy(depth, name, bound.shape, bound.source)

    def step(self, depth: int, loop: Loop) -> None:
        """One step: its pointers and gathered rows (those its kernels use),
        its slots in the scratch (those they use), then its kernels."""
        kernels = _fuse_accumulations(loop.schedule.kernels)
        used = {b for kernel in kernels for b in (*kernel_reads(kernel), *kernel_writes(kernel))}
        for bound in loop.pointers + loop.fills:
            self.bind(depth, bound, used)
        for slot in loop.schedule.slots:
            if slot.name not in used:
                continue
            extent = f"{self.sub.dim(slot.shape[0])} x {self.sub.dim(slot.shape[1])}"
            where = self.at(self.scratch, loop.region + slot.offset)
            self.line(depth, f"{self.real} *{self.c(slot.name)} = {where}; /* {extent} */")
        for kernel in kernels:
            if isinstance(kernel, _AddProduct):
                self.add_product(depth, kernel)
                continue
            ck = _inner_kernel(self.sub, kernel)
            if ck.kind == "map" and ck.fields.get("loops") and not ck.declares:
                self.map_loops(depth, ck)
            elif ck.kind == "matmul" and not ck.fields.get("call") and ck.fields.get("order") == "ikj" \
                    and not ck.declares:
                self.matmul_loops(depth, ck)
            else:
                self.lines.append(("kernel", depth, ck))

    def independent(self, whole: bool = False) -> None:
        """Tell GCC that the next loop's iterations are independent (and,
        `whole`, to keep it a loop rather than unroll it into scalar code
        that it no longer vectorizes); other compilers skip it."""
        self.lines.append(("line", 0, "#if defined(__GNUC__) && !defined(__clang__)"))
        self.lines.append(("line", 0, "#pragma GCC ivdep"))
        if whole:
            self.lines.append(("line", 0, "#pragma GCC unroll 1"))
        self.lines.append(("line", 0, "#endif"))

    def matmul_loops(self, depth: int, ck: CKernel) -> None:
        """A small product of the step (i-k-j order, the macro's loops),
        each row of the product accumulated over k as one vector loop over
        j: the product never overlaps its factors. The sum over k runs in
        the same order as the macro's, so the values are the same."""
        f = ck.fields
        for comment in ck.comments:
            self.line(depth, f"/* {comment} */")
        self.line(depth, f"for (int64_t i = 0; i < {f['m']}; ++i) {{")
        self.line(depth + 1, f"for (int64_t j = 0; j < {f['n']}; ++j) {{")
        self.line(depth + 2, f"{f['c']} = 0;")
        self.line(depth + 1, "}")
        self.line(depth + 1, f"for (int64_t k = 0; k < {f['k']}; ++k) {{")
        self.line(depth + 2, f"const {self.real} acc = {f['a']};")
        self.independent(whole=True)
        self.line(depth + 2, f"for (int64_t j = 0; j < {f['n']}; ++j) {{")
        self.line(depth + 3, f"{f['c']} += acc * {f['b']};")
        self.line(depth + 2, "}")
        self.line(depth + 1, "}")
        self.line(depth, "}")

    def map_loops(self, depth: int, ck: CKernel) -> None:
        """An elementwise loop of the step, as the map macro writes it, told
        (GCC) that its iterations are independent: each reads and writes
        its own entries (an output overwrites an input only entry for
        entry), so GCC needs no run-time checks of how its many pointers
        overlap, of which it gives up past a few and then calls the scalar
        exp and tanh instead of libmvec's."""
        f = ck.fields
        for comment in ck.comments:
            self.line(depth, f"/* {comment} */")
        if f.get("hoisted"):
            self.line(depth, "{")
            depth += 1
            for name, expr in f["hoisted"]:
                self.line(depth, f"const {self.real} {name} = {expr};")
        self.independent()
        loops = list(f["loops"])
        for n, (var, bound) in enumerate(loops):
            self.line(depth + n, f"for (int64_t {var} = 0; {var} < {bound}; ++{var}) {{")
        inner = depth + len(loops)
        for name, expr in f["temps"]:
            self.line(inner, f"const {self.real} {name} = {expr};")
        for target, expr in f["stores"]:
            self.line(inner, f"{target} = {expr};")
        for n in reversed(range(len(loops))):
            self.line(depth + n, "}")
        if f.get("hoisted"):
            self.line(depth - 1, "}")

    def add_product(self, depth: int, kernel: _AddProduct) -> None:
        """acc += a @ b for a column a (m x 1) and a row b (1 x n), straight
        into the accumulator (no m x n product in between)."""
        sub, zero = self.sub, sp.Integer(0)
        acc = View(kernel.acc, zero, sp.sympify(kernel.n), sp.Integer(1))
        for equation in kernel.equations:
            self.line(depth, f"/* {comment_text(equation.comment)} */")
        self.line(depth, f"for (int64_t i = 0; i < {sub.dim(kernel.m)}; ++i) {{")
        self.line(depth + 1, f"const {self.real} acc = {sub.access(kernel.a, LOOP_I, zero)};")
        self.independent(whole=True)
        self.line(depth + 1, f"for (int64_t j = 0; j < {sub.dim(kernel.n)}; ++j) {{")
        self.line(depth + 2, f"{sub.access(acc, LOOP_I, LOOP_J)} += acc * {sub.access(kernel.b, zero, LOOP_J)};")
        self.line(depth + 1, "}")
        self.line(depth, "}")

    def swap(self, depth: int) -> None:
        cur, nxt, swap = self.names["cur"], self.names["nxt"], self.names["swap"]
        self.line(depth, f"{self.real} *{swap} = {cur};")
        self.line(depth, f"{cur} = {nxt};")
        self.line(depth, f"{nxt} = {swap};")

    def emit(self) -> list[tuple[str, int, Any]]:
        k, names, real = self.k, self.names, self.real
        cur, i, t = names["cur"], names["i"], names["t"]
        self.line(0, "{")
        self.line(1, f"{real} *{self.scratch} = ({real} *)(((uintptr_t){self.unaligned} + 63) & ~(uintptr_t)63);")
        self.line(1, f"{real} *{cur} = {self.scratch};")
        self.line(1, f"{real} *{names['nxt']} = {self.at(self.scratch, k.width)};")
        if "seg" in names:
            self.line(1, f"{real} *{names['seg']} = {self.at(self.scratch, 2 * k.width)};")
        for whole in k.wholes:
            self.bind(1, whole, self.used)
        for buffer, size in k.zeroed:
            self.line(1, f"for (int64_t {i} = 0; {i} < {self.index(size)}; ++{i}) {{")
            self.line(2, f"{self.c(buffer)}[{i}] = 0;")
            self.line(1, "}")
        for off, _, source, shape in k.starts:
            self.copy(1, self.at(cur, off) if self.index(off) == "0" else f"({self.at(cur, off)})", shape, source)
        length = self.index(k.length)
        if k.mode == "forward":
            (loop,) = k.loops
            self.line(1, f"for (int64_t {t} = 0; {t} < {length}; ++{t}) {{")
            if k.kept is not None:
                self.keep(2)
            self.step(2, loop)
            self.swap(2)
            self.line(1, "}")
        elif k.every > 1:
            recompute, reverse = k.loops
            s, t0, n, u, seg = names["s"], names["t0"], names["len"], names["u"], names["seg"]
            width, every = self.index(k.width), k.every
            last = self.index(ceildiv(sp.sympify(k.length), every) - 1)
            self.line(1, f"for (int64_t {s} = {last}; {s} >= 0; --{s}) {{")
            self.line(2, f"const int64_t {t0} = {s}*{every};")
            self.line(2, f"const int64_t {n} = {length} - {t0} < {every} ? {length} - {t0} : {every};")
            self.line(2, f"for (int64_t {i} = 0; {i} < {width}; ++{i}) {{")
            self.line(3, f"{seg}[{i}] = {self.c(str(k.kept))}[{s}*{width} + {i}];")
            self.line(2, "}")
            self.line(2, f"for (int64_t {u} = 1; {u} {'<=' if k.recompute_last else '<'} {n}; ++{u}) {{")
            self.line(3, f"const int64_t {t} = {t0} + {u} - 1;")
            self.step(3, recompute)
            self.line(2, "}")
            self.line(2, f"for (int64_t {u} = {n} - 1; {u} >= 0; --{u}) {{")
            self.line(3, f"const int64_t {t} = {t0} + {u};")
            self.step(3, reverse)
            self.swap(3)
            self.line(2, "}")
            self.line(1, "}")
        else:
            (reverse,) = k.loops
            self.line(1, f"for (int64_t {t} = {length} - 1; {t} >= 0; --{t}) {{")
            self.step(2, reverse)
            self.swap(2)
            self.line(1, "}")
        for buffer, off, size in k.finals:
            self.line(1, f"for (int64_t {i} = 0; {i} < {self.index(size)}; ++{i}) {{")
            self.line(2, f"{self.c(buffer)}[{i}] = {cur}[{self.at(i, off)}];")
            self.line(1, "}")
        self.line(0, "}")
        return self.lines

    def keep(self, depth: int) -> None:
        """Row t/every of the kept states = the state at step t (every k-th t)."""
        k, names = self.k, self.names
        t, i, every, width = names["t"], names["i"], k.every, self.index(k.width)
        if every > 1:
            self.line(depth, f"if ({t} % {every} == 0) {{")
            depth += 1
        row = f"({t}/{every})" if every > 1 else t
        self.line(depth, f"for (int64_t {i} = 0; {i} < {width}; ++{i}) {{")
        self.line(depth + 1, f"{self.c(str(k.kept))}[{row}*{width} + {i}] = {names['cur']}[{i}];")
        self.line(depth, "}")
        if every > 1:
            self.line(depth - 1, "}")


def _emit_scan(em: FunctionEmitter, k: ScanKernel) -> dict:
    return {"body": _ScanEmitter(em, k).emit()}


def _emit_part(em: FunctionEmitter, k: PartKernel) -> dict:
    return {"text": comment_text(k.text)}


KERNEL_EMITTERS[ScanKernel] = _emit_scan
KERNEL_EMITTERS[PartKernel] = _emit_part


__all__ = ["ScanFinal", "ScanOutput", "ceildiv", "final_state", "scan"]
