"""Reductions over one axis (kept as size 1): sum, logsumexp, max, min, prod;
and softmax and log_softmax along an axis (nn.softmax, nn.log_softmax), max-subtracted.

Each is one call of `reduction(...)` below, which registers its record and
how it lowers from `sbp.reduce(name, x, axis)`; the C helper each kernel
calls is the block of that name in templates/reduce.c.j2. The names of the
registered reductions are the one list everyone reads (registry.reductions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import sympy as sp

from symbackprop.base.registry import JvpRule, OpRecord, VjpRule, attrs_of, extend, plain_grad_fn, register
from symbackprop.declare.tensor import Reduce, Softmax, reduced_shape
from symbackprop.emit.codegen import FunctionEmitter, worth_threads
from symbackprop.errors import ModelError
from symbackprop.ir.construct import broadcast, const, is_const, log_softmax, logsumexp, map_, reduce_extreme, reduce_sum, softmax
from symbackprop.ir.node import Node, Shape, op_node, placeholder
from symbackprop.ops.cumulative import ROWS_HELPERS, axis_op, axis_walk, contiguous, rows_at_once, rows_fields
from symbackprop.ops.extreme import extreme_mean, extreme_spread
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Equation, View, latex_name

A0, A1, A2 = placeholder(0), placeholder(1), placeholder(2)


@dataclass(frozen=True)
class ReduceAttrs:
    """What a reduction's kernel does, as its record's `attrs`: its kernel
    and emit read these, never the op's name.

    title: the kernel's name in comments and the derivation.
    passes: the passes over the entries (log-sum-exp: two, the largest of
        the entries and of their softmax).
    column_sums: down the columns of a row-major matrix, every column's
        result in one pass over the rows (a sum: a bias's gradient of a
        large batch), not one helper call per column.
    """

    title: str
    passes: int = 1
    column_sums: bool = False


@dataclass(frozen=True)
class ReduceKernel:
    """A reduction (`kind`, its op) of `src` (rows x cols) over `axis`."""

    kind: str
    out: str
    src: View
    rows: object
    cols: object
    axis: int
    equations: tuple[Equation, ...]
    softmax: View | None = None  # logsumexp's: the softmax of src along the axis, read for the result

    def reads(self) -> list[str]:
        return [self.src.buffer] + ([self.softmax.buffer] if self.softmax is not None else [])

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def attrs(self) -> ReduceAttrs:
        return attrs_of(self.kind, ReduceAttrs)

    @property
    def title(self) -> str:
        return self.attrs.title

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): one a reduced entry a pass."""
        return sp.Integer(0), sp.sympify(self.rows) * self.cols * self.attrs.passes


# How each reduction lowers from sbp.reduce(name, x, axis): node of x over axis.
_FROM_REDUCE: dict[str, Callable[[Node, int], Node]] = {}


def reduction(name: str, vjp: VjpRule, jvp: JvpRule, evaluate: Callable[[np.ndarray, int], np.ndarray],
              lower: Callable[[Node, int], Node], text: str, latex: str, grad_fn: str,
              attrs: ReduceAttrs) -> OpRecord:
    """Register a reduction over one axis.

    text, latex: what the kernel computes, for comments and the derivation,
        with {arg} (the reduced tensor), {what} ("down each column" / "along
        each row"), {index} (i / j) and {term} (the entry, as LaTeX).
    """
    _FROM_REDUCE[name] = lower

    def kernel(sched, node: Node, out: str) -> ReduceKernel:
        src, *softmax = node.args  # logsumexp: (z, its softmax)
        axis = node.attrs[0]
        words = {"arg": sched.label(src), "what": "down each column" if axis == 0 else "along each row",
                 "index": "i" if axis == 0 else "j"}
        words["term"] = rf"\left({latex_name(words['arg'])}\right)_{{ij}}"
        equation = Equation(out, text.format(**words), f"{latex_name(out)} = {latex.format(**words)}")
        return ReduceKernel(node.op, out, sched.view(src), src.shape[0], src.shape[1], axis, (equation,),
                            sched.view(softmax[0]) if softmax else None)

    return register(OpRecord(
        name, vjp=vjp, jvp=jvp, evaluate=lambda node, args, context: evaluate(args[0], node.attrs[0]),
        kernel=kernel, emit=_emit, template="reduce_kernel", grad_fn=plain_grad_fn(grad_fn),
        reduction=True, helper=True, attrs=attrs,
    ))


def _emit(em: FunctionEmitter, kernel: ReduceKernel) -> dict:
    """One call of the module's helper for the op (reduce.c.j2) per row
    or column: its first entry, how many, and the stride between them; a
    max or min over many rows, one call of its _rows helper a block of
    them (short rows eight at a time, a row in each lane of a vector)."""
    src = kernel.src
    outer_len, inner_len = (kernel.cols, kernel.rows) if kernel.axis == 0 else (kernel.rows, kernel.cols)
    outer = LOOP_J if kernel.axis == 0 else LOOP_I
    looped = em.dim(outer_len) != "1"

    def walk(view: View) -> tuple[str, str]:
        """A row's (column's) first entry and the stride along it, as C."""
        by_rows = kernel.axis == 0
        outer_stride, inner_stride = (view.col_stride, view.row_stride) if by_rows else (view.row_stride, view.col_stride)
        start = sp.expand(view.offset + (outer * outer_stride if looped else 0))
        pointer = em.namer.name(view.buffer) + ("" if start == 0 else f" + {em.index.doprint(start)}")
        return pointer, em.dim(sp.sympify(inner_stride)) if inner_len != 1 else "1"

    pointer, step = walk(src)
    args = f"{pointer}, {em.dim(inner_len)}, {step}"
    if kernel.softmax is not None:  # logsumexp: and its softmax's row (column)
        args += ", {}, {}".format(*walk(kernel.softmax))
    inner_stride = src.row_stride if kernel.axis == 0 else src.col_stride
    if kernel.attrs.column_sums and kernel.axis == 0 and looped and src.col_stride == 1 and inner_len != 1:
        # every column's sum in one pass over the rows (a bias's gradient of a large batch)
        base = em.namer.name(src.buffer) + ("" if src.offset == 0 else f" + {em.dim(src.offset)}")
        columns = f"{base}, {em.dim(inner_len)}, {em.dim(outer_len)}, {em.dim(sp.sympify(inner_stride))}"
        return {"columns": f"{columns}, {em.namer.name(kernel.out)}", "loop": None, "out": None, "args": None}
    fields = {
        "columns": None,
        "loop": (str(outer), em.dim(outer_len)) if looped else None,
        "parallel": looped and worth_threads(outer_len),  # each row's (column's) helper call alone: any thread count
        "out": f"{em.namer.name(kernel.out)}[{outer if looped else 0}]",
        "args": args,
    }
    if kernel.kind in ROWS_HELPERS and looped and kernel.softmax is None and rows_at_once(outer_len):
        row_stride = src.row_stride if kernel.axis == 1 else src.col_stride
        fields.update(rows_fields(em, outer, outer_len, f"{pointer}, ", f"{em.dim(inner_len)}, {step}, "
                                  f"{em.index.doprint(sp.sympify(row_stride))}", kernel.out))
    return fields


def _mean(arg: Node, axis: int) -> Node:
    total = reduce_sum(arg, axis)
    return total if arg.shape[axis] == 1 else map_(A0 / arg.shape[axis], [total])


_FROM_REDUCE["mean"] = _mean  # a declared reduction, not an op: a scaled sum


def _lower_reduce(lowerer, expr: Reduce) -> Node:
    return _FROM_REDUCE[expr.op](lowerer.lower(expr.arg), expr.axis)


def _reduce_shape(expr: Reduce, of) -> tuple:
    return reduced_shape(of(expr.arg), expr.axis)


# --- sum ------------------------------------------------------------------------


def _sum_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (broadcast(g, node.args[0].shape),)


def _sum_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return reduce_sum(tangents[0], node.attrs[0]) if tangents[0] is not None else None


# --- logsumexp -------------------------------------------------------------------


# The node's args are (z, softmax(z) along its axis): the softmax computes
# each exp once, and the log-sum-exp (the largest z minus log of the largest
# softmax entry, 1/sum) and its derivatives read it. Its adjoint through
# the node is 0: the softmax is z's function, and the rules below are z's
# whole derivative.


def _logsumexp_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # d lse / d z = softmax(z), scaled by the broadcast adjoint
    z, p = node.args
    return (map_(A0 * A1, [p, g], z.shape), None)


def _logsumexp_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    # d lse = sum(softmax(z) * dz) over the reduced axis
    (z, p), tz = node.args, tangents[0]
    if tz is None:
        return None
    return reduce_sum(map_(A0 * A1, [p, tz], z.shape), node.attrs[0])


def _softmax_times(node: Node, v: Node) -> Node:
    """p (v - sum(p v)) along the axis, p the softmax `node`: its Jacobian
    (symmetric) times v, so both its VJP and its JVP."""
    total = reduce_sum(map_(A0 * A1, [node, v], node.shape), node.attrs[0])
    return map_(A0 * (A1 - A2), [node, v, total], node.shape)


def _softmax_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    return (_softmax_times(node, g),)


def _softmax_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return None if tangents[0] is None else _softmax_times(node, tangents[0])


def _softmax_value(x: np.ndarray, axis: int, reverse: bool = False, nan_at_inf: int = 1) -> np.ndarray:
    """The C helper's values: exp(x - max) / sum, max taken with NaN skipped;
    a line whose max is infinite exp(x - max) (nan_at_inf: NaN throughout
    where it is +inf, as torch.softmax)."""
    with np.errstate(all="ignore"):
        top = np.fmax.reduce(x, axis=axis, keepdims=True)
        e = np.exp(x - top)
        p = e / e.sum(axis=axis, keepdims=True)
        return np.where(np.isinf(top), np.where(top > 0, np.nan, e) if nan_at_inf else e, p)


def _log_softmax_value(x: np.ndarray, axis: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        top = np.fmax.reduce(x, axis=axis, keepdims=True)
        shifted = x - top
        return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _log_softmax_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # d log_softmax_k / d z_l = [k == l] - p_l: the adjoint g - p * sum(g) (the softmax
    # argument is z's function: the rule is z's whole derivative, no adjoint reaches it)
    z, p = node.args
    return (map_(A0 - A1 * A2, [g, p, reduce_sum(g, node.attrs[0])], z.shape), None)


def _log_softmax_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    (z, p), tz = node.args, tangents[0]
    if tz is None:
        return None
    return map_(A0 - A1, [tz, reduce_sum(map_(A0 * A1, [p, tz], z.shape), node.attrs[0])], z.shape)


@dataclass(frozen=True)
class LogSoftmaxKernel:
    """log_softmax of `src` along `axis` from its softmax, into the
    contiguous `out` of the same shape: one helper call a row (column)."""

    kind: str
    out: str
    src: View
    softmax: View
    shape: Shape
    axis: int
    equations: tuple[Equation, ...]

    def reads(self) -> list[str]:
        return [self.src.buffer, self.softmax.buffer]

    def writes(self) -> list[str]:
        return [self.out]

    @property
    def title(self) -> str:
        return "log-softmax"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): two an entry (the largest of it and of its softmax)."""
        return sp.Integer(0), 2 * sp.sympify(self.shape[0]) * self.shape[1]


def _log_softmax_kernel(sched, node: Node, out: str) -> LogSoftmaxKernel:
    src, p = node.args
    axis = node.attrs[0]
    label = sched.label(src)
    what = "down each column" if axis == 0 else "along each row"
    index = "i" if axis == 0 else "j"
    term = rf"\left({latex_name(label)}\right)_{{ij}}"
    equation = Equation(out, f"log_softmax of {label} {what}: (its entries - their max) - log(sum(exp(that)))",
                        rf"{latex_name(out)} = {term} - \log \sum_{{{index}'}} "
                        rf"\exp \left({latex_name(label)}\right)_{{{index}'}}")
    return LogSoftmaxKernel(node.op, out, sched.view(src), sched.view(p), node.shape, axis, (equation,))


def _emit_log_softmax(em: FunctionEmitter, kernel: LogSoftmaxKernel) -> dict:
    """One helper call per row (column): the entries, their softmax and the output, each a first entry and a stride."""
    walk, loop, count = axis_walk(em, kernel.shape, kernel.axis)
    (x, x_step), (p, p_step), (y, y_step) = (walk(v) for v in (kernel.src, kernel.softmax,
                                                               contiguous(kernel.out, kernel.shape)))
    return {"loop": loop, "args": f"{x}, {count}, {x_step}, {p}, {p_step}, {y}, {y_step}"}


def _lower_softmax(lowerer, expr: Softmax) -> Node:
    arg = lowerer.lower(expr.arg)
    return log_softmax(arg, expr.axis) if expr.log else softmax(arg, expr.axis)


def _logsumexp_value(x: np.ndarray, axis: int) -> np.ndarray:
    top = x.max(axis=axis, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(all="ignore"):
        return safe + np.log(np.exp(x - safe).sum(axis=axis, keepdims=True))


def _lower_logsumexp(arg: Node, axis: int) -> Node:
    return arg if arg.shape[axis] == 1 else logsumexp(arg, axis)


# --- max, min ---------------------------------------------------------------------


def _extreme_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    # the adjoint shared evenly among the entries equal to the extreme (ties split, as JAX)
    return (extreme_spread(g, node.args[0], node, node.attrs[0]),)


def _extreme_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    if tangents[0] is None:
        return None
    return extreme_mean(tangents[0], node.args[0], node, node.attrs[0])


# --- prod ---------------------------------------------------------------------------


def reduce_prod(a: Node, axis: int) -> Node:
    """The product over `axis` (kept as size 1)."""
    if a.shape[axis] == 1:
        return a
    shape = reduced_shape(a.shape, axis)
    if is_const(a):
        return const(a.attrs[0] ** a.shape[axis], shape)
    return op_node("prod", (a,), shape, (axis,))


def prod_others(a: Node, axis: int) -> Node:
    """Each entry's product of the other entries along `axis` (exact where
    an entry is 0: prefix times suffix products, never a division)."""
    return op_node("prod_others", (a,), a.shape, (axis, False))


def _prod_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    (x,) = node.args
    return (map_(A0 * A1, [g, prod_others(x, node.attrs[0])], x.shape),)


def _prod_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    (x,), (tx,) = node.args, tangents
    if tx is None:
        return None
    return reduce_sum(map_(A0 * A1, [prod_others(x, node.attrs[0]), tx], x.shape), node.attrs[0])


def _others_value(x: np.ndarray, axis: int, reverse: bool) -> np.ndarray:
    y = np.moveaxis(x, axis, -1)
    ones = np.ones_like(y[..., :1])
    before = np.concatenate([ones, np.cumprod(y[..., :-1], axis=-1)], axis=-1)
    after = np.flip(np.concatenate([ones, np.cumprod(np.flip(y, -1)[..., :-1], axis=-1)], axis=-1), -1)
    return np.moveaxis(before * after, -1, axis)


def _second_order(node: Node, *rest: object) -> NoReturn:
    raise ModelError("second derivatives through sbp.reduce('prod', ...) are not supported "
                     "(the derivative of the product of the other entries)")


reduction("sum", _sum_vjp, _sum_jvp, lambda x, axis: x.sum(axis=axis, keepdims=True), reduce_sum,
          "sum of {arg} {what}", r"\sum_{{{index}}} {term}", "Sum", ReduceAttrs("sum", column_sums=True))
reduction("logsumexp", _logsumexp_vjp, _logsumexp_jvp, _logsumexp_value, _lower_logsumexp,
          "log(sum(exp({arg}))) {what}, its max subtracted first", r"\log \sum_{{{index}}} \exp {term}", "LogSumExp",
          ReduceAttrs("log-sum-exp", passes=2))
reduction("max", _extreme_vjp, _extreme_jvp, lambda x, axis: x.max(axis=axis, keepdims=True),
          lambda arg, axis: reduce_extreme("max", arg, axis), "max of {arg} {what}", r"\max_{{{index}}} {term}", "Max",
          ReduceAttrs("maximum"))
reduction("min", _extreme_vjp, _extreme_jvp, lambda x, axis: x.min(axis=axis, keepdims=True),
          lambda arg, axis: reduce_extreme("min", arg, axis), "min of {arg} {what}", r"\min_{{{index}}} {term}", "Min",
          ReduceAttrs("minimum"))
reduction("prod", _prod_vjp, _prod_jvp, lambda x, axis: x.prod(axis=axis, keepdims=True), reduce_prod,
          "product of {arg} {what}", r"\prod_{{{index}}} {term}", "Prod",
          ReduceAttrs("product"))
axis_op("softmax_axis", _softmax_vjp, _softmax_jvp, _softmax_value, "softmax of {arg} {what}, its max subtracted first",
        r"\exp {term} / \sum_{{{index}'}} \exp \left({arg}\right)_{{{index}'}}", plain_grad_fn("Softmax"),
        lowering=((Softmax, _lower_softmax),), shapes=((Softmax, lambda e, of: of(e.arg)),))
register(OpRecord(
    "log_softmax_axis", vjp=_log_softmax_vjp, jvp=_log_softmax_jvp,
    evaluate=lambda node, args, context: _log_softmax_value(args[0], node.attrs[0]),
    kernel=_log_softmax_kernel, emit=_emit_log_softmax, template="axis_kernel",
    grad_fn=lambda node: ("LogSoftmax", [node.args[0]]), helper=True,
))
axis_op("prod_others", _second_order, _second_order, _others_value, "product of the other entries of {arg} {what}",
        r"\prod_{{{index}' \ne {index}}} {term}", plain_grad_fn("ProdOthers"))
# sbp.reduce(name, ...) lowers through the reduction of its name ("mean": a scaled sum)
extend("sum", lowering=((Reduce, _lower_reduce),), shapes=((Reduce, _reduce_shape),))
