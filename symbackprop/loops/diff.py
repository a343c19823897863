"""A scan's derivatives. Reverse mode: a "scan_vjp" node, whose loop runs
the step's VJP backwards over the kept states, accumulating the adjoints of
the captured values. Forward mode: the tangent of a scan is a scan over
(state, tangent) pairs. Second order: the module's hvp goes reverse over
forward where the loss holds a scan (diff/hessian.py); a scan_vjp that is
differentiated again (sbp.grad of a scan in the loss) is re-expressed as a
generic scan running backwards (again.py), which these rules differentiate.
The kept states read by that scan have rules too: their tangent is the
tangent scan's, their adjoint is added to each step's state adjoint (the
states as further outputs of the step). Refused: the second order of a
checkpointed scan (NO_SECOND_ORDER)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import sympy as sp

from symbackprop.diff.autodiff import jvp as _jvp
from symbackprop.diff.autodiff import vjp as _vjp
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, is_const, map_
from symbackprop.ir.node import Node, op_node, placeholder
from symbackprop.loops.again import NO_SECOND_ORDER, backward_vjp, columns, generic_index
from symbackprop.loops.graph import FreshLeaves, ScanBack, ScanStep, backward_scratch, scan_node, scan_part


def part_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    """The adjoint of a part, handed to its loop's rule (which collects
    them all, part_seeds) as a scan_seed node."""
    if node.attrs[0] == "count":  # a fixed point's number of steps: piecewise constant
        return (None,)
    return (op_node("scan_seed", (g,), node.args[0].shape, node.attrs),)


def part_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """The tangent of a part: the matching part of the loop's tangent scan,
    whose states and outputs are the loop's, then their tangents."""
    kind, index = node.attrs
    tangent = tangents[0]
    if tangent is None or kind == "count":
        return None
    augmented: ScanStep = tangent.attrs[0]
    if kind == "states":  # the tangents' columns of the tangent scan's kept states
        width = node.args[0].attrs[0].width
        return columns(scan_part(tangent, "states", 0, (node.shape[0], 2 * width)), width, width)
    if kind not in ("output", "final"):  # a part of a backward pass: of its generic scan (again.py)
        kind, index = generic_index(node.args[0].attrs[0], kind, index)
    shift = len(augmented.outputs if kind == "output" else augmented.states) // 2
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
    kept_seed = seeds.pop(("states", 0), None)
    if kept_seed is not None:  # the kept states are read (again.py): each state is an output too
        step, seeds = _states_as_outputs(step, seeds, kept_seed)
    n_states, n_inputs = len(step.states), len(step.inputs)
    leaf = FreshLeaves(step)
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


def _states_as_outputs(step: ScanStep, seeds: dict, kept_seed: Node) -> tuple[ScanStep, dict]:
    """The step with its states as further outputs (row t: the state at
    step t, as kept), seeded with the kept states' adjoint's columns."""
    if step.every > 1:
        raise ModelError(NO_SECOND_ORDER)
    seeds = dict(seeds)
    for i, (off, size) in enumerate(zip(step.offsets, step.sizes)):
        seeds[("output", len(step.outputs) + i)] = columns(kept_seed, off, size)
    return replace(step, outputs=step.outputs + step.states), seeds


def backward_vjp_rule(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    """The VJP of a scan_vjp node: of its generic scan (again.py)."""
    return backward_vjp(node, g, needed, part_seeds(g))


def is_zero(node: Node) -> bool:
    return is_const(node) and node.attrs[0] == 0


def scan_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    """The tangent of a scan is a scan over (state, tangent) pairs; its
    parts "output" len(outputs)+o and "final" len(states)+i are the tangents
    of output o and final state i (see part_jvp)."""
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    t_inits, t_seqs, t_caps = step.split(list(tangents))
    leaf = FreshLeaves(step)
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
    raise AssertionError(f"scan: a {node.op} node is read by its loop's rule (part_seeds), never differentiated")


def unsupported_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    raise AssertionError(f"scan: a {node.op} node is read by its loop's rule (part_seeds), never differentiated")
