"""Lowering a fixed point: FixedPointFinal and FixedPointCount become
"scan_part" nodes of one "fixed_point" node, a scan's loop without
sequences (a ScanStep with `until` set: at most max_iter steps, stopping
early), whose step is lowered by a nested lowerer over placeholder leaves
for the state and the outer values the step reads."""

from __future__ import annotations

from dataclasses import replace

from symbackprop.errors import ModelError
from symbackprop.ir.construct import leaf
from symbackprop.ir.lower import Lowerer, shape_of
from symbackprop.ir.node import Node, topological_order
from symbackprop.loops.declare import same_layout, symbol_name
from symbackprop.loops.fixpoint import FixedPointCount, FixedPointFinal, FixedPointSpec
from symbackprop.loops.graph import ScanStep, Until, scan_node, scan_part
from symbackprop.loops.hoist import hoist_loops

FIXED_POINT_CONTEXT = "fixed-point step"  # the context of the lowerer of a fixed point's step


def _lower_spec(lowerer: Lowerer, spec: FixedPointSpec) -> Node:
    """The fixed_point node of `spec`, lowered once per lowering."""
    cache = lowerer.cache("fixed_point")
    found = cache.get(spec)
    if found is None:
        found = cache[spec] = _build(lowerer, spec)
    return found


def _build(lowerer: Lowerer, spec: FixedPointSpec) -> Node:
    outer: dict = lowerer.leaves
    outer_names = {symbol_name(sym) for sym in outer}
    for sym in spec.states:
        if sym in outer or symbol_name(sym) in outer_names:
            raise ModelError(f"fixed_point: {sym} stands for the state and cannot also be an input or param "
                             "of the model")
    inits = [lowerer.lower(e) for e in spec.inits]
    state_leaves = {sym: leaf(symbol_name(sym), shape_of(sym), "scan_state") for sym in spec.states}
    capture_leaves = {sym: leaf(symbol_name(sym), node.shape, "scan_capture") for sym, node in outer.items()}
    for sym, init in zip(spec.states, inits):
        if not same_layout(init.shape, state_leaves[sym].shape):
            raise ModelError(f"fixed_point: the state {sym} has shape {state_leaves[sym].shape} but its init has "
                             f"shape {init.shape}")
    sub = lowerer.nested({**capture_leaves, **state_leaves}, FIXED_POINT_CONTEXT)
    allowed = ", ".join(symbol_name(s) for s in spec.states)
    try:
        next_states = tuple(sub.lower(e) for e in spec.next_states)
    except ModelError as exc:
        if "is not supported" in str(exc):
            raise
        raise ModelError(f"in the step of a fixed point (which may use {allowed} and the model's inputs and "
                         f"params): {exc}") from None
    states = tuple(state_leaves.values())
    roots, values = hoist_loops(next_states, states, {c: outer[sym] for sym, c in capture_leaves.items()})
    reached = set(topological_order(roots))
    captured = [c for c in values if c in reached]
    step = ScanStep(states=states, inputs=(), captures=tuple(captured), next_states=tuple(roots),
                    outputs=(), every=1, length=spec.max_iter, until=None)
    step = replace(step, until=Until(spec.tol, spec.mode, step.width))  # the test reads every state
    return scan_node(step, inits + [values[c] for c in captured])


def lower_final(lowerer: Lowerer, expr: FixedPointFinal) -> Node:
    """FixedPointFinal -> the "final" part of its fixed_point node."""
    carrier = _lower_spec(lowerer, expr.spec)
    step: ScanStep = carrier.attrs[0]
    return scan_part(carrier, "final", expr.index, step.states[expr.index].shape)


def lower_count(lowerer: Lowerer, expr: FixedPointCount) -> Node:
    """FixedPointCount -> the "count" part of its fixed_point node."""
    return scan_part(_lower_spec(lowerer, expr.spec), "count", 0, (1, 1))
