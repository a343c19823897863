"""Emit C99 (source, header, cffi cdef) from function schedules.

Scalars are printed by a subclass of SymPy's C99 printer; everything else
is rendered by the Jinja templates in templates/, which get small plain
dataclasses of strings, never the compiler's objects. Here: the printers,
those dataclasses, FunctionEmitter (a kernel's template data, by its op's
record), the thresholds of threads and BLAS, the runtime header and the
rendering; one scheduled function's template data is emit/cfunction.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, is_dataclass
from dataclasses import fields as dataclass_fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import sympy as sp
from sympy.printing.c import C99CodePrinter
from sympy.printing.codeprinter import PrintMethodNotImplementedError

from symbackprop.base.abi import ARG_KINDS, SIZE_DOES_NOT_FIT, STATUS_TEXT
from symbackprop.base.cnames import DESCRIBE_MODULE, CNamer, comment_text
from symbackprop.base.cprint import IEEEPrinter
from symbackprop.base.functions import CHelper, helpers_called
from symbackprop.base.registry import helpers, record
from symbackprop.emit.cparts import FixedBuffer, Prelude, enumerators, place_name, prelude
from symbackprop.emit.describe import NULL_POINTER, SHAPE_STATUSES, CDescription, EpochNames, describe, describe_epoch
from symbackprop.emit.emitted import FLOAT32, FLOAT64, REAL_TYPES, RealType
from symbackprop.emit.templatecache import TEMPLATES, environment, template_bytecode_cache
from symbackprop.emit.wrap import wrap_c_code, wrap_c_comments
from symbackprop.errors import ModelError
from symbackprop.schedule.cse import MAX_PRODUCT_POWER
from symbackprop.schedule.kernel import LOOP_I, LOOP_J, Kernel, View, loop_index

LOOP_K = loop_index("k")




class ScalarPrinter(IEEEPrinter):
    """SymPy's C99 printer with the few changes generated kernels need:
    symbols print as given C text, integer powers as products, powers
    -1/2 and +-3/2 through sqrt (no pow() call), step
    functions as comparisons (NaN-propagating, see IEEEPrinter), and
    literals in the module's real type."""

    def __init__(self, text: dict[sp.Symbol, str], real: RealType):
        # no math_macros: M_PI and M_SQRT2 are not C99
        super().__init__({"type_aliases": {sp.codegen.ast.real: real.sympy_type}, "math_macros": {}})
        self.text = text
        self.real = real

    def _print_Symbol(self, expr: sp.Symbol) -> str:
        return self.text.get(expr) or super()._print_Symbol(expr)

    def _print_Pow(self, expr: sp.Pow) -> str:
        base, exp = expr.args
        if exp.is_Integer and 2 <= abs(int(exp)) <= MAX_PRODUCT_POWER and base.is_Symbol:
            factor = self.parenthesize(base, sp.printing.precedence.PRECEDENCE["Mul"])
            product = "(" + "*".join([factor] * abs(int(exp))) + ")"
            return product if exp > 0 else f"{self._one()}/{product}"
        if exp == -1:
            return f"{self._one()}/{self.parenthesize(base, sp.printing.precedence.PRECEDENCE['Mul'])}"
        if exp.is_Rational and exp.q == 2 and exp != sp.S.Half and abs(exp.p) <= 2 * MAX_PRODUCT_POWER + 1 \
                and (base.is_Symbol or abs(exp.p) <= 3):
            # x**(k/2) as x**floor(k/2) * sqrt(x): pow() of a non-integer is a libm call an entry
            # (layer norm's x**(-1/2), a potential's r**(-3/2)); sqrt vectorizes. A compound base
            # is written at most twice.
            factor = self.parenthesize(base, sp.printing.precedence.PRECEDENCE["Mul"])
            product = "*".join([factor] * (abs(int(exp.p)) // 2) + [self._print(sp.sqrt(base))])
            power = product if abs(exp.p) == 1 else f"({product})"
            return power if exp > 0 else f"{self._one()}/{power}"
        return super()._print_Pow(expr)

    def _print_NumberSymbol(self, expr: sp.Expr) -> str:
        """pi, E, ...: a literal with enough digits for double precision."""
        return self._print(sp.Float(expr.evalf(20), 20))

    _print_Pi = _print_Exp1 = _print_EulerGamma = _print_GoldenRatio = _print_Catalan = _print_NumberSymbol


class CheckedPrinter:
    """A printer whose failure to print names the expression and its kernel."""

    def __init__(self, printer: ScalarPrinter, kernel: Kernel):
        self.printer, self.kernel = printer, kernel

    def doprint(self, expr: sp.Expr) -> str:
        try:
            return self.printer.doprint(expr)
        except PrintMethodNotImplementedError as exc:
            what = "; ".join(e.comment for e in self.kernel.equations)
            raise ModelError(f"{exc}: C has no equivalent, in {what}") from None


class IndexPrinter(C99CodePrinter):
    """Integer index arithmetic: dimensions print as their C names."""

    def __init__(self, text: dict[sp.Symbol, str]):
        super().__init__()
        self.text = text

    def _print_Symbol(self, expr: sp.Symbol) -> str:
        return self.text.get(expr) or super()._print_Symbol(expr)

    def _print_Integer(self, expr: sp.Integer) -> str:
        return str(int(expr))

    def _print_Pow(self, expr: sp.Pow) -> str:
        """Integer powers of dimensions as products: pow() is floating point."""
        base, exp = expr.args
        if exp.is_Integer and exp > 0:
            return "*".join([self.parenthesize(base, sp.printing.precedence.PRECEDENCE["Mul"])] * int(exp))
        raise ModelError(f"dimension expression {expr} is not a product of dimensions")

    def _print_Min(self, expr: sp.Min) -> str:
        """An integer min (a checkpoint segment's rows: loops.graph), never fmin."""
        return self._choose(expr.args, "<")

    def _print_Max(self, expr: sp.Max) -> str:
        return self._choose(expr.args, ">")

    def _choose(self, args: Sequence[sp.Expr], test: str) -> str:
        a = self._print(args[0])
        if len(args) == 1:
            return a
        b = self._choose(args[1:], test)
        return f"(({a}) {test} ({b}) ? ({a}) : ({b}))"


# --- what the templates get -------------------------------------------------


@dataclass(frozen=True)
class CParam:
    role: str  # "dim", "input", "output", "work"
    name: str  # the user-facing name (array keyword or result name)
    cname: str
    decl: str  # the C declaration, e.g. "const double *X"
    shape: tuple[str, ...]  # C expressions of the array's shape
    index: bool = False  # an Index: int64_t row numbers


@dataclass(frozen=True)
class CKernel:
    kind: str  # the op whose record emitted it
    comments: tuple[str, ...]
    fields: dict
    declares: tuple[tuple[str, str, str], ...] = ()  # workspace slots first written here
    template: str = ""  # the macro of macros.j2 (or the template file) that prints it: the record's

    def last_declared(self) -> list[str]:
        """The pointers it declares that none of its other declarations is
        placed after: a kernel that writes its buffers through `work` (a
        table's stores) names only these in `(void)` casts, so that a C
        user's -Wall -Werror build accepts them (the others are read by the
        next declaration)."""
        placed = set(re.findall(r"\w+", " ".join(where for _, where, _ in self.declares)))  # (a search per name: quadratic)
        return [name for name, _, _ in self.declares if name not in placed]


@dataclass(frozen=True)
class CFunction:
    name: str
    summary: str
    params: tuple[CParam, ...]
    dims: tuple[str, ...]
    uses_work: bool
    kernels: tuple[CKernel, ...]
    work_size: str
    unused: tuple[str, ...] = ()  # C names of array parameters no kernel reads (a vjp of an output that ignores some inputs)
    static: bool = False  # internal to the module (the shared forward and gradient)
    split: int | None = None  # kernel index where a call with `with_grads` 0 returns
    delegate: str | None = None  # a wrapper: the call it returns
    # (Index, its rows, rows of each array it gathers from): checked at entry, before anything is written
    checks: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    statuses: tuple[int, ...] = (0,)  # what it can return (see STATUS_TEXT)
    # (rows, batch) as C text: rows % batch must be 0 (a batched scan's whole steps), checked at entry
    divides: tuple[tuple[str, str], ...] = ()
    parts: tuple[tuple[int, int], ...] = ()  # kernel ranges of its parts (see cparts), none when short
    unit: int = 0  # the translation unit of its body (and work_len) where the module is split (cunits)
    # a call its kernels follow (a train step's value_and_grad: emit/stepcall.py), and the
    # workspace pointers (name, where, extent) it writes into
    call: str | None = None
    call_pointers: tuple[tuple[str, str, str], ...] = ()
    part_units: tuple[int, ...] = ()  # the unit of each part, where the module is split
    # all its sizes (arrays and workspace) summed, as checked C (emit/sizes.py): above
    # SYMBACKPROP_SIZE_MAX the function returns SIZE_DOES_NOT_FIT; None with no dimension
    size_check: str | None = None
    fixed: tuple[FixedBuffer, ...] = ()  # its workspace buffers at a fixed place: named, where it has parts (cparts)

    @property
    def places(self) -> list[tuple[str, str]]:
        """Where it has parts: the enum lines naming its fixed buffers'
        places (cparts), (enumerator, comment); else none."""
        return enumerators(self.name, self.fixed) if self.parts else []

    def place_name(self, buffer: str) -> str:
        return place_name(self.name, buffer)

    def declared(self, start: int = 0, end: int | None = None) -> list[tuple[str, str, str]]:
        """The workspace pointers it declares of table(start, end): where it
        has parts, not those of a named place (cparts)."""
        named = {b.name for b in self.fixed} if self.parts else set()
        return [d for d in self.table(start, end) if d[0] not in named]

    def wide(self, start: int = 0, end: int | None = None) -> bool:
        """Whether its kernels (those from start to end) hold a wide
        per-example body: marked SYMBACKPROP_WIDE (the runtime header)."""
        return any(k.fields.get("wide") for k in self.kernels[start:end])

    def attribute(self, start: int = 0, end: int | None = None) -> str:
        """The C attribute macro (and a space) its kernels from start to
        end call for: SYMBACKPROP_WIDE for a wide per-example body, else
        SYMBACKPROP_STRAIGHT for a long straight-line one; or nothing.
        SYMBACKPROP_WIDE_SUMS where a wide body adds into many sums
        (ops.emap_c.WIDE_SUMS_NARROW)."""
        if any(k.fields.get("wide_sums") for k in self.kernels[start:end]):
            return "SYMBACKPROP_WIDE_SUMS "
        if self.wide(start, end):
            return "SYMBACKPROP_WIDE "
        return "SYMBACKPROP_STRAIGHT " if any(k.fields.get("straight") for k in self.kernels[start:end]) else ""

    def table(self, start: int = 0, end: int | None = None) -> list[tuple[str, str, str]]:
        """The workspace pointers (name, where, extent) that kernels start to
        end first write, in order: declared in one block at the top of the
        function (and one after a forward-only call returns), each placed
        after its neighbour, so a new buffer changes that block, not the
        kernels around it."""
        return [d for kernel in self.kernels[start:end] for d in kernel.declares]

    def prelude(self, start: int, body: str) -> Prelude:
        """The parameters of the part beginning at kernel `start`, given its
        C text: the function's, and the workspace pointers it uses."""
        real = next(p.decl for p in self.params if p.role == "work").rsplit("*", 1)[0]
        pointers = [(name, f"{real}*{name}") for name, _, _ in [*self.declared(), *self.call_pointers]]
        return prelude([(p.cname, p.decl) for p in self.params] + pointers, body, frozenset(b.name for b in self.fixed))

    @property
    def dim_params(self) -> str:
        """What its work_len takes: the dimensions (and a shared function's flag)."""
        return ", ".join(p.decl for p in self.params if p.role in ("dim", "flag")) or "void"

    @property
    def all_params(self) -> str:
        return ", ".join(p.decl for p in self.params)

    @property
    def cffi_params(self) -> str:
        """For cffi, arrays are `void *`: it then takes untyped buffers, the
        cheapest pointers it makes from numpy arrays."""
        return ", ".join(p.decl if p.role == "dim" else f"void *{p.cname}" for p in self.params)


@dataclass(frozen=True)
class CModule:
    prefix: str
    guard: str  # include guard macro
    model_name: str  # as a comment-safe text
    real: str  # "float64" / "float32": what it was generated for
    real_c: str  # the real type in its text: its macro (cnames.real_macro), by default real_default
    functions: tuple[CFunction, ...]
    version: str
    internal: tuple[CFunction, ...] = ()  # static functions the public ones call
    epoch: EpochNames | None = None  # an epoch.CEpoch, when the module has a train_step
    dims: tuple[str, ...] = ()  # C names of its dimensions, in the order of a `dims` array
    units: int = 1  # translation units its C is compiled as (cunits): 1, or a few for a large module
    products: tuple[Any, ...] = ()  # a function per kind of matrix product call (emit/products.py), where it has many
    maps: tuple[Any, ...] = ()  # a function per kind of element-wise loop that repeats (emit/maps.py)
    sizes: tuple[Any, ...] = ()  # a function per distinct size check (emit/sizes.py SizeFunction)
    # (C name of a dimension, its least value, why): the model's fixed entries along dimensions
    # bound at call time (ir.lower.Lowered.minimums); every other dimension's least value is 1
    least: tuple[tuple[str, int, str], ...] = ()

    def least_of(self, dim: str) -> int:
        """The least value a call may bind the dimension (a C name) to."""
        return next((value for name, value, _ in self.least if name == dim), 1)

    @property
    def shared(self) -> str:
        """The storage macro of its functions that one unit may call in
        another: static in a one-unit build, else hidden."""
        return f"{self.prefix.upper()}_SHARED"

    @property
    def real_default(self) -> str:
        """The C type it was generated for: double or float."""
        return REAL_TYPES[self.real].c

    @property
    def descriptions(self) -> tuple[CDescription, ...]:
        """What the self-describing functions say of each public function,
        then of train_epoch when there is one."""
        described = tuple(describe(fn, self.real_c) for fn in self.functions)
        if self.epoch is None:
            return described
        step = next(d for d in described if d.function == self.epoch.step)
        return (*described, describe_epoch(step, self.epoch, self.real_c))

    @property
    def describe_statuses(self) -> tuple[int, ...]:
        return SHAPE_STATUSES

    @property
    def size_status(self) -> int:
        """What a function returns when its sizes do not fit (emit/sizes.py)."""
        return SIZE_DOES_NOT_FIT

    @property
    def null_status(self) -> int:
        """What an array-form call returns for a NULL pointer it needs."""
        return NULL_POINTER

    @property
    def arg_kinds(self) -> dict[int, str]:
        return ARG_KINDS

    @property
    def module_names(self) -> dict[str, str]:
        """The C names of the module's own self-describing functions."""
        return {what: f"{self.prefix}_{what}" for what in DESCRIBE_MODULE}

    @property
    def helper_prefix(self) -> str:
        """The prefix of the runtime header's helpers for this real type."""
        return REAL_TYPES[self.real].helper_prefix

    @property
    def status_text(self) -> dict[int, str]:
        return STATUS_TEXT

    def all_kernels(self) -> Iterator[CKernel]:
        """Every kernel, those nested in others' fields (a scan's step) too."""
        stack: list[Any] = [k for f in self.internal + self.functions for k in f.kernels]
        stack += [kind.kernel for kind in self.maps]
        while stack:
            item = stack.pop()
            if isinstance(item, CKernel):
                yield item
                stack.extend(item.fields.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)

    @property
    def function_helpers(self) -> tuple[CHelper, ...]:
        """The scalar-function helpers its kernels call (base.functions)."""
        return helpers_called(_texts([k.fields for k in self.all_kernels()]))


def _texts(value: object) -> Iterator[str]:
    """The strings in template data (kernel fields: lists, tuples, dicts,
    dataclasses; nested kernels are walked by CModule.all_kernels)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif is_dataclass(item) and not isinstance(item, (type, CKernel)):
            stack.extend(getattr(item, f.name) for f in dataclass_fields(item))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


# --- emission ---------------------------------------------------------------

class FunctionEmitter:
    """Prints one scheduled function's kernels into template data."""

    def __init__(self, namer: CNamer, dims: dict[sp.Symbol, str], real: RealType):
        self.namer = namer
        self.dims = dims
        self.real = real
        self.work_offsets: dict[str, int] = {}  # a workspace buffer -> its constant place in `work` (work_offsets)
        self.index = IndexPrinter({**dims, LOOP_I: "i", LOOP_J: "j", LOOP_K: "k"})
        self._dim_texts: dict[object, str] = {}

    def dim(self, d: object) -> str:
        if isinstance(d, (int, sp.Integer)):  # the printer's text of it, without its walk (a slot's extent, offset)
            return str(int(d))
        text = self._dim_texts.get(d)
        if text is None:  # (a function asks for a few dozen distinct ones thousands of times: n, 3*n)
            text = self._dim_texts[d] = self.index.doprint(sp.sympify(d))
        return text

    def access(self, view: View, i: sp.Expr, j: sp.Expr) -> str:
        """buffer[offset + i*row_stride + j*col_stride], terms in that order."""
        terms = []
        for coefficient, var in ((view.offset, sp.S.One), (view.row_stride, i), (view.col_stride, j)):
            if isinstance(coefficient, (int, sp.Integer)) and (var.is_Integer or var in self.index.text):
                # what the general case below prints, without SymPy's product and printer (most accesses)
                if coefficient == 0 or var == 0:
                    continue
                if var.is_Integer:
                    terms.append(str(int(coefficient) * int(var)))
                elif coefficient == 1:
                    terms.append(self.index.text[var])
                else:
                    terms.append(f"{int(coefficient)}*{self.index.text[var]}")
                continue
            term = sp.sympify(coefficient) * var
            if term.has(sp.Add, sp.Pow):  # else expand changes nothing, and costs 0.1 ms a term
                term = sp.expand(term)
            if term == 0:
                continue
            if term.is_Number or var == 1 or coefficient == 1 or not var.is_Symbol:
                terms.append(self.index.doprint(term))
            else:
                terms.append(f"{self.index.doprint(sp.sympify(coefficient))}*{self.index.doprint(var)}")
        return f"{self.namer.name(view.buffer)}[{' + '.join(terms) or '0'}]"

    def kernel(self, kernel: Kernel) -> CKernel:
        """The template data of a kernel: the fields its op's record emits."""
        comments = tuple(comment_text(e.comment) for e in kernel.equations)
        found = record(kernel.kind)
        return CKernel(kernel.kind, comments, found.need("emit")(self, kernel), template=found.need("template"))

    def loops(self, shape: tuple) -> tuple[list[tuple[str, str]], sp.Expr, sp.Expr]:
        rows, cols = shape
        loops = []
        i = LOOP_I if rows != 1 else sp.Integer(0)
        j = LOOP_J if cols != 1 else sp.Integer(0)
        if rows != 1:
            loops.append(("i", self.dim(rows)))
        if cols != 1:
            loops.append(("j", self.dim(cols)))
        return loops, i, j


# Functions with SIMD variants in glibc's libmvec (x86_64): declared with
# GCC's simd attribute when built with -DSYMBACKPROP_LIBMVEC, loops calling
# them vectorize (results within glibc's documented 4 ulp).
LIBMVEC = frozenset(
    "acos acosh asin asinh atan atan2 atanh cbrt cos cosh erf erfc exp exp10 exp2 expm1 hypot "
    "log log10 log1p log2 pow sin sinh tan tanh".split()
)


# Loops over at least this many rows (or over a symbolic batch) are split
# across threads when the module is built with OpenMP (-fopenmp).
PARALLEL_MIN_ROWS = 64


def worth_threads(rows: int | sp.Expr) -> bool:
    rows = sp.sympify(rows)  # symbolic: a dimension, or an expression of them (a batched scan's N/B steps)
    return not rows.is_Integer or int(rows) >= PARALLEL_MIN_ROWS


# A loop whose iterations are not rows (attention's sequences)
# runs on threads when the call has at least this many multiply-adds.
PARALLEL_MIN_WORK = 65536


def min_rows_for_threads(work_per_row: int) -> int:
    """The fewest rows (positions) whose loop of `work_per_row` operations
    a row is worth a parallel region: the run-time test of such a loop."""
    return -(-PARALLEL_MIN_WORK // max(1, work_per_row))


# Products with fewer multiply-adds than this stay as inline loops, which
# the C compiler unrolls for fixed small shapes; a BLAS call costs ~1 us.
BLAS_MIN_MULTIPLY_ADDS = 4096

# LU factorizations and their solves of matrices of at least this size call
# LAPACK's getrf and the BLAS's trsm where linked (templates/linalg.c.j2);
# smaller ones stay as the runtime header's loops, which were as fast up to
# here (`taskset -c 1 python benchmarks/linalg.py --threshold`, OpenBLAS
# 0.3.34, one thread, Zen 4, det's value_and_grad LAPACK / loops: n=48 1.05,
# 64 1.01, 80 0.97, 96 0.89; solve's: 1.20, 1.04, 1.00, 0.92).
LAPACK_MIN_SIZE = 80
# Cholesky factorizations (potrf) and triangular solves (trsm) from this size
# up (`-DSYMBACKPROP_LAPACK_CHOLESKY_MIN`): benchmarks/gaussian.py's model
# without logdet, one thread pinned, CPU time, LAPACK / loops: n=16 1.12,
# 32 1.03, 48 0.98, 64 0.93, 80 0.87, 128 0.86.
CHOLESKY_LAPACK_MIN_SIZE = 48

# With OpenMP, BLAS products of at least this many multiply-adds (about
# 50 us on one core) are split across the threads (matmul.c.j2).
PARALLEL_MIN_PRODUCT = 1 << 20


@lru_cache(maxsize=1)
def template_environment() -> jinja2.Environment:
    """The templates' environment; their compiled code is built with the
    package and kept between processes (emit.templatecache)."""
    return environment(jinja2.FileSystemLoader(str(_template_dir())), template_bytecode_cache())


def _template_dir() -> Path:
    """The templates: the top-level templates/ of a checkout, symbackprop/templates
    in the wheel (emit.templatecache.TEMPLATES)."""
    if not (TEMPLATES / "module.c.j2").is_file():
        raise FileNotFoundError(f"symbackprop's templates are missing from {TEMPLATES}")
    return TEMPLATES


RUNTIME_HEADER = "symbackprop_runtime.h"


@dataclass(frozen=True)
class RuntimeType:
    """One real type's part of the runtime header, as its templates read it."""

    real: str
    real_c: str
    prefix: str  # of its helpers: symbackprop_f64_matmul, ...
    gemm: str
    trmm: str
    vector_math: tuple[str, ...]
    helpers: tuple[str, ...]  # the ops' C helpers of reduce.c.j2 (base.registry.helpers): all of them
    lanes: int  # a lane reduction's running values (RealType.lanes)
    blas_min: int = BLAS_MIN_MULTIPLY_ADDS
    parallel_product_min: int = PARALLEL_MIN_PRODUCT
    parallel_sum_min: int = PARALLEL_MIN_WORK
    lapack_min: int = LAPACK_MIN_SIZE
    cholesky_lapack_min: int = CHOLESKY_LAPACK_MIN_SIZE


def runtime_type(real: RealType) -> RuntimeType:
    """A real type's part of the header: every libmvec function and every
    op's helper, so that the header is the same whatever the models."""
    suffix = "f" if real.name == "float32" else ""
    return RuntimeType(real.name, real.c, real.helper_prefix, real.gemm, real.trmm,
                       tuple(name + suffix for name in sorted(LIBMVEC)), tuple(sorted(helpers())), real.lanes)


@lru_cache(maxsize=1)
def runtime_header() -> str:
    """symbackprop_runtime.h: the helpers and declarations every generated
    module includes, the same for every model (see templates/runtime.h.j2).
    Rendered twice: the helpers both types define, found in the first text,
    are the aliases a float64 module compiled as float calls."""
    from symbackprop._version import __version__

    types = [runtime_type(real) for real in (FLOAT64, FLOAT32)]
    template = template_environment().get_template("runtime.h.j2")
    helpers = template.render(types=types, version=__version__, aliases=())
    names = [set(re.findall(rf"\b{t.prefix}_(\w+)\(", helpers)) for t in types]
    text = template.render(types=types, version=__version__, aliases=sorted(names[0] & names[1]))
    return wrap_c_comments(text)


def kernel_printer(module: CModule) -> Any:
    """macros.j2's `kernel`, which prints a kernel's C: printer(kernel, real, prefix)."""
    macros: Any = template_environment().get_template("macros.j2").make_module({"m": module})
    return macros.kernel


def render(module: CModule) -> tuple[str, str, str]:
    env = template_environment()
    source = wrap_c_code(wrap_c_comments(env.get_template("module.c.j2").render(m=module)))
    header = wrap_c_code(wrap_c_comments(env.get_template("module.h.j2").render(m=module)))
    cdef = env.get_template("cdef.j2").render(m=module)
    return source, header, cdef
