"""Layer norm's normalization as two ops (declare.attention.RowNormalize):

    normalize_rows(X; eps)         Y[i,:] = (X[i,:] - mu_i) r_i,   mu_i = mean_j X[i,j],
                                   r_i = 1/sqrt(mean_j (X[i,j] - mu_i)^2 + eps)
    normalize_rows_vjp(X, G; eps)  r_i (G[i,:] - mean_j G[i,j] - Y[i,:] mean_j G[i,j] Y[i,j])

The row's Jacobian r (I - 11^T/d - y y^T/d) is symmetric, so the VJP op
is also the JVP of normalize_rows and its own VJP with respect to G. Its
derivatives in X come from the same map written with the IR's row sums
and maps (`_expanded`, differentiated by autodiff), which was the whole
lowering before: the forward was four passes over the rows (their sum,
the centred rows, their squares' sum, the scaled rows plus a stored m x d
derivative) and the backward about six; now each is one loop over the
rows (each row read from L1 after its first pass), the backward reading
X and G only (Y and r recomputed: cheaper than storing and reading them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, attrs_of, plain_grad_fn, register
from symbackprop.declare.attention import RowNormalize
from symbackprop.diff import autodiff
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, worth_threads
from symbackprop.ir.construct import is_const, leaf, map_, reduce_sum
from symbackprop.ir.node import Node, op_node, placeholder, topological_order
from symbackprop.schedule.kernel import LOOP_I, Equation, View, latex_name

A0, A1, A2, A3, A4 = (placeholder(i) for i in range(5))

# --- constructors ---------------------------------------------------------------


def normalize_rows(x: Node, eps: sp.Expr) -> Node:
    return op_node("normalize_rows", (x,), x.shape, (sp.sympify(eps),))


def normalize_rows_vjp(x: Node, g: Node, eps: sp.Expr) -> Node:
    return op_node("normalize_rows_vjp", (x, g), x.shape, (sp.sympify(eps),))


# --- the same maps in the IR's row sums and maps --------------------------------------


def _normalized(x: Node, eps: sp.Expr) -> tuple[Node, Node]:
    """(Y, r) of X as row sums and maps."""
    d = x.shape[1]
    centred = map_(A0 - A1 / d, [x, reduce_sum(x, 1)])
    scale = map_(1 / sp.sqrt(A0 / d + eps), [reduce_sum(map_(A0**2, [centred]), 1)])
    return map_(A0 * A1, [centred, scale]), scale


def _expanded_vjp(x: Node, g: Node, eps: sp.Expr) -> Node:
    """normalize_rows_vjp(X, G) as row sums and maps."""
    d = x.shape[1]
    y, scale = _normalized(x, eps)
    return map_(A0 * (A1 - A2 / d - A3 * A4 / d), [scale, g, reduce_sum(g, 1), y, reduce_sum(map_(A0 * A1, [g, y]), 1)])


def _substitute(root: Node, mapping: dict[Node, Node]) -> Node:
    """root's graph with the nodes of `mapping` replaced."""
    memo = dict(mapping)
    for node in topological_order([root]):
        if node not in memo:
            args = tuple(memo.get(a, a) for a in node.args)
            memo[node] = node if args == node.args else op_node(node.op, args, node.shape, node.attrs)
    return memo[root]


def _stand_ins(x: Node, g: Node) -> tuple[Node, Node]:
    """Leaves in place of X and G: derivatives in X alone, G held fixed
    (G may itself depend on X, as in a Hessian's graph)."""
    return leaf("\0normalize X", x.shape, "stand-in"), leaf("\0normalize G", g.shape, "stand-in")


# --- derivatives ------------------------------------------------------------------


def _normalize_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (normalize_rows_vjp(node.args[0], g, node.attrs[0]),)


def _normalize_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    # the Jacobian is symmetric: J t is its VJP of t
    return normalize_rows_vjp(node.args[0], tangents[0], node.attrs[0]) if tangents[0] is not None else None


def _vjp_vjp(node: Node, seed: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    x, g = node.args
    (eps,) = node.attrs
    wrt_x = None
    if needed[0]:
        sx, sg = _stand_ins(x, g)
        seed_leaf = leaf("\0normalize seed", seed.shape, "stand-in")
        (grad,), _ = autodiff.vjp([(_expanded_vjp(sx, sg, eps), seed_leaf)], [sx])
        wrt_x = _substitute(grad, {sx: x, sg: g, seed_leaf: seed})
    return (wrt_x, normalize_rows_vjp(x, seed, eps) if needed[1] else None)


def _vjp_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    x, g = node.args
    (eps,) = node.attrs
    dx, dg = tangents
    parts = [] if dg is None else [normalize_rows_vjp(x, dg, eps)]
    if dx is not None:
        sx, sg = _stand_ins(x, g)
        tangent_leaf = leaf("\0normalize tangent", dx.shape, "stand-in")
        (tangent,) = autodiff.jvp([_expanded_vjp(sx, sg, eps)], {sx: tangent_leaf})
        parts.append(_substitute(tangent, {sx: x, sg: g, tangent_leaf: dx}))
    return None if not parts else parts[0] if len(parts) == 1 else map_(A0 + A1, parts)


# --- numpy references ---------------------------------------------------------------


def _np_normalized(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    centred = x - x.mean(axis=1, keepdims=True)
    scale = 1 / np.sqrt((centred**2).mean(axis=1, keepdims=True) + eps)
    return centred * scale, scale


def _eval_normalize(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    x = np.broadcast_to(args[0], context.shape(node))
    return _np_normalized(x, float(node.attrs[0]))[0]


def _eval_vjp(node: Node, args: list[np.ndarray], context) -> np.ndarray:
    x, g = (np.broadcast_to(a, context.shape(node)) for a in args)
    y, scale = _np_normalized(x, float(node.attrs[0]))
    return scale * (g - g.mean(axis=1, keepdims=True) - y * (g * y).mean(axis=1, keepdims=True))


# --- kernel -------------------------------------------------------------------------


@dataclass(frozen=True)
class NormalizeAttrs:
    """What a row normalization's kernel does, as its record's `attrs`: the
    kernel, emit and kernel_normalize.c.j2 branch on this, never on the
    op's name.

    gradient: the row's VJP r (G - mean(G) - Y mean(G Y)), reading X and G
        (three sums a row: the squares, G's and G (X - mean)'s); else the
        normalized row (X - mean) r, reading X (two: its sum and squares).
    madds: multiply-adds an entry.
    """

    gradient: bool
    madds: int


@dataclass(frozen=True)
class NormalizeKernel:
    """normalize_rows (args: X) or normalize_rows_vjp (X, G) into the contiguous `out`;
    an argument is a view, or a constant (an adjoint of 1)."""

    kind: str
    out: str
    args: tuple[tuple[View | None, sp.Expr | None], ...]
    rows: object
    width: object
    eps: sp.Expr
    equations: tuple[Equation, ...]

    def reads(self) -> list[str]:
        return [view.buffer for view, _ in self.args if view is not None]

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def title(self) -> str:
        return self.kind.replace("_", " ")

    @property
    def attrs(self) -> NormalizeAttrs:
        return attrs_of(self.kind, NormalizeAttrs)

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): a few an entry."""
        entries = sp.sympify(self.rows) * self.width
        return entries * self.attrs.madds, 2 * entries


_MATH = {
    "normalize_rows": "({0}[i, :] - mu_i) r_i, mu_i = mean_j {0}[i, j], r_i = 1/sqrt(mean_j ({0}[i, j] - mu_i)^2 + {eps})",
    "normalize_rows_vjp": "r_i ({1}[i, :] - mean_j {1}[i, j] - y[i, :] mean_j {1}[i, j] y[i, j]), y = ({0} - mu) r "
                          "normalized as in normalize_rows (mu_i, r_i of {0}'s row i, recomputed)",
}


def _kernel(sched, node: Node, out: str) -> NormalizeKernel:
    args, labels = [], []
    for arg in node.args:
        if is_const(arg):
            args.append((None, arg.attrs[0]))
            labels.append(f"({arg.attrs[0]})")
        else:
            args.append((sched.view(arg), None))
            labels.append(sched.label(arg))
    eps = node.attrs[0]
    value = _MATH[node.op].format(*labels, eps=f"{float(eps):.6g}")
    latex = rf"{latex_name(out)} = \operatorname{{{node.op.replace('_', '-')}}}({', '.join(map(latex_name, labels))})"
    return NormalizeKernel(node.op, out, tuple(args), node.shape[0], node.shape[1], eps,
                           (Equation(out + "[i, :]", value, latex),))


class RowRead:
    """How the C reads entry `column` (C text) of row i of an argument."""

    def __init__(self, em: FunctionEmitter, kernel: NormalizeKernel, view: View | None, constant: sp.Expr | None):
        self.em, self.view = em, view
        if view is None:
            dims = {d: f"(({em.real.c}){c})" for d, c in em.dims.items()}  # real, not integer, division
            self.constant = f"({CheckedPrinter(ScalarPrinter(dims, em.real), kernel).doprint(constant)})"

    def at(self, column: str) -> str:
        if self.view is None:
            return self.constant
        return self.em.access(self.view, LOOP_I, sp.Symbol(column, integer=True) if column.isidentifier()
                              else sp.sympify(column, locals={"k": sp.Symbol("k", integer=True),
                                                              "l": sp.Symbol("l", integer=True)}))


def _emit(em: FunctionEmitter, kernel: NormalizeKernel) -> dict:
    reads = [RowRead(em, kernel, view, constant) for view, constant in kernel.args]
    width = em.dim(kernel.width)
    squares = sp.Symbol("squares", real=True)
    dims = {d: f"(({em.real.c}){c})" for d, c in em.dims.items()}
    scale = ScalarPrinter({squares: "squares", **dims}, em.real).doprint(1 / sp.sqrt(squares / kernel.width + kernel.eps))
    return {"m": em.dim(kernel.rows), "d": width if width.isidentifier() or width.isdigit() else f"({width})",
            "out": em.namer.name(kernel.out), "x": reads[0], "g": reads[1] if len(reads) > 1 else None,
            "scale": scale, "parallel": worth_threads(kernel.rows), "op": kernel.attrs,
            "lanes": em.real.lanes}


def _lower(lowerer, expr: RowNormalize) -> Node:
    return normalize_rows(lowerer.lower(expr.args[0]), expr.args[1])


def _op(name: str, vjp, jvp, evaluate, grad_fn: str, **more) -> None:
    register(OpRecord(name, vjp=vjp, jvp=jvp, evaluate=evaluate, kernel=_kernel, emit=_emit,
                      template="kernel_normalize.c.j2", grad_fn=plain_grad_fn(grad_fn), **more))


_op("normalize_rows", _normalize_vjp, _normalize_jvp, _eval_normalize, "NormalizeRows",
    attrs=NormalizeAttrs(gradient=False, madds=1), lowering=((RowNormalize, _lower),),
    shapes=((RowNormalize, lambda expr, of: of(expr.args[0])),))
_op("normalize_rows_vjp", _vjp_vjp, _vjp_jvp, _eval_vjp, "NormalizeRowsVjp",
    attrs=NormalizeAttrs(gradient=True, madds=3))
