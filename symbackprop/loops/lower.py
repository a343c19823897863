"""Lowering a scan: ScanOutput and ScanFinal become "scan_part" nodes of
one "scan" node, whose step is lowered by a nested lowerer over placeholder
leaves for the state, the input row and the outer values the step reads."""

from __future__ import annotations

from symbackprop.errors import ModelError
from symbackprop.ir.construct import leaf
from symbackprop.ir.lower import Lowerer, shape_of
from symbackprop.ir.node import Node, topological_order
from symbackprop.loops.declare import ScanFinal, ScanOutput, ScanSpec, entries, is_vector, same_layout, symbol_name
from symbackprop.loops.graph import ScanStep, scan_node, scan_part
from symbackprop.loops.hoist import hoist_loops
from symbackprop.loops.reshape import reshape

STEP_CONTEXT = "scan step"  # the context of the lowerer of a scan's step (see ir.Lowerer.nested)


def _lower_spec(lowerer: Lowerer, spec: ScanSpec) -> Node:
    """The scan node of `spec`, lowered once per lowering (however many of
    its outputs and final states the model reads)."""
    cache = lowerer.cache("scan")
    found = cache.get(spec)
    if found is None:
        found = cache[spec] = _build_scan(lowerer, spec)
    return found


def _build_scan(lowerer: Lowerer, spec: ScanSpec) -> Node:
    outer: dict = lowerer.leaves
    outer_names = {symbol_name(sym) for sym in outer}
    for sym in spec.states + spec.inputs:
        if sym in outer or symbol_name(sym) in outer_names:
            raise ModelError(
                f"scan: {sym} stands for the scan's state or input and cannot also be an input or param of the model"
            )
    if spec.batch.free_symbols - lowerer.dims:
        raise ModelError(f"scan: batch={spec.batch} is not a dimension of any input or param (it is bound at call "
                         f"time from one that has it, e.g. an initial state of {spec.batch} rows)")
    inits = [lowerer.lower(e) for e in spec.inits]
    seqs = [_steps(lowerer.lower(e), spec) for e in spec.sequences]
    state_leaves = {sym: leaf(symbol_name(sym), shape_of(sym), "scan_state") for sym in spec.states}
    input_leaves = {sym: leaf(symbol_name(sym), shape_of(sym), "scan_input") for sym in spec.inputs}
    capture_leaves = {sym: leaf(symbol_name(sym), node.shape, "scan_capture") for sym, node in outer.items()}
    for sym, init in zip(spec.states, inits):
        if not same_layout(init.shape, state_leaves[sym].shape):
            raise ModelError(f"scan: the state {sym} has shape {state_leaves[sym].shape} but its init has shape "
                             f"{init.shape}")
    length = spec.length
    for sym, seq in zip(spec.inputs, seqs):
        if seq.shape[0] != length:
            raise ModelError(f"scan: the sequences have different numbers of rows ({length} and {seq.shape[0]})")
        if entries(input_leaves[sym].shape) != seq.shape[1]:
            raise ModelError(f"scan: the input {sym} has {entries(input_leaves[sym].shape)} entries but the rows of "
                             f"its sequence have {seq.shape[1]}")
    sub = lowerer.nested({**capture_leaves, **state_leaves, **input_leaves}, STEP_CONTEXT)
    allowed = ", ".join(symbol_name(s) for s in spec.states + spec.inputs)
    try:
        next_states = tuple(sub.lower(e) for e in spec.next_states)
        outputs = tuple(sub.lower(e) for e in spec.outputs)
    except ModelError as exc:
        raise ModelError(f"in the step of a scan (which may use {allowed} and the model's inputs and params): "
                         f"{exc}") from None
    for sym, nxt in zip(spec.states, next_states):
        if nxt.shape != state_leaves[sym].shape:
            raise ModelError(f"scan: the state {sym} has shape {state_leaves[sym].shape} but its step_state has "
                             f"shape {nxt.shape}")
    for out in outputs:
        if not is_vector(out.shape) and spec.batch == 1:
            raise ModelError(f"scan: a step output must be a vector; got shape {out.shape}")
    varying = (*state_leaves.values(), *input_leaves.values())
    roots, values = hoist_loops(next_states + outputs, varying, {c: outer[sym] for sym, c in capture_leaves.items()})
    reached = set(topological_order(roots))
    captured = [c for c in values if c in reached]
    step = ScanStep(
        states=tuple(state_leaves.values()),
        inputs=tuple(input_leaves.values()),
        captures=tuple(captured),
        next_states=tuple(roots[:len(next_states)]),
        outputs=tuple(roots[len(next_states):]),
        every=spec.every,
        length=length,
        reverse=spec.reverse,
    )
    return scan_node(step, inits + seqs + [values[c] for c in captured])


def _steps(seq: Node, spec: ScanSpec) -> Node:
    """A sequence as the loop reads it: one row a step (T x B*D, the same
    memory as the (T*B) x D sequence, time-major)."""
    if spec.batch == 1:
        return seq
    if seq.shape[0] != spec.rows:
        raise ModelError(f"scan: the sequences have different numbers of rows ({spec.rows} and {seq.shape[0]})")
    return reshape(seq, (spec.length, spec.batch * seq.shape[1]))


def lower_output(lowerer: Lowerer, expr: ScanOutput) -> Node:
    """ScanOutput -> the "output" part of its scan node (batched: read back
    as (T*B) x O)."""
    carrier = _lower_spec(lowerer, expr.spec)
    step: ScanStep = carrier.attrs[0]
    out = step.outputs[expr.index]
    part = scan_part(carrier, "output", expr.index, (step.length, entries(out.shape)))
    return reshape(part, expr.shape) if expr.spec.batch != 1 else part


def lower_final(lowerer: Lowerer, expr: ScanFinal) -> Node:
    """ScanFinal -> the "final" part of its scan node."""
    carrier = _lower_spec(lowerer, expr.spec)
    step: ScanStep = carrier.attrs[0]
    return scan_part(carrier, "final", expr.index, step.states[expr.index].shape)

