"""One scheduled function as template data (a CFunction): its parameters,
kernels, workspace pointers, entry checks and size check; the value-only
variant of a shared function's loops (forward_only); the public wrappers
that call a shared forward-and-gradient function (emit_wrapper)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import sympy as sp

from symbackprop.base.abi import SIZE_DOES_NOT_FIT
from symbackprop.base.cnames import CNamer
from symbackprop.emit import sizes
from symbackprop.emit.codegen import CFunction, CKernel, CParam, FunctionEmitter
from symbackprop.emit.cparts import MAX_PLACE, FixedBuffer, part_ranges
from symbackprop.emit.emitted import RealType
from symbackprop.schedule.kernel import kernel_reads, kernel_writes
from symbackprop.schedule.scheduler import FunctionSchedule, Slot


def emit_function(
    schedule: FunctionSchedule,
    namer: CNamer,
    dims: dict[sp.Symbol, str],
    real: RealType,
    inputs: Sequence[tuple[str, tuple]],
    outputs: Sequence[tuple[str, tuple]],
    summary: str,
    prefix: str,
    inout: frozenset[str] = frozenset(),
    indices: frozenset[str] = frozenset(),
    shared: str | None = None,
) -> CFunction:
    """The template data of one scheduled function. With `shared` (its C
    name), a static function with a last parameter `with_grads` that
    returns after the schedule's split when it is 0 (see emit_wrapper)."""
    emitter = FunctionEmitter(namer, dims, real)
    params = [CParam("dim", str(d), c, f"int64_t {c}", ()) for d, c in dims.items()]
    for name, shape in inputs:
        c = namer.name(name)
        role, const = ("inout", "") if name in inout else ("input", "const ")
        ctype = "int64_t" if name in indices else real.c  # an Index: row numbers
        params.append(CParam(role, name, c, f"{const}{ctype} *{c}", tuple(emitter.dim(d) for d in shape),
                             index=name in indices))
    for name, shape in outputs:
        if name in inout:
            continue
        c = namer.name(name)
        params.append(CParam("output", name, c, f"{real.c} *{c}", tuple(emitter.dim(d) for d in shape)))
    params.append(CParam("work", "work", "work", f"{real.c} *work", ()))
    if shared:
        params.append(CParam("flag", "with_grads", "with_grads", "int with_grads", ()))
    emitter.work_offsets = work_offsets(schedule)
    kernels = [emitter.kernel(k) for k in schedule.kernels]
    if shared:
        kernels = forward_only(kernels, schedule)
    declares = _slot_declarations(schedule, emitter, shared is not None)
    kernels = [replace(k, declares=tuple(declares.get(i, ()))) for i, k in enumerate(kernels)]
    checks = entry_checks(schedule, emitter)
    divides = whole_steps(schedule, emitter)
    size_check = _size_check(schedule, emitter, [*inputs, *outputs], f"{prefix}_{schedule.name}")
    work_size = emitter.dim(schedule.work_size)
    if shared:  # its work_len takes the flag too: a forward-only call needs less
        work_size = f"with_grads ? {work_size} : {emitter.dim(schedule.head_work_size)}"
    return CFunction(
        name=shared or f"{prefix}_{schedule.name}",  # as the pipeline named it (plan.function_name)
        static=shared is not None,
        split=schedule.split if shared else None,
        summary=summary,
        params=tuple(params),
        dims=tuple(dims.values()),
        uses_work=bool(schedule.slots),
        unused=_unused_inputs(params, schedule),
        kernels=tuple(kernels),
        work_size=work_size,
        checks=checks,
        divides=divides,
        statuses=statuses(tuple(dims.values()), checks, divides),
        parts=part_ranges(len(kernels), schedule.split if shared else None, straight_kernels(kernels)),
        size_check=size_check,
        fixed=fixed_buffers(schedule, emitter),
    )


def _size_check(schedule: FunctionSchedule, emitter: FunctionEmitter, arrays: Sequence[tuple[str, tuple]],
                what: str) -> str | None:
    """All the function's sizes summed (its workspace, with and without the
    gradient, and its arrays), as checked C; None when they are fixed (then
    checked here: a ModelError above the limit)."""
    size = sizes.total([schedule.work_size, schedule.head_work_size,
                        *(sp.Mul(*[sp.sympify(d) for d in shape]) for _, shape in arrays)])
    if not size.free_symbols:
        sizes.fixed_size(size, what)
        return None
    return sizes.checked(size, emitter.dim)


def work_offsets(schedule: FunctionSchedule) -> dict[str, int]:
    """Each workspace buffer at a constant place in `work`, the same in a
    call that stops at the split (schedule.head_slots) where it has one
    there: a kernel may read or write it as work[place]."""
    head = {slot.name: slot.offset for slot in schedule.head_slots}
    return {slot.name: int(slot.offset) for slot in schedule.slots
            if sp.sympify(slot.offset).is_Integer and head.get(slot.name, slot.offset) == slot.offset}


def straight_kernels(kernels: Sequence[CKernel]) -> list[int]:
    """Which kernels hold a long straight-line body: each is a part of its own (cparts)."""
    return [i for i, k in enumerate(kernels) if k.fields.get("straight")]


def _slot_declarations(schedule: FunctionSchedule, emitter: FunctionEmitter,
                       shared: bool) -> dict[int, list[tuple[str, str, str]]]:
    """Each workspace pointer by the kernel that first writes it: (C name,
    where, extent), placed relative to its neighbour (a shared function's
    forward-only call may keep less)."""
    namer = emitter.namer
    first_write: dict[str, int] = {}
    for index, kernel in enumerate(schedule.kernels):
        for buffer in kernel_writes(kernel):
            first_write.setdefault(buffer, index)
    declares: dict[int, list[tuple[str, str, str]]] = {}

    def place(slot: Slot, slot_of: dict[str, Slot]) -> str:
        if slot.reuses is not None:
            return namer.name(slot.reuses)
        if slot.after is not None:
            before = slot_of[slot.after]
            return f"{namer.name(slot.after)} + {emitter.dim(sp.sympify(before.shape[0]) * before.shape[1])}"
        return f"work + {emitter.dim(slot.offset)}" if slot.offset != 0 else "work"  # after the fixed-size buffers

    slot_of = {slot.name: slot for slot in schedule.slots}
    head_of = {slot.name: slot for slot in schedule.head_slots} if shared else {}
    for slot in schedule.slots:
        extent = _extent(slot, emitter)
        if slot.reuses is not None:
            extent = f"{extent}, in {namer.name(slot.reuses)}'s memory"
        where = place(slot, slot_of)
        if slot.name in head_of and place(head_of[slot.name], head_of) != where:  # a forward-only call keeps less
            where = f"with_grads ? {where} : {place(head_of[slot.name], head_of)}"
        declares.setdefault(first_write[slot.name], []).append((namer.name(slot.name), where, extent))
    return declares


def _extent(slot: Slot, emitter: FunctionEmitter) -> str:
    """A buffer's shape as C text (a padded buffer's rows: "(N + 7) x 1")."""
    return " x ".join(f"({text})" if " " in text and text[0] != "(" else text for text in map(emitter.dim, slot.shape))


# Only scalars get a named place: a deep MLP of fixed batch whose every matrix
# buffer was a place in `work` took GCC twice as long (1,000 layers: 33 -> 68 s
# of CPU), where the parts' pointers to 1 x 1 buffers were what cost.
NAMED_PLACE_MAX = 1


def fixed_buffers(schedule: FunctionSchedule, emitter: FunctionEmitter) -> tuple[FixedBuffer, ...]:
    """The 1 x 1 workspace buffers at a fixed place (work_offsets),
    each placed relative to the buffer before it or whose memory it takes,
    where that one is such a buffer too (cparts names their places)."""
    offsets, namer = emitter.work_offsets, emitter.namer
    fixed: list[FixedBuffer] = []
    named: set[str] = set()
    for slot in schedule.slots:
        size = sp.sympify(slot.shape[0]) * slot.shape[1]
        place = offsets.get(slot.name)
        if place is None or not size.is_Integer or int(size) > NAMED_PLACE_MAX or place + int(size) > MAX_PLACE:
            continue
        base = slot.reuses if slot.reuses is not None else slot.after
        if base in named:
            fixed.append(FixedBuffer(namer.name(slot.name), namer.name(base), place - offsets[base], _extent(slot, emitter)))
        else:
            fixed.append(FixedBuffer(namer.name(slot.name), None, place, _extent(slot, emitter)))
        named.add(slot.name)
    return tuple(fixed)


def forward_only(kernels: list[CKernel], schedule: FunctionSchedule) -> list[CKernel]:
    """In the shared forward-and-gradient function, a per-example loop that
    computes forward values and adds into gradients in one pass gets a
    second, value-only variant (`forward` in its fields) that a call with
    `with_grads` 0 runs: forward does no derivative work, and
    value_and_grad keeps its single pass over the examples."""
    needed = schedule.needed_before_split
    out = list(kernels)
    for index, ck in enumerate(kernels[:schedule.split]):
        fields = ck.fields
        if ck.kind != "emap" or "store_buffers" not in fields:
            continue
        keep = [b in needed for b in fields["store_buffers"]]
        if all(keep) or not any(keep):
            continue
        out[index] = replace(ck, fields={**fields, "forward": _value_only(fields, keep, needed)})
    return out


def branches(kernel: CKernel) -> tuple[CKernel, CKernel]:
    """A loop with a value-only variant (forward_only) as two kernels, the
    one a call with gradients runs and the one a call without runs: each
    can then be a part of its own, in a unit of its own (cunits). The
    second declares nothing (the first placed its pointers)."""
    fields = {key: value for key, value in kernel.fields.items() if key != "forward"}
    grads = replace(kernel, fields={**fields, "branch": "with_grads"})
    value = replace(kernel, fields={**fields, **kernel.fields["forward"], "branch": "!with_grads"}, declares=(),
                    comments=("the loop above, the forward values only: for a call without gradients",))
    return grads, value


def _value_only(fields: dict, keep: list[bool], needed: set[str]) -> dict:
    """The stores kept, the temporaries they use (transitively), the
    zeroing of the accumulators kept."""
    uses = dict(zip((temp[0] for temp in fields["temps"]), fields["temp_uses"]))
    live: set[str] = set()
    stack = [t for kept, used in zip(keep, fields["store_uses"]) if kept for t in used]
    while stack:
        name = stack.pop()
        if name not in live:
            live.add(name)
            stack.extend(uses[name])
    return {
        "zero": [z for z, b in zip(fields["zero"], fields["zero_buffers"]) if b in needed],
        "zero_buffers": [b for b in fields["zero_buffers"] if b in needed],
        "temps": [temp for temp in fields["temps"] if temp[0] in live],
        "stores": [store for store, kept in zip(fields["stores"], keep) if kept],
        "after": fields.get("after", []) if fields.get("after_buffer") in needed else [],
        "sums_after": [entry for entry in fields.get("sums_after", ()) if entry[-1] in needed],
        "store_buffers": [b for b, kept in zip(fields["store_buffers"], keep) if kept],
    }


def statuses(dims: Sequence[str], checks: Sequence[object], divides: Sequence[object] = ()) -> tuple[int, ...]:
    """The statuses a function with these dimensions, index checks and
    whole-step checks returns (with dimensions, its sizes are checked too)."""
    return (0,) + ((1,) if dims else ()) + ((2,) if checks else ()) + ((5,) if divides else ()) + \
        ((SIZE_DOES_NOT_FIT,) if dims else ())


def whole_steps(schedule: FunctionSchedule, emitter: FunctionEmitter) -> tuple[tuple[str, str], ...]:
    """The (rows, batch) pairs its kernels need whole (a kernel's divides(),
    a batched scan's), as C text, each once."""
    pairs = (pair for kernel in schedule.kernels for pair in getattr(kernel, "divides", tuple)())
    return tuple(dict.fromkeys((emitter.dim(n), emitter.dim(k)) for n, k in pairs))



def _unused_inputs(params: Sequence[CParam], schedule: FunctionSchedule) -> tuple[str, ...]:
    """Input arrays no kernel reads: cast to void in the C, so that builds
    with -Wunused-parameter -Werror (a C user's) accept the function."""
    read = {buffer for kernel in schedule.kernels for buffer in kernel_reads(kernel)}
    return tuple(p.cname for p in params if p.role in ("input", "inout") and p.name not in read)


def emit_wrapper(run: CFunction, name: str, summary: str, outputs: set[str], with_grads: bool,
                 written_before_split: set[str]) -> CFunction:
    """A public function that calls the shared static one: forward stops at
    the split. The results it does not return go to its workspace, after the
    shared function's own, where they are written (value_and_grad's named
    outputs; a gradient forward's loops compute alongside a value); the
    others forward never writes, and gets NULL for."""
    dims = ", ".join(run.dims + ("1" if with_grads else "0",))
    params: list[CParam] = []
    call: list[str] = []
    extra: list[str] = []
    for p in run.params:
        if p.role == "flag":
            call.append("1" if with_grads else "0")
        elif p.role != "output" or p.name in outputs:
            params.append(p)
            call.append(p.cname)
        elif not with_grads and p.name not in written_before_split:
            call.append("NULL")
        else:
            call.append(f"work + {run.name}_work_len({dims})" + "".join(f" + {size}" for size in extra))
            extra.append("*".join(d if d.isidentifier() or d.isdigit() else f"({d})" for d in p.shape))
    work_size = f"{run.name}_work_len({dims})" + "".join(f" + {size}" for size in extra)
    return CFunction(name=name, summary=summary, params=tuple(params), dims=run.dims, uses_work=True, kernels=(),
                     work_size=work_size, delegate=f"{run.name}({', '.join(call)})",
                     checks=run.checks, statuses=run.statuses, divides=run.divides, size_check=run.size_check)


def entry_checks(schedule: FunctionSchedule, emitter: FunctionEmitter) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """The schedule's index checks grouped by Index, as C text: (Index, its
    rows, the rows of each array it gathers from). A gather nested in a
    kernel's own schedule (a scan's step) has no entry check: its rows would
    be read unchecked, so it is refused here (scan's steps cannot gather)."""
    nested = _nested_index_checks(schedule)
    if nested:
        raise AssertionError(f"gathers inside a nested step are not checked at the function's entry: {nested}")
    checks = schedule.index_checks
    grouped: dict[str, tuple[str, list[str]]] = {}
    for name, rows, bound in checks:
        cname = emitter.namer.name(name)
        _, bounds = grouped.setdefault(cname, (emitter.dim(rows), []))
        text = emitter.dim(bound)
        text = text if text.isidentifier() or text.isdigit() else f"({text})"
        if text not in bounds:
            bounds.append(text)
    return tuple((cname, rows, tuple(bounds)) for cname, (rows, bounds) in grouped.items())


def _nested_index_checks(schedule: FunctionSchedule) -> list[tuple]:
    """The index checks of the schedules inside the schedule's kernels (a scan's loops)."""
    found: list[tuple] = []
    for kernel in schedule.kernels:
        for loop in getattr(kernel, "loops", ()):
            inner = getattr(loop, "schedule", None)
            if isinstance(inner, FunctionSchedule):
                found += list(inner.index_checks) + _nested_index_checks(inner)
    return found
