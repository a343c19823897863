"""matmul: A @ B, lowered from SymPy's MatMul and whole MatPow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import sympy as sp

from symbackprop.base.registry import OpRecord, plain_grad_fn, register
from symbackprop.diff.autodiff import add_all
from symbackprop.emit.codegen import BLAS_MIN_MULTIPLY_ADDS, LOOP_K, FunctionEmitter
from symbackprop.errors import ModelError
from symbackprop.ir.construct import broadcast, const, map_, matmul, reduce_sum, transpose
from symbackprop.ir.interpret import Context
from symbackprop.ir.lower import as_dim
from symbackprop.ir.node import SCALAR, Dim, Node
from symbackprop.messages import short
from symbackprop.ops.elementwise import A0, A1
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Equation, View, latex, latex_name


@dataclass(frozen=True)
class MatMulKernel:
    out: str
    a: View
    b: View
    m: object
    k: object
    n: object
    equations: tuple[Equation, ...]
    kind: str = "matmul"
    add: bool = False  # out += A @ B (a sum of products in one buffer: schedule.fusion.ProductSum)

    def reads(self) -> list[str]:
        return [self.a.buffer, self.b.buffer] + ([self.out] if self.add else [])

    def summed(self, count: int, first: bool) -> MatMulKernel:
        """This product as one of `count` that its output adds up: the
        first writes the output (its comment says more are added), the
        others add into it."""
        if first:
            equations = tuple(replace(e, text=f"{e.text}, the first of {count} products added up here")
                              for e in self.equations)
            return replace(self, equations=equations)
        equations = tuple(replace(e, written=_added_latex(e), assign="+=") for e in self.equations)
        return replace(self, add=True, equations=equations)

    def writes(self) -> list[str]:
        return [self.out]

    title = "matrix product"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): m*k*n multiply-adds."""
        return sp.sympify(self.m) * self.k * self.n, sp.Integer(0)


def _added_latex(equation: Equation) -> Callable[[], str]:
    """`out = A B` as `out += A B`, when the derivation asks."""
    return lambda: equation.latex.replace(" = ", r" \mathrel{+}= ", 1)


def _vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    a, b = node.args
    grad_a = matmul(g, transpose(b)) if needed[0] else None
    grad_b = matmul(transpose(a), g) if needed[1] else None
    return grad_a, grad_b


def _jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    (a, b), (ta, tb) = node.args, tangents
    terms = ([matmul(ta, b)] if ta is not None else []) + ([matmul(a, tb)] if tb is not None else [])
    return add_all(terms) if terms else None


def _evaluate(node: Node, args: list[np.ndarray], context: Context) -> np.ndarray:
    return args[0] @ args[1]


def _kernel(sched, node: Node, out: str) -> MatMulKernel:
    a, b = node.args
    factors = (sched.symbol(a), sched.symbol(b))  # its LaTeX when the derivation asks (a scan's steps: never)
    equation = Equation(out, f"{sched.label(a)} @ {sched.label(b)}", lambda: f"{latex_name(out)} = {latex(sp.MatMul(*factors))}")
    return MatMulKernel(out, sched.view(a), sched.view(b), a.shape[0], a.shape[1], b.shape[1], (equation,))


def _emit(em: FunctionEmitter, kernel: MatMulKernel) -> dict:
    """Small products of fixed shapes as inline loops with constant trip
    counts (the C compiler unrolls them); the rest as one call of the
    module's matmul helper, which hands large ones to BLAS."""
    return matmul_fields(em, kernel)


def matmul_fields(em: FunctionEmitter, kernel: MatMulKernel) -> dict:
    """The template data of a product (also of one in a scan's step)."""
    size = sp.sympify(kernel.m) * kernel.k * kernel.n
    if not size.is_Number or size >= BLAS_MIN_MULTIPLY_ADDS:
        args = [em.dim(kernel.m), em.dim(kernel.n), em.dim(kernel.k)]
        for v in (kernel.a, kernel.b):
            pointer = f"{em.namer.name(v.buffer)} + {em.dim(v.offset)}".replace(" + 0", "")
            args += [pointer, em.dim(v.row_stride), em.dim(v.col_stride)]
        args.append(em.namer.name(kernel.out))
        return {"args": tuple(args), "callee": None, "add": kernel.add}  # callee: emit/products.py
    b_rows_contiguous = kernel.b.col_stride == 1 or kernel.n == 1
    out = View(kernel.out, sp.Integer(0), sp.sympify(kernel.n), sp.Integer(1))
    return {
        "args": None,
        "add": kernel.add,
        "order": "ikj" if b_rows_contiguous else "ijk",
        "m": em.dim(kernel.m),
        "k": em.dim(kernel.k),
        "n": em.dim(kernel.n),
        "a": em.access(kernel.a, LOOP_I, LOOP_K),
        "b": em.access(kernel.b, LOOP_K, LOOP_J),
        "c": em.access(out, LOOP_I, LOOP_J),
    }


# --- lowering from SymPy --------------------------------------------------------


def _mat_mul(lowerer, expr: sp.MatMul) -> Node:
    coeff, factors = expr.as_coeff_matrices()
    for sym in sorted(coeff.free_symbols - set(lowerer.leaves) - lowerer.dims, key=str):
        # e.g. ones(1, m) * ones(m, 1), which SymPy folds into the coefficient m
        raise ModelError(f"{sym} in {short(expr)} is neither an input, a param nor a dimension of one")
    factors = _regroup_product(list(factors), lowerer.named_products, expr)
    lowered = [_factor(lowerer, f) for f in factors]
    if coeff == 1:
        return _product_chain(lowered)
    smallest = _smallest_factor(lowered, lowerer.shape(expr))
    if smallest is None:
        return map_(A0 * A1, [lowerer.lower(coeff), _product_chain(lowered)])
    # c (A @ B) as A @ (c B) where B has fewer entries than the product
    # (attention's 1/sqrt(dh) on a d x d weight, not on every score)
    factor = lowered[smallest]
    assert isinstance(factor, Node)  # (_smallest_factor picks no OneMatrix)
    lowered[smallest] = map_(A0 * A1, [lowerer.lower(coeff), factor])
    return _product_chain(lowered)


def _entries(shape: tuple) -> int | None:
    rows, cols = shape
    return int(rows) * int(cols) if sp.sympify(rows).is_Integer and sp.sympify(cols).is_Integer else None


def _smallest_factor(factors: list[Node | _Ones], shape: tuple) -> int | None:
    """The index of the factor of fixed size with the fewest entries, where
    it has fewer than the product (one of symbolic size, a batch, counts as
    larger); None where a factor is a OneMatrix or none has a fixed size."""
    nodes = [f for f in factors if isinstance(f, Node)]
    if len(nodes) != len(factors):
        return None
    known = [(size, index) for index, f in enumerate(nodes) if (size := _entries(f.shape)) is not None]
    if not known:
        return None
    size, index = min(known)
    product = _entries(shape)
    return index if product is None or size < product else None


def _factor(lowerer, factor: sp.MatrixExpr) -> Node | _Ones:
    if isinstance(factor, sp.OneMatrix):
        lowerer.check_dims(factor)
        return _Ones(as_dim(factor.shape[0], factor), as_dim(factor.shape[1], factor))
    return lowerer.lower(factor)


def _regroup_product(factors: list[sp.Basic], named: list[sp.MatMul], whole: sp.Basic) -> list[sp.Basic]:
    """Factors with each named product occurring in them as a run replaced by it."""
    for sub in named:
        run = list(sub.args)
        if sub == whole or len(run) > len(factors):
            continue
        for start in range(len(factors) - len(run) + 1):
            if factors[start:start + len(run)] == run:
                rest = factors[:start] + [sub] + factors[start + len(run):]
                return _regroup_product(rest, named, whole)
    return factors


@dataclass(frozen=True)
class _Ones:
    """A OneMatrix factor of a product: becomes a sum and/or a broadcast."""

    rows: Dim
    cols: Dim


def _product_chain(factors: list[Node | _Ones]) -> Node:
    acc = factors[0]
    for factor in factors[1:]:
        acc = _product(acc, factor)
    if isinstance(acc, _Ones):
        return const(1, (acc.rows, acc.cols))
    return acc


def _product(a: Node | _Ones, b: Node | _Ones) -> Node | _Ones:
    if isinstance(a, _Ones):
        if isinstance(b, _Ones):
            return const(a.cols, (a.rows, b.cols))
        # ones(r, k) @ B: column sums, repeated on r rows
        return broadcast(reduce_sum(b, 0), (a.rows, b.shape[1]))
    if isinstance(b, _Ones):  # A @ ones(k, c): row sums, repeated in c columns
        return broadcast(reduce_sum(a, 1), (a.shape[0], b.cols))
    return matmul(a, b)


def _mat_pow(lowerer, expr: sp.MatPow) -> Node:
    """A**k for whole k >= 1 is a chain of products (SymPy writes A*A as
    A**2); any power of a 1x1 matrix is elementwise (SymPy's
    applyfunc(sqrt) of a 1x1 matrix gives M**(1/2))."""
    base, exponent = expr.args
    if lowerer.shape(expr) == SCALAR:
        return map_(A0**A1, [lowerer.lower(base), lowerer.lower(exponent)])
    if not (exponent.is_Integer and exponent >= 1):
        raise ModelError(
            f"unsupported matrix operation MatPow (a matrix power other than A*A*...; for elementwise powers "
            f"use HadamardPower): {short(expr)}"
        )
    factor = lowerer.lower(base)
    product = factor
    for _ in range(int(exponent) - 1):
        product = matmul(product, factor)
    return product


def _matmul_shape(expr: sp.MatMul, of) -> tuple:
    factors = expr.as_coeff_matrices()[1]
    return (of(factors[0])[0], of(factors[-1])[1])


register(OpRecord(
    "matmul",
    vjp=_vjp,
    jvp=_jvp,
    evaluate=_evaluate,
    kernel=_kernel,
    emit=_emit,
    template="matmul_kernel",
    grad_fn=plain_grad_fn("MatMul"),
    lowering=((sp.MatMul, _mat_mul), (sp.MatPow, _mat_pow)),
    shapes=((sp.MatMul, _matmul_shape), (sp.MatPow, lambda e, of: of(e.args[0]))),
))
