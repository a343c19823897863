"""The template data of a scan's kernels. Every statement of a loop is
printed by templates/kernel_scan.c.j2 and scan.j2 (the step's kernels by the
ordinary kernel macros); here are only the names and C expressions they
fill in: pointers, offsets, the loops' bounds, each copy as a map kernel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import sympy as sp

from symbackprop.base.cnames import CNamer, comment_text
from symbackprop.emit.codegen import LIBMVEC, CKernel, FunctionEmitter, ScalarPrinter
from symbackprop.loops.bind import STEP, Fill, Loop, PartKernel, Pointer, ScanKernel, U, natural_layout
from symbackprop.loops.declare import ceildiv, entries
from symbackprop.ops.matmul import MatMulKernel
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Equation, MapKernel, View, kernel_reads, kernel_writes


class _ScopedNamer(CNamer):
    """C names for a loop's inner names: outer buffers keep theirs; the rest
    are prefixed with the scope (unique in the C function)."""

    def __init__(self, outer: Any, scope: str, bound: dict[str, str]):
        super().__init__()
        self.outer, self.scope, self.bound = outer, scope, bound

    def name(self, logical: str) -> str:
        if logical in self.bound:
            return self.outer.name(self.bound[logical])
        return self.outer.name(f"\0{self.scope} {logical}")


def _inner_kernel(em: FunctionEmitter, kernel: Any) -> CKernel:
    """A step kernel's template data: loops run on one thread (the loop over
    steps is sequential), products as outside loops (small ones inline, the
    rest through the runtime's matmul helper and BLAS: a batched step's
    B x D by D x H products), and the loops that GCC may treat as
    independent marked so (see the `independent` macro)."""
    ck = em.kernel(kernel)
    if ck.kind == "map" and ck.fields.get("parallel"):
        ck = replace(ck, fields={**ck.fields, "parallel": False})
    f = ck.fields
    independent = (ck.kind == "map" and f.get("loops")) or (
        ck.kind == "matmul" and not f.get("args") and f.get("order") == "ikj")
    if independent and not ck.declares:
        ck = replace(ck, fields={**f, "independent": True, "whole": _calls_vector_math(kernel)})
    return ck


def _calls_vector_math(kernel: Any) -> bool:
    """Whether a map kernel's loop calls a function with a SIMD variant
    (tanh, log, ...). GCC unrolls a short loop (a gate of 16) into scalar
    code before it vectorizes, and then calls the scalar function once an
    entry: such a loop is kept whole (see the `independent` macro)."""
    if not isinstance(kernel, MapKernel):
        return False
    exprs = [expr for _, expr in (*kernel.temps, *kernel.stores)]
    return any(type(call).__name__ in LIBMVEC for expr in exprs for call in expr.atoms(sp.Function))


@dataclass(frozen=True)
class AddProduct:
    """acc += a @ b, an outer product (a: m x 1, b: 1 x n) added straight
    into an accumulator: a MatMulKernel with k = 1 and the MapKernel
    `acc = acc + product` that was its only reader, as one loop nest
    (templates/kernel_scan_add_product.c.j2)."""

    acc: str
    a: View
    b: View
    m: Any
    n: Any
    equations: tuple[Equation, ...]
    kind: str = "scan_add_product"

    title = "product added"

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): m*n multiply-adds (k = 1)."""
        return sp.sympify(self.m) * self.n, sp.Integer(0)

    def reads(self) -> tuple[str, ...]:
        return (self.acc, self.a.buffer, self.b.buffer)

    def writes(self) -> tuple[str, ...]:
        return (self.acc,)


def _added_product(kernel: Any, products: dict[str, MatMulKernel]) -> tuple[str, MatMulKernel] | None:
    """(acc, product) when `kernel` is `acc = acc + product` over the whole
    of an outer product, both laid out row-major from offset 0."""
    if not isinstance(kernel, MapKernel) or kernel.temps or len(kernel.stores) != 1 or len(kernel.loads) != 2:
        return None
    acc, expr = kernel.stores[0]
    views = {view.buffer: (symbol, view) for symbol, view in kernel.loads}
    others = [buffer for buffer in views if buffer != acc]
    if acc not in views or len(others) != 1 or others[0] not in products:
        return None
    product = products[others[0]]
    shape = (sp.sympify(product.m), sp.sympify(product.n))
    if tuple(sp.sympify(d) for d in kernel.shape) != shape or sp.sympify(expr - views[acc][0] - views[others[0]][0]) != 0:
        return None
    if any(sp.sympify(view.offset) != 0 or not natural_layout(view, shape, rows=False) for _, view in views.values()):
        return None
    return acc, product


def _fuse_accumulations(kernels: Sequence[Any]) -> list[Any]:
    """The step's kernels, with each outer product that is only added into
    an accumulator (a weight's adjoint: x^T @ delta) added into it directly,
    at the product's place (the accumulator is read and written by that
    addition only)."""
    products = {k.out: k for k in kernels if isinstance(k, MatMulKernel) and sp.sympify(k.k) == 1}
    fused: dict[int, AddProduct] = {}
    dropped: set[int] = set()
    for at, kernel in enumerate(kernels):
        found = _added_product(kernel, products)
        if found is None:
            continue
        acc, product = found
        touching = [n for n, k in enumerate(kernels) if n != at and (
            {acc, product.out} & set(kernel_reads(k) + kernel_writes(k)))]
        where = kernels.index(product)
        if touching != [where] or where > at or acc in (product.a.buffer, product.b.buffer):
            continue
        lhs = kernel.equations[0].lhs if kernel.equations else acc
        text = product.equations[0].text if product.equations else "product"
        fused[where] = AddProduct(acc, product.a, product.b, product.m, product.n,
                                  (Equation(lhs, text, "", "+="),))
        dropped.add(at)
    return [fused.get(n, k) for n, k in enumerate(kernels) if n not in dropped]


def emit_add_product(em: FunctionEmitter, kernel: AddProduct) -> dict:
    """The fields of templates/kernel_scan_add_product.c.j2."""
    zero = sp.Integer(0)
    acc = View(kernel.acc, zero, sp.sympify(kernel.n), sp.Integer(1))
    return {"m": em.dim(kernel.m), "n": em.dim(kernel.n), "a": em.access(kernel.a, LOOP_I, zero),
            "acc": em.access(acc, LOOP_I, LOOP_J), "b": em.access(kernel.b, zero, LOOP_J)}


def copy_loop(loops: list[tuple[str, str]], target: str, value: str) -> CKernel:
    """`target = value` over `loops`: a map kernel of one store (the map
    macro prints it)."""
    return CKernel("map", (), {"loops": loops, "hoisted": [], "parallel": False, "temps": [], "stores": [(target, value)]})


class _ScanData:
    """The template data of one ScanKernel. Its C names are asked for in the
    order the C declares them (the namer numbers clashes in that order)."""

    def __init__(self, em: FunctionEmitter, k: ScanKernel):
        self.k = k
        self.outer = em
        self.sub = FunctionEmitter(_ScopedNamer(em.namer, k.scope, dict(k.bound)), em.dims, em.real)
        self.c = self.sub.namer.name
        self.names = {role: self.c(name) for role, name in k.names.items()}
        self.loop_var = {STEP: sp.Symbol(self.names["t"], integer=True)}
        if "u" in self.names:
            self.loop_var[U] = sp.Symbol(self.names["u"], integer=True)
        self.unaligned = self.c(k.scratch)
        self.scratch = self.names["base"]  # the scratch from its first 64-byte boundary
        self.used: set[str] = set()
        for loop in k.loops:
            for kernel in loop.schedule.kernels:
                self.used.update(kernel_reads(kernel))
                self.used.update(kernel_writes(kernel))

    def index(self, expr: Any) -> str:
        return self.sub.dim(sp.sympify(expr).xreplace(self.loop_var))

    def at(self, base: str, offset: Any) -> str:
        text = self.index(offset)
        return base if text == "0" else f"{base} + {text}"

    def value(self, source: View | sp.Expr, i: Any, j: Any) -> str:
        if isinstance(source, View):
            offset = sp.sympify(source.offset).xreplace(self.loop_var)  # an outer buffer: its own C name
            return self.outer.access(View(source.buffer, offset, source.row_stride, source.col_stride), i, j)
        return ScalarPrinter({}, self.sub.real).doprint(sp.sympify(source))

    def copy(self, target: str, shape: tuple, source: View | sp.Expr) -> CKernel:
        """target[0 .. size) = source (of `shape`), in row-major order."""
        i, j = sp.Symbol(self.names["i"], integer=True), sp.Symbol(self.names["j"], integer=True)
        rows, cols = shape
        if rows == 1 or cols == 1:
            size = self.index(entries(shape))
            ij = (sp.Integer(0), i) if rows == 1 else (i, sp.Integer(0))
            return copy_loop([(str(i), size)], f"{target}[{i}]", self.value(source, *ij))
        width = self.index(cols)
        loops = [(str(i), self.index(rows)), (str(j), width)]
        return copy_loop(loops, f"{target}[{i}*{width} + {j}]", self.value(source, i, j))

    def base(self, inner: str) -> str:
        return self.scratch if inner == self.k.scratch else self.c(inner)

    def bind(self, bound: Pointer | Fill, used: set[str]) -> dict | None:
        """A pointer the loop declares (None when its kernels do not use it);
        a fill, with the copy that fills it."""
        if bound.name not in used:
            return None
        name = self.c(bound.name)
        where = self.at(self.base(bound.base), bound.offset)
        if isinstance(bound, Pointer):
            return {"const": not bound.writable, "name": name, "where": where, "fill": None}
        return {"const": False, "name": name, "where": where, "fill": self.copy(name, bound.shape, bound.source)}

    def step(self, loop: Loop) -> CKernel:
        """One step: its pointers and gathered rows (those its kernels use),
        its slots in the scratch (those they use), then its kernels."""
        kernels = _fuse_accumulations(loop.schedule.kernels)
        used = {b for kernel in kernels for b in (*kernel_reads(kernel), *kernel_writes(kernel))}
        binds = [b for b in (self.bind(bound, used) for bound in loop.pointers + loop.fills) if b is not None]
        slots = []
        for slot in loop.schedule.slots:
            if slot.name in used:
                extent = f"{self.sub.dim(slot.shape[0])} x {self.sub.dim(slot.shape[1])}"
                slots.append((self.c(slot.name), self.at(self.scratch, loop.region + slot.offset), extent))
        inner = [_inner_kernel(self.sub, kernel) for kernel in kernels]
        return CKernel("scan_step", (), {"binds": binds, "slots": slots, "kernels": inner})

    def keep(self) -> dict:
        """Row t/every of the kept states = the state at step t (every k-th t)."""
        k, names = self.k, self.names
        t, every, width = names["t"], k.every, self.index(k.width)
        row = f"({t}/{every})" if every > 1 else t
        copy = copy_loop([(names["i"], width)], f"{self.c(str(k.kept))}[{row}*{width} + {names['i']}]",
                         f"{names['cur']}[{names['i']}]")
        return {"every": every if every > 1 else None, "rows": copy}

    def segments(self) -> dict:
        """The names and bounds of the backward loop over checkpoint segments."""
        k, names = self.k, self.names
        width, i = self.index(k.width), names["i"]
        restore = copy_loop([(i, width)], f"{names['seg']}[{i}]", f"{self.c(str(k.kept))}[{names['s']}*{width} + {i}]")
        last = self.index(ceildiv(sp.sympify(k.length), k.every) - 1)
        return {"last": last, "every": k.every, "restore": restore, "through": "<=" if k.recompute_last else "<"}

    def fields(self) -> dict:
        k, names, i = self.k, self.names, self.names["i"]
        fields: dict[str, Any] = {
            "names": names, "unaligned": self.unaligned, "nxt_at": self.at(self.scratch, k.width),
            "seg_at": self.at(self.scratch, 2 * k.width) if "seg" in names else None,
            "wholes": [b for b in (self.bind(whole, self.used) for whole in k.wholes) if b is not None],
            "zeroed": [copy_loop([(i, self.index(size))], f"{self.c(buffer)}[{i}]", "0") for buffer, size in k.zeroed],
        }
        starts = []
        for off, _, source, shape in k.starts:
            target = self.at(names["cur"], off) if self.index(off) == "0" else f"({self.at(names['cur'], off)})"
            starts.append(self.copy(target, shape, source))
        fields.update(starts=starts, length=self.index(k.length), keep=None, segments=None, reverse=k.reverse,
                      until=None)
        if k.count is not None:  # an unrolled fixed point: back from the last step that ran
            fields["length"] = f"(int64_t){self.value(k.count, sp.Integer(0), sp.Integer(0))}"
        if k.mode == "forward":
            fields["mode"] = "forward"
            if k.until is not None:
                fields["mode"] = "until"
                tol, watch, count = k.until
                fields["until"] = {"tol": repr(float(tol)), "watch": self.index(watch),
                                   "count": self.c(count) if count else None}
            if k.kept is not None:
                fields["keep"] = self.keep()
        else:
            fields["mode"] = "segments" if k.every > 1 else "reverse"
            if k.every > 1:
                fields["segments"] = self.segments()
        fields["steps"] = [self.step(loop) for loop in k.loops]
        fields["finals"] = [copy_loop([(i, self.index(size))], f"{self.c(buffer)}[{i}]",
                                      f"{names['cur']}[{self.at(i, off)}]") for buffer, off, size in k.finals]
        return fields


def emit_scan(em: FunctionEmitter, k: ScanKernel) -> dict:
    """The fields of templates/kernel_scan.c.j2."""
    return _ScanData(em, k).fields()


def emit_part(em: FunctionEmitter, k: PartKernel) -> dict:
    """The fields of templates/kernel_scan_part.c.j2 (a comment)."""
    return {"text": comment_text(k.text)}
