"""An elementwise loop's result written over an input that nothing reads
after it: `g0 = grad_t1*(1 - t1**2)` into grad_t1's memory, not a fresh
block of the same size (an MLP's backward pass kept a third more
workspace than it needs).

Decided before the values are named: the result gets no buffer (and no
name) of its own, its node the input's buffer, so the C never holds two
names for one memory, and a loop shared through a function with restrict
parameters (emit/maps.py) still gets disjoint arrays, one of them read and
written. Only where the loop reads that input at exactly the entry it
writes (the input itself, of the loop's shape: no view, broadcast or
shift of it, and no shift in the loop at all), and only when every other
reader of the input's memory runs in an earlier step; only for a value
of the backward pass (an adjoint, a local derivative: the functions that
compute a forward value may differ in what it could write over, and each
names it in turn), never for a value the user named or one named after
it (grad_<name>). One such result a
loop, its store after the loop's others (`stores_last`): a loop body
computes its temporaries, then stores in order, so every read of an entry
comes before its store.
"""

from __future__ import annotations

from typing import Any

from symbackprop.base.registry import is_view
from symbackprop.ir.construct import is_const
from symbackprop.ir.node import SCALAR, Node
from symbackprop.schedule.fusion import MapGroup, step_nodes


def over_dead_inputs(sched: Any, stored: list[Node]) -> dict[Node, Node]:
    """{result: the input whose buffer it takes}, for the stored results of
    the scheduler's elementwise loops (see the module)."""
    step_of: dict[Node, int] = {}
    for k, step in enumerate(sched.plan):
        for member in step_nodes(step):
            step_of[member] = k
    named = set(sched.naming.names)  # the user's names (and the arguments'): each keeps its buffer
    candidates = {node for node in stored if node not in named and not _named_after(sched.naming, node, named)}
    # results: the backward pass's values alone (a forward value is named where every function that
    # computes it names it: functions differ in which readers follow, so in what they could write over)
    results = {node for node in candidates if node not in sched.naming.forward and node in sched.naming.origins}
    taken: dict[Node, Node] = {}
    for position, step in enumerate(sched.plan):
        if not isinstance(step, MapGroup) or step.late or step.shape == SCALAR:
            continue
        members = set(step.members)
        if any(arg in sched.through for member in members for arg in member.args):
            continue  # members may be computed at other entries
        for node in step.members:
            if node not in results or not _plain(sched, node):
                continue
            source = next((arg for arg in dict.fromkeys(node.args)
                           if arg in candidates and arg not in members and arg not in taken.values()
                           and arg.shape == node.shape and _plain(sched, arg)
                           and _read_before(sched, arg, members, position, step_of)), None)
            if source is not None:
                taken[node] = source
                break
    return taken


def _named_after(naming: Any, node: Node, named: set[Node]) -> bool:
    """Whether `node` (an adjoint, a part of one, a local derivative) would
    be named after a value the user named (grad_<name>): it keeps its buffer."""
    origin = naming.origins.get(node)
    return origin is not None and node not in naming.forward and any(o in named for o in origin[1:] if isinstance(o, Node))


def _plain(sched: Any, node: Node) -> bool:
    """A value stored in a buffer of its own: not a leaf, a view, a constant,
    a result, or a product of a sum (which share one)."""
    return not (node.op == "leaf" or is_view(node.op) or is_const(node) or node in sched.result_nodes
                or node in sched.summed_by or node in sched.summed or node in sched.spreads or node in sched.through)


def _read_before(sched: Any, node: Node, members: set[Node], position: int, step_of: dict[Node, int]) -> bool:
    """Whether every reader of `node`'s memory runs before step `position`,
    or in it as a member reading `node` itself (at its own entries)."""
    for user in sched.users.get(node, ()):
        if user in sched.result_nodes:
            return False
        if is_view(user.op) or user in sched.spreads or user in sched.through:
            if not _read_before(sched, user, set(), position, step_of):  # another view of it: before the loop
                return False
            continue
        at = step_of.get(user)
        if at is None or at > position or (at == position and user not in members):
            return False
    return True


def stores_last(stores: tuple, written_over: set[str]) -> tuple:
    """A loop's stores, those over an input it reads moved last."""
    return tuple(s for s in stores if s[0] not in written_over) + tuple(s for s in stores if s[0] in written_over)
