"""Long kernels are one function per kind, called with their arrays.

A transformer's blocks run the same layer norms, attention scores,
causal softmax and attention mix (and their gradients) on other arrays:
emit/maps.py makes a function of each kind of element-wise loop, but
these kernels stayed inline, about 20,000 characters of C a block, and
GCC compiled each copy again (a 12-block model spent 15 s in GCC, 2.3 s
for one block). Here each such kernel's C, printed without its comments
and with its arrays named a0, a1, ... in order of first use, is its
kind; each kind is one function of the module (CModule.maps, beside the
kinds of loop) and each kernel a call passing the dimensions its text
reads and its arrays. The parameters have the types the caller's
arrays have (const where the caller's is), and are not restrict: the
function computes what the inline kernel computed, as it computed it.
A map over examples' kernel (RESTRICT_KINDS) is the exception: its arrays
are restrict, as emit/maps.py's loops are and for the same reason (the
workspace gives no two buffers of one kernel the same memory), so that
GCC keeps a row's values in registers across the stores of a scatter
(k-means' gradient at each point's nearest centroid, 1.1x at k=10).

As with loops, whether a kernel is a call and the name it calls depend
on its own text only (MIN_CHARS, the text's kind and a hash of it), so
that an edit of one layer changes that layer's C and not another's.

A kernel is kept where it is when its text names anything of its
function other than arrays (the workspace's buffers, `work` itself) and
dimensions (the `with_grads` flag), when it returns, when it nests other kernels (a
scan), when it is an element-wise loop (emit/maps.py decides those) or
a call already, or when it carries an attribute of its function (wide,
straight, a value-only variant: cfunction.branches).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from symbackprop.emit.codegen import CFunction, CKernel, CModule, kernel_printer
from symbackprop.emit.maps import MapKind

# A kernel shorter than this stays inline: a call passes its arrays (a line
# each when long), and GCC compiles a short loop quickly (a row sum's 130
# characters; a layer norm's 1,600 and its gradient's 2,600 are calls).
MIN_CHARS = 400

_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_WORD = re.compile(r"\d[\w.]*|(?<!\.)(?<!->)\b([A-Za-z_]\w*)")  # no member after . or ->
_NOT_IN_A_CALL = frozenset({"return", "goto"})  # they would leave the called function, not the caller
# fields that make a kernel its function's (an attribute, a value-only variant) or maps.py's
_KEPT_FIELDS = ("callee", "wide", "wide_sums", "straight", "forward", "table", "parts")
# the kinds of kernel whose arrays are restrict in their function (see above)
RESTRICT_KINDS = frozenset({"emap"})


@dataclass(frozen=True)
class _Canonical:
    """A kernel's text with its arrays renamed, and what a call passes."""

    key: str
    params: tuple[str, ...]  # `int64_t m`, `const REAL *a0`, ...
    args: tuple[str, ...]  # the caller's dimensions and arrays, in the order of params
    body: str


def share_kernels(module: CModule, claim: Callable[[str], str]) -> CModule:
    """The module with each long kernel that can be a call a call of its
    kind's function (appended to CModule.maps); unchanged where none can.
    `claim` gives a new C name."""
    printer = kernel_printer(module)
    kinds: dict[str, MapKind] = {}
    canonical: dict[int, _Canonical] = {}
    for fn in module.internal + module.functions:
        scope = _scope(fn, module.real_c)
        for kernel in fn.kernels:
            if not _callable(kernel):
                continue
            text = str(printer(replace(kernel, comments=()), module.real_c, module.helper_prefix))
            shape = _canonical(text, scope, kernel.kind in RESTRICT_KINDS)
            if shape is None:
                continue
            canonical[id(kernel)] = shape
            if shape.key not in kinds:
                digest = hashlib.sha1(shape.key.encode()).hexdigest()[:4]
                body = CKernel(kernel.kind, (), {"text": shape.body}, template="text_kernel")
                kinds[shape.key] = MapKind(claim(f"{module.prefix}_{kernel.kind}_{digest}"), shape.params, body, 0)
            kinds[shape.key] = replace(kinds[shape.key], calls=kinds[shape.key].calls + 1)
    if not kinds:
        return module

    def calling(fn: CFunction) -> CFunction:
        def call(kernel: CKernel) -> CKernel:
            shape = canonical.get(id(kernel))
            if shape is None:
                return kernel
            return replace(kernel, template="map_kernel", fields={"callee": kinds[shape.key].name, "args": shape.args})

        return replace(fn, kernels=tuple(map(call, fn.kernels)))

    return replace(module, functions=tuple(map(calling, module.functions)),
                   internal=tuple(map(calling, module.internal)), maps=module.maps + tuple(kinds.values()))


def _callable(kernel: CKernel) -> bool:
    if kernel.template == "map_kernel" or any(kernel.fields.get(name) for name in _KEPT_FIELDS):
        return False
    return not _nests(kernel.fields)


def _nests(value: Any) -> bool:
    if isinstance(value, CKernel):
        return True
    if isinstance(value, dict):
        return any(_nests(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_nests(item) for item in value)
    return False


def _scope(fn: CFunction, real: str) -> dict[str, str]:
    """The names a kernel of `fn` may read, each with its C type: its
    parameters, and the workspace pointers it declares or is given."""
    types = {p.cname: p.decl[:-len(p.cname)] for p in fn.params}
    for name, _, _ in [*fn.table(), *fn.call_pointers]:
        types[name] = f"{real} *"
    return types


def _canonical(text: str, scope: dict[str, str], restrict: bool = False) -> _Canonical | None:
    """The kernel's text as a kind's body, or None where it stays inline;
    `restrict`: its array parameters restrict."""
    code = _COMMENT.sub(" ", text)
    if len(code.strip()) < MIN_CHARS:
        return None
    used: dict[str, str] = {}  # the scope's names it reads, in order of first use: their types
    words: set[str] = set()
    for match in _WORD.finditer(code):
        word = match.group(1)
        if word is None:
            continue
        words.add(word)
        if word in _NOT_IN_A_CALL:
            return None
        if word in scope:
            used.setdefault(word, scope[word])
    arrays = [name for name, ctype in used.items() if "*" in ctype]
    dims = [name for name, ctype in used.items() if ctype.strip() == "int64_t"]
    if len(arrays) + len(dims) < len(used):  # a flag, or anything but an array or a dimension
        return None
    names = {old: f"a{k}" for k, old in enumerate(arrays)}
    if set(names.values()) & (words - set(arrays)):
        return None
    params = tuple(f"int64_t {dim}" for dim in dims) + tuple(
        f"{_restricted(used[old]) if restrict else used[old]}{new}" for old, new in names.items())
    body = _WORD.sub(lambda m: names.get(m.group(1), m.group(0)) if m.group(1) else m.group(0), text)
    return _Canonical(repr((params, body)), params, (*dims, *arrays), body)


__all__ = ["MIN_CHARS", "share_kernels"]


def _restricted(ctype: str) -> str:
    """A pointer type (`const REAL *`) as a restrict one, ready for its name."""
    return ctype.rstrip().removesuffix("*").rstrip() + " *SYMBACKPROP_RESTRICT "
