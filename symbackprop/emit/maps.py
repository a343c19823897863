"""Element-wise loops that repeat are one function per kind, called with their arrays.

An unrolled recurrent network runs the same few element-wise loops at
every step, on other arrays: a GRU of 30 steps has 92 loops, 85 of them
of 3 kinds. GCC compiled (and vectorized) each copy again, and a copy
that reads 11 or 15 arrays was not vectorized at all: with no proof that
the arrays are disjoint, GCC checks each pair at run time, and gives up
past 10 checks (--param vect-max-version-for-alias-checks). Where a kind
of loop (the same C text once its arrays are named a0, a1, ... in order
of first use) occurs more than once in a module, in one function or
several, it becomes one function of the module; each copy is a call
passing the dimensions the loop reads and its arrays. Its parameters are
restrict (SYMBACKPROP_RESTRICT, the runtime header): a loop's output
never overlaps another of its arrays (the workspace gives a buffer the
memory of one whose last reader ran before the loop, and the module's
outputs must not overlap its inputs), so GCC vectorizes each kind once,
with no alias checks. A loop that occurs once keeps its C.

Only plain loops over a dimension are shared: those whose text names
nothing but their loop indices and temporaries, the module's dimensions
and real type, real arrays subscripted (`t3[3*i + j]`) and functions
called. A loop of constant size, a table, a loop in parts, a
straight-line body, an Index array, the workspace itself or any other
name keeps the loop where it is.
"""

from __future__ import annotations

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
_PLAIN_FIELDS = frozenset({"loops", "hoisted", "parallel", "straight", "temps", "stores", "statements", "independent"})


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
    """The module with each kind of element-wise loop that occurs more
    than once a function of its own (CModule.maps), <prefix>_<word>_loop
    (see _word); unchanged where none repeats. `claim` gives a new C name."""
    functions = module.internal + module.functions
    shapes = {id(kernel): shape for fn in functions for kernel, shape in _shapes(fn, module)}
    counts = Counter(shape.key for shape in shapes.values())
    repeated = {key for key, n in counts.items() if n > 1}
    if not repeated:
        return module
    kinds: dict[str, MapKind] = {}
    ties: Counter[str] = Counter()
    for fn in functions:  # numbered in the order first run
        for kernel in fn.kernels:
            shape = shapes.get(id(kernel))
            if shape is not None and shape.key in repeated and shape.key not in kinds:
                base = f"{module.prefix}_{_word(shape)}_loop"
                ties[base] += 1  # a tie: <base>_2, ... in the order first run
                name = claim(base if ties[base] == 1 else f"{base}_{ties[base]}")
                kinds[shape.key] = _kind(name, shape, kernel, module.real_c, counts[shape.key])

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


def _word(shape: _Shape) -> str:
    """What a kind of loop computes, from the name of the first array it
    writes in its first call, less its anchor (schedule.naming): sigmoid
    for sigmoid_W1, grad_add for grad_add_W2; so a kind keeps its name when
    other kinds come or go."""
    first = next((a for a, written in zip(shape.arrays, shape.written) if written), "")
    parts = [p for p in first.split("_") if p]
    if parts and parts[-1].isdigit():  # a tie's number
        parts.pop()
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
    writes = [target for target, _ in fields.get("stores", ())]
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
