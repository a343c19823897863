"""A long generated function is cut into parts: static functions of at most
PART_KERNELS kernels each, which the function calls in order.

A C compiler's optimizer (register allocation, partial redundancy
elimination) takes time that grows faster than linearly with the length of
one function: a 300-layer MLP as one function took GCC -O3 81 s, against 4 s
for 30 layers. Parts of bounded length make the compile time linear in the
model's depth; small models (every golden file) stay one function.

Each part takes those of the function's parameters that its kernels use,
and declares again the workspace pointers of earlier parts that they use,
at their absolute places in the workspace: so no part's text grows with
the length of the function.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

PART_KERNELS = 32  # kernels per part; a function with more is cut

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
class Prelude:
    """What a part declares before its kernels."""

    declares: tuple[tuple[str, str, str], ...]  # (name, where, extent) of earlier parts' pointers it uses
    params: tuple[tuple[str, str], ...]  # (name, declaration) of the function's parameters it uses, in order


def prelude(earlier: Sequence[tuple[str, str, str]], params: Sequence[tuple[str, str]], body: str) -> Prelude:
    """The pointers of earlier parts that `body` uses (and those their
    expressions use, in declaration order), and the parameters it uses.

    Args:
        earlier: (name, where, extent) of every pointer declared by earlier
            kernels, in order.
        params: (C name, C declaration) of the function's parameters.
        body: the C text of the part's kernels.
    """
    used = set(_IDENTIFIER.findall(_COMMENT.sub(" ", body)))  # a comment's words ("t9^T") use nothing
    where_of = {name: where for name, where, _ in earlier}
    needed: set[str] = set()
    pending = [name for name in used if name in where_of]
    while pending:  # a pointer may be placed after (or in) another one
        name = pending.pop()
        if name not in needed:
            needed.add(name)
            pending.extend(n for n in _IDENTIFIER.findall(where_of[name]) if n in where_of)
    declares = tuple(d for d in earlier if d[0] in needed)
    for _, where, _ in declares:
        used.update(_IDENTIFIER.findall(where))
    return Prelude(declares, tuple(p for p in params if p[0] in used))
