"""A long generated function is cut into parts: static functions of at most
PART_KERNELS kernels each, which the function calls in order.

A C compiler's optimizer (register allocation, partial redundancy
elimination) takes time that grows faster than linearly with the length of
one function: a 300-layer MLP as one function took GCC -O3 81 s, against 4 s
for 30 layers. Parts of bounded length make the compile time linear in the
model's depth; small models (every golden file) stay one function.

Each part takes those of the function's parameters and workspace pointers
(declared in one block by the function) that its kernels use: so no part's
text grows with the length of the function.
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
    """What a part takes."""

    params: tuple[tuple[str, str], ...]  # (name, declaration) of the parameters and pointers it uses, in order


def prelude(params: Sequence[tuple[str, str]], body: str) -> Prelude:
    """The parameters (the function's, then its workspace pointers) that
    `body`, the C text of the part's kernels, uses.

    Args:
        params: (C name, C declaration) of the function's parameters and
            of the workspace pointers it declares.
        body: the C text of the part's kernels.
    """
    used = set(_IDENTIFIER.findall(_COMMENT.sub(" ", body)))  # a comment's words ("t9^T") use nothing
    return Prelude(tuple(p for p in params if p[0] in used))
