"""The ops of convolutional layers (symbackprop.declare.conv, docs/conv.md).

Every value is still a matrix: a batch of images is n x (C*H*W), NCHW
order. The ops and their geometry attrs:

    conv2d(x, w)             (C, H, W, F, kh, kw, sh, sw, ph, pw, dh, dw)  n x F*Ho*Wo
    conv2d_input_grad(g, w)  the same geometry                  n x C*H*W
    conv2d_weight_grad(g, x) the same geometry                  F x C*kh*kw
    max_pool2d(x, t)         (C, H, W, kh, kw, sh, sw, ph, pw)  t's entry where x is largest in each window
    max_unpool2d(x, g)       the same               g sent back to those entries
    avg_pool2d(x)            (C, H, W, kh, kw, sh, sw, ph, pw)  each window's sum / (kh*kw)
    avg_unpool2d(g)          the same               g/(kh*kw) sent back over each window
    channel_sum(a)           (C, P)                 r x C*P -> r x C
    channel_broadcast(a)     (C, P)                 r x C -> r x C*P

Each op's VJP is made of these ops again (the three convolutions are one
trilinear form <y, conv(x, w)>, read three ways; the pools and channel ops
are pairs of transposes), so gradients of gradients exist too. A max pool
is max_pool2d(x, x): the argmax is piecewise constant, so only the second
argument carries a derivative.

Per axis: s the stride, p the padding (zeros; a max pool's is -inf), d a
convolution's dilation. The geometry and the numpy references are in
symbackprop.ops.conv_numpy.

The C of each is a loop nest over the batch (kernel_conv.c.j2), its bounds
numbers but the batch size's, never unrolled over pixels; built with
OpenMP, the batch loop runs on several threads (a convolution's in fixed
blocks: BATCH_BLOCKS), with the same results on any number of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import sympy as sp

from symbackprop.base.registry import OpRecord, attrs_of, plain_grad_fn, register
from symbackprop.declare import conv as declared
from symbackprop.emit.codegen import CheckedPrinter, FunctionEmitter, ScalarPrinter, worth_threads
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, is_const, map_
from symbackprop.ir.node import Node, op_node, placeholder
from symbackprop.ops import conv_direct as direct
from symbackprop.ops import conv_numpy as reference
from symbackprop.ops.conv_numpy import Conv, Pool
from symbackprop.schedule.kernel import Equation, latex_name

A0, A1 = placeholder(0), placeholder(1)

# --- constructors ---------------------------------------------------------------


def _add(a: Node | None, b: Node | None) -> Node | None:
    if a is None or b is None:
        return a if b is None else b
    return map_(A0 + A1, [a, b])


def conv2d(x: Node, w: Node, geometry: tuple) -> Node:
    return op_node("conv2d", (x, w), (x.shape[0], declared.out_cols("conv2d", geometry)), geometry)


def conv2d_input_grad(g: Node, w: Node, geometry: tuple) -> Node:
    c = Conv(*geometry)
    return op_node("conv2d_input_grad", (g, w), (g.shape[0], c.C * c.H * c.W), geometry)


def conv2d_weight_grad(g: Node, x: Node, geometry: tuple) -> Node:
    c = Conv(*geometry)
    return op_node("conv2d_weight_grad", (g, x), (c.F, c.C * c.KH * c.KW), geometry)


def max_pool2d(x: Node, t: Node, geometry: tuple) -> Node:
    return op_node("max_pool2d", (x, t), (x.shape[0], declared.out_cols("max_pool2d", geometry)), geometry)


def max_unpool2d(x: Node, g: Node, geometry: tuple) -> Node:
    return op_node("max_unpool2d", (x, g), x.shape, geometry)


def avg_pool2d(x: Node, geometry: tuple) -> Node:
    shape = (x.shape[0], declared.out_cols("avg_pool2d", geometry))
    if is_const(x) and not Pool(*geometry).padded:  # a padded window's mean counts its zeros
        return const(x.attrs[0], shape)
    return op_node("avg_pool2d", (x,), shape, geometry)


def avg_unpool2d(g: Node, geometry: tuple) -> Node:
    p = Pool(*geometry)
    shape = (g.shape[0], p.C * p.H * p.W)
    return op_node("avg_unpool2d", (g,), shape, geometry)


def channel_sum(a: Node, geometry: tuple) -> Node:
    channels, pixels = geometry
    if is_const(a):
        return const(a.attrs[0] * pixels, (a.shape[0], channels))
    return op_node("channel_sum", (a,), (a.shape[0], channels), geometry)


def channel_broadcast(a: Node, geometry: tuple) -> Node:
    channels, pixels = geometry
    if is_const(a):
        return const(a.attrs[0], (a.shape[0], channels * pixels))
    return op_node("channel_broadcast", (a,), (a.shape[0], channels * pixels), geometry)


# --- derivatives ------------------------------------------------------------------
# <y', conv(x, w)> = <x, input_grad(y', w)> = <w, weight_grad(y', x)>: each
# of the three is linear in both arguments, and its VJP is the other two.


def _conv_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    x, w = node.args
    geometry = node.attrs
    return (conv2d_input_grad(g, w, geometry) if needed[0] else None,
            conv2d_weight_grad(g, x, geometry) if needed[1] else None)


def _input_grad_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    y, w = node.args  # node = input_grad(y, w); g is an image batch's adjoint
    geometry = node.attrs
    return (conv2d(g, w, geometry) if needed[0] else None,
            conv2d_weight_grad(y, g, geometry) if needed[1] else None)


def _weight_grad_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    y, x = node.args  # node = weight_grad(y, x); g is a weight's adjoint
    geometry = node.attrs
    return (conv2d(x, g, geometry) if needed[0] else None,
            conv2d_input_grad(y, g, geometry) if needed[1] else None)


def bilinear_jvp(build: Callable[[Node, Node, tuple], Node]) -> Callable:
    def jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
        a, b = node.args
        ta, tb = tangents
        return _add(build(ta, b, node.attrs) if ta is not None else None,
                    build(a, tb, node.attrs) if tb is not None else None)

    return jvp


def _max_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    x, _ = node.args
    return (None, max_unpool2d(x, g, node.attrs) if needed[1] else None)


def _max_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return max_pool2d(node.args[0], tangents[1], node.attrs) if tangents[1] is not None else None


def _unpool_vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
    x, _ = node.args
    return (None, max_pool2d(x, g, node.attrs) if needed[1] else None)


def _unpool_jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
    return max_unpool2d(node.args[0], tangents[1], node.attrs) if tangents[1] is not None else None


def _linear(forward: Callable[[Node, tuple], Node], back: Callable[[Node, tuple], Node]) -> tuple[Callable, Callable]:
    """The VJP (the transpose, `back`) and JVP (itself) of a linear op of one argument."""

    def vjp(node: Node, g: Node, needed: Sequence[bool]) -> tuple[Node | None, ...]:
        return (back(g, node.attrs),)

    def jvp(node: Node, tangents: Sequence[Node | None]) -> Node | None:
        return forward(tangents[0], node.attrs) if tangents[0] is not None else None

    return vjp, jvp


# --- kernels ------------------------------------------------------------------------


@dataclass(frozen=True)
class Operand:
    """How the C reads a kernel's argument: a contiguous buffer, or a
    constant (an adjoint of 1, never stored) read the same at every entry."""

    buffer: str | None
    value: str | None = None

    def at(self, index: str) -> str:
        return f"{self.buffer}[{index}]" if self.buffer is not None else f"({self.value})"


@dataclass(frozen=True)
class ImageAttrs:
    """What an image op's kernel does, as its record's `attrs`: the kernel,
    emit and kernel_conv.c.j2 branch on these, never on the op's name.

    nest: the loops. "im2col": a convolution, each example's windows as a
        matrix and a matrix product; "window": a pool, over each k x k
        window; "channel": over each channel's pixels.
    scatter: values are sent back to the entries they were read from (a
        transpose: col2im, an unpool, a broadcast), not gathered from them.
    image: im2col: the operand ("a" or "b") whose pixels the windows gather.
    batch_sum: im2col: the result sums over the batch (each block's partial
        sum in the workspace, added in block order).
    window: a pool's value of a window: "max" (its first largest entry) or "mean".
    argmax: how a max window finds that entry: "branch" (an if) or
        "select" (?:, measured 4x faster in the unpool).
    """

    nest: str
    scatter: bool = False
    image: str | None = None
    batch_sum: bool = False
    window: str | None = None
    argmax: str = "branch"


@dataclass(frozen=True)
class ImageKernel:
    """One image op (`kind`) of `args` (buffers, or constants) into `out`."""

    kind: str
    out: str
    args: tuple[tuple[str | None, sp.Expr | None], ...]  # (buffer, None) or (None, constant)
    rows: object  # the batch (the output's rows; a weight gradient's: the argument's)
    geometry: tuple
    equations: tuple[Equation, ...]
    cols: str | None = None  # a convolution's workspace: each batch block's im2col matrix (and partial sum)

    def reads(self) -> list[str]:
        return [buffer for buffer, _ in self.args if buffer is not None] + ([self.cols] if self.cols else [])

    def writes(self) -> list[str]:
        return [self.out] + ([self.cols] if self.cols else [])

    @property
    def title(self) -> str:
        return self.kind.replace("_", " ")

    @property
    def attrs(self) -> ImageAttrs:
        return attrs_of(self.kind, ImageAttrs)

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations)."""
        rows = sp.sympify(self.rows)
        if self.attrs.nest == "im2col":
            c = Conv(*self.geometry)
            return rows * c.F * c.HO * c.WO * c.C * c.KH * c.KW, sp.Integer(0)
        if self.attrs.nest == "channel":
            return sp.Integer(0), rows * self.geometry[0] * self.geometry[1]
        p = Pool(*self.geometry)
        return sp.Integer(0), rows * p.C * p.HO * p.WO * p.KH * p.KW


# What each op's comment says it computes: (the entry written, =/+=, its
# value), {0} and {1} its arguments' labels, as the loops of kernel_conv.c.j2 name them.
_MATH = {
    "conv2d": ("[i,oc,oy,ox]", "=", "sum_{{ic,ky,kx}} {1}[oc,ic,ky,kx] * {0}[i,ic,{Y},{X}] "
               "(conv2d; zero outside the image)"),
    "conv2d_input_grad": ("[i,ic,{Y},{X}]", "+=", "{1}[oc,ic,ky,kx] * {0}[i,oc,oy,ox] "
                          "(conv2d's gradient by its images)"),
    "conv2d_weight_grad": ("[oc,ic,ky,kx]", "=", "sum_{{i,oy,ox}} {0}[i,oc,oy,ox] * {1}[i,ic,{Y},{X}] "
                           "(conv2d's gradient by its weights)"),
    "max_pool2d": ("[i,ch,oy,ox]", "=", "{1}[i,ch,best], best: the first largest {0}[i,ch,{Y},{X}], {WIN}{PAD}"),
    "max_unpool2d": ("[i,ch,best]", "+=", "{1}[i,ch,oy,ox], best: the first largest {0}[i,ch,{Y},{X}], "
                     "{WIN}{PAD} (zero elsewhere)"),
    "avg_pool2d": ("[i,ch,oy,ox]", "=", "sum_{{{WIN}{PAD}}} {0}[i,ch,{Y},{X}] / {AREA}"),
    "avg_unpool2d": ("[i,ch,{Y},{X}]", "+=", "{0}[i,ch,oy,ox] / {AREA}, {WIN}{PAD}"),
    "channel_sum": ("[i,ch]", "=", "sum_at {0}[i,ch,at] (over each channel's pixels)"),
    "channel_broadcast": ("[i,ch,at]", "=", "{0}[i,ch] (over each channel's pixels)"),
}


def kernel_operands(sched, node: Node) -> tuple[list[tuple[str | None, sp.Expr | None]], list[str]]:
    """How a loop-nest kernel reads its arguments: (buffer, None) or (None,
    a constant) each, and their labels for its comment. (Shared with the
    attention ops, whose kernels read contiguous matrices too.)"""
    args: list[tuple[str | None, sp.Expr | None]] = []
    labels = []
    for arg in node.args:
        if is_const(arg):
            args.append((None, arg.attrs[0]))
            labels.append(str(arg.attrs[0]))
            continue
        view = sched.view(arg)
        rows, cols = arg.shape
        if view.offset != 0 or view.col_stride != (1 if cols != 1 else 0) or (rows != 1 and view.row_stride != cols):
            raise ModelError(f"{node.op} reads its argument {sched.label(arg)} as a contiguous matrix; "
                             "a transposed or sliced view is not supported")
        args.append((view.buffer, None))
        labels.append(sched.label(arg))
    return args, labels


def _kernel(sched, node: Node, out: str) -> ImageKernel:
    args, labels = kernel_operands(sched, node)
    geometry = tuple(node.attrs)
    # the math with this op's numbers ("oy*1+ky" is written "oy+ky")
    entry, assign, value = (re.sub(r"\*1\+", "+", part.format(*labels, **_constants(node.op, geometry)))
                            for part in _MATH[node.op])
    latex = rf"{latex_name(out)} = \operatorname{{{node.op.replace('_', '-')}}}({', '.join(latex_name(s) for s in labels)})"
    rows = node.args[0].shape[0]
    cols = None
    attrs = attrs_of(node.op, ImageAttrs)
    if attrs.nest == "im2col":
        cols = sched.claim_scratch(f"{out}_cols", (batch_blocks(rows), workspace(Conv(*geometry), attrs)))
    return ImageKernel(node.op, out, tuple(args), rows, geometry, (Equation(out + entry, value, latex, assign),), cols)


def workspace(c: Conv, attrs: ImageAttrs) -> int:
    """A batch block's entries of a convolution's workspace: its windows, then
    a weight gradient's sum; an input gradient's room for the direct kernel
    too (the flipped weights and the padded output gradient), which
    outgrows the windows where the images are small and the channels many
    (64 x 64 channels of 8 x 8: 36,864 weights beside 36,864 windows)."""
    ckk = c.C * c.KH * c.KW
    per = ckk * c.HO * c.WO + (c.F * ckk if attrs.batch_sum else 0)
    run = direct.transposed(c) if attrs.scatter else None
    if attrs.scatter and run is None:  # a stride's: its phases' flipped taps and the padded output gradient
        rooms = [d["room"] for d in (direct.strided_input_grad_fields(c, real, True) for real in ("float32", "float64")) if d]
        return max([per, *rooms])
    if run is None or run.WO < direct.MIN_INPUT_GRAD_WIDTH:
        return per
    return max(per, c.F * ckk + run.C * (run.H + 2 * run.PH) * (run.W + 2 * run.PW))


# A convolution runs its batch as this many fixed blocks of examples, each
# with its own windows (and a weight gradient's partial sum) in the
# workspace: the blocks can run on as many threads, and a weight gradient
# adds the blocks' sums in block order, so it is bit for bit the same on
# any number of threads. 8 blocks: the workspace stays small (LeNet's
# second convolution: 8 x 144 x 16 entries) and 2, 4 or 8 threads share
# them evenly.
BATCH_BLOCKS = 8


def batch_blocks(rows: object) -> int:
    """The blocks of a batch of `rows` examples (fewer for a smaller fixed batch)."""
    count = sp.sympify(rows)
    return min(BATCH_BLOCKS, int(count)) if count.is_Integer else BATCH_BLOCKS


def _constants(op: str, geometry: tuple) -> dict:
    """What a comment names: the input coordinates Y and X a window entry
    (ky, kx) of output pixel (oy, ox) reads; a pool's window WIN, its size
    AREA and PAD (where the padding is not read)."""
    nest = attrs_of(op, ImageAttrs).nest
    if nest == "im2col":
        c = Conv(*geometry)
        dilated = ("" if c.DH == 1 else f"*{c.DH}", "" if c.DW == 1 else f"*{c.DW}")
        return {"Y": f"oy*{c.SH}+ky{dilated[0]}-{c.PH}", "X": f"ox*{c.SW}+kx{dilated[1]}-{c.PW}"}
    if nest == "channel":
        return {}
    p = Pool(*geometry)
    square = p.KH == p.KW
    return {"Y": f"oy*{p.SH}+ky" + (f"-{p.PH}" if p.PH else ""), "X": f"ox*{p.SW}+kx" + (f"-{p.PW}" if p.PW else ""),
            "WIN": f"ky,kx < {p.KH}" if square else f"ky < {p.KH}, kx < {p.KW}",
            "AREA": f"{p.KH}^2" if square else f"{p.KH}*{p.KW}", "PAD": " inside the image" if p.padded else ""}


def _emit(em: FunctionEmitter, kernel: ImageKernel) -> dict:
    printer = CheckedPrinter(ScalarPrinter({}, em.real), kernel)
    args = [Operand(em.namer.name(b)) if b is not None else Operand(None, printer.doprint(v)) for b, v in kernel.args]
    fields: dict = {"n": em.dim(kernel.rows), "out": em.namer.name(kernel.out), "a": args[0],
                    "b": args[1] if len(args) > 1 else None, "parallel": worth_threads(kernel.rows),
                    "blocks": batch_blocks(kernel.rows), "op": kernel.attrs}
    if kernel.attrs.nest == "im2col":
        c = Conv(*kernel.geometry)
        fields.update(asdict(c), HO=c.HO, WO=c.WO)
        fields["iy"] = _offset("oy", c.SH, "ky", c.PH, c.DH)
        fields["ix"] = _offset("ox", c.SW, "kx", c.PW, c.DW)
        fields["lo"], fields["hi"] = _inside_columns(c) if c.PH or c.PW else (None, None)
        fields["cols"] = em.namer.name(kernel.cols) if kernel.cols is not None else None
        # a block's workspace: its windows (the direct kernels' padded image fits), then a weight gradient's sum
        fields["per"] = workspace(c, kernel.attrs)
        buffers = all(a.buffer for a in args)  # the direct kernels read both operands from memory
        fields["wgrad"] = direct.weight_grad_fields(c, em.real.name, buffers) if kernel.attrs.batch_sum else None
        sgrad = direct.strided_input_grad_fields(c, em.real.name, buffers) if kernel.attrs.scatter else None
        fields["sgrad"] = sgrad if sgrad and sgrad["room"] <= fields["per"] else None
        fields["direct"] = direct.template_fields(c, kernel.attrs.scatter, kernel.attrs.batch_sum, em.real.name,
                                                  buffers, fields["per"])
    elif kernel.attrs.nest == "channel":
        fields["C"], fields["P"] = kernel.geometry
    else:
        p = Pool(*kernel.geometry)
        fields.update(asdict(p), HO=p.HO, WO=p.WO)
        fields["iy"] = _offset("oy", p.SH, "ky", p.PH)
        fields["ix"] = _offset("ox", p.SW, "kx", p.PW)
        fields["padded"] = p.padded  # the window's rows and columns clipped to the image
        # a max unpool writes each window's entries once where the windows do
        # not overlap, and zeroes nothing first where they also cover the image
        fields["disjoint"] = p.SH >= p.KH and p.SW >= p.KW
        fields["tiles"] = (p.SH, p.SW) == (p.KH, p.KW) and not p.padded and (p.H, p.W) == (p.HO * p.KH, p.WO * p.KW)
    return fields


def _inside_columns(c: Conv) -> tuple[list[int], list[int]]:
    """For each kernel column kx, the output columns [lo, hi) whose input
    column ox*SW + kx*DW - PW is inside the image (the rest read the padding)."""
    lo, hi = [], []
    for kx in range(c.KW):
        inside = [ox for ox in range(c.WO) if 0 <= ox * c.SW + kx * c.DW - c.PW < c.W]
        lo.append(inside[0] if inside else 0)
        hi.append(inside[-1] + 1 if inside else 0)
    return lo, hi


def _offset(out: str, stride: int, k: str, pad: int, dilation: int = 1) -> str:
    """The C of an input coordinate: out*stride + k*dilation - pad."""
    text = out if stride == 1 else f"{out} * {stride}"
    return f"{text} + {k}" + (f" * {dilation}" if dilation != 1 else "") + (f" - {pad}" if pad else "")


def _lowering(build: Callable[..., Node]) -> Callable:
    """The lowering of a declared image op to `build`(*its operands, its geometry)."""

    def lower(lowerer, expr: declared.ImageOp) -> Node:
        return build(*(lowerer.lower(o) for o in expr.operands), expr.geometry)

    return lower


def _shape(expr: declared.ImageOp, of) -> tuple:
    return (of(expr.operands[0])[0], declared.out_cols(expr.op, expr.geometry))


def _op(name: str, attrs: ImageAttrs, vjp, jvp, evaluate, grad_fn: str, lowers: type | None = None,
        build: Callable[..., Node] | None = None) -> None:
    more = {"lowering": ((lowers, _lowering(build)),), "shapes": ((lowers, _shape),)} if lowers and build else {}
    register(OpRecord(name, vjp=vjp, jvp=jvp, evaluate=evaluate, kernel=_kernel, emit=_emit,
                      template="kernel_conv.c.j2", grad_fn=plain_grad_fn(grad_fn), attrs=attrs,
                      **more))  # type: ignore[arg-type]


_op("conv2d", ImageAttrs("im2col", image="a"), _conv_vjp, bilinear_jvp(conv2d), reference.eval_conv, "Conv2d",
    declared.Conv2d, conv2d)
_op("conv2d_input_grad", ImageAttrs("im2col", scatter=True), _input_grad_vjp, bilinear_jvp(conv2d_input_grad),
    reference.eval_input_grad, "Conv2dInputGrad")
_op("conv2d_weight_grad", ImageAttrs("im2col", image="b", batch_sum=True), _weight_grad_vjp,
    bilinear_jvp(conv2d_weight_grad), reference.eval_weight_grad, "Conv2dWeightGrad")
_op("max_pool2d", ImageAttrs("window", window="max"), _max_vjp, _max_jvp, reference.eval_max, "MaxPool2d",
    declared.MaxPool2d, lambda x, geometry: max_pool2d(x, x, geometry))  # x's argmax, x's entry there
_op("max_unpool2d", ImageAttrs("window", scatter=True, window="max", argmax="select"), _unpool_vjp, _unpool_jvp,
    reference.eval_unpool, "MaxUnpool2d")
_op("avg_pool2d", ImageAttrs("window", window="mean"), *_linear(avg_pool2d, avg_unpool2d), reference.eval_avg, "AvgPool2d",
    declared.AvgPool2d, avg_pool2d)
_op("avg_unpool2d", ImageAttrs("window", scatter=True, window="mean"), *_linear(avg_unpool2d, avg_pool2d),
    reference.eval_avg_unpool, "AvgUnpool2d")
_op("channel_sum", ImageAttrs("channel"), *_linear(channel_sum, channel_broadcast), reference.eval_channel_sum, "ChannelSum",
    declared.ChannelSum, channel_sum)
_op("channel_broadcast", ImageAttrs("channel", scatter=True), *_linear(channel_broadcast, channel_sum),
    reference.eval_channel_broadcast, "ChannelBroadcast", declared.ChannelBroadcast, channel_broadcast)
