"""Differentiating a scan's backward pass again (a loss that holds
sbp.grad of a scan; the hvp of such a loss).

The "scan_vjp" node stays the first-order backward pass (its own kernel,
checkpointing). Only where it is differentiated again is it re-expressed
as a generic scan that runs backwards (ScanStep.reverse), to which the
scan's own rules (diff.py) apply:

    states    the adjoints of the step's states, then one accumulator per
              captured value whose adjoint is summed
    inputs    the step's states (the kept states' columns), its inputs
              and the adjoints of its outputs, row t
    next      the step's VJP: the adjoint of state t, accumulator + term
    outputs   the adjoints of the inputs' rows
    inits     the adjoints of the final states (0 where none), zeros

so that its final states are the adjoints of the inits and of the
captured values, and its outputs those of the sequences. It reads every
state, so the forward pass must keep them all: checkpointing
(`checkpoint_every` > 1) is refused here. The rules build it over stand-in
leaves of the scan_vjp's arguments (so that autodiff stops at them), then
put the arguments in.
"""

from __future__ import annotations

from collections.abc import Sequence

from symbackprop.diff.autodiff import jvp as _jvp
from symbackprop.diff.autodiff import vjp as _vjp
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, emap, leaf, row_placeholder
from symbackprop.ir.node import Node, op_node, topological_order
from symbackprop.loops.graph import ScanBack, ScanStep, backward_scratch, scan_node, scan_part

NO_SECOND_ORDER = (  # what stays refused
    "scan: differentiating a scan's backward pass again (a loss that holds sbp.grad of a scan) "
    "needs every state kept: drop checkpoint_every from that scan (hvp, hessian and first order allow it)")
UNROLLED_AGAIN = (
    "fixed_point: differentiating the backward pass of diff=\"unrolled\" again (a loss that holds sbp.grad "
    "of a fixed point) is not supported; use diff=\"implicit\" (hvp and hessian allow both)")


def columns(a: Node, start, count) -> Node:
    """Columns start .. start+count-1 of `a`, row by row."""
    bodies = [row_placeholder(0, int(start) + j) for j in range(int(count))]
    return emap(bodies, [a], [("row", 0)], (a.shape[0],), ("row", 0), (a.shape[0], int(count)))


def generic_index(back: ScanBack, kind: str, index: int) -> tuple[str, int]:
    """The part of the generic scan that holds part (kind, index) of the
    scan_vjp: grad_init i, grad_capture m and grad_seq j."""
    if kind == "grad_init":
        return "final", index
    if kind == "grad_capture":
        return "final", len(back.step.states) + [m for m, _, _ in back.accumulate].index(index)
    return "output", [j for j, _ in back.grad_inputs].index(index)


def generic_step(back: ScanBack) -> ScanStep:
    """The backward pass's step as a scan step (see the module's docstring)."""
    step = back.step
    return ScanStep(
        states=back.grad_next + tuple(acc for _, acc, _ in back.accumulate),
        inputs=step.states + step.inputs + tuple(gy for _, gy in back.grad_outputs),
        captures=step.captures,
        next_states=back.grad_states + tuple(total for _, _, total in back.accumulate),
        outputs=tuple(g for _, g in back.grad_inputs),
        every=1,
        length=step.length,
        reverse=not step.reverse,
    )


def generic_scan(back: ScanBack, args: Sequence[Node]) -> Node:
    """The scan computing what a scan_vjp node over `args` computes."""
    step = back.step
    if step.every > 1:
        raise ModelError(NO_SECOND_ORDER)
    if back.counted:  # its kept states past the steps that ran are not states at all
        raise ModelError(UNROLLED_AGAIN)
    kept, seqs, caps, gys, gfs = back.split(args)
    states = [columns(kept, off, size) for off, size in zip(step.offsets, step.sizes)]
    given = dict(zip(back.grad_finals, gfs))
    inits = [given.get(i, const(0, s.shape)) for i, s in enumerate(step.states)]
    inits += [const(0, acc.shape) for _, acc, _ in back.accumulate]
    return scan_node(generic_step(back), (*inits, *states, *seqs, *gys, *caps))


def _stand_ins(node: Node) -> tuple[Node, ...]:
    return tuple(leaf(f"scan_vjp_arg{k}", a.shape, "scan_stand_in") for k, a in enumerate(node.args))


def _put_in(roots: Sequence[Node], mapping: dict[Node, Node]) -> list[Node]:
    """`roots` with the stand-ins replaced by the arguments; the loops'
    scratch is sized again (it depends on how they read their arguments)."""
    memo = dict(mapping)
    for node in topological_order(roots):
        if node in memo:
            continue
        args = tuple(memo.get(a, a) for a in node.args)
        if args == node.args:
            memo[node] = node
        elif node.op == "scan":
            memo[node] = scan_node(node.attrs[0], args)
        elif node.op == "scan_vjp":
            memo[node] = op_node("scan_vjp", args, (backward_scratch(node.attrs[0], args), 1), node.attrs)
        else:
            memo[node] = op_node(node.op, args, node.shape, node.attrs)
    return [memo[r] for r in roots]


def backward_vjp(node: Node, g: Node, needed: Sequence[bool], seeds: dict[tuple[str, int], Node]) -> tuple[Node | None, ...]:
    """The VJP of a scan_vjp node, given the adjoints of its parts: the VJP
    of the generic scan over the stand-ins, the arguments put in."""
    back: ScanBack = node.attrs[0]
    stand = _stand_ins(node)
    scan = generic_scan(back, stand)
    roots = []
    for (kind, index), seed in seeds.items():
        where, at = generic_index(back, kind, index)
        roots.append((scan_part(scan, where, at, seed.shape), seed))
    wanted = [s for s, n in zip(stand, needed) if n]
    grads, _ = _vjp(roots, wanted)
    put = iter(_put_in(grads, dict(zip(stand, node.args))))
    return tuple(next(put) if n else None for n in needed)


def backward_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """The tangent of a scan_vjp node: the tangent scan of the generic scan
    (its parts are read by diff.part_jvp through generic_index)."""
    stand = _stand_ins(node)
    scan = generic_scan(node.attrs[0], stand)
    (tangent,) = _jvp([scan], {s: t for s, t in zip(stand, tangents) if t is not None})
    return _put_in([tangent], dict(zip(stand, node.args)))[0]
