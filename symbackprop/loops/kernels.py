"""The kernels of a scan: the forward loop ("scan" nodes), the backward
loop ("scan_vjp" nodes, with checkpoint segments recomputed) and the parts
its loops write ("scan_part"). The step is scheduled by the ordinary
scheduler, with names scoped to the loop."""

from __future__ import annotations

from typing import Any

import sympy as sp

from symbackprop.ir.construct import is_const, leaf
from symbackprop.ir.node import Node
from symbackprop.loops.bind import (
    STEP,
    Binder,
    Fill,
    InnerNames,
    Loop,
    PartKernel,
    Pointer,
    ScanKernel,
    U,
    fits,
    part_buffers,
    state_pointers,
)
from symbackprop.loops.declare import entries
from symbackprop.loops.graph import (
    ScanBack,
    ScanStep,
    cached_products,
    cached_width,
    node_offsets,
    reverse_roots,
    reverse_scratch,
    step_scratch,
    substitute,
)
from symbackprop.schedule.kernel import Equation, latex_name
from symbackprop.schedule.scheduler import Scheduler, schedule


def states_text(step: ScanStep) -> str:
    return ", ".join(s.attrs[0] for s in step.states)


def build_forward(sched: Scheduler, node: Node, out: str) -> ScanKernel:
    """The loop of a "scan" node: its states from the inits, the step at
    each row of the sequences, writing the outputs' rows, the kept states
    and the final states (the buffers of its parts)."""
    step: ScanStep = node.attrs[0]
    inits, seqs, caps = step.split(node.args)
    parts = part_buffers(sched, node)
    inner = InnerNames()
    names = {role: inner.claim(role) for role in ("t", "cur", "nxt", "swap", "i", "j", "base")}
    scratch = inner.claim(out, outer=out)
    width = step.width
    binder = Binder(sched, inner, scratch, 2 * width + step_scratch(step))
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
        pointers.append(Pointer(row, outer, STEP * entries(root.shape), True))
        results.append((row, root))
        writes.append(buffer)
    pointers += state_pointers(step, state_names, names["cur"], 0, False)
    pointers += state_pointers(step, next_names, names["nxt"], 0, True)
    inner.prename([root for _, root in results])
    fs = fits(schedule(f"{out} step", results, inner.naming, sum_products=False), step_scratch(step))
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
    for off, size, init, _s in zip(step.offsets, step.sizes, inits, step.states):
        source = init.attrs[0] if is_const(init) else binder.outer(init)
        starts.append((off, size, source, init.shape))
    until = None
    if step.until is not None:  # a fixed point: its test's locals and the count of steps run
        names.update(change=inner.claim("change"), d=inner.claim("d"))
        count = parts.get(("count", 0))
        if count is not None:
            writes.append(count)
            count = inner.claim(count, outer=count)
        until = (step.until.tol, step.until.watch, count)
    outputs = [parts[("output", o)] for o in range(len(step.outputs)) if ("output", o) in parts]
    text, latex = _forward_equation(step, names["t"], outputs, inner.bound[kept] if kept else None)
    return ScanKernel(
        mode="forward", scope=out, scratch=scratch, bound=tuple(inner.bound.items()), length=step.length,
        every=step.every, width=width, offsets=step.offsets, sizes=step.sizes, names=names,
        wholes=tuple(w for w in wholes if w.name), starts=tuple(starts), kept=kept,
        loops=(Loop(fs, 2 * width, tuple(pointers), tuple(step_fills)),),
        finals=tuple(finals), zeroed=(), equations=(Equation(out, text, latex),),
        reads_=tuple(dict.fromkeys(binder.reads)), writes_=tuple(dict.fromkeys(writes)), reverse=step.reverse,
        until=until,
    )


def _forward_equation(step: ScanStep, t: str, outputs: list[str], kept: str | None) -> tuple[str, str]:
    """The comment and the LaTeX of a forward loop."""
    if step.until is not None:
        return _until_equation(step, t, kept)
    text = (f"scan over {t} < {step.length}: ({states_text(step)}) = step({states_text(step)}, "
            f"{', '.join(x.attrs[0] for x in step.inputs)} = row {t})"
            + (f"; outputs in rows of {', '.join(outputs)}" if outputs else "")
            + (f"; one state in {step.every} kept in {kept}" if kept and step.every > 1 else "")
            + (f"; states kept in {kept}" if kept and step.every == 1 else ""))
    made = "".join(rf", \ {latex_name(o)}_t" for o in outputs)
    latex = (rf"({states_text(step)})_{{t+1}}{made} = \mathrm{{step}}(({states_text(step)})_t, x_t)"
             rf" \quad \text{{for }} t < {sp.latex(step.length)}")
    return text, latex


def _until_equation(step: ScanStep, t: str, kept: str | None) -> tuple[str, str]:
    """The comment and the LaTeX of a fixed point's loop."""
    assert step.until is not None
    text = (f"fixed point: ({states_text(step)}) = step({states_text(step)}) until the largest change is "
            f"<= {step.until.tol!r} or NaN, at most {step.length} steps ({t})"
            + (f"; states kept in {kept}" if kept else ""))
    latex = (rf"({states_text(step)})_{{k+1}} = \mathrm{{step}}(({states_text(step)})_k) \quad \text{{until }} "
             rf"\max |\Delta| \le {sp.latex(sp.Float(step.until.tol, 3))}, \ k < {step.length}")
    return text, latex


class _Backward:
    """Builds the loop of a "scan_vjp" node: the step's VJP run from the last
    step to the first, over the kept states; with checkpoints, a recompute
    loop first rebuilds each segment's states from its checkpoint. Names and
    scratch are claimed in a fixed order (that of the C's declarations)."""

    def __init__(self, sched: Scheduler, node: Node, out: str):
        back: ScanBack = node.attrs[0]
        self.back, self.step, self.out, self.sched = back, back.step, out, sched
        step = back.step
        self.kept_arg, self.seqs, caps, self.gys, self.gfs = back.split(node.args)
        self.parts = part_buffers(sched, node)
        inner = self.inner = InnerNames(back.origins)
        roles = ["t", "cur", "nxt", "swap", "i", "j", "base"] + (["seg", "s", "t0", "len", "u"] if step.every > 1 else [])
        self.names = {role: inner.claim(role) for role in roles}
        self.scratch = inner.claim(out, outer=out)
        width, segment = step.width, step.segment  # a segment's rows: sized by the steps too
        self.cached = cached_products(back)
        cached_at = 2 * width + (segment + 1) * width  # the products of the segment's steps, after its states
        self.cached_offsets = [cached_at + off for off in node_offsets(self.cached)]
        self.cw = cached_width(self.cached)
        self.region = 2 * width + (segment * width if step.every > 1 else 0) + \
            (width + segment * self.cw if self.cached else 0)
        binder = self.binder = Binder(sched, inner, self.scratch, self.region + reverse_scratch(back))
        self.state_names = [inner.claim(s.attrs[0], s) for s in step.states]
        self.kept_view = binder.outer(self.kept_arg)
        self.kept = inner.claim(self.kept_view.buffer, outer=self.kept_view.buffer)
        self.wholes = [binder.whole(c, a) for c, a in zip(step.captures, caps)]
        self.row_pointers: list[Pointer | Fill] = []
        self.row_fills: list[Pointer | Fill] = []
        for x, seq in zip(step.inputs, self.seqs):
            bound = binder.rows(x, seq)
            (self.row_pointers if isinstance(bound, Pointer) else self.row_fills).append(bound)
        self.writes = [out]
        self.zeroed: list[tuple[str, Any]] = []
        self.count = binder.outer(node.args[-1]) if back.counted else None  # the steps a fixed point ran

    def recompute_loop(self) -> Loop:
        """A segment's states: state u-1 -> state u, inputs at row t = t0 + u - 1."""
        step, inner, width, scratch = self.step, self.inner, self.step.width, self.scratch
        next_names = [inner.claim(f"{s.attrs[0]}_next") for s in step.states]
        pointers = list(self.row_pointers)
        pointers += state_pointers(step, self.state_names, self.names["seg"], (U - 1) * width, False)
        pointers += state_pointers(step, next_names, self.names["seg"], U * width, True)
        results = list(zip(next_names, step.next_states))
        # the outputs the forward loop computed too (into a scratch row), so
        # that the recomputed states are the forward's to the last bit
        computed = part_buffers(self.sched, self.kept_arg.args[0])
        for o, root in enumerate(step.outputs):
            if ("output", o) in computed:
                row = inner.claim(f"out{o}_row")
                pointers.append(Pointer(row, scratch, self.binder.room(entries(root.shape)), True))
                results.append((row, root))
        inner.prename([root for _, root in results])
        for product, at in zip(self.cached, self.cached_offsets):
            name = inner.claim(f"{inner.naming(product)}_kept")
            pointers.append(Pointer(name, scratch, at + (U - 1) * self.cw, True))
            results.append((name, product))
        fs = fits(schedule(f"{self.out} recompute", results, inner.naming, sum_products=False), reverse_scratch(self.back))
        return Loop(fs, self.region, tuple(pointers), tuple(self.row_fills))

    def reverse_loop(self) -> Loop:
        """The step's VJP: the adjoint of state t from that of state t+1 and
        of output t, the adjoints of the inputs' rows and of the captures."""
        step, inner, back = self.step, self.inner, self.back
        grad_next = [inner.claim(g.attrs[0], g) for g in back.grad_next]
        grad_state = [inner.claim(f"grad_{s.attrs[0]}") for s in step.states]
        pointers, fills = list(self.row_pointers), list(self.row_fills)
        segments = step.every > 1
        state_row = (U * step.width) if segments else STEP * step.width
        pointers += state_pointers(step, self.state_names, self.names["seg"] if segments else self.kept, state_row, False)
        pointers += state_pointers(step, grad_next, self.names["cur"], 0, False)
        pointers += state_pointers(step, grad_state, self.names["nxt"], 0, True)
        kept_leaves = {}
        for product, at in zip(self.cached, self.cached_offsets):
            kept_leaf = leaf(f"{inner.naming(product)}_kept", product.shape, "scan_kept")
            kept_leaves[product] = kept_leaf
            pointers.append(Pointer(inner.claim(kept_leaf.attrs[0], kept_leaf), self.scratch, at + U * self.cw, False))
        roots = substitute(reverse_roots(back), kept_leaves)
        n_states, n_inputs = len(back.grad_states), len(back.grad_inputs)
        results = list(zip(grad_state, roots[:n_states]))
        for (_o, gy_leaf), gy in zip(back.grad_outputs, self.gys):
            bound = self.binder.rows(gy_leaf, gy)
            (pointers if isinstance(bound, Pointer) else fills).append(bound)
        grad_inputs = [(j, g) for (j, _), g in zip(back.grad_inputs, roots[n_states:n_states + n_inputs])]
        results += self._results(grad_inputs, roots[n_states + n_inputs:], pointers)
        inner.prename(list(step.next_states) + list(step.outputs))
        inner.prename([root for _, root in results])
        fs = fits(schedule(f"{self.out} reverse", results, inner.naming, sum_products=False), reverse_scratch(back))
        return Loop(fs, self.region, tuple(pointers), tuple(fills))

    def _results(self, grad_inputs: list, totals: list, pointers: list) -> list[tuple[str, Node]]:
        """The rows of the sequences' adjoints (pointers into their buffers)
        and the captures' accumulators (zeroed before the loop)."""
        inner, results = self.inner, []
        for j, grad in grad_inputs:
            buffer = self.parts.get(("grad_seq", j))
            if buffer is None:
                continue
            row = inner.claim(f"{buffer}_row")
            outer = inner.claim(buffer, outer=buffer)
            pointers.append(Pointer(row, outer, STEP * self.seqs[j].shape[1], True))
            results.append((row, grad))
            self.writes.append(buffer)
        for (m, acc, _), total in zip(self.back.accumulate, totals):
            buffer = self.parts.get(("grad_capture", m))
            if buffer is None:
                continue
            name = inner.claim(buffer, acc, outer=buffer)
            results.append((name, total))
            self.zeroed.append((name, entries(acc.shape)))
            self.writes.append(buffer)
        return results

    def starts_and_finals(self) -> tuple[list, list]:
        """The adjoints of the final states copied in (zero where none is
        given), and those of the inits copied out after the loop."""
        step, back = self.step, self.back
        starts = []
        for i, gf in zip(back.grad_finals, self.gfs):
            source = gf.attrs[0] if is_const(gf) else self.binder.outer(gf)
            starts.append((step.offsets[i], step.sizes[i], source, gf.shape))
        have = set(back.grad_finals)
        starts.extend((step.offsets[i], step.sizes[i], sp.Integer(0), step.states[i].shape)
                      for i in range(len(step.states)) if i not in have)
        finals = []
        for (kind, index), buffer in self.parts.items():
            if kind == "grad_init":
                finals.append((self.inner.claim(buffer, outer=buffer), step.offsets[index], step.sizes[index]))
                self.writes.append(buffer)
        return starts, finals

    def equation(self) -> Equation:
        step, every = self.step, self.step.every
        last = "the count of steps run" if self.count is not None else step.length
        text = (f"backward scan over {self.names['t']} = {last}-1 .. 0: adjoints of ({states_text(step)}) and of "
                f"the step's inputs and params, from the states kept in {self.kept_view.buffer}"
                + (f", each segment of {every} steps recomputed from its checkpoint" if every > 1 else ""))
        latex = (rf"\bar{{s}}_t = \bar{{s}}_{{t+1}} \frac{{\partial s_{{t+1}}}}{{\partial s_t}} + \bar{{y}}_t "
                 rf"\frac{{\partial y_t}}{{\partial s_t}} \quad \text{{for }} t = {sp.latex(step.length)}-1, \ldots, 0")
        return Equation(self.out, text, latex)


def build_backward(sched: Scheduler, node: Node, out: str) -> ScanKernel:
    """The loop of a "scan_vjp" node (see _Backward)."""
    b = _Backward(sched, node, out)
    step = b.step
    loops = ([b.recompute_loop()] if step.every > 1 else []) + [b.reverse_loop()]
    starts, finals = b.starts_and_finals()
    return ScanKernel(
        mode="backward", scope=out, scratch=b.scratch, bound=tuple(b.inner.bound.items()), length=step.length,
        every=step.every, width=step.width, offsets=step.offsets, sizes=step.sizes, names=b.names,
        wholes=tuple(w for w in b.wholes if w.name), starts=tuple(starts), kept=b.kept, loops=tuple(loops),
        finals=tuple(finals), zeroed=tuple(b.zeroed), equations=(b.equation(),),
        reads_=tuple(dict.fromkeys(b.binder.reads)), writes_=tuple(dict.fromkeys(b.writes)),
        recompute_last=bool(b.cached), reverse=step.reverse, count=b.count,
    )


def build_part(sched: Scheduler, node: Node, out: str) -> PartKernel:
    """A part of a scan's results: its loop wrote it; only a comment."""
    kind, index = node.attrs
    carrier = sched.buffer(node.args[0]) or "?"
    what = {"output": f"output {index}", "final": f"final state {index}", "states": "kept states",
            "grad_init": f"adjoint of init {index}", "grad_seq": f"adjoint of sequence {index}",
            "grad_capture": f"adjoint of captured value {index}", "count": "count of steps"}[kind]
    return PartKernel(f"{out}: the {what} of the loop of {carrier}, written by it")

