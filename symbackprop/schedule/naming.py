"""Readable, stable, unique names for the values a schedule stores."""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp

from symbackprop.base.cnames import sanitize
from symbackprop.base.registry import is_view
from symbackprop.ir.construct import is_const
from symbackprop.ir.node import Node, topological_order

# The op word of a node's name, where the op's tag is long or says little
_OP_WORDS = {"matmul": "mm", "normalize_rows": "norm", "normalize_rows_vjp": "dnorm", "causal_softmax": "softmax",
             "attention_scores": "scores", "attention_mix": "mix", "attention_mix_t": "mixt", "conv2d": "conv",
             "conv2d_input_grad": "dconv", "conv2d_weight_grad": "dconvw", "channel_broadcast": "bcast",
             "channel_sum": "chsum", "triangular_solve": "trisolve", "prod_others": "prodx", "logsumexp": "lse",
             "scan_add_product": "scanmm", "max_pool2d": "maxpool", "avg_pool2d": "avgpool",
             "max_unpool2d": "maxunpool", "avg_unpool2d": "avgunpool", "fixed_point": "fixpt"}
_AXIS_OPS = frozenset({"sum", "max", "min", "prod", "lse"})  # over an axis: colsum (axis 0), rowsum (axis 1)
_FUNCTION_WORDS = {"heaviside": "step", "piecewise": "select", "loggamma": "lgamma"}
_ROLE_RANK = {"param": 0}  # an anchor's rank among those equally near: params, then named values, then inputs
_NAMED_RANK, _INPUT_RANK = 1, 2
_SEARCH = 48  # nodes an anchor search visits at most (a model's graph may be large)


class Naming:
    """Readable, stable, unique names for nodes: the user's names where there
    are some, grad_<x> for the adjoint of x, d<y>_d<x> for the elementwise
    derivative of one named value with respect to another, and the rest
    <op>_<anchor>: a short word for the op (mm, sigmoid, colsum, ...) and
    the nearest param, input or user-named value among the node's operands
    (breadth first, params before the rest), mm_W2 for H @ W2. Only a tie
    between equal names is numbered (mm_W2_2, in the order claimed), so a
    name depends on the node and what is near it, and a change elsewhere in
    the model renames nothing. An adjoint is grad_<its value's name>, the
    name the value has or would have where it is not stored."""

    def __init__(self, leaves: dict[str, Node], roots: Sequence[tuple[str, Node]], origins: dict[Node, tuple],
                 named: Sequence[tuple[str, Node]] = ()):
        self.origins = dict(origins)
        self.names: dict[Node, str] = {}
        self.taken: set[str] = set()
        self.counts: dict[str, int] = {}  # base -> the last suffix claimed for it
        self.anchors: dict[Node, tuple[int, str]] = {}  # the values names are made from -> (rank, name)
        self.bases: dict[Node, str] = {}  # memo of _base
        for name, node in leaves.items():
            self.names[node] = self.claim(name)
        for name, node in roots:
            if node not in self.names:
                self.names[node] = self.claim(name)
                self.anchors[node] = (_NAMED_RANK, self.names[node])
        # a forward value is a value, even where it is also a derivative (interned nodes)
        self.forward = set(topological_order([node for _, node in roots]))
        for name, node in named:  # the user's names of intermediates (Model(names=...))
            if node not in self.names and not is_view(node.op) and not is_const(node):
                self.names[node] = self.claim(name)
                self.anchors[node] = (_NAMED_RANK, self.names[node])

    def add_origins(self, origins: dict[Node, tuple]) -> None:
        """Where more derivative nodes come from (the first word stays)."""
        for node, origin in origins.items():
            self.origins.setdefault(node, origin)

    def claim(self, base: str) -> str:
        """`base` if free, else base_<k> for the first free k from 2."""
        name, count = base, 1
        if name in self.taken:  # the search resumes where the last one for this base stopped
            count = self.counts.get(base, 1)
        while name in self.taken:
            count += 1
            name = f"{base}_{count}"
        self.counts[base] = count
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
        if origin[0] == "local":
            _, fwd, index = origin
            return fwd in self.anchors and fwd.args[index] in self.anchors
        return origin[0] in ("adjoint", "part")

    def would_be(self, node: Node) -> str:
        """The node's name, or the name it would have (unclaimed) if it is not named yet."""
        return self.names.get(node) or self._derive(node)

    def _derive(self, node: Node) -> str:
        origin = self.origins.get(node)
        if origin is None or node in self.forward:
            return self._base(node)
        # made of names, sanitized as the C will have them (a user's "int" is int_, its adjoint grad_int)
        if origin[0] == "adjoint":
            return sanitize("grad_" + self.would_be(origin[1]))
        if origin[0] == "part":  # one term of the adjoint of origin[1]
            return sanitize(f"grad_{self.would_be(origin[1])}_part")
        if self.derived(node):  # a local derivative between two named values
            _, fwd, index = origin
            return sanitize(f"d{self.names[fwd]}_d{self.names[fwd.args[index]]}")
        return self._base(node)

    def _base(self, node: Node) -> str:
        base = self.bases.get(node)
        if base is None:
            anchor = self._anchor(node)
            base = self.bases[node] = sanitize(op_word(node) + (f"_{anchor}" if anchor else ""))
        return base

    def _anchor(self, node: Node) -> str | None:
        """The name of the nearest anchor among the node's operands, breadth
        first in argument order, params first among the equally near ones;
        views and constants are looked through."""
        level, seen = list(node.args), {node}
        while level and len(seen) < _SEARCH:
            found: list[tuple[int, int, str]] = []
            deeper: list[Node] = []
            for arg in level:
                if arg in seen:
                    continue
                seen.add(arg)
                rank = self._rank(arg)
                if rank is not None:
                    found.append((rank[0], len(found), rank[1]))
                elif is_view(arg.op):
                    level.append(arg.args[0]) if arg.args else None
                else:
                    deeper += arg.args
            if found:
                return min(found)[2]
            level = deeper
        return None

    def _rank(self, node: Node) -> tuple[int, str] | None:
        if node.op == "leaf":
            return _ROLE_RANK.get(node.attrs[1], _INPUT_RANK), self.names.get(node) or sanitize(str(node.attrs[0]))
        return self.anchors.get(node)


def op_word(node: Node) -> str:
    """A short word for what the node computes: mm, colsum, sigmoid, add, ..."""
    if node.op == "map":
        return body_word(node.attrs[0])
    word = _OP_WORDS.get(node.op, node.op)
    if word in _AXIS_OPS and node.attrs and node.attrs[0] in (0, 1):
        return ("col" if node.attrs[0] == 0 else "row") + word
    return word


def body_word(body: sp.Expr) -> str:
    """The word of an elementwise body: its outermost function (sigmoid,
    tanh, relu for Max(0, x), step for Heaviside), else add, mul, sq, ..."""
    if not body.free_symbols:
        return "const"
    if body.is_Symbol:
        return "copy"
    if isinstance(body, sp.Max) and sp.S.Zero in body.args and len(body.args) == 2:
        return "relu"
    if body.is_Add:
        return "add"
    if body.is_Mul:
        return "mul"
    if body.is_Pow:
        return {2: "sq", -1: "inv", sp.Rational(1, 2): "sqrt", sp.Rational(-1, 2): "rsqrt"}.get(body.exp, "pow")
    name = type(body).__name__.lower()
    return _FUNCTION_WORDS.get(name, name)
