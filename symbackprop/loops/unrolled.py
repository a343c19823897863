"""An unrolled recurrence, compiled as a scan. A model that writes its
steps out in a Python loop (`h = nn.gru_cell(x_t, h, W, U, b)` for each
x_t) lowers to one copy of the step per step, each compiled on its own;
this pass finds the repeated step in the lowered IR and replaces the run
with one "scan" node (loops/graph.py), so that the step is compiled once
whatever the number of steps.

Where to look: the states of a recurrence lie on the longest path from a
root down the graph (each step adds to it), one step's length apart, so
the path's ops repeat with that period. Each node of one phase of the
period is a candidate state R_1 .. R_K (oldest first), R_0 the one below.

What a run is: the K steps' graphs, walked in parallel as K-tuples of
nodes from (R_1, .., R_K) down (anti-unification). A tuple of one node
is a capture (a param, a value computed before the loop); a tuple none of
whose nodes depends on R_0 is an input slot (row t of a sequence, such as
the x_t); a tuple (n_1, .., n_K) with n_2 .. n_K the first K-1 nodes of
another tuple M is a state whose next value is M's (the shift is what
makes it a recurrence: R_0 .. R_{K-1} is one, an LSTM's c another, a step
that reads S_{t-2} a third); a tuple of nodes of one op, shape and attrs
that all depend on R_0 is computed by the step from its arguments' tuples.
Anything else is no run. Each rule holds node by node, so the scan's step
computes, at step t, exactly the t-th node of each tuple: the rewrite is
exact, and gradients follow from the scan's own rules.

Per-step params (a different W_t each step) would fit as a sequence, but
that is a different model than a shared cell: such a run is left as it is.
`SYMBACKPROP_UNROLLED_SCANS=0` leaves every unrolled recurrence as written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from symbackprop.base.registry import is_view
from symbackprop.ir.construct import is_const, leaf
from symbackprop.ir.lower import Lowered
from symbackprop.ir.node import Node, op_node, topological_order
from symbackprop.loops.declare import entries
from symbackprop.loops.graph import ScanStep, scan_node, scan_part, substitute
from symbackprop.loops.hoist import hoist_loops
from symbackprop.loops.reshape import reshape
from symbackprop.loops.zero_start import zero_like, zero_start
from symbackprop.ops.slices import slice_view

# Shorter runs stay unrolled: a loop (forward and backward) costs GCC more
# than a few straight-line steps do. An unrolled GRU compiled in 1.9 s of
# CPU at 10 steps (2.5 s as a scan from zeros), 2.1 s at 16 (2.5 s), 2.3 s
# at 20 (2.4-2.5 s), 2.4-2.5 s at 24 (2.5-2.6 s), 4.3 s at 100 (2.9 s;
# benchmarks/compile_blocks.py, pinned, 2026-12-07).
MIN_STEPS = 32
MAX_PERIOD = 256  # the longest step (nodes on the path from one state to the one before) looked for
MAX_TRIES = 8  # runs tried per path, each shorter than the last
NEWEST_TRIED = 3  # a phase's newest candidates left out in turn where its probe fails
MAX_ROUNDS = 16  # recurrences replaced per model (each round finds one)
WALK_BUDGET = 5_000_000  # nodes a walk may visit (a step's nodes times K): past it, no run
OPT_OUT_ENV = "SYMBACKPROP_UNROLLED_SCANS"


class _NoRun(Exception):
    """The tuples disagree: `drop` oldest steps are not part of the run."""

    def __init__(self, drop: int):
        super().__init__(drop)
        self.drop = drop


NEVER = 1 << 30  # a disagreement no shorter run avoids (per-step params)


def recognize_scans(lowered: Lowered) -> Lowered:
    """`lowered` with each run of MIN_STEPS or more repeated steps of a
    recurrence replaced by one scan (unchanged where there is none)."""
    if os.environ.get(OPT_OUT_ENV, "").strip() == "0":
        return lowered
    taken = set(lowered.leaves)
    for _ in range(MAX_ROUNDS):
        roots = [lowered.loss, *lowered.outputs.values()]
        found = _first_run(roots, taken)
        if found is None:
            return lowered
        lowered = _replaced(lowered, found)
    return lowered


def _replaced(lowered: Lowered, mapping: dict[Node, Node]) -> Lowered:
    names = list(lowered.outputs)
    named = [node for _, node in lowered.named]
    done = substitute([lowered.loss, *lowered.outputs.values(), *named], mapping)
    loss, outputs, named_nodes = done[0], done[1:1 + len(names)], done[1 + len(names):]
    return replace(lowered, loss=loss, outputs=dict(zip(names, outputs)),
                   named=tuple((name, node) for (name, _), node in zip(lowered.named, named_nodes)))


def _first_run(roots: Sequence[Node], taken: set[str]) -> dict[Node, Node] | None:
    """The states of a run -> what the scan reads them as."""
    order = topological_order(roots)
    height: dict[Node, int] = {}
    for node in order:
        height[node] = 1 + max((height[a] for a in node.args), default=-1)
    position = {node: k for k, node in enumerate(order)}
    for root in roots:
        for anchors in _ranked(_candidates(_spine(root, height)), order, position, taken):
            found = _best_run(anchors, order, position, roots, taken)
            if found is not None:
                return found
    return None


def _ranked(phases: list[list[Node]], order: list[Node], position: dict[Node, int],
            taken: set[str]) -> list[list[Node]]:
    """The phases whose newest steps walk as one step (leaving out the
    newest candidate or two where they do not: the spine's top may be a
    layer above, as a stacked RNN's h2_T above h1's chain), fewest states first
    (a GRU's h, not h and a gate), then the most read (the state, which
    every gate reads, not a product inside the step), then nearest the
    root: each probed on its newest MIN_STEPS steps, which costs little."""
    readers: dict[Node, int] = {}
    for node in order:
        for a in set(node.args):
            readers[a] = readers.get(a, 0) + 1
    scored = []
    for k, phase in enumerate(phases):
        for newest in range(len(phase), len(phase) - NEWEST_TRIED, -1):  # the top may be another chain's
            anchors = phase[:newest]
            probe = anchors[-MIN_STEPS - 1:]
            if len(probe) <= MIN_STEPS:
                break
            try:
                walk = _Walk(probe[0], tuple(probe[1:]), _dependents(probe[0], order, position), taken)
                walk.scan()
            except _NoRun:
                continue
            scored.append((len(walk.states), -readers.get(anchors[-2], 0), k, anchors))
            break
    return [anchors for *_, anchors in sorted(scored, key=lambda s: s[:3])]


def _spine(root: Node, height: dict[Node, int]) -> list[Node]:
    """The longest path from `root` to a leaf (the first argument of the
    longest on a tie: the same choice in every step)."""
    path = [root]
    while path[-1].args:
        path.append(max(path[-1].args, key=height.__getitem__))
    return path


def _signature_ids(spine: list[Node]) -> np.ndarray:
    ids: dict[tuple, int] = {}
    out = []
    for node, below in zip(spine, spine[1:] + [None]):
        which = node.args.index(below) if below is not None else -1
        sig = (node.op, node.shape, node.attrs if node.op != "leaf" else node.attrs[1], len(node.args), which)
        out.append(ids.setdefault(sig, len(ids)))
    return np.array(out, dtype=np.int64)


def _longest_true(flags: np.ndarray) -> tuple[int, int]:
    """(start, length) of the first longest run of True in `flags`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    starts, ends = edges[::2], edges[1::2]
    if not len(starts):
        return 0, 0
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def _candidates(spine: list[Node]) -> list[list[Node]]:
    """For the period of the spine's longest periodic stretch, each phase's
    nodes (the candidate states), oldest first, with the one below the
    oldest (R_0) in front."""
    ids = _signature_ids(spine)
    best: tuple[int, int, int] | None = None  # (covered, period, start)
    for period in range(1, min(MAX_PERIOD, len(ids) // MIN_STEPS) + 1):
        start, length = _longest_true(ids[:-period] == ids[period:])
        covered = length + period
        if length and covered >= MIN_STEPS * period and (best is None or covered > best[0]):
            best = (covered, period, start)
    if best is None:
        return []
    covered, period, start = best
    phases = []
    for phase in range(period):
        at = [k for k in range(start + phase, start + covered, period) if k + period < len(spine)]
        if len(at) >= MIN_STEPS:
            phases.append([spine[at[-1] + period], *(spine[k] for k in reversed(at))])
    return phases


def _best_run(anchors: list[Node], order: list[Node], position: dict[Node, int], roots: Sequence[Node],
              taken: set[str]) -> dict[Node, Node] | None:
    """The longest run ending at the newest of `anchors` that walks as one
    step, as the nodes of its steps -> the scan's values of them (None
    where there is none)."""
    for _ in range(MAX_TRIES):
        if len(anchors) - 1 < MIN_STEPS:
            return None
        init, steps = anchors[0], tuple(anchors[1:])
        try:
            walk = _Walk(init, steps, _dependents(init, order, position), taken)
            mapping = _read_as(walk, *walk.scan())
        except _NoRun as failed:
            anchors = anchors[min(failed.drop, len(anchors)):]
            continue
        inside = [_last_index(walk.computed[r], r) for r in roots if r in walk.computed and r is not steps[-1]]
        if inside:  # an output of the model inside the run (wrt it, its adjoint needs the later steps)
            anchors = anchors[max(inside) + 1:]  # start the run after it
            continue
        read = _read_outside(roots, walk, mapping)
        if read:  # a loss over every state: what it reads of the steps, the step's outputs
            mapping = _read_as(walk, *walk.scan(read), read)
            if _read_outside(roots, walk, mapping):
                return None
        return mapping
    return None


def _read_as(walk: _Walk, step: ScanStep, args: list[Node],
             read: Sequence[tuple[Node, ...]] = ()) -> dict[Node, Node]:
    """The last state -> the scan's final state; the nodes of each tuple
    of `read` (the step's outputs, in order) -> their rows of the output."""
    carrier = scan_node(step, args)
    last = walk.steps[-1]
    mapping = {last: scan_part(carrier, "final", walk.root_state or 0, last.shape)}
    for k, nodes in enumerate(read):
        width = entries(nodes[0].shape)
        rows = scan_part(carrier, "output", k, (step.length, width))
        for t, node in enumerate(nodes, start=walk.offset):
            row = slice_view(rows, (t, 1, 0, 1), (1, width))
            mapping.setdefault(node, row if node.shape == row.shape else op_node("reshape", (row,), node.shape))
    return mapping


def _read_outside(roots: Sequence[Node], walk: _Walk, mapping: dict[Node, Node]) -> list[tuple[Node, ...]]:
    """The tuples of the step some of whose nodes something outside the
    steps still reads (besides the loop), in the walk's order: each would
    keep the steps below it unrolled."""
    new_roots = substitute(list(roots), mapping)
    outer = set(topological_order(next(iter(mapping.values())).args[0].args))  # what the loop reads
    steps = walk.computed
    found = {steps[a] for n in topological_order(new_roots) if n not in steps for a in n.args
             if a in steps and a not in outer}
    found.update(steps[n] for n in new_roots if n in steps)
    return [t for t in dict.fromkeys(walk.computed.values()) if t in found]


def _dependents(init: Node, order: list[Node], position: dict[Node, int]) -> set[Node]:
    """The nodes that read `init`, directly or not (computed after it)."""
    found: set[Node] = set()
    for node in order[position[init] + 1:]:
        if any(a is init or a in found for a in node.args):
            found.add(node)
    return found


def _last_index(nodes: tuple[Node, ...], node: Node) -> int:
    return len(nodes) - 1 - nodes[::-1].index(node)


def _same_op(nodes: tuple[Node, ...]) -> bool:
    first = nodes[0]
    return all(n.op == first.op and n.shape == first.shape and n.attrs == first.attrs
               and len(n.args) == len(first.args) for n in nodes)


def _last_unlike(nodes: tuple[Node, ...]) -> int:
    """How many of the oldest steps to drop so that the rest agree with the newest."""
    newest = nodes[-1]
    unlike = [k for k, n in enumerate(nodes) if not _same_op((n, newest))]
    return unlike[-1] + 1 if unlike else 1


class _Walk:
    """The K steps from `steps` down, walked as tuples (see the module's
    docstring); `scan()` builds the step and the scan's arguments."""

    def __init__(self, init: Node, steps: tuple[Node, ...], varying: set[Node], taken: set[str]):
        self.init, self.steps, self.varying, self.outer_names = init, steps, varying, taken
        self.taken: set[str] = set()
        self.by_value: dict[Node, Node] = {}  # the outer value -> its capture leaf
        self.memo: dict[tuple[Node, ...], Node] = {}
        self.prefixes: dict[tuple[Node, ...], tuple[Node, ...]] = {}  # M[:-1] -> M, for each tuple walked
        self.states: list[tuple[Node, ...]] = []
        self.slots: list[tuple[Node, ...]] = []
        self.captures: dict[Node, Node] = {}  # capture leaf -> the outer value
        self.expand: set[tuple[Node, ...]] = set()  # mixed tuples computed by the step, not states
        self.root_state: int | None = None
        self.offset = 0  # 1 where the loop starts from zeros a step before `steps` (loops/zero_start.py)

    def scan(self, outputs: Sequence[tuple[Node, ...]] = ()) -> tuple[ScanStep, list[Node]]:
        for _ in range(MAX_TRIES):
            self.memo, self.prefixes, self.states, self.slots, self.captures = {}, {}, [], [], {}
            self.computed: dict[Node, tuple[Node, ...]] = {}  # a node of a step -> its tuple
            self.taken, self.by_value, self.root_state = set(self.outer_names), {}, None
            self.budget = WALK_BUDGET
            self.visit(self.steps)
            unresolved = [t for t in self.states if t[1:] not in self.prefixes]
            if not unresolved:
                return self._build(outputs)
            for t in unresolved:
                if not _same_op(t):
                    raise _NoRun(_last_unlike(t))
            self.expand.update(unresolved)  # a view or product of a state: walk it down to the state
        raise _NoRun(1)

    def visit(self, t: tuple[Node, ...]) -> Node:
        found = self.memo.get(t)
        if found is None:
            found = self.memo[t] = self._classify(t)
        return found

    def _classify(self, t: tuple[Node, ...]) -> Node:
        first = t[0]
        if all(n is first for n in t):
            return self._shared(first)
        if t[1:] in self.prefixes:  # shifted by a step from a tuple walked: a state
            return self._state(t)
        self.budget -= len(t)
        if self.budget < 0:
            raise _NoRun(NEVER)  # walking a history down, not a step
        inside = [n in self.varying for n in t]
        if not all(inside) and any(inside) and t not in self.expand:
            return self._state(t)  # the first steps read values from before the run: a state, or no run
        if not _same_op(t) or first.op == "leaf":
            if any(inside):
                raise _NoRun(_last_unlike(t))
            return self._slot(t)
        self.prefixes[t[:-1]] = t
        for n in t:
            self.computed.setdefault(n, t)
        args = [self.visit(tuple(n.args[k] for n in t)) for k in range(len(first.args))]
        return op_node(first.op, args, first.shape, first.attrs)

    def _fresh(self, stem: str) -> str:
        name, k = stem, 0
        while name in self.taken:
            k += 1
            name = f"{stem}_{k}"
        self.taken.add(name)
        return name

    def _shared(self, node: Node) -> Node:
        """A node every step reads: a constant or a view of shared nodes
        stays in the step; anything else is a capture."""
        if is_const(node):
            return node
        if is_view(node.op) and node.args:
            return op_node(node.op, [self._shared(a) for a in node.args], node.shape, node.attrs)
        found = self.by_value.get(node)
        if found is not None:
            return found
        # an input or param under its own name, as in a declared scan's step (loops/lower.py)
        name = node.attrs[0] if node.op == "leaf" else self._fresh(f"captured{len(self.captures)}")
        capture = leaf(name, node.shape, "scan_capture")
        self.captures[capture] = node
        self.by_value[node] = capture
        return capture

    def _slot(self, t: tuple[Node, ...]) -> Node:
        """Row t of a sequence: per-step values computed before the loop."""
        if any(n.shape != t[0].shape for n in t):
            raise _NoRun(_last_unlike(t))
        if any(n.op == "leaf" and n.attrs[1] == "param" for n in t):
            raise _NoRun(NEVER)  # a param per step: not one cell repeated
        self.slots.append(t)
        return leaf(self._fresh(f"step_input{len(self.slots) - 1}"), t[0].shape, "scan_input")

    def _state(self, t: tuple[Node, ...]) -> Node:
        if any(n.shape != t[-1].shape for n in t):
            raise _NoRun(_last_unlike(t))
        if t[1:] == self.steps[:-1]:
            self.root_state = len(self.states)
        self.states.append(t)
        self.prefixes[t[:-1]] = t
        return leaf(self._fresh(f"step_state{len(self.states) - 1}"), t[-1].shape, "scan_state")

    def _build(self, read: Sequence[tuple[Node, ...]]) -> tuple[ScanStep, list[Node]]:
        if self.root_state is None:
            raise _NoRun(NEVER)  # R_0 .. R_{K-1} is no state: the candidates are no recurrence
        state_leaves = tuple(self.memo[t] for t in self.states)
        next_states = tuple(self.memo[self.prefixes[t[1:]]] for t in self.states)
        input_leaves = tuple(self.memo[t] for t in self.slots)
        inits, slots = [t[0] for t in self.states], list(self.slots)
        first = zero_start(inits, next_states, state_leaves, slots, input_leaves, self.captures)
        self.offset = int(first is not None)
        if first is not None:  # the step before the run is the step from zeros: the loop starts there
            inits, slots = [zero_like(s) for s in inits], [(v, *t) for v, t in zip(first, slots)]
        outputs = tuple(self.memo[t] for t in read)
        roots, values = hoist_loops(next_states + outputs, state_leaves + input_leaves, dict(self.captures))
        reached = set(topological_order(roots))
        captured = [c for c in values if c in reached]
        step = ScanStep(states=state_leaves, inputs=input_leaves, captures=tuple(captured),
                        next_states=tuple(roots[:len(next_states)]), outputs=tuple(roots[len(next_states):]), every=1,
                        length=len(self.steps) + self.offset)
        args = inits + [_sequence(t) for t in slots] + [values[c] for c in captured]
        return step, args


def _sequence(values: tuple[Node, ...]) -> Node:
    """The per-step values as the loop reads them: row t (of T) holds step
    t's value, row-major (the input itself where the values are its
    consecutive row blocks, else a copy)."""
    width = entries(values[0].shape)
    block = _rows_of(values)
    if block is not None:  # contiguous rows, read in place (a reshape of a row slice is row-major)
        return block if block.shape == (len(values), width) else op_node("reshape", (block,), (len(values), width))
    rows = tuple(reshape(v, (1, width)) for v in values)
    steps = tuple(x for t in range(len(values)) for x in (t, 1, 0, 1))
    return op_node("slice_scatter", rows, (len(values), width), steps)


def _rows_of(values: tuple[Node, ...]) -> Node | None:
    """The rows of one matrix that the values are, block after block
    (X[t*n:(t+1)*n, :] for consecutive t), or None."""
    first = values[0]
    if first.op != "slice" or is_view(first.args[0].op):
        return None
    whole, (rows, cols) = first.args[0], first.shape
    start = first.attrs[0]
    if not isinstance(rows, int) or cols != whole.shape[1] or tuple(first.attrs) != (start, 1, 0, 1):
        return None
    for t, v in enumerate(values):
        if v.op != "slice" or v.args[0] is not whole or tuple(v.attrs) != (start + t * rows, 1, 0, 1):
            return None
    if start == 0 and whole.shape[0] == rows * len(values):
        return whole
    return op_node("slice", (whole,), (rows * len(values), cols), (start, 1, 0, 1))
