"""User names to C identifiers: valid, not reserved, unique, deterministic.

Nothing a user names reaches the C text except through `CNamer.name` (for
identifiers) or `comment_text` (for comments).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

C_KEYWORDS = frozenset(
    """auto break case char const continue default do double else enum extern float for goto
    if inline int long register restrict return short signed sizeof static struct switch typedef
    union unsigned void volatile while _Bool _Complex _Imaginary _Alignas _Alignof _Atomic
    _Generic _Noreturn _Static_assert _Thread_local asm fortran""".split()
)

# Names from math.h, stdlib.h, stdint.h, string.h and the preprocessor that
# a generated file may see; a user name equal to one gets a suffix. Math
# functions are reserved with their float and long double variants too.
_MATH = """acos acosh asin asinh atan atan2 atanh cbrt ceil copysign cos cosh erf erfc exp exp2 expm1
    fabs fdim floor fma fmax fmin fmod frexp hypot ilogb ldexp lgamma llrint llround log log10
    log1p log2 logb lrint lround modf nan nearbyint nextafter nexttoward pow remainder remquo rint
    round scalbln scalbn sin sinh sqrt tan tanh tgamma trunc j0 j1 jn y0 y1 yn gamma""".split()
C_LIBRARY = frozenset(
    [f + suffix for f in _MATH for suffix in ("", "f", "l")]
    + """signgam isnan isinf isfinite isnormal signbit fpclassify HUGE_VAL INFINITY NAN M_PI M_E errno
    abs labs div exit free malloc calloc realloc rand srand abort atexit getenv system qsort
    bsearch atoi atof atol strtod memcpy memset memmove strlen strcmp strcpy index rindex
    size_t ptrdiff_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t
    intptr_t uintptr_t NULL EOF FILE stdin stdout stderr main assert offsetof bool true false
    defined math_errhandling static_assert st_atime st_mtime st_ctime L_tmpnam L_ctermid
    L_cuserid P_tmpdir sched_priority linux unix i386 complex imaginary""".split()
)

# Object-like macros of the C library and Python.h that the tables above do
# not list are upper case (EDOM, INT_MAX, the header guard <PREFIX>_H) or
# carry a library prefix (Py_, M_, PRId64); user names of that form get a
# suffix too. Names with one capital letter (X, W1, W_2) are left alone.
_MACRO_LIKE = re.compile(r"^(?:[^a-z]*[A-Z][^a-z]*[A-Z][^a-z]*|Py[A-Z_].*|PY.*|M_.*|(?:PRI|SCN)[a-zA-Z].*)$")

# Names the templates use for their own locals and parameters (dims and
# shape: those of the self-describing functions, whose bodies name the
# dimensions too).
INTERNAL = frozenset("i j k l acc maxval total lane result top work status dims shape stacked".split()
                     # a wide loop's examples in whole groups of lanes (templates/kernel_emap.c.j2;
                     # its rows8, rows16: _TEMP)
                     + "row i0 lanes into picks".split()
                     # the loop variables of the image ops (templates/kernel_conv.c.j2)
                     + "at best share wv ch ic oc kk ky kx oy ox iy ix blk win wsum".split()
                     # and of attention (templates/kernel_attention.c.j2)
                     + "seq len row0 qt ks hd dk qbase val wt pw srow aw orow".split())
# CSE temporaries, accumulators, the direct convolution's locals, a wide loop's rows8 (rows<lanes>)
_TEMP = re.compile(r"^((x|acc|rows)\d+|dc_\w+)$")
MAX_LENGTH = 48


def _ascii(name: str) -> str:
    out = []
    for ch in unicodedata.normalize("NFKD", name):
        if ch.isascii():
            out.append(ch)
        elif unicodedata.combining(ch):
            continue
        else:
            out.append(f"u{ord(ch):04x}")
    return "".join(out)


def sanitize(name: str) -> str:
    """A valid C identifier that reads like `name` (not yet made unique)."""
    ident = re.sub(r"[^A-Za-z0-9_]", "_", _ascii(name))
    ident = re.sub(r"_+", "_", ident).strip("_") or "v"
    if ident[0].isdigit():
        ident = "v" + ident
    ident = ident[:MAX_LENGTH]
    if _reserved(ident):
        ident += "_"
    return ident


def _listed(ident: str) -> bool:
    return ident in C_KEYWORDS or ident in C_LIBRARY or ident in INTERNAL or _TEMP.match(ident) is not None


def _reserved(ident: str) -> bool:
    # symbackprop_*: the runtime header's helpers (symbackprop_f64_matmul, ...)
    return _listed(ident) or _MACRO_LIKE.match(ident) is not None or ident.lower().startswith("symbackprop_")


class CNamer:
    """Gives each logical name one C identifier; first come, first served."""

    def __init__(self, reserved: frozenset[str] = frozenset()):
        self.reserved = set(reserved)
        self.ident: dict[str, str] = {}

    def name(self, logical: str) -> str:
        found = self.ident.get(logical)
        if found is not None:
            return found
        base = sanitize(logical)
        ident, count = base, 1
        while ident in self.reserved or _listed(ident):
            count += 1
            ident = f"{base}_{count}"
        self.reserved.add(ident)
        self.ident[logical] = ident
        return ident


# The functions by which a generated module describes itself (emit/describe.py):
# <prefix>_<what> for the module, <function>_<what> for each function.
DESCRIBE_MODULE = ("n_dims", "name_dim")
DESCRIBE_FUNCTION = ("n_dims", "name_dim", "n_in", "n_out", "name_in", "name_out", "kind_in", "shape_in", "shape_out",
                     "call", "call_work_len")


# Suffixes of the names a function's C name derives (its work_len, its
# self-description); the packed entries add "__packed", which no sanitized
# name holds.
DERIVED = (*DESCRIBE_FUNCTION, "work_len")


def function_base(name: str) -> str:
    """A function's C name (without the module prefix) for `name`: sanitized,
    and never ending as a name another function derives (_call, _work_len,
    _shape_in, ...): the vjp of an output "o_call" beside that of "o" would
    define o's nm_vjp_o_call twice. Such a name gets "_fn"."""
    base = sanitize(name)
    return base + "_fn" if any(base.endswith("_" + suffix) for suffix in DERIVED) else base


def describing(function: str) -> dict[str, str]:
    """The C names of a function's self-describing functions, by what they say."""
    return {what: f"{function}_{what}" for what in DESCRIBE_FUNCTION}


def abi_names(prefix: str, kinds: Iterable[str]) -> frozenset[str]:
    """The C names a module with these functions defines besides the
    functions themselves: reserved, so that no user name shadows one."""
    names = {f"{prefix}_{what}" for what in DESCRIBE_MODULE}
    for kind in kinds:
        names |= {f"{prefix}_{kind}", f"{prefix}_{kind}_work_len", *describing(f"{prefix}_{kind}").values()}
    return frozenset(names)


def real_macro(prefix: str) -> str:
    """The macro that a module's C text names its real type by (<PREFIX>_REAL):
    upper case with an underscore, so no user name can take it (_MACRO_LIKE)."""
    return f"{prefix.upper()}_REAL"


def comment_text(text: str) -> str:
    """Text that is safe inside a /* */ comment on one line, in ASCII."""
    if not (text.isascii() and text.isprintable()):  # (most equations are: no walk over their characters)
        text = _ascii(text).replace("\r", " ").replace("\n", " ")
        text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text.replace("*/", "* /").replace("/*", "/ *").replace("??", "? ?")
