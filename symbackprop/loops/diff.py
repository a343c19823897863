"""A scan's derivatives. Reverse mode: a "scan_vjp" node, whose loop runs
the step's VJP backwards over the kept states, accumulating the adjoints of
the captured values. Forward mode: the tangent of a scan is a scan over
(state, tangent) pairs. Forward-over-reverse (hvp, hessian) through a scan
is refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import sympy as sp

from symbackprop.diff.autodiff import jvp as _jvp
from symbackprop.diff.autodiff import vjp as _vjp
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, is_const, leaf, map_
from symbackprop.ir.node import Node, op_node, placeholder
from symbackprop.loops.graph import ScanBack, ScanStep, backward_scratch, scan_node, scan_part

NO_SECOND_ORDER = (
    "differentiating a scan's backward pass again (hvp, hessian, a loss that holds sbp.grad of a scan) "
    "through a scan is not supported; use value_and_grad, vjp or jvp (sbp.jvp inside a loss)"
)


def part_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    kind, index = node.attrs
    if kind == "count":  # a fixed point's number of steps: piecewise constant
        return (None,)
    if kind not in ("output", "final"):
        raise ModelError(f"scan: the {kind} of a scan cannot be differentiated ({NO_SECOND_ORDER})")
    carrier = node.args[0]
    return (op_node("scan_seed", (g,), carrier.shape, (kind, index)),)


def part_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    kind, index = node.attrs
    tangent = tangents[0]
    if tangent is None or kind == "count":
        return None
    if kind not in ("output", "final"):
        raise ModelError(NO_SECOND_ORDER)
    step: ScanStep = node.args[0].attrs[0]
    shift = len(step.outputs) if kind == "output" else len(step.states)
    return scan_part(tangent, kind, index + shift, node.shape)


def part_seeds(g: Node) -> dict[tuple[str, int], Node]:
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


def scan_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    seeds = part_seeds(g)
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
        (j, g_) for j, g_ in zip(want_inputs, grads[n_states:n_states + len(want_inputs)]) if not is_zero(g_)
    )
    accumulate = []
    for m, g_ in zip(want_caps, grads[n_states + len(want_inputs):]):
        if is_zero(g_):
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
    if step.until is not None:  # a fixed point unrolled: back from the last step that ran
        args += (scan_part(node, "count", 0, (1, 1)),)
        back = replace(back, counted=True)
    backward = op_node("scan_vjp", args, (backward_scratch(back, args), 1), (back,))
    adjoints: list[Node | None] = [scan_part(backward, "grad_init", i, inits[i].shape) if needed[i] else None
                                   for i in range(n_states)]
    have_inputs = {j for j, _ in back.grad_inputs}
    adjoints += [scan_part(backward, "grad_seq", j, seqs[j].shape) if j in have_inputs else None
                 for j in range(n_inputs)]
    have_caps = {m for m, _, _ in back.accumulate}
    adjoints += [scan_part(backward, "grad_capture", m, caps[m].shape) if m in have_caps else None
                 for m in range(len(caps))]
    return tuple(adjoints)


def is_zero(node: Node) -> bool:
    return is_const(node) and node.attrs[0] == 0


def scan_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """The tangent of a scan is a scan over (state, tangent) pairs; its
    parts "output" len(outputs)+o and "final" len(states)+i are the tangents
    of output o and final state i (see part_jvp)."""
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    t_inits, t_seqs, t_caps = step.split(list(tangents))
    d_states = tuple(leaf(f"d{s.attrs[0]}", s.shape, "scan_tangent") for s in step.states)
    given = dict(zip(step.states, d_states))
    d_inputs, d_seqs = [], []
    for x, _seq, t in zip(step.inputs, seqs, t_seqs):
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
    augmented = replace(
        step,
        states=step.states + d_states,
        inputs=step.inputs + tuple(d_inputs),
        captures=step.captures + tuple(d_caps),
        next_states=step.next_states + tuple(derived[:len(step.states)]),
        outputs=step.outputs + tuple(derived[len(step.states):]),
    )
    if step.until is not None and step.until.mode == "implicit":
        # the tangents iterate to the implicit function theorem's: the loop
        # runs until they have converged too (unrolled: the primal's steps)
        augmented = replace(augmented, until=replace(step.until, watch=augmented.width))
    d_inits = [t if t is not None else const(0, init.shape) for init, t in zip(inits, t_inits)]
    args = (*inits, *d_inits, *seqs, *d_seqs, *caps, *d_cap_args)
    return scan_node(augmented, args)


def unsupported_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    raise ModelError(f"scan: {node.op} cannot be differentiated again ({NO_SECOND_ORDER})")


def unsupported_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    raise ModelError(NO_SECOND_ORDER)

