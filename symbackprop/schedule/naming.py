"""Readable, stable, unique names for the values a schedule stores."""

from __future__ import annotations

import re
from collections.abc import Sequence

from symbackprop.emit.cnames import sanitize
from symbackprop.ir.construct import is_const
from symbackprop.ir.node import Node, topological_order
from symbackprop.ops.registry import is_view


class Naming:
    """Readable, stable, unique names for nodes: the user's names where there
    are some, grad_<x> for the adjoint of x, d<y>_d<x> for the elementwise
    derivative of y with respect to x, and the rest numbered densely, t<k>
    (g<k> for an adjoint of a value that has no name), in the order the
    scheduler asks for them: only the values the C stores get a number, so
    the numbers that appear have no gaps, and an adjoint is named after its
    value only when that value has a name a reader can find."""

    def __init__(self, leaves: dict[str, Node], roots: Sequence[tuple[str, Node]], origins: dict[Node, tuple],
                 named: Sequence[tuple[str, Node]] = ()):
        self.origins = dict(origins)
        self.names: dict[Node, str] = {}
        self.taken: set[str] = set()
        self.counts: dict[str, int] = {}  # base -> the last suffix claimed for it
        self.numbers: dict[str, int] = {}  # numbered prefix (t, g) -> the last number claimed for it
        for name, node in leaves.items():
            self.names[node] = self.claim(name)
        for name, node in roots:
            if node not in self.names:
                self.names[node] = self.claim(name)
        # a forward value is a value, even where it is also a derivative (interned nodes)
        self.forward = set(topological_order([node for _, node in roots]))
        for name, node in named:  # the user's names of intermediates (Model(names=...))
            if node not in self.names and not is_view(node.op) and not is_const(node):
                self.names[node] = self.claim(name)

    def add_origins(self, origins: dict[Node, tuple]) -> None:
        """Where more derivative nodes come from (the first word stays)."""
        for node, origin in origins.items():
            self.origins.setdefault(node, origin)

    def claim(self, base: str) -> str:
        """`base` if free, else base_<k> for the first free k; "t0" (or "g0")
        is the next free t<k> (g<k>)."""
        numbered = _NUMBERED.fullmatch(base)
        if numbered:
            return self.number(numbered.group(1))
        name, count = base, 0
        if name in self.taken:  # the search resumes where the last one for this base stopped
            count = self.counts.get(base, 0)
        while name in self.taken:
            count += 1
            name = f"{base}_{count}"
        self.counts[base] = count
        self.taken.add(name)
        return name

    def number(self, prefix: str) -> str:
        """The next free <prefix><k>, k counting up from 0 per prefix."""
        count = self.numbers.get(prefix, -1)
        name = ""
        while not name or name in self.taken:
            count += 1
            name = f"{prefix}{count}"
        self.numbers[prefix] = count
        self.taken.add(name)
        return name

    def __call__(self, node: Node) -> str:
        name = self.names.get(node)
        if name is None:
            name = self.names[node] = self.claim(self._derive(node))
        return name

    def derived(self, node: Node) -> bool:
        """Whether the node's name is made from another's (an adjoint's,
        a local derivative's): those are named after the values they come from."""
        origin = self.origins.get(node)
        if origin is None or node in self.forward:
            return False
        if origin[0] == "local":  # d<y>_d<x> only where both have names by now; else a t<k> in run order
            _, fwd, index = origin
            return fwd in self.names and fwd.args[index] in self.names
        return origin[0] in ("adjoint", "part")

    def _derive(self, node: Node) -> str:
        origin = self.origins.get(node)
        if origin is None or node in self.forward:
            return "t0"
        # made of names, sanitized as the C will have them (a user's "int" is int_, its adjoint grad_int)
        if origin[0] == "adjoint":
            return sanitize("grad_" + self.names[origin[1]]) if origin[1] in self.names else "g0"
        if origin[0] == "part":  # one term of the adjoint of origin[1]
            return sanitize(f"grad_{self.names[origin[1]]}_part") if origin[1] in self.names else "g0"
        if origin[0] == "local":
            _, fwd, index = origin
            arg = fwd.args[index]
            if fwd in self.names and arg in self.names:
                return sanitize(f"d{self.names[fwd]}_d{self.names[arg]}")
        return "t0"


_NUMBERED = re.compile(r"([tg])0")
