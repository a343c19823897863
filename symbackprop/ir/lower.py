"""Lower a Model's SymPy expressions to IR nodes: each SymPy class through
the lowering rule its op's record declares (symbackprop.ops), matrix
symbols and indices here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp
from sympy.core.function import Application, AppliedUndef
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import BooleanAtom, BooleanFunction
from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.base.exprdag import Splitter, shared_xreplace
from symbackprop.base.registry import lowering_rule, shape_rule
from symbackprop.declare.model import Model, leaf_name
from symbackprop.declare.tensor import ExampleMap, Index
from symbackprop.errors import ModelError
from symbackprop.ir.construct import element, leaf, map_, pack
from symbackprop.ir.node import SCALAR, Dim, Node, Shape, ShapeMismatch, placeholder
from symbackprop.messages import described, shape_text, short

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
    # (dimension, least value, why): fixed entries taken along a dimension bound at call time
    # (X[2, 0] of X (n x 3) needs n >= 3); each call checks them (the binder and the C)
    minimums: tuple[tuple[str, int, str], ...] = ()


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
    return Lowered(model, leaves, loss, outputs, tuple(dims), named, least_values(lowerer.minimums))


def least_values(needs: list[tuple[str, int, str]]) -> tuple[tuple[str, int, str], ...]:
    """The largest need of each dimension (the first named where several
    are as large), in the order the dimensions were first met."""
    most: dict[str, tuple[str, int, str]] = {}
    for need in needs:
        if need[0] not in most or need[1] > most[need[0]][1]:
            most[need[0]] = need
    return tuple(most.values())


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
        self.minimums: list[tuple[str, int, str]] = []  # see need_at_least()

    def cache(self, owner: str) -> dict:
        """A dict that lives as long as this lowering, for an op defined
        outside this module to memoize what it lowered (scan: one node per
        declared scan, however many of its parts the model reads)."""
        return self.caches.setdefault(owner, {})

    def nested(self, leaves: dict[sp.Basic, Node], context: str) -> Lowerer:
        """A lowerer for a graph nested in this one's (a scan's step), over
        its own `leaves` and this one's dims, with `context` added to its
        `contexts` (so that an op can refuse to nest in itself)."""
        sub = Lowerer(leaves, tuple(self.dims))
        sub.contexts = self.contexts + (context,)
        sub.minimums = self.minimums  # one list: a scan's step's entries are the model's
        return sub

    def entry(self, atom: MatrixElement) -> Node:
        """parent[i, j] of constant i and j: a negative one counts from the
        end of a fixed size (as Python's); along a size bound at call time
        the entry is a need of every call (need_at_least).

        Raises:
            ModelError: an index not a number, past a fixed size, or negative
                along a size bound at call time.
        """
        parent, i, j = atom.args
        if not (i.is_Integer and j.is_Integer):
            raise ModelError(f"only constant indices are supported: {short(atom)}")
        matrix = self.lower(parent)
        at = []
        for index, size, what in ((int(i), matrix.shape[0], "row"), (int(j), matrix.shape[1], "column")):
            if isinstance(size, sp.Symbol):
                if index < 0:
                    raise ModelError(f"{short(atom)} takes {what} {index} of {short(parent)}, counted from the end of "
                                     f"{size}, which is bound at call time: only a fixed entry is supported there")
                self.need_at_least(size, index + 1, f"the model reads {what} {index} of {short(parent)}")
            else:
                index = index + int(size) if index < 0 else index
                if not 0 <= index < int(size):
                    raise ModelError(f"{short(atom)} takes {what} {index} of {short(parent)}, which has {size}")
            at.append(index)
        return element(matrix, at[0], at[1])

    def need_at_least(self, size: Dim, least: int, why: str) -> None:
        """A fixed entry or part of a dimension bound at call time: every
        call must bind it to at least `least` (checked by the binder and the C)."""
        if isinstance(size, sp.Symbol) and least > 1:
            self.minimums.append((str(size), least, why))

    def scalar_result(self, expr: sp.Basic, what: str) -> Node:
        node = self.lower(expr)
        if node.shape != SCALAR:
            raise ModelError(f"{what} must be a scalar; {short(expr)} has shape {node.shape}")
        return node

    def lower(self, expr: sp.Basic) -> Node:
        expr = sp.sympify(expr)
        node = self.memo.get(expr)
        if node is None:
            self._lower_chain(expr)
            node = self.memo[expr]
        return node

    def _lower_chain(self, expr: sp.Basic) -> None:
        """Lower expr and, first, the chain of sums, products and
        elementwise functions below it, each after its arguments, in the
        order the rules' recursion would (depth first, left to right): a
        rule then finds its arguments lowered, and lowering an unrolled
        network of 1,000 steps recurses no deeper than one step."""
        stack: list[tuple[sp.Basic, bool]] = [(expr, False)]
        while stack:
            sub, ready = stack.pop()
            if sub in self.memo:
                continue
            if ready:
                self.memo[sub] = self._lower(sub)
                continue
            stack.append((sub, True))
            if isinstance(sub, _CHAIN):
                stack.extend((a, False) for a in reversed(sub.args) if isinstance(a, _CHAIN) and a not in self.memo)

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
                arg = self.entry(atom)
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
        return map_(shared_xreplace(expr, subs, {}), args, SCALAR)  # conditions as they stand (exprdag)

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
# the SymPy classes whose rules lower each of their matrix arguments first, in order
_CHAIN = (sp.MatAdd, sp.MatMul, sp.HadamardProduct, sp.HadamardPower, ElementwiseApplyFunction, sp.Transpose)
_OWN_SHAPE = (sp.OneMatrix, sp.ZeroMatrix, sp.Identity, ExampleMap)
