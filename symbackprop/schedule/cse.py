"""One CSE over a straight-line program (a fused loop's large shared
values, a per-example map's body) and its outputs."""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp

from symbackprop.schedule.dagcse import dag_cse

# x**n of a symbol for |n| up to this is printed as a product: without
# -ffast-math a C compiler keeps pow() a library call (pow(x, 2) excepted).
MAX_PRODUCT_POWER = 8


def inline(expr: sp.Expr, lets: dict[sp.Symbol, sp.Expr]) -> sp.Expr:
    """`expr` with the local values of a (small) program substituted back."""
    while expr.free_symbols & lets.keys():
        expr = expr.xreplace(lets)
    return expr


def cse_program(program: list[tuple[sp.Symbol, sp.Expr]], outputs: list[sp.Expr]) -> tuple[list, list]:
    """One CSE over a straight-line program and its outputs: the common
    subexpressions and the program's own values (those the outputs read)
    as one list of temporaries, each after what it uses, named x0, x1, ...
    in order; integer powers of a base share their multiplications."""
    return share_powers(*dag_cse(outputs, dict(program)))


def share_powers(temps: Sequence[tuple[sp.Symbol, sp.Expr]], outputs: Sequence[sp.Expr]) -> tuple[list, list]:
    """A CSE'd program (temporaries named x0, x1, ... in order, each after
    what it uses) whose integer powers of a common base share their
    multiplications: the exponents a base is raised to (x**2, x**3, ...,
    x**-k too) come from one chain of temporaries, each one multiplication
    of two before it (x2 = x*x, x3 = x2*x, ..., x12 = x6*x6: see
    _power_chain), placed just before its first use; x**-k is 1/x**k. A
    base is left as it is (x**2 prints as x*x) unless the chain saves a
    multiplication or a call of pow(). Temporaries are renumbered x0, x1,
    ... in their new order."""
    exprs = [e for _, e in temps] + list(outputs)
    found: dict[sp.Expr, dict[int, int]] = {}  # base -> |exponent| -> occurrences as printed
    for expr in exprs:
        for node in sp.preorder_traversal(expr):
            if _is_integer_power(node):
                counts = found.setdefault(node.base, {})
                counts[abs(int(node.exp))] = counts.get(abs(int(node.exp)), 0) + 1
    chains = {base: _power_chain(sorted(counts)) for base, counts in found.items() if _worth_a_chain(base, counts)}
    if not chains:
        return list(temps), list(outputs)
    new: dict[sp.Symbol, sp.Expr] = {}  # the chains' temporaries, in order of creation
    powers: dict[sp.Basic, sp.Expr] = {}
    bases = {}
    for number, (base, steps) in enumerate(chains.items()):
        power = {1: base}
        if not base.is_Symbol:  # a compound base: named once (its own powers rewritten below)
            power[1] = sp.Symbol(f"_pow{number}_1", real=True)
            bases[power[1]] = new[power[1]] = base
        for k, (a, b) in steps.items():
            power[k] = sp.Symbol(f"_pow{number}_{k}", real=True)
            new[power[k]] = power[a] * power[b]  # x*x is Pow(x, 2): printed as a product
        for k in found[base]:
            powers[sp.Pow(base, k)] = power[k]
            powers[sp.Pow(base, -k)] = 1 / power[k]
    new.update({sym: base.xreplace(powers) for sym, base in bases.items()})
    order = {sym: n for n, sym in enumerate(new)}
    program: list[tuple[sp.Symbol, sp.Expr]] = []
    placed: set[sp.Symbol] = set()

    def place_uses(expr: sp.Expr) -> None:  # the chain temporaries `expr` uses, each after what it uses
        for sym in sorted(expr.free_symbols & new.keys() - placed, key=order.__getitem__):
            if sym not in placed:
                place_uses(new[sym])
                placed.add(sym)
                program.append((sym, new[sym]))

    for sym, expr in temps:
        rewritten = expr.xreplace(powers)
        place_uses(rewritten)
        if rewritten in new:  # a temporary that was a power: the chain's is it
            powers[sym] = rewritten
        else:
            program.append((sym, rewritten))
    reduced = [e.xreplace(powers) for e in outputs]
    for expr in reduced:
        place_uses(expr)
    names = {sym: sp.Symbol(f"x{k}", real=True) for k, (sym, _) in enumerate(program)}
    return [(names[sym], e.xreplace(names)) for sym, e in program], [e.xreplace(names) for e in reduced]


def _is_integer_power(node: sp.Basic) -> bool:
    return (isinstance(node, sp.Pow) and node.exp.is_Integer and abs(int(node.exp)) >= 2
            and not node.base.is_number)


def _worth_a_chain(base: sp.Expr, counts: dict[int, int]) -> bool:
    """Whether one chain of temporaries for `base` beats printing each of
    its powers on its own: as a product of the symbol (|k| - 1
    multiplications), or as pow() (any other base, |k| above
    MAX_PRODUCT_POWER; C compilers make pow(x, 2) a multiplication)."""
    if any(k > (MAX_PRODUCT_POWER if base.is_Symbol else 2) for k in counts):
        return True
    return len(_power_chain(sorted(counts))) < sum(n * (k - 1) for k, n in counts.items())


def _power_chain(exponents: list[int]) -> dict[int, tuple[int, int]]:
    """An addition chain through `exponents` (each at least 2): exponent
    -> the two earlier ones (1 the base) whose product it is, in order.
    An exponent is a sum of two already there: up to MAX_PRODUCT_POWER the
    most uneven (x5 = x4*x, what GCC makes of x*x*x*x*x: measured, the
    even split was 5% slower on W7's x**2..x**5), above it the most even
    (x40 = x20*x20: a short dependency path; on a degree-40 polynomial's
    gradient 20% faster than x40 = x39*x); else a sum of one there and one
    a sum of two there (x9 = x6*x3 after x6 = x3*x3); else it is built
    from its halves (square and multiply: x**64 takes 6 steps)."""
    steps: dict[int, tuple[int, int]] = {}

    def pair(k: int) -> tuple[int, int] | None:
        halves = [b for b in (1, *steps) if 2 * b <= k and (k - b == 1 or k - b in steps)]
        if not halves:
            return None
        b = min(halves) if k <= MAX_PRODUCT_POWER else max(halves)
        return (k - b, b)

    def build(k: int) -> None:
        if k == 1 or k in steps:
            return
        if (found := pair(k)) is None:
            for a in sorted((1, *steps), reverse=True):
                if a < k - 1 and (rest := pair(k - a)) is not None:
                    steps[k - a] = rest
                    found = (max(a, k - a), min(a, k - a))
                    break
            else:
                build(k - k // 2)
                build(k // 2)
                found = (k - k // 2, k // 2)
        steps[k] = found

    for k in exponents:
        build(k)
    return steps
