"""The vocabulary of kernels: how a kernel reads a tensor (View), the
equation a kernel's comment shows, and the fused elementwise loop (MapKernel);
the kernels of other ops live beside their records (symbackprop.ops)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy as sp
from sympy.printing.latex import LatexPrinter
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from symbackprop.base.cprint import OrderedTerms
from symbackprop.base.exprdag import shared_xreplace
from symbackprop.ir.node import Shape
from symbackprop.schedule import opcount


def loop_index(name: str) -> sp.Symbol:
    """A kernel's loop index in its index arithmetic: printed by its name,
    ordered among a sum's terms by its name (as any symbol), but never equal
    to a model's symbol of that name (a dimension declared Symbol("i",
    integer=True) printed as the loop's i, which the C then did not declare
    or, inside the loop, read as the wrong number)."""
    return sp.Symbol(name, integer=True, loop_index=True)


LOOP_I, LOOP_J = loop_index("i"), loop_index("j")


@dataclass(frozen=True)
class View:
    """How a kernel reads a tensor: buffer[offset + i*row_stride + j*col_stride]."""

    buffer: str
    offset: sp.Expr
    row_stride: sp.Expr
    col_stride: sp.Expr

    def at(self, i: sp.Expr, j: sp.Expr) -> sp.Expr:
        return self.offset + i * self.row_stride + j * self.col_stride


@dataclass(frozen=True)
class Equation:
    """What a kernel computes, for comments (text) and the derivation (LaTeX).

    The LaTeX may be given as a function that writes it: only the
    derivation reads it, and a scan's step kernels, which it does not
    show, have hundreds of equations (printing them took most of an LSTM's
    compile)."""

    lhs: str
    text: str
    written: str | Callable[[], str]  # the LaTeX, or what writes it when first asked
    assign: str = "="  # "+=" where examples add into one place

    @functools.cached_property
    def latex(self) -> str:
        return self.written if isinstance(self.written, str) else self.written()

    @property
    def comment(self) -> str:
        return f"{self.lhs} {self.assign} {self.text}"


# A name with a LaTeX special character is set as text, each one escaped
# (_latex_text); SymPy typesets the others (W1 as W_{1}, alpha as \alpha,
# an entry alpha[j, 0] as it is): a user's name never reaches the math (a
# notebook's MathJax) as LaTeX commands
_LATEX_SPECIAL = re.compile(r"[\\{}$%#&]")  # (^ and ~ alone: SymPy's superscript, a space)
_LATEX_ESCAPES = {"\\": r"{\backslash}", "{": r"\{", "}": r"\}", "$": r"\unicode{36}", "%": r"\%", "#": r"\#", "&": r"\&",
                  "_": r"\_", "^": r"{\wedge}", "~": r"{\sim}", " ": r"\ "}


def _latex_text(name: str) -> str:
    r"""Any string as LaTeX math that shows it: \mathtt{...}, escaped
    (a control character as '?'; a dollar as its code point, which no
    renderer reads as the end of the math)."""
    shown = "".join(_LATEX_ESCAPES.get(c, c if c.isprintable() else "?") for c in name)
    return rf"\mathtt{{{shown}}}"


@functools.lru_cache(maxsize=8192)  # each equation's LaTeX names its symbols again (a determinant's: 500 of them)
def latex_name(name: str) -> str:
    """grad_x as dL/dx, dy_dx as dy/dx, other names as SymPy writes them;
    a name with a LaTeX special character (\\ { } $ % # &) as escaped text."""
    if name.startswith("grad_") and len(name) > 5:
        return rf"\frac{{\partial L}}{{\partial {latex_name(name[5:])}}}"
    match = re.fullmatch(r"d([A-Za-z]\w*?)_d([A-Za-z]\w*)", name)
    if match:
        top, bottom = (latex_name(g) for g in match.groups())
        return rf"\frac{{\partial {top}}}{{\partial {bottom}}}"
    if _LATEX_SPECIAL.search(name) or not name.isprintable():
        return _latex_text(name)
    return sp.latex(sp.Symbol(name))


# An explicit matrix of more entries than this is shown by its shape in the
# derivation (a 62 x 62 one-hot table or 62 gathered entries are no reading).
MAX_SHOWN_ENTRIES = 16


def latex(expr: sp.Basic) -> str:
    if isinstance(expr, sp.MatrixBase) and expr.rows * expr.cols > MAX_SHOWN_ENTRIES:
        return rf"\text{{a {expr.rows} x {expr.cols} matrix: see the C}}"
    names = {s: latex_name(str(s.name)) for s in expr.atoms(sp.Symbol, sp.MatrixSymbol)}
    return _OrderedLatex({"symbol_names": names}).doprint(expr)


class _OrderedLatex(OrderedTerms, LatexPrinter):
    """sp.latex, its sums ordered sooner (OrderedTerms)."""

    def _print_MatMul(self, expr: sp.MatMul) -> str:
        """SymPy's, without its test for a minus sign where every factor is
        a named matrix or its transpose (no sign to find): the test builds
        -expr and simplifies it, most of the derivation of an unrolled GRU
        of 100 steps (1,500 products, 4.6 of 5.8 s of CPU)."""
        if not all(isinstance(_untransposed(arg), (sp.MatrixSymbol, sp.Symbol)) for arg in expr.args):
            return super()._print_MatMul(expr)
        return " ".join(self.parenthesize(arg, PRECEDENCE["Mul"], False) for arg in expr.args)  # (precedence's test too)


def _untransposed(expr: sp.Basic) -> sp.Basic:
    return expr.arg if isinstance(expr, sp.Transpose) else expr


def equation(lhs: str, rhs: sp.Basic, printer: StrPrinter | None = None) -> Equation:
    text = sp.sstr(rhs) if printer is None else printer.doprint(rhs)
    return Equation(lhs, text, lambda: f"{latex_name(lhs)} = {latex(rhs)}")


class SharedStrPrinter(OrderedTerms, StrPrinter):
    """sstr that prints each distinct subexpression once: a fused loop's
    equations share their conditions and terms (a fixed point's step
    prints its stop tests in every entry). A subexpression's text does not
    depend on where it stands, so the text is sstr's."""

    def __init__(self) -> None:
        super().__init__()
        self._texts: dict = {}

    def _print(self, expr: Any, **kwargs: Any) -> str:
        if kwargs or not isinstance(expr, sp.Basic):
            return super()._print(expr, **kwargs)
        text = self._texts.get(expr)
        if text is None:
            text = self._texts[expr] = super()._print(expr)
        return text


@functools.lru_cache(maxsize=8192)
def count_ops(expr: sp.Basic) -> Any:
    """sp.count_ops, over expr's distinct terms (opcount): a fused loop's
    values are counted for its equation, the function's operation counts
    and its work."""
    return opcount.count_ops(expr)


def map_equations(values: Sequence[tuple[str, sp.Expr]], readable: dict) -> tuple[Equation, ...]:
    """A fused loop's values (lhs, value) as equations, their loads renamed
    by `readable`, the first MAX_EQUATIONS_SHOWN of them (a determinant's 500
    stored minors took 2 s to print, as text and LaTeX), and any beyond
    MAX_EQUATION_OPS (a gradient of a determinant by minors: printing them
    took 20 s; counted only up to that bound), as a pointer to the C's
    temporaries. Renamed and printed together: the values share most of
    their subexpressions."""
    done: dict = {}
    printer = SharedStrPrinter()

    def one(lhs: str, value: sp.Expr) -> Equation:
        if opcount.exceeds(value, MAX_EQUATION_OPS):
            return _see_the_c(lhs)
        return equation(lhs, shared_xreplace(value, readable, done), printer)

    return tuple(one(lhs, value) if k < MAX_EQUATIONS_SHOWN else _see_the_c(lhs) for k, (lhs, value) in enumerate(values))


SEE_THE_C = "see the temporaries in the C"  # an equation's text where its value is too large to show


def _see_the_c(lhs: str) -> Equation:
    return Equation(lhs, SEE_THE_C, rf"{latex_name(lhs)} = \text{{see the C}}")


@dataclass(frozen=True)
class MapKernel:
    """A fused elementwise loop: loads, CSE temporaries, stores."""

    shape: Shape
    loads: tuple[tuple[sp.Symbol, View], ...]
    temps: tuple[tuple[sp.Symbol, sp.Expr], ...]
    stores: tuple[tuple[str, sp.Expr], ...]  # (output buffer, value)
    equations: tuple[Equation, ...]
    load_first: bool = False  # it overwrites an input: read every input before any store
    kind: str = "map"
    # its values before CSE, for the op counts (None: not counted, a copy)
    before_cse: tuple[sp.Expr, ...] | None = field(default=None, compare=False)
    guards: tuple[int, ...] = ()  # the k of each guard inside(k) its values test (schedule.shifted)
    # loop-free, run from a table of its products: each temporary's rows, then each store's
    # (None: a store of a load or temporary as it is); schedule.straight.as_table
    table: tuple | None = field(default=None, compare=False)
    # (1 x columns buffer, value): added up down each column as the loop runs (fusion.MapGroup.sums)
    sums: tuple[tuple[str, sp.Expr], ...] = ()

    def reads(self) -> list[str]:
        return [view.buffer for _, view in self.loads]

    def writes(self) -> list[str]:
        return [out for out, _ in self.stores] + [out for out, _ in self.sums]

    @property
    def title(self) -> str:
        return "elementwise loop" if any(self.work()) else "copy"

    def op_counts(self) -> tuple[int, int]:
        """Scalar operations in its values before CSE and in its body after."""
        before = opcount.count_all(self.before_cse or ())
        return before, sum(count_ops(e) for _, e in self.temps + self.stores + self.sums)

    def work(self) -> tuple[sp.Expr, sp.Expr]:
        """(multiply-adds, other operations): its body's (after CSE) per element, a sum's addition one."""
        per = sum(count_ops(e) for _, e in self.temps + self.stores + self.sums) + len(self.sums)
        return sp.Integer(0), sp.sympify(self.shape[0]) * self.shape[1] * sp.Integer(per)


# A fused elementwise loop, or the kernel an op's record builds (its `kind`
# names that op; it says which buffers it touches with reads() and writes()).
Kernel = MapKernel | Any

# A map body with more operations than this is shown in comments by what it
# reads, not written out: its CSE'd temporaries in the C are the readable form.
MAX_SHOWN_OPS = 60
MAX_EQUATION_OPS = 120  # of a fused elementwise loop's value (map_equations)
MAX_EQUATIONS_SHOWN = 16  # of one fused loop's stored values (map_equations)


# A fused loop's value read by several of its members is substituted into
# each up to this size (an estimate: operations as a tree); beyond, it is
# named once (a determinant by minors had 87,282 operations inlined).
MAX_INLINED_OPS = 400


def kernel_writes(kernel: Kernel) -> list[str]:
    return list(kernel.writes())


def kernel_reads(kernel: Kernel) -> list[str]:
    return list(kernel.reads())
