"""Linear algebra of square matrices (n x n, n symbolic or fixed): det,
logdet, solve, cholesky and triangular_solve (declare/linalg.py), and band,
the triangle masks their rules need.

Each op's kernel is one call of the runtime header's helper of its name
(templates/linalg.c.j2: LU with partial pivoting, Cholesky, substitution),
which reads its matrices through strides: a transposed argument (A^T in a
rule) is a view, never a copy. det, logdet and solve read the factors of
their matrix, the node lu(A) (LAPACK's getrf above a size where linked),
their last argument: the forward pass's factors, which the gradients'
solves with A^T read again (solve's `trans`), as JAX's and PyTorch's do.
Their rules differentiate through A alone: the factors' adjoint and
tangent are None (lu's rules say so), A carries the whole derivative. The derivative rules are built from these
same ops (Giles 2008, "Collected matrix derivative results"; Murray 2016 for
Cholesky), so the derivatives can be differentiated again:

    det:    A-bar = g det(A) A^{-T}           d det = det(A) sum(A^{-T} * dA)
    logdet: A-bar = g A^{-T}                  d logdet = sum(A^{-T} * dA)
    solve:  B-bar = A^{-T} G, A-bar = -B-bar X^T          dX = A^{-1} (dB - dA X)
    triangular_solve (T the triangle read):
            B-bar = T^{-T} G, T-bar = -tri(B-bar X^T)      dX = T^{-1} (dB - tri(dT) X)
    cholesky of S = (A + A^T)/2, Phi(M) = lower triangle of M, diagonal halved:
            A-bar = sym(L^{-T} Phi(L^T L-bar) L^{-1})      dL = L Phi(L^{-1} sym(dA) L^{-T})

A^{-T} is solve(A, I, trans=True), I = band(1, diagonal only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy as sp

from symbackprop.base.registry import JvpRule, OpRecord, VjpRule, attrs_of, plain_grad_fn, register
from symbackprop.declare.linalg import Cholesky, Det, LogDet, Solve, TriangularSolve
from symbackprop.diff.autodiff import add_all
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter
from symbackprop.ir.construct import const, is_const, map_, matmul, reduce_sum, transpose
from symbackprop.ir.node import SCALAR, Node, Shape, op_node, placeholder
from symbackprop.schedule.kernel import Equation, View, latex_name

A0, A1, A2 = placeholder(0), placeholder(1), placeholder(2)


# --- the kernel: one helper call ---------------------------------------------------


@dataclass(frozen=True)
class LinalgAttrs:
    """What a linear algebra op's kernel does, as its record's `attrs`: its
    kernel, emit and record read these, never the op's name.

    title: the kernel's name in comments and the derivation.
    madds: its multiply-adds of (n, k): the first operand's size and the
        last shape's columns (the right-hand sides).
    scalar: the helper returns the result (det, logdet), not writing it.
    factored: its last operand is lu(A) of its first, A: the helper gets
        A's size and the factors' pointer, not A's entries.
    entrywise: a mask of one m x n operand (band): the helper gets its
        rows and columns, its flags as real scales, and does one
        operation an entry (others: n).
    """

    title: str
    madds: Callable[[sp.Expr, sp.Expr], sp.Expr]
    scalar: bool = False
    entrywise: bool = False
    factored: bool = False


@dataclass(frozen=True)
class LinalgKernel:
    """`kind` (an op) of its `operands` (views, or a constant read at every
    entry) into the contiguous `out` (no workspace: det's, logdet's and
    solve's factors are lu's output). `flags`: literal arguments after the
    operands (band's scales, triangular_solve's lower, solve's trans)."""

    kind: str
    out: str
    operands: tuple[View | sp.Expr, ...]
    shapes: tuple[Shape, ...]
    flags: tuple[sp.Expr, ...]
    equations: tuple[Equation, ...]

    def reads(self) -> list[str]:
        return [v.buffer for v in self.operands if isinstance(v, View)]

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def attrs(self) -> LinalgAttrs:
        return attrs_of(self.kind, LinalgAttrs)

    @property
    def title(self) -> str:
        return self.attrs.title

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): LU n^3/3, Cholesky n^3/6, a
        substitution n^2/2 per right-hand side column (solve: two)."""
        n = sp.sympify(self.shapes[0][0])
        k = sp.sympify(self.shapes[-1][1])
        return self.attrs.madds(n, k), (n * self.shapes[0][1] if self.attrs.entrywise else n)


def _lu(n: sp.Expr, k: sp.Expr) -> sp.Expr:
    return n**3 / 3


def _kernel_builder(text: Callable[[list[str], Node], tuple[str, str]]) -> Callable:
    """The kernel builder of an op; text(labels, node) -> (comment, LaTeX)."""

    def kernel(sched, node: Node, out: str) -> LinalgKernel:
        labels = [str(a.attrs[0]) if is_const(a) else sched.label(a) for a in node.args]
        comment, written = text(labels, node)
        equation = Equation(out, comment, f"{latex_name(out)} = {written}")
        operands = tuple(a.attrs[0] if is_const(a) else sched.view(a) for a in node.args)
        flags = tuple(sp.sympify(f) for f in node.attrs)
        return LinalgKernel(node.op, out, operands, tuple(a.shape for a in node.args) + (node.shape,), flags,
                            (equation,))

    return kernel


def _emit(em: FunctionEmitter, kernel: LinalgKernel) -> dict:
    """One helper call (templates/linalg.c.j2): each operand as (first entry,
    its size, row stride, column stride), the first one's size n (band's:
    rows, cols), the second's its columns k; then the flags and the output;
    det and logdet return their value. A constant operand is a
    compound literal read with strides 0. A factored op's A is its size
    alone, its factors (the last operand) a pointer alone."""
    printer = CheckedPrinter(ScalarPrinter({}, em.real), kernel)
    args: list[str] = []
    factored = kernel.attrs.factored
    for index, (operand, shape) in enumerate(zip(kernel.operands, kernel.shapes)):
        if factored and index == 0:  # A: its size (the helper reads its factors)
            args.append(em.dim(shape[0]))
            continue
        if factored and index == len(kernel.operands) - 1:  # the factors: contiguous
            assert isinstance(operand, View)
            offset = "" if operand.offset == 0 else f" + {em.dim(operand.offset)}"
            args.append(em.namer.name(operand.buffer) + offset)
            continue
        if isinstance(operand, View):
            pointer = em.namer.name(operand.buffer) + ("" if operand.offset == 0 else f" + {em.dim(operand.offset)}")
            strides = [em.dim(operand.row_stride), em.dim(operand.col_stride)]
        else:
            pointer, strides = f"&(const {em.real.c}){{{printer.doprint(operand)}}}", ["0", "0"]
        sizes = [shape[0], shape[1]] if kernel.attrs.entrywise else [shape[index]]
        args += [pointer, *(em.dim(s) for s in sizes), *strides]
    args += [printer.doprint(f) if kernel.attrs.entrywise else str(int(f)) for f in kernel.flags]
    scalar = kernel.attrs.scalar
    args += [] if scalar else [em.namer.name(kernel.out)]
    return {"loop": None, "columns": None, "out": f"{em.namer.name(kernel.out)}[0]" if scalar else None,
            "args": ", ".join(args)}


def _linalg_op(name: str, vjp: VjpRule, jvp: JvpRule, evaluate: Callable[..., np.ndarray],
               text: Callable[[list[str], Node], tuple[str, str]], grad_fn: str, attrs: LinalgAttrs,
               **more: object) -> OpRecord:
    return register(OpRecord(
        name, vjp=vjp, jvp=jvp, evaluate=lambda node, args, context: evaluate(*args, *node.attrs),
        kernel=_kernel_builder(text), emit=_emit, template="reduce_kernel" if attrs.scalar else "axis_kernel",
        grad_fn=plain_grad_fn(grad_fn), helper=True, attrs=attrs, **more,  # type: ignore[arg-type]
    ))


# --- constructors ------------------------------------------------------------------


def band(a: Node, below: sp.Expr, diagonal: sp.Expr, above: sp.Expr) -> Node:
    """Entry (i, j) of `a` times `below` where i > j, `diagonal` where i == j,
    `above` where i < j (a scale 0 gives 0, also for an inf entry)."""
    return op_node("band", (a,), a.shape, (sp.sympify(below), sp.sympify(diagonal), sp.sympify(above)))


def identity(n: object) -> Node:
    return band(const(1, (n, n)), 0, 1, 0)


def _stored(a: Node) -> Node:
    """A constant operand as a stored matrix (the kernels read memory)."""
    return band(a, 1, 1, 1) if is_const(a) else a


def lu(a: Node) -> Node:
    """The LU factors of A with partial pivoting, (n + 1) x n: their layout
    is the C helper's (templates/linalg.c.j2), read only by det, logdet and
    solve of the same A (one node: the forward pass's factors serve the
    gradient's solves)."""
    n = a.shape[0]
    return op_node("lu", (a,), (n + 1, n))


def det(a: Node) -> Node:
    a = _stored(a)
    return op_node("det", (a, lu(a)), SCALAR)


def logdet(a: Node) -> Node:
    a = _stored(a)
    return op_node("logdet", (a, lu(a)), SCALAR)


def solve(a: Node, b: Node, trans: bool = False) -> Node:
    """X with A X = B, or A^T X = B (trans): both from the factors of A."""
    a = _stored(a)
    return op_node("solve", (a, _stored(b), lu(a)), b.shape, (int(bool(trans)),))


def cholesky(a: Node) -> Node:
    return op_node("cholesky", (_stored(a),), a.shape)


def triangular_solve(t: Node, b: Node, lower: bool) -> Node:
    """X with T X = B, T the lower (or upper) triangle of `t`."""
    return op_node("triangular_solve", (_stored(t), _stored(b)), b.shape, (int(bool(lower)),))


def _triangle(m: Node, lower: bool) -> Node:
    return band(m, 1, 1, 0) if lower else band(m, 0, 1, 1)


def _inverse_transpose(a: Node) -> Node:
    return solve(a, identity(a.shape[0]), trans=True)


def _sum_all(m: Node) -> Node:
    return reduce_sum(reduce_sum(m, 0), 1)


def _neg(m: Node) -> Node:
    return map_(-A0, [m])


def _sym(m: Node) -> Node:
    return map_((A0 + A1) / 2, [m, transpose(m)])


# --- band ----------------------------------------------------------------------------


def _band_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (band(g, *node.attrs),)  # a mask: its own adjoint


def _band_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return band(tangents[0], *node.attrs) if tangents[0] is not None else None


def _band_value(x: np.ndarray, below: sp.Expr, diagonal: sp.Expr, above: sp.Expr) -> np.ndarray:
    rows, cols = np.indices(x.shape)
    scale = np.where(rows > cols, float(below), np.where(rows == cols, float(diagonal), float(above)))
    with np.errstate(invalid="ignore"):
        return np.where(scale == 0, 0.0, scale * x)


# --- det, logdet ------------------------------------------------------------------------


# --- lu: read by det, logdet and solve, which differentiate through A ----------------


def _lu_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (None,)  # never reached: its readers give the factors no adjoint


def _lu_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return None  # its readers' JVP rules take A's tangent, not the factors'


def _lu_value(a: np.ndarray) -> np.ndarray:
    """The C helper's layout: row-major, the factors of A^T (P A^T = L U)
    packed and transposed, then the 1-based pivots."""
    pivots: list[int] = []
    packed, _, _ = lu_factor(np.asarray(a, dtype=float).T, pivots=pivots)
    return np.vstack([packed.T, np.array(pivots, dtype=float)[None, :]])


def _det_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return map_(A0 * A1 * A2, [g, node, _inverse_transpose(node.args[0])], node.args[0].shape), None


def _det_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    if tangents[0] is None:
        return None
    return map_(A0 * A1, [node, _sum_all(map_(A0 * A1, [_inverse_transpose(node.args[0]), tangents[0]]))])


def _logdet_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return map_(A0 * A1, [g, _inverse_transpose(node.args[0])], node.args[0].shape), None


def _logdet_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    if tangents[0] is None:
        return None
    return _sum_all(map_(A0 * A1, [_inverse_transpose(node.args[0]), tangents[0]]))


def lu_factor(a: np.ndarray, rhs: np.ndarray | None = None,
              pivots: list[int] | None = None) -> tuple[np.ndarray, np.ndarray | None, float]:
    """The C helper's LU with partial pivoting, in numpy: (LU packed, rhs
    with its rows swapped alongside and eliminated, the permutation's sign);
    `pivots` gets each column's pivot row, 1-based. A zero pivot (the
    column is zero on and below the diagonal) is skipped; a NaN is chosen
    as the pivot, so it spreads."""
    lu = np.array(a, dtype=float)
    x = None if rhs is None else np.array(rhs, dtype=float)
    n, sign = lu.shape[0], 1.0
    with np.errstate(all="ignore"):
        for c in range(n):
            column = np.abs(lu[c:, c])
            nan = np.flatnonzero(np.isnan(column))
            p = c + (int(nan[0]) if nan.size else int(np.argmax(column)))
            if pivots is not None:
                pivots.append(p + 1)
            if p != c:
                lu[[c, p]] = lu[[p, c]]
                if x is not None:
                    x[[c, p]] = x[[p, c]]
                sign = -sign
            pivot = lu[c, c]
            if pivot == 0:
                continue
            lu[c + 1:, c] /= pivot
            lu[c + 1:, c + 1:] -= np.outer(lu[c + 1:, c], lu[c, c + 1:])
            if x is not None:
                x[c + 1:] -= np.outer(lu[c + 1:, c], x[c])
    return lu, x, sign


def _det_value(a: np.ndarray, factors: np.ndarray) -> np.ndarray:
    packed, _, sign = lu_factor(a)
    return np.array([[sign * np.prod(np.diag(packed))]])


def _logdet_value(a: np.ndarray, factors: np.ndarray) -> np.ndarray:
    packed, _, _ = lu_factor(a)
    with np.errstate(divide="ignore"):
        return np.array([[np.sum(np.log(np.abs(np.diag(packed))))]])


# --- solve -------------------------------------------------------------------------------


def _solve_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    """op(A) X = B (op: A^T where trans): B-bar = op(A)^{-T} G from the same
    factors, A-bar = -B-bar X^T (its transpose where trans)."""
    a, trans = node.args[0], bool(node.attrs[0])
    grad_b = solve(a, g, not trans)
    grad_a = None
    if needed[0]:
        outer = matmul(grad_b, transpose(node)) if not trans else matmul(node, transpose(grad_b))
        grad_a = _neg(outer)
    return grad_a, grad_b if needed[1] else None, None


def _solve_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    a, ta, tb, trans = node.args[0], tangents[0], tangents[1], bool(node.attrs[0])
    terms = [tb] if tb is not None else []
    if ta is not None:
        terms.append(_neg(matmul(transpose(ta) if trans else ta, node)))
    return solve(a, add_all(terms), trans) if terms else None


def _back_substitute(u: np.ndarray, x: np.ndarray, lower: bool, unit: bool = False) -> np.ndarray:
    """x <- T^{-1} x, T the lower (upper) triangle of u (unit: ones on its diagonal)."""
    n = u.shape[0]
    order = range(n) if lower else range(n - 1, -1, -1)
    with np.errstate(all="ignore"):
        for i in order:
            others = slice(0, i) if lower else slice(i + 1, n)
            x[i] -= u[i, others] @ x[others]
            if not unit:
                x[i] /= u[i, i]
    return x


def _solve_value(a: np.ndarray, b: np.ndarray, factors: np.ndarray, trans: int) -> np.ndarray:
    packed, x, _ = lu_factor(np.asarray(a).T if trans else a, b)
    assert x is not None
    return _back_substitute(packed, x, lower=False)  # the forward pass ran alongside the elimination


# --- triangular_solve -----------------------------------------------------------------------


def _triangular_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    t, lower = node.args[0], bool(node.attrs[0])
    grad_b = triangular_solve(transpose(t), g, not lower)
    grad_t = _triangle(_neg(matmul(grad_b, transpose(node))), lower) if needed[0] else None
    return grad_t, grad_b if needed[1] else None


def _triangular_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    (t, _), (tt, tb), lower = node.args, tangents, bool(node.attrs[0])
    terms = ([tb] if tb is not None else []) + ([_neg(matmul(_triangle(tt, lower), node))] if tt is not None else [])
    return triangular_solve(t, add_all(terms), lower) if terms else None


def _triangular_value(t: np.ndarray, b: np.ndarray, lower: int) -> np.ndarray:
    return _back_substitute(t, np.array(b, dtype=float), bool(lower))


# --- cholesky ---------------------------------------------------------------------------------


def _phi(m: Node) -> Node:
    return band(m, 1, sp.Rational(1, 2), 0)


def _cholesky_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    upper = transpose(node)  # L^T: L^{-T} M is triangular_solve(L^T, M, upper)
    inner = _phi(matmul(upper, g))
    left = triangular_solve(upper, inner, lower=False)  # L^{-T} Phi
    both = transpose(triangular_solve(upper, transpose(left), lower=False))  # (L^{-T} Phi) L^{-1}
    return (_sym(both),)


def _cholesky_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    if tangents[0] is None:
        return None
    left = triangular_solve(node, _sym(tangents[0]), lower=True)  # L^{-1} dS
    both = transpose(triangular_solve(node, transpose(left), lower=True))  # L^{-1} dS L^{-T}
    return matmul(node, _phi(both))


def _cholesky_value(a: np.ndarray) -> np.ndarray:
    """The C helper's column-by-column Cholesky of (a + a^T)/2 (NaN from a
    non-positive pivot on, as sqrt of a negative number)."""
    s = (np.asarray(a, dtype=float) + np.asarray(a, dtype=float).T) / 2
    n = s.shape[0]
    low = np.zeros_like(s)
    with np.errstate(all="ignore"):
        for j in range(n):
            low[j, j] = np.sqrt(s[j, j] - low[j, :j] @ low[j, :j])
            low[j + 1:, j] = (s[j + 1:, j] - low[j + 1:, :j] @ low[j, :j]) / low[j, j]
    return low


# --- lowering and registration ------------------------------------------------------------------


def _texts(template: str, latex: str) -> Callable[[list[str], Node], tuple[str, str]]:
    """Comment and LaTeX of a kernel, with {0}, {1} the operands' labels and
    {lower} / {triangle} triangular_solve's."""

    def text(labels: list[str], node: Node) -> tuple[str, str]:
        words = {"triangle": "lower" if node.attrs and node.attrs[0] else "upper"}
        names = [latex_name(label) for label in labels]
        return template.format(*labels, **words), latex.format(*names, **words)

    return text


def _solve_text(labels: list[str], node: Node) -> tuple[str, str]:
    t = "^T" if node.attrs[0] else ""
    return (f"X with {labels[0]}{t} X = {labels[1]}, from the LU factors {labels[2]}",
            f"{latex_name(labels[0])}^{{{'-T' if t else '-1'}}} {latex_name(labels[1])}")


_BAND_WORDS = {(0, 1, 0): "the diagonal of {0}", (1, 1, 0): "the lower triangle of {0}",
               (0, 1, 1): "the upper triangle of {0}", (1, sp.Rational(1, 2), 0): "the lower triangle of {0}, diagonal halved",
               (1, 1, 1): "{0}"}


def _band_text(labels: list[str], node: Node) -> tuple[str, str]:
    below, diagonal, above = node.attrs
    if node.attrs == (0, 1, 0) and is_const(node.args[0]) and node.args[0].attrs[0] == 1:
        return "the identity", "I"
    words = _BAND_WORDS.get(node.attrs, "{0} times " + f"{below} below the diagonal, {diagonal} on it, {above} above")
    return (words.format(labels[0]),
            rf"\operatorname{{band}}_{{{below},{diagonal},{above}}}\left({latex_name(labels[0])}\right)")


_linalg_op("band", _band_vjp, _band_jvp, _band_value, _band_text, "Band",
           LinalgAttrs("triangle mask", lambda n, k: sp.Integer(0), entrywise=True))
_linalg_op("lu", _lu_vjp, _lu_jvp, _lu_value,
           _texts("the LU factors of {0}, partial pivoting", r"\operatorname{{lu}}\left({0}\right)"), "LU",
           LinalgAttrs("LU factorization", _lu))
_linalg_op("det", _det_vjp, _det_jvp, _det_value,
           _texts("det({0}) from its LU factors {1}", r"\det {0}"), "Det",
           LinalgAttrs("determinant", lambda n, k: n, scalar=True, factored=True),
           lowering=((Det, lambda lowerer, e: det(lowerer.lower(e.args[0]))),), shapes=((Det, lambda e, of: SCALAR),))
_linalg_op("logdet", _logdet_vjp, _logdet_jvp, _logdet_value,
           _texts("log|det({0})| from its LU factors {1}", r"\log \left|\det {0}\right|"), "LogDet",
           LinalgAttrs("log-determinant", lambda n, k: n, scalar=True, factored=True),
           lowering=((LogDet, lambda lowerer, e: logdet(lowerer.lower(e.args[0]))),),
           shapes=((LogDet, lambda e, of: SCALAR),))
_linalg_op("solve", _solve_vjp, _solve_jvp, _solve_value, _solve_text, "Solve",
           LinalgAttrs("linear solve", lambda n, k: n**2 * k, factored=True),
           lowering=((Solve, lambda lowerer, e: solve(lowerer.lower(e.args[0]), lowerer.lower(e.args[1]))),),
           shapes=((Solve, lambda e, of: of(e.args[1])),))
_linalg_op("cholesky", _cholesky_vjp, _cholesky_jvp, _cholesky_value,
           _texts("lower L with L L^T = ({0} + {0}^T)/2", r"\operatorname{{chol}}\left({0}\right)"), "Cholesky",
           LinalgAttrs("Cholesky factor", lambda n, k: n**3 / 6),
           lowering=((Cholesky, lambda lowerer, e: cholesky(lowerer.lower(e.args[0]))),),
           shapes=((Cholesky, lambda e, of: of(e.args[0])),))


def _lower_triangular(lowerer, expr: TriangularSolve) -> Node:
    t, b = lowerer.lower(expr.args[0]), lowerer.lower(expr.args[1])
    if expr.transpose:  # T^T X = B: the other triangle of the transposed view
        return triangular_solve(transpose(t), b, not expr.lower)
    return triangular_solve(t, b, expr.lower)


_linalg_op("triangular_solve", _triangular_vjp, _triangular_jvp, _triangular_value,
           _texts("X with the {triangle} triangle of {0} times X = {1}", r"\operatorname{{tri}}\left({0}\right)^{{-1}} {1}"),
           "TriangularSolve", LinalgAttrs("triangular solve", lambda n, k: n**2 * k / 2),
           lowering=((TriangularSolve, _lower_triangular),),
           shapes=((TriangularSolve, lambda e, of: of(e.args[1])),))
