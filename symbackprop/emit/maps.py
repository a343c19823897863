"""Element-wise loops are one function per kind, called with their arrays.

An unrolled recurrent network runs the same few element-wise loops at
every step, on other arrays: a GRU of 30 steps has 92 loops, 85 of them
of 3 kinds. GCC compiled (and vectorized) each copy again, and a copy
that reads 11 or 15 arrays was not vectorized at all: with no proof that
the arrays are disjoint, GCC checks each pair at run time, and gives up
past 10 checks (--param vect-max-version-for-alias-checks). Each kind of
loop (the same C text once its arrays are named a0, a1, ... in order of
first use) is one function of the module; each loop is a call passing
the dimensions the loop reads and its arrays. Its parameters are
restrict (SYMBACKPROP_RESTRICT, the runtime header): a loop's output
never overlaps another of its arrays (the workspace gives a buffer the
memory of one whose last reader ran before the loop, and the module's
outputs must not overlap its inputs), so GCC vectorizes each kind once,
with no alias checks.

A loop that occurs once is a function too: whether a loop is a call, and
the name it calls, depend on its own text only, so that a model edit in
one layer (sigmoid -> relu) changes that layer's C and not another
layer's (whose loop was a call while two layers shared it, and inline
once it was alone; checked in tests/compiled/test_diff_stays_local.py).

Only plain loops over a dimension are shared: those whose text names
nothing but their loop indices and temporaries, the module's dimensions
and real type, real arrays subscripted (`t3[3*i + j]`) and functions
called. A loop of constant size, a table, a loop in parts, a
straight-line body, an Index array, the workspace itself or any other
name keeps the loop where it is.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from symbackprop.emit.codegen import CFunction, CKernel, CModule

# C words a loop's text may hold besides its own names (casts, literals)
_C_WORDS = frozenset({"int64_t", "int", "double", "float", "const", "INFINITY", "NAN"})
_TOKEN = re.compile(r"\d[\w.]*|([A-Za-z_]\w*)(\s*[\[(])?")
# the fields of a map kernel a shared loop may have (others: a table, parts, flags kept inline)
_PLAIN_FIELDS = frozenset({"loops", "hoisted", "parallel", "straight", "temps", "stores", "statements", "independent",
                           "whole", "sums", "sums_block"})


@dataclass(frozen=True)
class MapKind:
    """The module's function for the loops of one kind: name(dims..., arrays...)."""

    name: str
    params: tuple[str, ...]  # its C parameters: `int64_t n`, `REAL *SYMBACKPROP_RESTRICT a0`, ...
    kernel: CKernel  # the loop, its arrays named a0, a1, ... in order of first use
    calls: int  # how many loops of the module it runs
    unit: int = 0  # the translation unit of its body, where the module is split (cunits)


@dataclass(frozen=True)
class _Shape:
    """A loop in canonical form: its key (the renamed fields' text, which
    also says which dimensions it reads and which arrays it writes), and
    what a call passes."""

    key: str
    dims: tuple[str, ...]
    arrays: tuple[str, ...]  # the caller's arrays, in order of first use
    written: tuple[bool, ...]  # whether each is stored to
    fields: dict  # the fields with the arrays renamed


def share_maps(module: CModule, claim: Callable[[str], str]) -> CModule:
    """The module with each kind of plain element-wise loop a function of
    its own (CModule.maps), named from its own text (see _names); unchanged
    where it has none. `claim` gives a new C name."""
    functions = module.internal + module.functions
    shapes = {id(kernel): shape for fn in functions for kernel, shape in _shapes(fn, module)}
    if not shapes:
        return module
    counts = Counter(shape.key for shape in shapes.values())
    firsts: dict[str, tuple[_Shape, CKernel]] = {}  # each kind's first loop, in the order first run
    anchors = frozenset(name for fn in functions for p in fn.params for name in (p.name, p.cname))
    words: dict[str, Counter[str]] = {}  # each kind's words, one a loop
    for fn in functions:
        for kernel in fn.kernels:
            shape = shapes.get(id(kernel))
            if shape is not None:
                firsts.setdefault(shape.key, (shape, kernel))
                words.setdefault(shape.key, Counter())[_word(shape, anchors)] += 1
    names = _names(module.prefix, {key: _most(words[key]) for key in firsts},
                   {key: shape for key, (shape, _) in firsts.items()})
    kinds = {key: _kind(claim(names[key]), shape, kernel, module.real_c, counts[key])
             for key, (shape, kernel) in firsts.items()}

    def calling(fn: CFunction) -> CFunction:
        def call(kernel: CKernel) -> CKernel:
            shape = shapes.get(id(kernel))
            if shape is None or shape.key not in kinds:
                return kernel
            args = (*shape.dims, *shape.arrays)
            return replace(kernel, fields={"callee": kinds[shape.key].name, "args": args})

        return replace(fn, kernels=tuple(map(call, fn.kernels)))

    return replace(module, functions=tuple(map(calling, module.functions)),
                   internal=tuple(map(calling, module.internal)), maps=tuple(kinds.values()))


def _shapes(fn: CFunction, module: CModule) -> Iterable[tuple[CKernel, _Shape]]:
    """Each of its loops that can be shared, with its canonical form."""
    arrays = {p.cname for p in fn.params if p.role in ("input", "inout", "output") and not p.index}
    arrays |= {name for kernel in fn.kernels for name, _, _ in kernel.declares}  # workspace slots: real
    arrays |= {name for name, _, _ in fn.call_pointers}
    dims = frozenset(module.dims)
    words = _C_WORDS | {module.real_c}  # a dimension as a real: ((REAL)n)
    for kernel in fn.kernels:
        if kernel.kind == "map" and kernel.template == "map_kernel" and _plain(kernel.fields):
            shape = _shape(kernel.fields, arrays, dims, words)
            if shape is not None:
                yield kernel, shape


def _names(prefix: str, words: dict[str, str], shapes: dict[str, _Shape]) -> dict[str, str]:
    """Each kind's name, from its own loops only, so that an edit of one
    layer renames no kind that another layer calls:
    <prefix>_<word>_<bounds>_loop (net_sigmoid_nx6_loop: what its loops
    compute, over n x 6), and where kinds of another text have the same
    word and bounds (several `mul` loops), each with a short hash of its
    text after it (net_mul_nx16_loop_3fa9), not numbered by order."""
    bases = {key: f"{prefix}_{words[key]}_{_bounds(shape)}_loop" for key, shape in shapes.items()}
    tied = Counter(bases.values())
    return {key: base if tied[base] == 1 else f"{base}_{hashlib.sha1(key.encode()).hexdigest()[:4]}"
            for key, base in bases.items()}


def _most(words: Counter[str]) -> str:
    """The word most of a kind's loops have (the first in sorted order among
    as many): not the first loop's, which is the edited layer's as often as
    not (the backward pass runs the last layer first)."""
    return min(words.items(), key=lambda item: (-item[1], item[0]))[0]


def _bounds(shape: _Shape) -> str:
    """The sizes it loops over, joined by x: nx6, n, NxK."""
    return "x".join(re.sub(r"\W", "", str(bound)) for _, bound in shape.fields["loops"])


def _word(shape: _Shape, anchors: frozenset[str] = frozenset()) -> str:
    """What a loop computes, from the name of the first array it
    writes, less its anchor (schedule.naming: one of the
    module's arrays, `anchors`, else the last word): sigmoid for
    sigmoid_W1, grad_add for grad_add_U_z; so a kind keeps its name when
    other kinds come or go."""
    first = next((a for a, written in zip(shape.arrays, shape.written) if written), "")
    first = re.sub(r"_\d+$", "", first)  # a tie's number
    for anchor in sorted(anchors, key=len, reverse=True):
        if first.endswith(f"_{anchor}") and len(first) > len(anchor) + 1:
            return first[:-len(anchor) - 1]
    parts = [p for p in first.split("_") if p]
    return "_".join(parts[:-1] if len(parts) > 1 else parts) or "map"


def _plain(fields: dict) -> bool:
    """A plain loop over a dimension: a loop of constant size (a 2 x 2
    transpose of a scan's weights) costs GCC little, and unrolled whole
    it is faster inline than called."""
    loops = fields.get("loops") or ()
    sized = any(not str(bound).isdigit() for _, bound in loops)
    return sized and set(fields) <= _PLAIN_FIELDS and not fields.get("straight")


def _texts(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def _shape(fields: dict, arrays: set[str], dims: frozenset[str], words: frozenset[str] = _C_WORDS) -> _Shape | None:
    """The loop in canonical form, or None where its text names something
    a function of the module would not see (see the module's text)."""
    local = {index for index, _ in fields["loops"]}
    local |= {name for name, _ in fields.get("hoisted", ())} | {name for name, _ in fields.get("temps", ())}
    local |= {name for store, name, _ in fields.get("statements", ()) if not store}
    used: dict[str, bool] = {}  # array: written, in order of first use
    seen_dims: set[str] = set()
    writes = [target for target, _ in (*fields.get("stores", ()), *fields.get("sums", ()))]
    writes += [name for store, name, _ in fields.get("statements", ()) if store]
    written = {match.group(1) for text in writes for match in _TOKEN.finditer(text) if match.group(1)}
    for text in _texts([fields[name] for name in sorted(fields) if name not in ("parallel", "independent")]):
        for match in _TOKEN.finditer(text):
            word, after = match.group(1), (match.group(2) or "").strip()
            if word is None or word in local or word in words or after == "(":
                continue
            if word in dims and not after:
                seen_dims.add(word)
            elif word in arrays and after == "[":
                used.setdefault(word, word in written)
            else:
                return None
    names = {old: f"a{k}" for k, old in enumerate(used)}
    if set(names.values()) & (local | seen_dims):
        return None
    renamed = _renamed(fields, names)
    return _Shape(repr(sorted(renamed.items())), tuple(sorted(seen_dims)), tuple(used), tuple(used.values()), renamed)


def _renamed(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _TOKEN.sub(lambda m: names.get(m.group(1), m.group(1)) + (m.group(2) or "") if m.group(1) else m.group(0),
                          value)
    if isinstance(value, dict):
        return {key: _renamed(item, names) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_renamed(item, names) for item in value)
    return value


def _kind(name: str, shape: _Shape, kernel: CKernel, real: str, calls: int) -> MapKind:
    params = [f"int64_t {dim}" for dim in shape.dims]
    params += [f"{'' if written else 'const '}{real} *SYMBACKPROP_RESTRICT a{k}" for k, written in enumerate(shape.written)]
    body = CKernel(kernel.kind, (), shape.fields, template=kernel.template)
    return MapKind(name, tuple(params), body, calls)


__all__ = ["MapKind", "share_maps"]
