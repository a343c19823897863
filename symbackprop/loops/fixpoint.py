"""The user-facing declaration of a loop that stops on a condition:
`fixed_point`, `iterations` and the SymPy objects they return
(FixedPointSpec, FixedPointFinal, FixedPointCount).

    x_star = symbackprop.fixed_point(step, state, init, tol=..., max_iter=..., diff="implicit")

runs state <- step from init until the largest change of an entry of the
state is <= tol (or NaN), or max_iter steps have run. It lowers to the
scan's machinery (a scan without sequences, whose forward loop may stop
early: loops/fixpoint_lower.py); its derivative is the implicit function
theorem's (loops/implicit.py) or the scan's backward pass over the
iterations that ran ("unrolled")."""

from __future__ import annotations

import math
from typing import Any

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.declare.standing import Standing
from symbackprop.errors import ModelError
from symbackprop.loops.declare import LoopFinal, LoopSpec, as_tuple, expr_shape, same_layout, symbol_name

MODES = ("implicit", "unrolled")  # how a fixed point is differentiated (the one list of them)


class FixedPointSpec(LoopSpec):
    """What `fixed_point` was given, as one SymPy object (hashed with the model)."""

    def __new__(cls, states, next_states, inits, tol: Any, max_iter: Any, mode: Any) -> FixedPointSpec:
        # mode: a name of MODES, or its index (as SymPy rebuilds the object from its args)
        index = MODES.index(mode) if isinstance(mode, str) else int(mode)
        return sp.Basic.__new__(cls, sp.Tuple(*states), sp.Tuple(*next_states), sp.Tuple(*inits),
                                sp.Float(tol, precision=53), sp.Integer(max_iter), sp.Integer(index))

    states = property(lambda self: tuple(self.args[0]))
    next_states = property(lambda self: tuple(self.args[1]))
    inits = property(lambda self: tuple(self.args[2]))
    tol = property(lambda self: float(self.args[3]))
    max_iter = property(lambda self: int(self.args[4]))
    mode = property(lambda self: MODES[int(self.args[5])])

    def _sympystr(self, printer: Any) -> str:
        states = ", ".join(printer._print(s) for s in self.states)
        return f"fixed_point[{states}](tol={self.tol!r}, max_iter={self.max_iter}, diff={self.mode})"


class FixedPointFinal(LoopFinal):
    """The state where a fixed-point loop stopped (shaped like the state)."""


class FixedPointCount(Standing, sp.MatrixExpr):
    """The number of steps a fixed-point loop ran (1 x 1; its derivative is zero)."""

    def __new__(cls, spec: FixedPointSpec) -> FixedPointCount:
        return sp.Basic.__new__(cls, spec)

    spec = property(lambda self: self.args[0])
    shape = (sp.Integer(1), sp.Integer(1))

    def _entry(self, i: Any, j: Any, **kwargs: Any) -> sp.Expr:
        return MatrixElement(self, i, j)

    def _sympystr(self, printer: Any) -> str:
        return f"{printer._print(self.spec)}.count"


def fixed_point(step: Any, state: Any, init: Any, tol: float = 1e-12, max_iter: int = 100,
                diff: str = "implicit") -> Any:
    """A loop that runs `state <- step` until the state stops changing, in the C.

    From `init`, the loop runs x_{k+1} = step(x_k) and stops after the first
    step whose largest absolute change of an entry, max_i |x_{k+1,i} -
    x_{k,i}| (over all states), is <= tol or NaN, or after max_iter steps;
    it returns the last state computed (NaN entries if the iteration
    produced one).

    Args:
        step: the next state, a SymPy expression of `state` and the model's
            inputs and params; a tuple with a tuple of states.
        state: MatrixSymbol (or Symbol) standing for the state (a row, a
            column or a matrix); a tuple for several. Not an input or param
            of the model.
        init: the state before the first step, an expression of the model's
            inputs and params shaped like `state` (a tuple likewise).
        tol: the stopping tolerance on the largest absolute change (>= 0).
        max_iter: the most steps the loop runs (a positive integer).
        diff: "implicit": the derivative at the fixed point by the implicit
            function theorem (exact when the loop converged and I - d step /
            d state is invertible; its adjoint is solved by the same
            iteration, which converges when the spectral radius of d step /
            d state is < 1); "unrolled": the derivative of the steps that
            ran (exact for the computed function; keeps max_iter states).

    Returns:
        The final state, a FixedPointFinal matrix expression shaped like
        `state` (a tuple of them for a tuple of states); `iterations(x)`
        is the number of steps run.

    Raises:
        ModelError: a bad tol, max_iter or diff, a state that is not a
            symbol, or mismatched shapes. Undeclared symbols in the step
            are reported when the model is compiled.
    """
    states, next_states, inits = as_tuple(state), as_tuple(step), as_tuple(init)
    if diff not in MODES:
        raise ModelError(f"fixed_point: diff must be one of {', '.join(map(repr, MODES))}; got {diff!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, sp.Integer)) or int(max_iter) < 1:
        raise ModelError(f"fixed_point: max_iter must be a positive integer; got {max_iter!r}")
    try:
        tol_value = float(tol)
    except (TypeError, ValueError):
        raise ModelError(f"fixed_point: tol must be a number >= 0; got {tol!r}") from None
    if not math.isfinite(tol_value) or tol_value < 0:
        raise ModelError(f"fixed_point: tol must be a finite number >= 0; got {tol!r}")
    _check_declaration(states, next_states, inits)
    spec = FixedPointSpec(states, next_states, inits, tol_value, int(max_iter), diff)
    finals = tuple(FixedPointFinal(spec, k) for k in range(len(states)))
    return finals if isinstance(state, (tuple, list)) else finals[0]


def _check_declaration(states: tuple, next_states: tuple, inits: tuple) -> None:
    if not states:
        raise ModelError("fixed_point needs at least one state")
    for symbol in states:
        if not isinstance(symbol, (sp.MatrixSymbol, sp.Symbol)):
            raise ModelError(f"fixed_point: state must be MatrixSymbols or Symbols standing for it; got {symbol!r}")
    names = [symbol_name(s) for s in states]
    for name in names:
        if names.count(name) > 1:
            raise ModelError(f"fixed_point: the name {name!r} is given to two of its states")
    if len(next_states) != len(states) or len(inits) != len(states):
        raise ModelError(f"fixed_point: {len(states)} states need as many step expressions and inits; "
                         f"got {len(next_states)} and {len(inits)}")
    for symbol, nxt, start in zip(states, next_states, inits):
        want = expr_shape(symbol)
        if expr_shape(nxt) != want:
            raise ModelError(f"fixed_point: the state {symbol} has shape {want} but its step has shape "
                             f"{expr_shape(nxt)}: {nxt}")
        if not same_layout(expr_shape(start), want):
            raise ModelError(f"fixed_point: the state {symbol} has shape {want} but its init has shape "
                             f"{expr_shape(start)}")


def iterations(result: Any) -> FixedPointCount:
    """The number of steps a fixed-point loop ran, as a 1 x 1 expression.

    Args:
        result: what `fixed_point` returned (a final state, or one of a tuple).

    Returns:
        A FixedPointCount (1 x 1): use it as a model output. Its
        derivative is zero.

    Raises:
        ModelError: `result` does not come from `fixed_point`.
    """
    first = result[0] if isinstance(result, (tuple, list)) and result else result
    if not isinstance(first, FixedPointFinal):
        raise ModelError(f"iterations needs the result of symbackprop.fixed_point; got {result!r}")
    return FixedPointCount(first.spec)
