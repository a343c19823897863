"""One CSE over a straight-line program (a fused loop's large shared
values, a per-example map's body) and its outputs."""

from __future__ import annotations

import sympy as sp


def inline(expr: sp.Expr, lets: dict[sp.Symbol, sp.Expr]) -> sp.Expr:
    """`expr` with the local values of a (small) program substituted back."""
    while expr.free_symbols & lets.keys():
        expr = expr.xreplace(lets)
    return expr


def cse_program(program: list[tuple[sp.Symbol, sp.Expr]], outputs: list[sp.Expr]) -> tuple[list, list]:
    """One CSE over a straight-line program and its outputs: the common
    subexpressions and the program's own values as one list of temporaries,
    each after what it uses, named x0, x1, ... in order."""
    replacements, reduced = sp.cse([e for _, e in program] + outputs, symbols=sp.numbered_symbols("_c", real=True),
                                   order="none")
    definitions = dict(replacements)
    definitions.update({sym: e for (sym, _), e in zip(program, reduced)})
    # copies (x1 = x0) and negations of a value are substituted, not named
    copies = _copies_of(definitions)
    while any(e.free_symbols & copies.keys() for e in copies.values()):  # chains of copies: to their ends
        copies = {sym: e.xreplace(copies) for sym, e in copies.items()}
    definitions = {sym: e.xreplace(copies) for sym, e in definitions.items() if sym not in copies}
    reduced = [e.xreplace(copies) for e in reduced]
    ordered: list[sp.Symbol] = []
    placed: set[sp.Symbol] = set()

    def place(symbol: sp.Symbol) -> None:  # depth first: what it uses comes first
        stack = [(symbol, False)]
        while stack:
            sym, expanded = stack.pop()
            if sym in placed:
                continue
            if expanded:
                placed.add(sym)
                ordered.append(sym)
                continue
            stack.append((sym, True))
            uses = sorted(definitions[sym].free_symbols & definitions.keys(), key=str, reverse=True)
            stack.extend((used, False) for used in uses if used not in placed)

    outputs = reduced[len(program):]
    position = {sym: k for k, (sym, _) in enumerate(program)}
    for expr in outputs:
        for sym in sorted(expr.free_symbols & definitions.keys(), key=lambda s: _definition_order(s, position)):
            place(sym)
    names = {sym: sp.Symbol(f"x{k}", real=True) for k, sym in enumerate(ordered)}
    temps = [(names[sym], definitions[sym].xreplace(names)) for sym in ordered]
    return temps, [e.xreplace(names) for e in outputs]


def _copies_of(definitions: dict[sp.Symbol, sp.Basic]) -> dict[sp.Symbol, sp.Basic]:
    return {sym: e for sym, e in definitions.items() if e.is_Atom or (isinstance(e, sp.Expr) and (-e).is_Atom)}


def _definition_order(symbol: sp.Symbol, position: dict[sp.Symbol, int]) -> tuple:
    """Program values in program order, CSE temporaries after them by number."""
    if symbol in position:
        return (0, position[symbol])
    return (1, int(symbol.name[2:]))
