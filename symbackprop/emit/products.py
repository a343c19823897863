"""A module with many matrix products calls one function per kind of product.

The runtime header's product helper is static: GCC compiles a copy of its
loops (and its BLAS branch) into each call, fitted to the call's constant
sizes and strides. An unrolled recurrent network calls it at every step:
a GRU of 10 steps made 142 calls of 11 kinds, and its four units took
3.1 s of GCC CPU, 0.9 s with the helper never inlined. Past
MAX_INLINED_PRODUCTS calls, each kind of call (add or not, and the same
sizes and strides as C text) becomes one small function of the module,
which calls the helper with those constants (the one copy, fitted to
them) and is not inlined; the calls pass what is not a constant (a batch
size) and the three arrays. A module with fewer calls keeps them as they
were (an MLP's few products: its C is unchanged).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from symbackprop.emit.codegen import CFunction, CKernel, CModule

# More calls of the product than this in a module: a function per kind of
# call (each copy compiled into a call cost GCC about 20 ms).
MAX_INLINED_PRODUCTS = 32

# A product's ten arguments (ops/matmul.py matmul_fields "args"): these are its
# sizes and strides, the rest its three arrays (a, b, the result).
_SHAPE = (0, 1, 2, 4, 5, 7, 8)
_ARRAYS = {3: "a", 6: "b", 9: "c"}


@dataclass(frozen=True)
class ProductKind:
    """The module's function for the calls of one kind: name(s0, s1, ...,
    a, b, c), its sizes that are not constants first."""

    name: str
    add: bool
    params: tuple[str, ...]  # its C parameters: `int64_t s0`, ..., then the arrays a, b and c
    args: tuple[str, ...]  # the helper's ten arguments, constants and parameters
    calls: int  # how many calls of the module it serves
    unit: int = 0  # the translation unit of its body, where the module is split (cunits)


def share_products(module: CModule, claim: Callable[[str], str]) -> CModule:
    """The module with each kind of product call a function of its own
    (CModule.products), where it calls the product more than
    MAX_INLINED_PRODUCTS times; else unchanged. `claim` gives a new C name."""
    calls: Counter[tuple] = Counter()  # by kind, in the order first called

    def count(kernel: CKernel) -> CKernel:
        calls[_kind_key(kernel)] += 1
        return kernel

    _with_calls([fn.kernels for fn in module.internal + module.functions], count)
    if calls.total() <= MAX_INLINED_PRODUCTS:
        return module
    names = _names(module.prefix, list(calls))
    kinds = {key: _kind(claim(names[key]), key, n, module.real_c) for key, n in calls.items()}

    def function(fn: CFunction) -> CFunction:
        return replace(fn, kernels=_with_calls(fn.kernels, lambda kernel: _calling(kernel, kinds[_kind_key(kernel)])))

    return replace(module, functions=tuple(map(function, module.functions)),
                   internal=tuple(map(function, module.internal)), products=tuple(kinds.values()))


def _with_calls(value: Any, call: Callable[[CKernel], CKernel]) -> Any:
    """`value` with each product call in it, nested ones too (a scan's step
    kernels, in their fields), replaced by call(kernel), in order."""
    if isinstance(value, CKernel):
        return call(value) if _is_call(value) else replace(value, fields=_with_calls(value.fields, call))
    if isinstance(value, dict):
        return {key: _with_calls(item, call) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_with_calls(item, call) for item in value)
    return value


def _is_call(kernel: CKernel) -> bool:
    """A product calling the runtime's helper (not inline loops), not yet a kind's function."""
    return kernel.kind == "matmul" and bool(kernel.fields.get("args")) and kernel.fields["callee"] is None


def _kind_key(kernel: CKernel) -> tuple:
    args = kernel.fields["args"]
    return (bool(kernel.fields["add"]), *(args[k] for k in _SHAPE))


def _names(prefix: str, keys: list[tuple]) -> dict[tuple, str]:
    """Each kind's name from its own sizes and strides, not numbered in the
    order first called (a product of another shape in one layer renumbered
    the kinds of every later layer): <prefix>_product_<rows>_<inner>_<cols>,
    then _at / _bt where a or b is read transposed and _add; kinds that
    still tie (other strides) each with 4 hex digits of their key."""
    bases = {}
    for key in keys:
        add, shape = key[0], dict(zip(_SHAPE, key[1:]))
        sizes = "_".join(re.sub(r"\W", "", str(shape[k])) for k in (0, 2, 1))
        flags = ("_at" if shape[5] != "1" else "") + ("_bt" if shape[8] != "1" else "") + ("_add" if add else "")
        bases[key] = f"{prefix}_product_{sizes}{flags}"
    tied = Counter(bases.values())
    return {key: base if tied[base] == 1 else f"{base}_{hashlib.sha1(repr(key).encode()).hexdigest()[:4]}"
            for key, base in bases.items()}


def _constant(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _kind(name: str, key: tuple, calls: int, real: str) -> ProductKind:
    add, shape = key[0], dict(zip(_SHAPE, key[1:]))
    sizes: list[str] = []
    args = []
    for k in range(10):
        if k in _ARRAYS:
            args.append(_ARRAYS[k])
        elif _constant(shape[k]):
            args.append(shape[k])
        else:
            sizes.append(f"s{len(sizes)}")
            args.append(sizes[-1])
    params = (*(f"int64_t {size}" for size in sizes), f"const {real} *a", f"const {real} *b", f"{real} *c")
    return ProductKind(name, add, params, tuple(args), calls)


def _calling(kernel: CKernel, kind: ProductKind) -> CKernel:
    """The kernel calling its kind's function: the non-constant sizes, then the arrays."""
    args = kernel.fields["args"]
    passed = [args[k] for k in _SHAPE if not _constant(args[k])] + [args[k] for k in _ARRAYS]
    return replace(kernel, fields={**kernel.fields, "callee": kind.name, "args": tuple(passed)})


__all__ = ["MAX_INLINED_PRODUCTS", "ProductKind", "share_products"]
