"""A fixed point's reverse-mode derivative. "unrolled": the scan's backward
pass over the steps that ran (loops/diff.py, from the count of steps).
"implicit": the implicit function theorem at x* = f(x*, theta):

    lambda = (df/dx)^T lambda + g        (at x*; a second fixed-point loop)
    theta_bar = (df/dtheta)^T lambda     (an ordinary VJP of one step)

The adjoint loop is itself a "fixed_point" node (same tol and max_iter,
started from g), so it is emitted by the same loop and can be
differentiated again; the init gets no adjoint (x* does not depend on it)."""

from __future__ import annotations

from collections.abc import Sequence

from symbackprop.diff.autodiff import vjp as _vjp
from symbackprop.ir.construct import const, leaf, map_
from symbackprop.ir.node import Node, placeholder, topological_order
from symbackprop.loops.diff import is_zero, part_seeds, scan_vjp
from symbackprop.loops.graph import ScanStep, scan_node, scan_part, substitute


def fixed_point_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    step: ScanStep = node.attrs[0]
    assert step.until is not None
    if step.until.mode == "unrolled":
        return scan_vjp(node, g, needed)
    return _implicit_vjp(node, step, part_seeds(g), needed)


def _implicit_vjp(node: Node, step: ScanStep, seeds: dict, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    _, _, caps = step.split(node.args)
    n_states = len(step.states)
    finals = [scan_part(node, "final", i, s.shape) for i, s in enumerate(step.states)]
    gs = [seeds[("final", i)] if ("final", i) in seeds else const(0, s.shape) for i, s in enumerate(step.states)]
    lam_star = _adjoint_loop(node, step, finals, gs)
    # theta_bar = (df/dtheta)^T lambda: one step's VJP, taken over the step's
    # placeholders (x* and lambda held fixed) and then placed at x*
    lams = [leaf(f"adj_{s.attrs[0]}", s.shape, "scan_adjoint") for s in step.states]
    want = [m for m in range(len(caps)) if needed[n_states + m]]
    pulled, _ = _vjp(list(zip(step.next_states, lams)), [step.captures[m] for m in want])
    outer = {**dict(zip(step.states, finals)), **dict(zip(step.captures, caps)), **dict(zip(lams, lam_star))}
    grads = substitute(pulled, outer)
    adjoints: list[Node | None] = [None] * len(node.args)
    for m, grad in zip(want, grads):
        adjoints[n_states + m] = None if is_zero(grad) else grad
    return tuple(adjoints)


def _adjoint_loop(node: Node, step: ScanStep, finals: list[Node], gs: list[Node]) -> list[Node]:
    """lambda = (df/dx)^T lambda + g at x*, by the fixed point's own loop
    (the adjoint's iteration converges when the spectral radius of df/dx is
    below 1, as the forward's does near x*)."""
    _, _, caps = step.split(node.args)
    names = [s.attrs[0] for s in step.states]
    lams = tuple(leaf(f"adj_{n}", s.shape, "scan_state") for n, s in zip(names, step.states))
    stars = tuple(leaf(f"{n}_star", s.shape, "scan_capture") for n, s in zip(names, step.states))
    seeds = tuple(leaf(f"grad_{n}", s.shape, "scan_capture") for n, s in zip(names, step.states))
    at_star = substitute(step.next_states, dict(zip(step.states, stars)))
    pulled, _ = _vjp(list(zip(at_star, lams)), list(stars))
    next_lams = tuple(gl if is_zero(p) else map_(placeholder(0) + placeholder(1), [p, gl], gl.shape)
                      for p, gl in zip(pulled, seeds))
    outer = {**dict(zip(step.captures, caps)), **dict(zip(stars, finals)), **dict(zip(seeds, gs))}
    reached = set(topological_order(next_lams))
    captures = tuple(c for c in outer if c in reached)
    adjoint = ScanStep(states=lams, inputs=(), captures=captures, next_states=next_lams, outputs=(), every=1,
                       length=step.length, until=step.until)
    loop = scan_node(adjoint, [*gs, *[outer[c] for c in captures]])
    return [scan_part(loop, "final", i, lam.shape) for i, lam in enumerate(lams)]
