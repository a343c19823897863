"""What the emit stage hands the run stage: a module's texts (Emitted) and
its real type (RealType). Kept apart from codegen so that loading a
module from the cache imports no code generator (no Jinja, no printers)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy.codegen.ast

# The bytes of one vector register the C is written for: an AVX-512 one
# (two AVX2 ones elsewhere: GCC splits the vector). Kernels that keep
# running values in lanes keep one register's worth (RealType.lanes).
VECTOR_BYTES = 64


@dataclass(frozen=True)
class RealType:
    """The floating type of a module: its C name and its math suffix."""

    name: str  # "float64" / "float32"
    c: str  # "double" / "float"; in a module's text, its real-type macro (cnames.real_macro)
    numpy: str
    sympy_type: object

    @property
    def lanes(self) -> int:
        """The reals of one vector register: a lane reduction's width (eight
        float lanes in a sixteen-float register made GCC shuffle between its
        halves: a row of 256 floats summed 10x slower)."""
        return VECTOR_BYTES // (8 if self.name == "float64" else 4)

    @property
    def helper_prefix(self) -> str:
        """The prefix of its helpers in the runtime header: symbackprop_f64_matmul, ..."""
        return f"symbackprop_f{self.name[-2:]}"

    @property
    def gemm(self) -> str:
        return "dgemm" if self.name == "float64" else "sgemm"

    @property
    def trmm(self) -> str:
        """BLAS's triangular product (the attention ops' causal products)."""
        return "dtrmm" if self.name == "float64" else "strmm"


FLOAT64 = RealType("float64", "double", "float64", sympy.codegen.ast.float64)
FLOAT32 = RealType("float32", "float", "float32", sympy.codegen.ast.float32)
REAL_TYPES = {t.name: t for t in (FLOAT64, FLOAT32)}
# The most lanes of any real type (float32's sixteen): what a schedule,
# built before its real type is chosen, makes room for where a kernel keeps
# running values in RealType.lanes lanes (ops/emap_kernel.py PAD_ROWS). A
# float64 module compiled in single precision keeps its text's lanes.
MOST_LANES = max(t.lanes for t in REAL_TYPES.values())


@dataclass(frozen=True)
class Emitted:
    """The text of a generated module and the ABI the runtime needs."""

    prefix: str
    source: str  # <prefix>.c
    header: str  # <prefix>.h
    cdef: str  # declarations for cffi
    derivation: str  # Markdown: the backward pass as math
    # codegen's CModule (typed loosely: naming it would import the code generator);
    # None when rebuilt from compile()'s memo (only rendering reads it)
    module: object | None
