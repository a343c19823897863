"""A loop inside a step that does not read the step's state (nor its input
row) is the same every step: it is lowered once, outside, and the step reads
its result as a capture. (An argmax of f(r1, p) after an argmin r1 would
otherwise run the whole argmin inside each of its steps.)"""

from __future__ import annotations

from collections.abc import Sequence

from symbackprop.diff.autodiff import depends_on
from symbackprop.ir.construct import leaf
from symbackprop.ir.node import Node, topological_order
from symbackprop.loops.graph import substitute


def hoist_loops(roots: Sequence[Node], varying: Sequence[Node], outer: dict[Node, Node]) -> tuple[list[Node], dict]:
    """`roots` with each state-independent loop result replaced by a new
    capture leaf; returns them and `outer` (capture leaf -> the outer value)
    extended by those leaves (each bound to the loop, lowered outside)."""
    order = topological_order(roots)
    reaches = depends_on(order, set(varying))
    loops = [n for n in order if n.op == "scan_part" and not reaches[n]]
    if not loops:
        return list(roots), outer
    leaves = [leaf(f"hoisted{k}", n.shape, "scan_capture") for k, n in enumerate(loops)]
    outside = substitute(loops, outer)
    return substitute(roots, dict(zip(loops, leaves))), {**outer, **dict(zip(leaves, outside))}
