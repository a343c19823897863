"""A large module's C is compiled as several translation units at once.

GCC takes one core per file: a module whose C holds several long bodies
(a determinant's forward minors and their adjoints, an LSTM's forward and
backward scans, a mixture's value and gradient loops) waited for them one
after the other. The module stays one .c file, which still builds alone
with a plain `cc -c`; its long functions are grouped into a few units,
each guarded by `#if !defined(SYMBACKPROP_UNIT) || SYMBACKPROP_UNIT == k`,
and the builder compiles the file once per unit (-DSYMBACKPROP_UNIT=k),
all at once, then links the objects. Functions one unit calls in another
are then hidden (not static) symbols, static again in a one-unit build.

The grouping depends on the C text only (its size), never on the machine:
the same model gives the same file everywhere. What a piece costs GCC is
estimated by the length of its kernels' C (about 15-45 us of GCC -O3 per
character on the GradBench ports); a module with less than two units'
worth (UNIT_CHARS) stays one unit, with the C it always had. Otherwise a
kernel of ALONE_CHARS or more becomes a part of its own (cparts), and the
parts and functions are put into at most MAX_UNITS units, largest first
into the lightest unit (LPT), the rest of the module (its self-description,
wrappers, an epoch) in unit 0; the kinds of element-wise loop go together,
as one piece.
"""

from __future__ import annotations

import re
from dataclasses import replace

from symbackprop.emit.cfunction import branches, straight_kernels
from symbackprop.emit.codegen import CFunction, CKernel, CModule, kernel_printer
from symbackprop.emit.cparts import part_ranges

# About 0.15-0.35 s of GCC -O3: a unit less than this is not worth a process
# (a unit's own cost, the runtime header parsed again, is about 0.04 s).
# 15000 left ode (two scans and a backward scan, 18 000 characters: 0.8-1.2 s
# in one unit, 0.4 s for the longer of two) and saddle's gradient module whole.
UNIT_CHARS = 8000
# In a module split into units, a kernel this long is a part of its own, so
# that it can go to a unit of its own (gmm's gradient loop, lstm's backward
# scan, ode's forward scans).
ALONE_CHARS = 3000
# At most this many units: the glue compiles alongside, and each unit parses
# the runtime header again (about 0.04 s).
MAX_UNITS = 4
# What unit 0 holds besides its share: wrappers, the self-describing functions.
REST_CHARS = 2000
# A kind of matrix product's function (emit/products.py) is one call, but GCC
# compiles the helper's loops into it: about 20 ms, as a kernel of this length.
PRODUCT_CHARS = 600

# The kinds of element-wise loop (emit/maps.py) are placed as one piece, under
# this name (not a C name): in one unit, in the order first run, so that an
# edit of one layer adds or removes its kinds there and moves no other kind.
_MAPS = "<maps>"

_GUARD = re.compile(r"^#if !defined\(SYMBACKPROP_UNIT\) \|\| SYMBACKPROP_UNIT == (\d+)$", re.M)


def unit_count(source: str) -> int:
    """How many units a module's C is compiled as (1: not split), read
    from its guards."""
    return 1 + max((int(k) for k in _GUARD.findall(source)), default=0)


def kernel_sizes(module: CModule) -> dict[str, list[int]]:
    """The length of each kernel's C text, by function name."""
    kernel = kernel_printer(module)
    return {fn.name: [len(str(kernel(k, module.real_c, module.helper_prefix))) for k in fn.kernels]
            for fn in module.internal + module.functions}


def split_units(module: CModule) -> CModule:
    """The module with its functions assigned to units (CFunction.unit,
    part_units, the unit of each kind of loop or product; CModule.units),
    or unchanged where one unit is enough."""
    whole, sizes = module, kernel_sizes(module)
    module = _separated(module, sizes)
    if module is not whole:
        sizes = kernel_sizes(module)
    functions = module.internal + module.functions
    cut: dict[str, tuple[tuple[int, int], ...]] = {}
    pieces: list[tuple[int, str, int]] = []  # (size, function, part index or -1 for the whole function)
    for fn in functions:
        lengths = sizes[fn.name]
        alone = sorted(set(straight_kernels(fn.kernels)) | {i for i, n in enumerate(lengths) if n >= ALONE_CHARS})
        cut[fn.name] = parts = part_ranges(len(fn.kernels), fn.split, alone)
        if parts:
            pieces += [(sum(lengths[start:end]), fn.name, index) for index, (start, end) in enumerate(parts)]
        elif fn.kernels:
            pieces.append((sum(lengths), fn.name, -1))
    kernel = kernel_printer(module)
    if module.maps:  # one piece: a kind's unit does not move when another kind comes or goes
        pieces.append((sum(len(str(kernel(kind.kernel, module.real_c, module.helper_prefix))) for kind in module.maps),
                       _MAPS, -1))
    pieces += [(PRODUCT_CHARS, kind.name, -1) for kind in module.products]
    total = REST_CHARS + sum(size for size, _, _ in pieces)
    big = sum(size >= ALONE_CHARS for size, _, _ in pieces)  # a unit each at most (the rest goes with them)
    count = min(MAX_UNITS, total // UNIT_CHARS, big)
    if count < 2:
        return whole
    # largest first into the lightest unit; unit 0 starts with the rest, so
    # the first count - 1 pieces (each ALONE_CHARS or more) fill units 1 to
    # count - 1: every unit is used
    loads = [REST_CHARS] + [0] * (count - 1)
    placed: dict[tuple[str, int], int] = {}
    for _, (size, name, index) in sorted(enumerate(pieces), key=lambda p: (-p[1][0], p[0])):
        unit = min(range(count), key=lambda u: (loads[u], u))
        loads[unit] += size
        placed[name, index] = unit

    def assign(fn: CFunction) -> CFunction:
        parts = cut[fn.name]
        if not parts:
            return replace(fn, parts=(), unit=placed.get((fn.name, -1), 0))
        return replace(fn, parts=parts, unit=0, part_units=tuple(placed[fn.name, i] for i in range(len(parts))))

    return replace(module, internal=tuple(map(assign, module.internal)), functions=tuple(map(assign, module.functions)),
                   maps=tuple(replace(kind, unit=placed[_MAPS, -1]) for kind in module.maps),
                   products=tuple(replace(kind, unit=placed[kind.name, -1]) for kind in module.products), units=count)


def _separated(module: CModule, sizes: dict[str, list[int]]) -> CModule:
    """The module with each kernel of ALONE_CHARS or more that has a
    value-only variant as two kernels (cfunction.branches): a call with
    gradients and one without run different code, which can then be
    compiled in different units (llsq's per-example loop was one unit's
    whole time, both variants in one function)."""

    def separate(fn: CFunction) -> CFunction:
        kernels: list[CKernel] = []
        split = fn.split
        for index, (kernel, size) in enumerate(zip(fn.kernels, sizes[fn.name])):
            if size < ALONE_CHARS or "forward" not in kernel.fields:
                kernels.append(kernel)
                continue
            kernels += branches(kernel)
            if split is not None and index < split:
                split += 1
        return fn if len(kernels) == len(fn.kernels) else replace(fn, kernels=tuple(kernels), split=split)

    internal, functions = tuple(map(separate, module.internal)), tuple(map(separate, module.functions))
    if all(a is b for a, b in zip(internal + functions, module.internal + module.functions)):
        return module
    return replace(module, internal=internal, functions=functions)
