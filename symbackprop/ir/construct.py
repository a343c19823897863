"""The constructors of IR nodes, which fold what they can.

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
    logsumexp  stable log(sum(exp)) over one axis       attrs: (axis,); args: (a, its softmax_axis)
    softmax_axis, log_softmax_axis  max-subtracted along one axis (ops/reduce.py)
    element    A[i, j] as a 1x1 (a view)                attrs: (i, j)
    pack       a matrix from 1x1 values, zero elsewhere attrs: (positions,)
    max, min   the extreme over one axis (kept as size 1) attrs: (axis,)
    prod       the product over one axis (ops/reduce.py)  attrs: (axis,)
    cumsum     the running sum along an axis (ops/cumulative.py)  attrs: (axis, reverse)
    shift      moved k entries along an axis, a fill where none moves in (ops/cumulative.py)
                                                        attrs: (axis, reverse, k, fill)
    emap       a per-example function over one or two   attrs: (bodies, bindings,
               loop lengths (see emap() below)                  loops, target)"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import sympy as sp

from symbackprop.base.exprdag import substitute
from symbackprop.base.stable import fuse_across, stabilize
from symbackprop.declare.tensor import reduced_shape
from symbackprop.ir.node import SCALAR, Node, Shape, ShapeMismatch, op_node, placeholder

# --- constructors ---------------------------------------------------------


def leaf(name: str, shape: Shape, role: str) -> Node:
    return op_node("leaf", (), shape, (name, role))


def const(value: sp.Expr, shape: Shape = SCALAR) -> Node:
    return op_node("map", (), shape, (sp.sympify(value),))


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
    placed: list[int | tuple] = []  # each argument's new position, or (the constant put in its place,)
    kept: dict[Node, int] = {}  # each distinct argument's new position
    for arg in args:
        if arg.shape != shape and not broadcastable(arg.shape, shape):
            raise ShapeMismatch(f"cannot broadcast shape {arg.shape} to {shape}")
        placed.append((arg.attrs[0],) if is_const(arg) else kept.setdefault(arg, len(kept)))
    body, positions = _prepared(sp.sympify(body), tuple(placed), len(kept))
    distinct = list(kept)
    used = [distinct[i] for i in positions]
    if body == placeholder(0) and len(used) == 1 and used[0].shape == shape:
        return used[0]
    narrow = _broadcast_shape([a.shape for a in used])
    if used and narrow != shape and not (body == placeholder(0) and len(used) == 1):
        # every argument is narrower (e.g. a per-row value on every column):
        # computed once at their shape, then broadcast (never stored wide)
        return broadcast(map_(body, used, narrow), shape)
    fused = _match_logsumexp(body, used, shape)
    if fused is not None:
        return fused
    across = fuse_across(body, tuple(used), shape, placeholder)
    if across is not None:  # e.g. log(1 - p) of p = sigmoid(z): -softplus(z)
        return map_(across[0], across[1], shape)
    return op_node("map", tuple(used), shape, (body,))


@lru_cache(maxsize=4096)
def _prepared(body: sp.Expr, placed: tuple, count: int) -> tuple[sp.Expr, tuple[int, ...]]:
    """map_'s body over its `count` distinct arguments: each placeholder
    renamed to its argument's new position or replaced by a constant
    (`placed`, per argument: an int, or the constant in a 1-tuple), the body stabilized (exact rewrites of
    overflow-prone forms: 1/(1 + exp(-z)) -> sigmoid(z)) and renumbered over
    the arguments it still reads; and their positions. Remembered: a
    gradient applies the same few bodies (a product, a negation, a
    derivative of a sum) thousands of times."""
    moved = {placeholder(i): p[0] if isinstance(p, tuple) else placeholder(p)  # (a constant in a tuple: 1 == Integer(1))
             for i, p in enumerate(placed) if p != i}
    body = stabilize(body.xreplace(moved) if moved else body)  # (xreplace rebuilds what a key is in, even to itself)
    free = body.free_symbols  # once: a walk of the body (per argument, it was quadratic in a wide body)
    positions = tuple(i for i in range(count) if placeholder(i) in free)
    if len(positions) != count:
        body = body.xreplace({placeholder(old): placeholder(new) for new, old in enumerate(positions)})
    return body, positions


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
    return op_node("matmul", (a, b), shape)


def transpose(a: Node) -> Node:
    if a.op == "transpose":
        return a.args[0]
    if a.shape == SCALAR or is_const(a):
        return a if a.shape == SCALAR else const(a.attrs[0], (a.shape[1], a.shape[0]))
    return op_node("transpose", (a,), (a.shape[1], a.shape[0]))


def reduce_sum(a: Node, axis: int) -> Node:
    """Sum over `axis` (0: down the rows, giving 1 x cols; 1: along each row)."""
    if a.shape[axis] == 1:
        return a
    shape = reduced_shape(a.shape, axis)
    if is_const(a):
        return const(a.attrs[0] * a.shape[axis], shape)
    return op_node("sum", (a,), shape, (axis,))


def logsumexp(a: Node, axis: int) -> Node:
    """log(sum(exp(a))) over `axis`, computed from a and its softmax along
    that axis (the node's second argument, ops/reduce.py): each exp is
    computed once, in the softmax, which the gradient reuses."""
    shape = reduced_shape(a.shape, axis)
    return op_node("logsumexp", (a, softmax(a, axis, nan_at_inf=False)), shape, (axis,))


def softmax(a: Node, axis: int, nan_at_inf: bool = True) -> Node:
    """exp(a - max) / sum(exp(a - max)) along `axis` (ops/reduce.py).
    nan_at_inf: a line with a +inf is NaN throughout, as torch.softmax;
    else exp(a - max) there (NaN at the +inf, 0 elsewhere), the gradient
    of torch.logsumexp, which logsumexp's node reads."""
    return op_node("softmax_axis", (a,), a.shape, (axis, False, int(nan_at_inf)))


def log_softmax(a: Node, axis: int) -> Node:
    """(a - max) - log(sum(exp(a - max))) along `axis`, from a and its
    softmax (the node's second argument, which its gradient reads): the
    log of the sum is added to the small differences a - max, never
    subtracted from a."""
    return op_node("log_softmax_axis", (a, softmax(a, axis)), a.shape, (axis,))


def reduce_extreme(op: str, a: Node, axis: int) -> Node:
    """max or min over `axis`."""
    if a.shape[axis] == 1:
        return a
    shape = reduced_shape(a.shape, axis)
    if is_const(a):
        return const(a.attrs[0], shape)
    return op_node(op, (a,), shape, (axis,))


def row_placeholder(arg: int, col: int) -> sp.Symbol:
    """The symbol that stands for column `col` of an emap's arg-th argument."""
    return sp.Symbol(f"_e{arg}_{col}", real=True)


# How an emap reads an argument at each example (loop variables i, then k):
#   ("row", a)        row (i, k)[a] of the argument
#   ("gather", q, a)  row idx[(i, k)[a]], idx being argument q (an index leaf)
#   ("whole",)        row 0: a 1-row argument shared by every example
#   ("cell",)         element (i, k): a loops[0] x loops[1] argument
#   ("index",)        an index leaf, read only through gathers
#   ("guard", a)      a column read at (i, k)[a] and nowhere else: an example
#                     whose entry is 0 is skipped (adds nothing; its own place is 0)
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
    return op_node("emap", kept, shape, (programs, bindings, tuple(loops), target, live))


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
    needed = set(used) | {p for p, binding in enumerate(bindings) if binding[0] == "guard"}
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
    renamed = substitute([*bodies, *(e for _, e in lets)], subs)  # shared parts renamed once
    return (tuple(args[p] for p in keep), tuple(renumber(bindings[p]) for p in keep), tuple(renamed[:len(bodies)]),
            tuple((sym, e) for (sym, _), e in zip(lets, renamed[len(bodies):])), renumber(target))


def accumulates(target: tuple, loops: tuple) -> bool:
    """Whether several examples write one place of an emap's output."""
    return not (target == ("cell",) or (target[0] == "row" and len(loops) == 1))


def guard_of(node: Node) -> tuple[Node, int] | None:
    """An emap's guard (see emap): its column and the loop it is read at, or None."""
    for arg, binding in zip(node.args, node.attrs[1]):
        if binding[0] == "guard":
            return arg, binding[1]
    return None


def binding_width(node: Node, binding: tuple) -> int:
    if binding[0] in ("index", "guard"):
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
    if a.op == "map" and a.args and all(arg.op == "pack" for arg in a.args):
        # e.g. a gradient summed from one-hot packs (reverse mode through
        # entries): the entry's own arithmetic, so no matrix is stored and
        # the entry fuses with its readers (a fixed point's step was split in two)
        picks = [element(arg, i if arg.shape[0] != 1 else 0, j if arg.shape[1] != 1 else 0) for arg in a.args]
        return map_(a.attrs[0], picks, SCALAR)
    return op_node("element", (a,), SCALAR, (i, j))


def pack(shape: Shape, entries: dict[tuple[int, int], Node]) -> Node:
    entries = {p: e for p, e in entries.items() if not (is_const(e) and e.attrs[0] == 0)}
    if shape == SCALAR and (0, 0) in entries:
        return entries[(0, 0)]
    positions = tuple(sorted(entries))
    return op_node("pack", tuple(entries[p] for p in positions), shape, (positions,))


def broadcast(a: Node, shape: Shape) -> Node:
    """`a` repeated along the axes where its size is 1."""
    return map_(placeholder(0), [a], shape)


def is_broadcast(node: Node) -> bool:
    """Whether `node` is broadcast(a, shape) of a narrower `a`."""
    return (node.op == "map" and len(node.args) == 1 and node.attrs[0] == placeholder(0)
            and node.args[0].shape != node.shape)


def _match_logsumexp(body: sp.Expr, args: list[Node], shape: Shape) -> Node | None:
    """log(sum(exp(Z), axis)) becomes one stable logsumexp (max subtracted)."""
    if len(args) != 1 or args[0].op != "sum" or body != sp.log(placeholder(0)):
        return None
    summed = args[0].args[0]
    if summed.op == "map" and summed.attrs[0] == sp.exp(placeholder(0)):
        inner = summed.args[0]
        if inner.shape == summed.shape:
            return logsumexp(inner, args[0].attrs[0])
    return None
