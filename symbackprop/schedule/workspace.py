"""The workspace plan of a function: a slot for each intermediate buffer,
reusing the memory of a buffer of the same size whose last reader has run,
the one freed last (a buffer more in one layer then moves which memory the
buffers of the next layer or two take, not of every later layer as taking
the one freed first did; the size is the same either way: buffers of one
size are interchangeable). The buffers of a fixed size lie first, each at
a fixed place, then those whose size a dimension sets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.ir.node import Shape

ALIGN = 16  # entries: 64 bytes of floats, a cache line


@dataclass(frozen=True)
class Slot:
    """A buffer's place in the workspace. In the C it is written relative to
    its neighbour (`after`, or `reuses` a dead buffer's memory), so a change
    to one buffer moves no other declaration."""

    name: str
    shape: Shape
    offset: sp.Expr  # absolute, in elements
    after: str | None = None  # the new slot just before it (None: the first of its region, at `offset`)
    reuses: str | None = None  # the dead buffer whose memory it takes over


def plan_workspace(kernels: Sequence[Any], buffers: Mapping[str, Shape],
                   only_written: bool = False) -> tuple[tuple[Slot, ...], sp.Expr]:
    """Give each intermediate buffer (name -> shape) a workspace slot; reuse
    same-size slots whose last reader has already run. Kernels say what
    they touch with reads() and writes(). `only_written`: only the buffers
    these kernels write (a plan for the first part of a function).

    Returns:
        The slots, in order, and the workspace's size in elements.
    """
    written = {b for kernel in kernels for b in kernel.writes()}
    shapes = {buffer: shape for buffer, shape in buffers.items() if buffer in written or not only_written}
    sizes = {buffer: sp.sympify(shape[0]) * shape[1] for buffer, shape in shapes.items()}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    written_at: dict[str, int] = {}  # declared in the order written (as the comments list them), not by name
    for index, kernel in enumerate(kernels):
        for buffer in kernel.writes():
            first.setdefault(buffer, index)
            written_at.setdefault(buffer, len(written_at))
        for buffer in kernel.reads():
            last[buffer] = index
    free: list[str] = []  # buffers whose last reader has run
    releases: dict[int, list[str]] = {}
    placed: list[tuple[str, str | None, str | None]] = []  # (buffer, after, reuses), in order
    offset_of: dict[str, sp.Expr] = {}  # within its region
    end = {True: sp.Integer(0), False: sp.Integer(0)}  # each region's length
    previous: dict[bool, str | None] = {True: None, False: None}
    for buffer in sorted(sizes, key=lambda b: (first.get(b, 0), written_at.get(b, 0), b)):
        start = first.get(buffer, 0)
        for index in sorted(k for k in releases if k < start):
            free += releases.pop(index)
        reuse = next((gone for gone in reversed(free) if sizes[gone] == sizes[buffer]), None)
        if reuse is not None:
            free.remove(reuse)
            offset_of[buffer] = offset_of[reuse]
            placed.append((buffer, None, reuse))
        else:
            fixed = _fixed(sizes[buffer])
            offset_of[buffer] = end[fixed]
            end[fixed] = end[fixed] + sizes[buffer]
            placed.append((buffer, previous[fixed], None))  # the first of a size a dimension sets: after them all
            previous[fixed] = buffer
        releases.setdefault(last.get(buffer, start), []).append(buffer)
    # the buffers a dimension sizes (the large ones) start on a 64-byte line, as does work (run/function.py)
    fixed_end = -(-end[True] // ALIGN) * ALIGN if end[False] != 0 else end[True]
    slots = tuple(Slot(buffer, shapes[buffer], offset_of[buffer] + (0 if _fixed(sizes[buffer]) else fixed_end),
                       after=after, reuses=reuse)
                  for buffer, after, reuse in placed)
    return slots, sp.expand(fixed_end + end[False])


def _fixed(size: sp.Expr) -> bool:
    """Whether a buffer's size is a number: such buffers lie first in work,
    each at a fixed place (a function cut into parts names those places
    instead of passing a pointer to each: emit/cparts.py)."""
    return not size.free_symbols
