"""A long generated function is cut into parts: static functions of at most
PART_KERNELS kernels each, which the function calls in order.

A C compiler's optimizer (register allocation, partial redundancy
elimination) takes time that grows faster than linearly with the length of
one function: a 300-layer MLP as one function took GCC -O3 81 s, against 4 s
for 30 layers. Parts of bounded length make the compile time linear in the
model's depth; small models (every golden file) stay one function.

Each part takes those of the function's parameters and workspace pointers
(declared in one block by the function) that its kernels use: so no part's
text grows with the length of the function. The 1 x 1 buffers at a fixed place
in `work` (schedule/workspace.py, emit/cfunction.py) are not passed one
pointer each: their places are named once, an enum of the function, and
each buffer's name is a macro, `(work + place)`, from the function's first
part to its end, so a part that uses them takes `work`. A hand-like chain's
hvp passed its parts 11,000 pointers to 1 x 1 buffers, 30% of its C, and
GCC loaded each from the stack and could not tell them apart.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

PART_KERNELS = 32  # kernels per part; a function with more is cut
MAX_PLACE = 2**31 - 1  # the C standard's least INT_MAX: a place in an enum is an int

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def part_ranges(count: int, split: int | None, alone: Sequence[int] = ()) -> tuple[tuple[int, int], ...]:
    """(start, end) kernel ranges of the parts of a function of `count`
    kernels, none for a short one; `split` (where a forward-only call
    returns) is always a boundary. The kernels of `alone` (long
    straight-line bodies, each as much as many kernels for the compiler)
    are each a part of their own: a determinant's forward minors and their
    adjoints, one function, took GCC 1.7 s more than apart."""
    if count <= PART_KERNELS and not alone:
        return ()
    bounds = set(range(0, count, PART_KERNELS)) | {count} | {k for i in alone for k in (i, i + 1)}
    if split is not None and 0 < split < count:
        bounds.add(split)
    edges = sorted(bounds)
    return tuple(itertools.pairwise(edges))


@dataclass(frozen=True)
class FixedBuffer:
    """A workspace buffer at a fixed place in `work`: `offset` elements
    after the place of `base` (another such buffer: the one before it, or
    the dead one whose memory it takes), or after work's start (None)."""

    name: str  # its C name
    base: str | None
    offset: int
    extent: str  # its shape as C text, for the comment


def enumerators(function: str, buffers: Sequence[FixedBuffer]) -> list[tuple[str, str]]:
    """The enum lines that name the buffers' places, (enumerator, comment),
    each relative to its base: a buffer more moves no other line. A place
    one after the line before's is left implicit."""
    lines: list[tuple[str, str]] = []
    before: str | None = None
    for buffer in buffers:
        name = place_name(function, buffer.name)
        if (buffer.base, buffer.offset) == ((None, 0) if before is None else (before, 1)):
            value = name
        elif buffer.base is None:
            value = f"{name} = {buffer.offset}"
        else:
            value = f"{name} = {place_name(function, buffer.base)}" + (f" + {buffer.offset}" if buffer.offset else "")
        lines.append((value, buffer.extent))
        before = buffer.name
    return lines


def place_name(function: str, buffer: str) -> str:
    """The enumerator of a buffer's place: the function's name, two
    underscores (which no C name the namer gives holds), the buffer's."""
    return f"{function}__{buffer}"


@dataclass(frozen=True)
class Prelude:
    """What a part takes."""

    params: tuple[tuple[str, str], ...]  # (name, declaration) of the parameters and pointers it uses, in order


def prelude(params: Sequence[tuple[str, str]], body: str, in_work: frozenset[str] = frozenset()) -> Prelude:
    """The parameters (the function's, then its workspace pointers) that
    `body`, the C text of the part's kernels, uses.

    Args:
        params: (C name, C declaration) of the function's parameters and
            of the workspace pointers it declares.
        body: the C text of the part's kernels.
        in_work: the names of buffers at a named place (macros of `work`):
            a part that uses one takes `work`.
    """
    used = set(_IDENTIFIER.findall(_COMMENT.sub(" ", body)))  # a comment's words ("t9^T") use nothing
    if used & in_work:
        used.add("work")
    return Prelude(tuple(p for p in params if p[0] in used))
