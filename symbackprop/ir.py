"""Lower SymPy expressions to a DAG of tensor ops.

Every value is a 2-D tensor (rows, cols); a scalar is 1x1. Dimensions are
ints or SymPy Symbols (bound from the arrays at call time). Nodes are
immutable and hash-consed: building the same op on the same arguments twice
returns the same object, so shared subgraphs are shared nodes.

Each op's rules (the SymPy classes it lowers from, derivatives, numpy
reference, kernel, C) are its record in symbackprop.ops; this module holds
the nodes, the constructors that fold what they can, and the lowering
driver. The ops:
    leaf       a declared input or parameter           attrs: (name, role)
    map        elementwise scalar body over its args    attrs: (body,)
               args broadcast along axes where their size is 1
    matmul     A @ B
    transpose  A^T (a view: no copy is made)
    sum        sum over one axis (kept as size 1)       attrs: (axis,)
    logsumexp  stable log(sum(exp)) over one axis       attrs: (axis,)
    element    A[i, j] as a 1x1 (a view)                attrs: (i, j)
    pack       a matrix from 1x1 values, zero elsewhere attrs: (positions,)
    max, min   the extreme over one axis (kept as size 1) attrs: (axis,)
    prod       the product over one axis (ops/reduce.py)  attrs: (axis,)
    cumsum     the running sum along an axis (ops/cumulative.py)  attrs: (axis, reverse)
    emap       a per-example function over one or two   attrs: (bodies, bindings,
               loop lengths (see emap() below)                  loops, target)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, TypeAlias

import sympy as sp
from sympy.core.function import Application, AppliedUndef
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import BooleanAtom, BooleanFunction
from sympy.matrices.expressions.matexpr import MatrixElement

from .errors import ModelError
from .exprdag import Splitter
from .messages import described, shape_text, short
from .model import Model, leaf_name
from .ops.registry import lowering_rule, shape_rule
from .stable import fuse_across, stabilize
from .tensor import ExampleMap, Index, reduced_shape

Dim: TypeAlias = int | sp.Symbol
Shape: TypeAlias = tuple[Dim, Dim]
SCALAR: Shape = (1, 1)


class Node:
    """One op applied to argument nodes. Build with the functions below."""

    __slots__ = ("op", "args", "shape", "attrs", "__weakref__")
    op: str
    args: tuple["Node", ...]
    shape: Shape
    attrs: tuple

    def __repr__(self) -> str:
        return f"Node({self.op}, shape={self.shape}, attrs={self.attrs}, nargs={len(self.args)})"


# Hash-consing: each (op, args, shape, attrs) built while its node is alive
# gives that node. Weak values, so that a node lives only as long as a graph,
# plan or module uses it: a long session that compiles many models (or one
# model many times) does not keep every node ever built.
_INTERNED: weakref.WeakValueDictionary[tuple, Node] = weakref.WeakValueDictionary()


class ShapeMismatch(ModelError):
    """Operands of an op have incompatible shapes. Lowering re-raises it as
    a ModelError that names the user's subexpression."""


def _node(op: str, args: tuple[Node, ...], shape: Shape, attrs: tuple = ()) -> Node:
    key = (op, args, shape, attrs)
    node = _INTERNED.get(key)
    if node is None:
        node = Node()
        node.op, node.args, node.shape, node.attrs = op, args, shape, attrs
        _INTERNED[key] = node
    return node


def op_node(op: str, args: Iterable[Node], shape: Shape, attrs: tuple = ()) -> Node:
    """The node of a registered op (symbackprop.ops): its family's
    constructor checks the arguments and folds what it can first."""
    return _node(op, tuple(args), shape, attrs)


def placeholder(index: int) -> sp.Symbol:
    """The symbol that stands for a map's index-th argument in its body."""
    return sp.Symbol(f"_a{index}", real=True)


# --- constructors ---------------------------------------------------------


def leaf(name: str, shape: Shape, role: str) -> Node:
    return _node("leaf", (), shape, (name, role))


def const(value: sp.Expr, shape: Shape = SCALAR) -> Node:
    return _node("map", (), shape, (sp.sympify(value),))


def is_const(node: Node) -> bool:
    return node.op == "map" and not node.args


def broadcastable(arg: Shape, out: Shape) -> bool:
    return all(a == o or a == 1 for a, o in zip(arg, out))


def map_(body: sp.Expr, args: Iterable[Node], shape: Shape | None = None) -> Node:
    """body(args) elementwise; placeholders _a0.. stand for the args in order.

    Folds constant args into the body, merges repeated args, drops unused
    ones and renumbers, so equal computations are equal nodes.
    """
    args = tuple(args)
    if shape is None:
        shape = _broadcast_shape([a.shape for a in args])
    subs: dict[sp.Symbol, sp.Expr] = {}
    kept: list[Node] = []
    for index, arg in enumerate(args):
        if not broadcastable(arg.shape, shape):
            raise ShapeMismatch(f"cannot broadcast shape {arg.shape} to {shape}")
        if is_const(arg):
            subs[placeholder(index)] = arg.attrs[0]
        elif arg in kept:
            subs[placeholder(index)] = placeholder(kept.index(arg))
        else:
            subs[placeholder(index)] = placeholder(len(kept))
            kept.append(arg)
    # exact rewrites of overflow-prone forms (1/(1 + exp(-z)) -> sigmoid(z))
    body = stabilize(sp.sympify(body).xreplace(subs))
    used = [a for i, a in enumerate(kept) if placeholder(i) in body.free_symbols]
    if len(used) != len(kept):
        renumber = {placeholder(kept.index(a)): placeholder(i) for i, a in enumerate(used)}
        body = body.xreplace(renumber)
    if body == placeholder(0) and len(used) == 1 and used[0].shape == shape:
        return used[0]
    fused = _match_logsumexp(body, used, shape)
    if fused is not None:
        return fused
    across = fuse_across(body, tuple(used), shape, placeholder)
    if across is not None:  # e.g. log(1 - p) of p = sigmoid(z): -softplus(z)
        return map_(across[0], across[1], shape)
    return _node("map", tuple(used), shape, (body,))


def _broadcast_shape(shapes: list[Shape]) -> Shape:
    if not shapes:
        return SCALAR
    rows = next((s[0] for s in shapes if s[0] != 1), 1)
    cols = next((s[1] for s in shapes if s[1] != 1), 1)
    return (rows, cols)


def matmul(a: Node, b: Node) -> Node:
    """A @ B; a constant factor (every entry c, never stored in memory, e.g.
    the seed 1 of a loss that is itself a product) folds into sums."""
    if a.shape[1] != b.shape[0]:
        raise ShapeMismatch(f"matrix product of shapes {a.shape} and {b.shape}")
    shape = (a.shape[0], b.shape[1])
    if is_const(a) and is_const(b):
        return const(a.attrs[0] * b.attrs[0] * a.shape[1], shape)
    if is_const(a):  # c * column sums of B, repeated on every row
        return broadcast(map_(a.attrs[0] * placeholder(0), [reduce_sum(b, 0)]), shape)
    if is_const(b):  # c * row sums of A, repeated in every column
        return broadcast(map_(b.attrs[0] * placeholder(0), [reduce_sum(a, 1)]), shape)
    return _node("matmul", (a, b), shape)


def transpose(a: Node) -> Node:
    if a.op == "transpose":
        return a.args[0]
    if a.shape == SCALAR or is_const(a):
        return a if a.shape == SCALAR else const(a.attrs[0], (a.shape[1], a.shape[0]))
    return _node("transpose", (a,), (a.shape[1], a.shape[0]))


def reduce_sum(a: Node, axis: int) -> Node:
    """Sum over `axis` (0: down the rows, giving 1 x cols; 1: along each row)."""
    if a.shape[axis] == 1:
        return a
    shape = reduced_shape(a.shape, axis)
    if is_const(a):
        return const(a.attrs[0] * a.shape[axis], shape)
    return _node("sum", (a,), shape, (axis,))


def logsumexp(a: Node, axis: int) -> Node:
    shape = reduced_shape(a.shape, axis)
    return _node("logsumexp", (a,), shape, (axis,))


def reduce_extreme(op: str, a: Node, axis: int) -> Node:
    """max or min over `axis`."""
    if a.shape[axis] == 1:
        return a
    shape = reduced_shape(a.shape, axis)
    if is_const(a):
        return const(a.attrs[0], shape)
    return _node(op, (a,), shape, (axis,))


def row_placeholder(arg: int, col: int) -> sp.Symbol:
    """The symbol that stands for column `col` of an emap's arg-th argument."""
    return sp.Symbol(f"_e{arg}_{col}", real=True)


# How an emap reads an argument at each example (loop variables i, then k):
#   ("row", a)        row (i, k)[a] of the argument
#   ("gather", q, a)  row idx[(i, k)[a]], idx being argument q (an index leaf)
#   ("whole",)        row 0: a 1-row argument shared by every example
#   ("cell",)         element (i, k): a loops[0] x loops[1] argument
#   ("index",)        an index leaf, read only through gathers
# The target says where example (i, k) writes its outputs, in the same terms;
# where several examples write one place (a gather's scatter-add, a row of a
# two-loop map, a shared row) they add up.


def let_symbol(k: int) -> sp.Symbol:
    """The k-th local value of an emap's body (see emap)."""
    return sp.Symbol(f"_v{k}", real=True)


def emap(bodies: Iterable[sp.Expr], args: Iterable[Node], bindings: Iterable[tuple], loops: tuple,
         target: tuple, shape: Shape, lets: Iterable[tuple[sp.Symbol, sp.Expr]] = ()) -> Node:
    """A per-example function: for each example (i, or each pair (i, k)),
    output column c of row target(example) is bodies[c] of the argument rows
    bound to that example, the symbol _e<p>_<l> standing for column l of
    argument p.

    The body is a straight-line program: `lets` are (symbol, expression)
    assignments in order, which later ones and the bodies use. Derivatives
    extend the program (reverse or forward mode over it) instead of
    differentiating expanded expressions, so they grow linearly with it.
    Unused lets and arguments are dropped, constant arguments folded in.
    """
    arg_nodes, bindings = tuple(args), tuple(bindings)
    folded = {}  # constant arguments become numbers in the bodies
    for p, arg in enumerate(arg_nodes):
        if is_const(arg):
            folded.update({row_placeholder(p, c): arg.attrs[0] for c in range(binding_width(arg, bindings[p]))})
    programs = tuple(sp.sympify(b).xreplace(folded) for b in bodies)
    if all(b == 0 for b in programs) and accumulates(target, loops):
        return const(0, shape)
    live = _live_lets(tuple((sym, sp.sympify(e).xreplace(folded)) for sym, e in lets), programs)
    kept, bindings, programs, live, target = _drop_unused(arg_nodes, bindings, programs, live, tuple(target))
    return _node("emap", kept, shape, (programs, bindings, tuple(loops), target, live))


def _live_lets(lets: tuple, bodies: tuple) -> tuple:
    """The assignments the bodies need, in order."""
    needed = set().union(*(b.free_symbols for b in bodies))
    kept = []
    for sym, expr in reversed(lets):
        if sym in needed:
            kept.append((sym, expr))
            needed |= expr.free_symbols
    return tuple(reversed(kept))


def _drop_unused(args: tuple, bindings: tuple, bodies: tuple, lets: tuple, target: tuple) -> tuple:
    """Only the arguments the program reads (and the index leaves its gathers
    and the target use), renumbered in order, so equal maps are equal nodes."""
    free = set().union(*(b.free_symbols for b in bodies), *(e.free_symbols for _, e in lets))
    used = [p for p, a in enumerate(args) if any(row_placeholder(p, c) in free for c in range(binding_width(a, bindings[p])))]
    needed = set(used)
    for p in used + [None]:
        binding = target if p is None else bindings[p]
        if binding[0] == "gather":
            needed.add(binding[1])
    keep = sorted(needed)
    if len(keep) == len(args):
        return args, bindings, bodies, lets, target
    new = {old: k for k, old in enumerate(keep)}

    def renumber(binding: tuple) -> tuple:
        return ("gather", new[binding[1]], binding[2]) if binding[0] == "gather" else binding

    subs = {row_placeholder(old, c): row_placeholder(new[old], c)
            for old in keep for c in range(binding_width(args[old], bindings[old]))}
    return (tuple(args[p] for p in keep), tuple(renumber(bindings[p]) for p in keep),
            tuple(b.xreplace(subs) for b in bodies), tuple((sym, e.xreplace(subs)) for sym, e in lets), renumber(target))


def accumulates(target: tuple, loops: tuple) -> bool:
    """Whether several examples write one place of an emap's output."""
    return not (target == ("cell",) or (target[0] == "row" and len(loops) == 1))


def binding_width(node: Node, binding: tuple) -> int:
    if binding[0] == "index":
        return 0
    return 1 if binding[0] == "cell" else int(node.shape[1])


def element(a: Node, i: int, j: int) -> Node:
    if a.shape == SCALAR:
        return a
    if is_const(a):  # a constant is never stored: its entry is the constant (a sum's seed, broadcast)
        return const(a.attrs[0])
    if a.op == "pack":
        positions = a.attrs[0]
        return a.args[positions.index((i, j))] if (i, j) in positions else const(0)
    return _node("element", (a,), SCALAR, (i, j))


def pack(shape: Shape, entries: dict[tuple[int, int], Node]) -> Node:
    entries = {p: e for p, e in entries.items() if not (is_const(e) and e.attrs[0] == 0)}
    if shape == SCALAR and (0, 0) in entries:
        return entries[(0, 0)]
    positions = tuple(sorted(entries))
    return _node("pack", tuple(entries[p] for p in positions), shape, (positions,))


def broadcast(a: Node, shape: Shape) -> Node:
    """`a` repeated along the axes where its size is 1."""
    return map_(placeholder(0), [a], shape)


def _match_logsumexp(body: sp.Expr, args: list[Node], shape: Shape) -> Node | None:
    """log(sum(exp(Z), axis)) becomes one stable logsumexp (max subtracted)."""
    if body != sp.log(placeholder(0)) or len(args) != 1 or args[0].op != "sum":
        return None
    summed = args[0].args[0]
    if summed.op == "map" and summed.attrs[0] == sp.exp(placeholder(0)):
        inner = summed.args[0]
        if inner.shape == summed.shape:
            return logsumexp(inner, args[0].attrs[0])
    return None


# --- lowering SymPy -------------------------------------------------------


@dataclass(frozen=True)
class Lowered:
    """A model as tensor nodes."""

    model: Model
    leaves: dict[str, Node]  # user name -> leaf node, inputs then params
    loss: Node
    outputs: dict[str, Node]
    dims: tuple[sp.Symbol, ...]  # symbolic dimensions, in declaration order
    named: tuple[tuple[str, Node], ...] = ()  # the user's names of intermediates (Model.names)


def as_dim(d: sp.Expr, where: object) -> Dim:
    if isinstance(d, (int, sp.Integer)) or getattr(d, "is_Integer", False):
        if int(d) < 1:
            raise ModelError(f"dimension {d} of {where} must be positive")
        return int(d)
    if isinstance(d, sp.Symbol):
        return d
    raise ModelError(f"dimension {d} of {where} must be an integer or a Symbol")


def shape_of(expr: sp.Basic) -> Shape:
    if isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)):
        return (as_dim(expr.shape[0], expr), as_dim(expr.shape[1], expr))
    return SCALAR


def lower(model: Model) -> Lowered:
    """Lower the model's loss and outputs to tensor nodes.

    Raises:
        ModelError: naming the subexpression that is undeclared, unsupported
            or shaped wrong.
    """
    leaves: dict[str, Node] = {}
    by_symbol: dict[sp.Basic, Node] = {}
    dims: list[sp.Symbol] = []
    for role, group in (("input", model.inputs), ("param", model.params)):
        for sym in group:
            if isinstance(sym, Index) and role != "input":
                raise ModelError(f"the Index {sym} holds integers: declare it an input, not a {role}")
            node = leaf(leaf_name(sym), shape_of(sym), "index" if isinstance(sym, Index) else role)
            leaves[leaf_name(sym)] = by_symbol[sym] = node
            for d in node.shape:  # once each, also for a square (n, n) leaf
                if isinstance(d, sp.Symbol) and d not in dims:
                    dims.append(d)
    clash = [d for d in dims if leaf_name(d) in leaves]
    if clash:
        raise ModelError(f"{clash[0]} is used both as a dimension and as an input/param")
    lowerer = Lowerer(by_symbol, tuple(dims), (*model.outputs.values(), *model.names.values()))
    loss = lowerer.scalar_result(model.loss, "the loss")
    outputs = {name: lowerer.lower(expr) for name, expr in model.outputs.items()}
    named = tuple((name, lowerer.lower(expr)) for name, expr in model.names.items())  # the memo's nodes
    return Lowered(model, leaves, loss, outputs, tuple(dims), named)


class Lowerer:
    """Turns SymPy expressions into nodes, memoized per subexpression."""

    def __init__(self, leaves: dict[sp.Basic, Node], dims: tuple[sp.Symbol, ...], named: tuple[sp.Basic, ...] = ()):
        self.leaves = leaves
        self.dims = set(dims)
        self.memo: dict[sp.Basic, Node] = {}
        self.standins: dict[sp.Basic, Node] = {}  # symbols that stand for parts of a large scalar (_scalar)
        self.splitter = Splitter(lambda _: sp.Dummy("part", real=True))
        # Named outputs that SymPy flattens into larger sums and products
        # (Y = A + B inside Y - T = A + B - T): lowered as their own nodes,
        # so that a named intermediate is one value with one gradient.
        self.named_sums = [e for e in named if isinstance(e, sp.MatAdd)]
        self.named_products = [e for e in named if isinstance(e, sp.MatMul) and e.as_coeff_matrices()[0] == 1]
        self.caches: dict[str, dict] = {}  # see cache()
        self.contexts: tuple[str, ...] = ()  # see nested()

    def cache(self, owner: str) -> dict:
        """A dict that lives as long as this lowering, for an op defined
        outside this module to memoize what it lowered (scan: one node per
        declared scan, however many of its parts the model reads)."""
        return self.caches.setdefault(owner, {})

    def nested(self, leaves: dict[sp.Basic, Node], context: str) -> "Lowerer":
        """A lowerer for a graph nested in this one's (a scan's step), over
        its own `leaves` and this one's dims, with `context` added to its
        `contexts` (so that an op can refuse to nest in itself)."""
        sub = Lowerer(leaves, tuple(self.dims))
        sub.contexts = self.contexts + (context,)
        return sub

    def scalar_result(self, expr: sp.Basic, what: str) -> Node:
        node = self.lower(expr)
        if node.shape != SCALAR:
            raise ModelError(f"{what} must be a scalar; {short(expr)} has shape {node.shape}")
        return node

    def lower(self, expr: sp.Basic) -> Node:
        expr = sp.sympify(expr)
        node = self.memo.get(expr)
        if node is None:
            node = self.memo[expr] = self._lower(expr)
        return node

    def _lower(self, expr: sp.Basic) -> Node:
        if isinstance(expr, sp.MatrixBase):
            return self._explicit_matrix(expr)
        if isinstance(expr, sp.MatrixExpr):
            rule = _MATRIX_RULES.get(type(expr)) or _record_rule(type(expr))
            if rule is None:
                raise ModelError(f"unsupported matrix operation {type(expr).__name__}: {described(expr)}")
            if isinstance(expr, _OWN_SHAPE):  # other shapes follow from their (checked) arguments'
                self.check_dims(expr)
            try:
                return rule(self, expr)
            except ShapeMismatch as exc:
                raise ModelError(f"{exc} in {short(expr)}") from None
        if isinstance(expr, sp.Expr):
            return self._scalar(expr)
        raise ModelError(f"unsupported expression {short(repr(expr))} of type {type(expr).__name__}")

    def shape(self, expr: sp.MatrixExpr) -> Shape:
        """SymPy's shape of expr, from the nodes of its lowered arguments:
        SymPy's own walks down the whole chain under it at every level, which
        made lowering quadratic in depth (and recursive)."""
        node = self.memo.get(expr)
        if node is not None:
            return node.shape
        rule = shape_rule(type(expr))
        return shape_of(expr) if rule is None else rule(expr, self.shape)

    def check_dims(self, expr: sp.MatrixExpr) -> None:
        for d in expr.shape:
            for sym in sorted(sp.sympify(d).free_symbols - self.dims, key=str):
                raise ModelError(f"dimension {sym} of {short(expr)} is not a dimension of any input or param")

    def _scalar(self, expr: sp.Expr) -> Node:
        """A scalar expression becomes one map over its leaves and elements;
        a large one (many distinct subexpressions, or deep) a graph of maps,
        one per shared or deep subexpression, so that its derivative is
        reverse mode over that graph (linear), not one sp.diff of the whole
        body per argument (a determinant by minors took minutes)."""
        parts, whole = self.splitter(expr)
        for sub, symbol, body in parts:
            node = self.memo.get(sub)
            self.standins[symbol] = self.memo[sub] = node if node is not None else self._scalar_map(body)
        return self._scalar_map(whole)

    def _scalar_map(self, expr: sp.Expr) -> Node:
        atoms = scalar_atoms(expr)
        args: list[Node] = []
        subs: dict[sp.Basic, sp.Expr] = {}
        for atom in atoms:
            if isinstance(atom, MatrixElement):
                parent, i, j = atom.args
                if not (i.is_Integer and j.is_Integer):
                    raise ModelError(f"only constant indices are supported: {short(atom)}")
                arg = element(self.lower(parent), int(i), int(j))
            elif atom in self.standins:
                arg = self.standins[atom]
            elif atom in self.leaves:
                arg = self.leaves[atom]
                if arg.shape != SCALAR:
                    raise ModelError(f"{atom} is a matrix used as a scalar in {short(expr)}")
            elif atom in self.dims:
                continue  # a symbolic dimension stays in the body
            elif isinstance(atom, sp.Symbol) and atom.name.startswith("_a"):
                raise ModelError(f"symbol names starting with '_a' are reserved: {atom}")
            else:
                raise ModelError(f"{short(atom)} is neither an input nor a param (in {short(expr)})")
            subs[atom] = placeholder(len(args))
            args.append(arg)
        return map_(expr.xreplace(subs), args, SCALAR)

    def _explicit_matrix(self, expr: sp.MatrixBase) -> Node:
        rows, cols = expr.shape
        entries = {(i, j): self.lower(expr[i, j]) for i in range(rows) for j in range(cols)}
        return pack((rows, cols), entries)

    # --- leaves (every other SymPy class lowers through an op's record) ---

    def matrix_symbol(self, expr: sp.MatrixSymbol) -> Node:
        if expr not in self.leaves:
            raise ModelError(f"{short(expr)} is neither an input nor a param")
        return self.leaves[expr]

    def index(self, expr: Index) -> Node:
        raise ModelError(f"the Index {expr} holds row numbers: use it only to gather rows (gather({expr.name}, ...))")

# What a scalar expression may be built of besides atoms: arithmetic, applied
# functions (exp, Max, Piecewise, ...) and the conditions of a Piecewise.
_SCALAR_OPS = (sp.Add, sp.Mul, sp.Pow, Application, ExprCondPair, Relational, BooleanFunction, BooleanAtom)


def scalar_atoms(expr: sp.Expr) -> list[sp.Basic]:
    """Symbols and matrix elements of a scalar expression, in a fixed order.

    Raises:
        ModelError: an undefined function, a non-real constant, or an
            operation that is not plain arithmetic or a function.
    """
    atoms: list[sp.Basic] = []
    stack = [expr]
    seen: set[sp.Basic] = set()  # a shared subexpression is looked at once
    while stack:
        sub = stack.pop()
        if sub in seen:
            continue
        seen.add(sub)
        if isinstance(sub, AppliedUndef):
            raise ModelError(f"{sub.func} is an undefined function (no derivative, no C)")
        if isinstance(sub, (sp.Symbol, MatrixElement)):
            atoms.append(sub)
        elif isinstance(sub, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"matrix {short(sub)} used inside the scalar expression {short(expr)} ({shape_text(sub)}): "
                             "write sbp.as_scalar(m) for the entry of a 1x1 matrix m, m.applyfunc(f) to apply f entrywise")
        elif sub.is_Atom:
            if sub.is_extended_real is False:
                raise ModelError(f"{short(sub)} is not a real number: {short(expr)}")
        elif isinstance(sub, _SCALAR_OPS):
            stack.extend(reversed(sub.args))
        else:
            where = "" if sub == expr else f" (in {short(expr)})"
            raise ModelError(f"unsupported scalar operation {type(sub).__name__}: {short(sub)}{where}")
    return atoms


_MATRIX_RULES: dict[type, Callable[[Lowerer, sp.Basic], Node]] = {
    sp.MatrixSymbol: Lowerer.matrix_symbol,
    Index: Lowerer.index,
}


def _record_rule(cls: type) -> Callable[[Lowerer, sp.Basic], Node] | None:
    """The lowering rule an op's record declares for a SymPy class."""
    found = lowering_rule(cls)
    return None if found is None else found[1]


# Matrix expressions whose shape is their own (not their arguments'): the
# dimensions they name must be declared.
_OWN_SHAPE = (sp.OneMatrix, sp.ZeroMatrix, sp.Identity, ExampleMap)


def topological_order(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from roots, arguments before users, in a fixed
    order (depth-first, arguments left to right): never by set or id order."""
    order: list[Node] = []
    seen: set[Node] = set()
    for root in roots:
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, index = stack.pop()
            if node in seen:
                continue
            if index < len(node.args):
                stack.append((node, index + 1))
                stack.append((node.args[index], 0))
            else:
                seen.add(node)
                order.append(node)
    return order
