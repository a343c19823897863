"""A fixed point's reverse-mode derivative. "unrolled": the scan's backward
pass over the steps that ran (loops/diff.py, from the count of steps).
"implicit": the implicit function theorem at x* = f(x*, theta):

    lambda = (df/dx)^T lambda + g        (at x*; a second fixed-point loop)
    theta_bar = (df/dtheta)^T lambda     (an ordinary VJP of one step)

For a small state (at most DIRECT_ENTRIES entries, fixed shapes) lambda
is solved directly: (I - (df/dx)^T) lambda = g by LU, df/dx built from one
VJP of the step per entry. An entry whose step is the identity at x* (a
frozen entry: the row of df/dx is its unit vector, e.g. a loop's stop
branch) gets lambda = 0 and its equation is dropped: x* is held fixed
there (otherwise I - df/dx is singular). Larger states use an adjoint
loop: itself a "fixed_point" node (same tol and max_iter, started from g),
so it is emitted by the same loop and can be differentiated again. The
init gets no adjoint (x* does not depend on it)."""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp

from symbackprop.diff.autodiff import vjp as _vjp
from symbackprop.ir.construct import const, element, leaf, map_, pack
from symbackprop.ir.node import Node, placeholder, topological_order
from symbackprop.loops.diff import is_zero, part_seeds, scan_vjp
from symbackprop.loops.graph import ScanStep, scan_node, scan_part, substitute
from symbackprop.ops.linalg import solve


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
    entries = _entries(step)
    lam_star = (_direct_adjoint(step, caps, finals, gs, entries) if entries is not None
                else _adjoint_loop(node, step, finals, gs))
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


DIRECT_ENTRIES = 16  # states up to this many entries: (I - J^T) lambda = g solved by LU


def _entries(step: ScanStep) -> list[tuple[int, int, int]] | None:
    """(state, row, column) of every state entry, or None when the states
    are too large (or of symbolic shape) for the direct solve."""
    shapes = [s.shape for s in step.states]
    if not all(isinstance(d, (int, sp.Integer)) for shape in shapes for d in shape):
        return None
    found = [(k, i, j) for k, shape in enumerate(shapes) for i in range(int(shape[0])) for j in range(int(shape[1]))]
    return found if len(found) <= DIRECT_ENTRIES else None


def _direct_adjoint(step: ScanStep, caps: Sequence[Node], finals: list[Node], gs: list[Node],
                    entries: list[tuple[int, int, int]]) -> list[Node]:
    """lambda with (I - J^T) lambda = g at x*, J = df/dx (row m: one VJP of
    the step seeded by the unit vector of entry m); frozen entries (row m of
    J is e_m) get lambda_m = 0 and no equation."""
    outer = {**dict(zip(step.states, finals)), **dict(zip(step.captures, caps))}
    jac = []
    for k, i, j in entries:
        unit = pack(step.states[k].shape, {(i, j): const(1)})
        row, _ = _vjp([(step.next_states[k], unit)], list(step.states))
        row = substitute(row, outer)
        jac.append([element(row[k2], i2, j2) for k2, i2, j2 in entries])
    n = len(entries)
    frozen = [_frozen(jac[m], m) for m in range(n)]
    keep = [map_(1 - placeholder(0), [f]) for f in frozen]
    matrix = {}
    for r in range(n):  # A[r, c] = delta - J[c, r], rows and columns of frozen entries replaced by I's
        for c in range(n):
            if r == c:
                matrix[(r, c)] = map_(placeholder(0) + placeholder(1) * (1 - placeholder(2)), [frozen[r], keep[r], jac[r][r]])
            else:
                matrix[(r, c)] = map_(-placeholder(0) * placeholder(1) * placeholder(2), [jac[c][r], keep[r], keep[c]])
    rhs = {(m, 0): map_(placeholder(0) * placeholder(1), [element(gs[k], i, j), keep[m]]) for m, (k, i, j) in enumerate(entries)}
    lam = solve(pack((n, n), matrix), pack((n, 1), rhs))
    out = []
    for k, s in enumerate(step.states):
        out.append(pack(s.shape, {(i, j): element(lam, m, 0) for m, (k2, i, j) in enumerate(entries) if k2 == k}))
    return out


def _frozen(row: list[Node], m: int) -> Node:
    """1 where the step's entry m is the identity at x* (its Jacobian row
    is e_m), else 0."""
    off = sum((sp.Abs(placeholder(c) - (1 if c == m else 0)) for c in range(len(row))), sp.Integer(0))
    return map_(1 - sp.sign(off), row)  # off >= 0 (no Piecewise: SymPy folds one in a condition into booleans)
