"""The user-facing declaration of a scan: `scan`, `final_state` and the
SymPy objects they return (ScanSpec, ScanOutput, ScanFinal); LoopSpec and
LoopFinal, which the fixed point's share."""

from __future__ import annotations

from typing import Any, TypeVar

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.declare.standing import Standing
from symbackprop.errors import ModelError


class _Quotient(sp.Function):
    """A quotient of positive integers n, k: n itself for k = 1, `_exact`
    for two integers, else left as it stands."""

    is_integer = True
    is_positive = True

    @classmethod
    def eval(cls, n: sp.Expr, k: sp.Expr) -> sp.Expr | None:
        if k == 1:
            return n
        if n.is_Integer and k.is_Integer:
            return cls._exact(int(n), int(k))
        return None

    @staticmethod
    def _exact(n: int, k: int) -> sp.Expr:
        raise NotImplementedError


class ceildiv(_Quotient):
    """ceil(n / k) for positive integers; C integer arithmetic in the C."""

    @staticmethod
    def _exact(n: int, k: int) -> sp.Expr:
        return sp.Integer(-(-n // k))

    def _ccode(self, printer: Any, **kwargs: Any) -> str:
        n, k = self.args
        return f"(({printer._print(n)} - 1)/{int(k)} + 1)"  # n >= 1; n + k - 1 could overflow


class blocks(_Quotient):
    """n / k for positive integers, k dividing n: the steps of a batched
    scan (n rows, k a step); C integer division in the C."""

    @staticmethod
    def _exact(n: int, k: int) -> sp.Expr:
        if n % k:
            raise ModelError(f"scan: {n} rows do not make whole steps of {k} rows (batch={k})")
        return sp.Integer(n // k)

    def _ccode(self, printer: Any, **kwargs: Any) -> str:
        n, k = self.args
        return f"(({printer._print(n)})/({printer._print(k)}))"


def as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def expr_shape(expr: Any) -> tuple[sp.Expr, sp.Expr]:
    if isinstance(expr, (sp.MatrixExpr, sp.MatrixBase)):
        return (sp.sympify(expr.shape[0]), sp.sympify(expr.shape[1]))
    return (sp.Integer(1), sp.Integer(1))


def entries(shape: tuple) -> sp.Expr:
    """The number of entries of a matrix of `shape`."""
    return sp.sympify(shape[0]) * shape[1]


def is_vector(shape: tuple) -> bool:
    return shape[0] == 1 or shape[1] == 1


def same_layout(a: tuple, b: tuple) -> bool:
    """Equal shapes, or vectors of one length (a row and a column)."""
    return tuple(a) == tuple(b) or (is_vector(a) and is_vector(b) and entries(a) == entries(b))


def symbol_name(symbol: Any) -> str:
    return str(symbol.name)


class LoopSpec(Standing, sp.Basic):
    """What a loop was given (its step, states, inits), as one SymPy
    object: a declaration, left as it stands by doit (a doit through the
    step would fold a Piecewise under a condition, an inner loop's step,
    out into the outer step: its own symbols leak, and the rebuild costs
    minutes)."""


class ScanSpec(LoopSpec):
    """What `scan` was given, as one SymPy object (hashed with the model)."""

    def __new__(cls, states, inputs, next_states, outputs, inits, sequences, every, batch=1,
                reverse=False) -> ScanSpec:
        args = (sp.Tuple(*states), sp.Tuple(*inputs), sp.Tuple(*next_states), sp.Tuple(*outputs),
                sp.Tuple(*inits), sp.Tuple(*sequences), sp.Integer(every), sp.sympify(batch))
        # reverse only where set: a forward scan hashes (and names its C) as before
        return sp.Basic.__new__(cls, *args, sp.true) if reverse else sp.Basic.__new__(cls, *args)

    states = property(lambda self: tuple(self.args[0]))
    inputs = property(lambda self: tuple(self.args[1]))
    next_states = property(lambda self: tuple(self.args[2]))
    outputs = property(lambda self: tuple(self.args[3]))
    inits = property(lambda self: tuple(self.args[4]))
    sequences = property(lambda self: tuple(self.args[5]))
    every = property(lambda self: int(self.args[6]))
    batch = property(lambda self: self.args[7])  # rows a step (1: one row, a vector)
    reverse = property(lambda self: len(self.args) > 8)  # steps from the last rows to the first

    @property
    def rows(self) -> sp.Expr:
        """The rows of each sequence (T steps of `batch` rows)."""
        return expr_shape(self.sequences[0])[0]

    @property
    def length(self) -> sp.Expr:
        """T, the number of steps."""
        return blocks(self.rows, self.batch)

    def _sympystr(self, printer: Any) -> str:
        seqs = ", ".join(printer._print(s) for s in self.sequences)
        states = ", ".join(printer._print(s) for s in self.states)
        return f"scan[{states}]({seqs}{', reversed' if self.reverse else ''})"


class ScanOutput(Standing, sp.MatrixExpr):
    """The outputs of a scan: row t is the step's output at step t (T x O)."""

    def __new__(cls, spec: ScanSpec, index: int) -> ScanOutput:
        return sp.Basic.__new__(cls, spec, sp.Integer(index))

    spec = property(lambda self: self.args[0])
    index = property(lambda self: int(self.args[1]))

    @property
    def shape(self) -> tuple:
        out = expr_shape(self.spec.outputs[self.index])
        if self.spec.batch != 1:  # step t's B x O block is rows tB .. tB+B-1
            return (self.spec.rows, out[1])
        return (self.spec.rows, entries(out))

    def _entry(self, i: Any, j: Any, **kwargs: Any) -> sp.Expr:
        return MatrixElement(self, i, j)

    @property
    def final_state(self) -> Any:
        """The state after the last step (a tuple for a tuple of states)."""
        return final_state(self)

    def _sympystr(self, printer: Any) -> str:
        return f"{printer._print(self.spec)}.outputs[{self.index}]"


_Final = TypeVar("_Final", bound="LoopFinal")


class LoopFinal(Standing, sp.MatrixExpr):
    """The state `index` where a loop (`spec`) stopped, shaped like the state."""

    def __new__(cls: type[_Final], spec: LoopSpec, index: int) -> _Final:
        return sp.Basic.__new__(cls, spec, sp.Integer(index))

    spec = property(lambda self: self.args[0])
    index = property(lambda self: int(self.args[1]))

    @property
    def shape(self) -> tuple:
        return expr_shape(self.spec.states[self.index])

    def _entry(self, i: Any, j: Any, **kwargs: Any) -> sp.Expr:
        return MatrixElement(self, i, j)

    def _sympystr(self, printer: Any) -> str:
        return f"{printer._print(self.spec)}.final[{self.index}]"


class ScanFinal(LoopFinal):
    """The state after the last step of a scan (shaped like the state)."""


def scan(step_state: Any, step_output: Any, state: Any, inp: Any, init: Any, sequence: Any,
         checkpoint_every: int | None = None, batch: Any = 1, reverse: bool = False) -> Any:
    """A recurrence over the rows of `sequence`, run as a loop in the C.

    With `batch=B`, each step reads B rows (the t-th step of B sequences,
    stored time-major: step t is rows tB .. tB+B-1 of a (T*B) x D
    sequence), `inp` is B x D, the state usually B x H and each output
    B x O (rows tB .. tB+B-1 of the (T*B) x O result): the step is matrix
    code, one product per gate for the whole batch.

    Args:
        step_state: the next state, a SymPy expression of `state`, `inp` and
            the model's inputs and params; a tuple with a tuple of states.
        step_output: the step's output (a vector, or a tuple of them), or
            None for a scan used through its final state only.
        state: MatrixSymbol (or Symbol) standing for the state; a tuple for
            several (an LSTM's h and c). Not an input or param of the model.
        inp: MatrixSymbol (or Symbol) standing for one row of `sequence`, a
            vector of D entries; a tuple, with a tuple of sequences.
        init: the state before the first step: an expression of the
            model's inputs and params shaped like `state` (a tuple likewise).
        sequence: a T x D matrix expression (usually an input); T may be a
            symbolic dimension, bound at call time.
        checkpoint_every: keep every k-th state for the backward pass and
            recompute the others (memory ~ T/k + k states instead of T);
            None keeps every state.
        batch: the rows a step reads: 1 (a row, the default) or a positive
            integer or symbolic dimension B (bound at call time by an input
            or param that has it, e.g. the initial state). The sequences'
            rows must be a multiple of B.
        reverse: run the steps from the last rows to the first (the
            backward direction of a bidirectional RNN): the first step
            reads step T-1's rows and the output of the step that read
            step t's rows is step t's rows of the outputs, so the outputs
            line up with the sequence; the final state is the state after
            reading step 0.

    Returns:
        The outputs as a (T x O) ScanOutput (a SymPy matrix expression), a
        tuple of them for a tuple of outputs, or, when step_output is None,
        the final state (see `final_state`).

    Raises:
        ModelError: mismatched lengths or shapes, a state or input that is
            not a symbol, or a bad checkpoint interval. Undeclared symbols
            in the step are reported when the model is compiled.
    """
    states, next_states, inits = as_tuple(state), as_tuple(step_state), as_tuple(init)
    inputs, sequences = as_tuple(inp), as_tuple(sequence)
    outputs = () if step_output is None else as_tuple(step_output)
    every = 1 if checkpoint_every is None else checkpoint_every
    if isinstance(every, bool) or not isinstance(every, (int, sp.Integer)) or int(every) < 1:
        raise ModelError(f"scan: checkpoint_every must be a positive integer or None; got {checkpoint_every!r}")
    batch = _checked_batch(batch)
    if not isinstance(reverse, bool):
        raise ModelError(f"scan: reverse must be True or False; got {reverse!r}")
    if reverse and every > 1:  # a segment recomputes forward in time from its checkpoint
        raise ModelError("scan: checkpoint_every is not supported with reverse=True; leave it None")
    _check_declaration(states, inputs, next_states, inits, sequences, outputs, batch)
    spec = ScanSpec(states, inputs, next_states, outputs, inits, sequences, int(every), batch, reverse)
    if not outputs:
        return final_state(ScanFinal(spec, 0))
    results = tuple(ScanOutput(spec, k) for k in range(len(outputs)))
    return results if isinstance(step_output, (tuple, list)) else results[0]


def _checked_batch(batch: Any) -> sp.Expr:
    value = sp.sympify(batch) if not isinstance(batch, bool) else None
    if value is None or not (value.is_Symbol or value.is_Integer) or value.is_positive is not True:
        raise ModelError(f"scan: batch must be a positive integer or a positive integer Symbol (a dimension); "
                         f"got {batch!r}")
    return value


def _check_declaration(states: tuple, inputs: tuple, next_states: tuple, inits: tuple, sequences: tuple,
                       outputs: tuple, batch: sp.Expr) -> None:
    """The arguments of `scan` agree in number, kind and shape (else a ModelError)."""
    if not states:
        raise ModelError("scan needs at least one state")
    if not sequences:
        raise ModelError("scan needs at least one sequence (its rows set the number of steps)")
    for what, symbols in (("state", states), ("inp", inputs)):
        for symbol in symbols:
            if not isinstance(symbol, (sp.MatrixSymbol, sp.Symbol)):
                raise ModelError(f"scan: {what} must be MatrixSymbols or Symbols standing for it; got {symbol!r}")
    names = [symbol_name(s) for s in states + inputs]
    for name in names:
        if names.count(name) > 1:
            raise ModelError(f"scan: the name {name!r} is given to two of its states and inputs")
    if len(next_states) != len(states) or len(inits) != len(states):
        raise ModelError(
            f"scan: {len(states)} states need as many step_state expressions and inits; "
            f"got {len(next_states)} and {len(inits)}"
        )
    if len(sequences) != len(inputs):
        raise ModelError(f"scan: {len(inputs)} inputs need as many sequences; got {len(sequences)}")
    _check_shapes(states, inputs, next_states, inits, sequences, outputs, batch)


def _check_shapes(states: tuple, inputs: tuple, next_states: tuple, inits: tuple, sequences: tuple,
                  outputs: tuple, batch: sp.Expr) -> None:
    for symbol, nxt, start in zip(states, next_states, inits):
        want = expr_shape(symbol)
        if expr_shape(nxt) != want:
            raise ModelError(
                f"scan: the state {symbol} has shape {want} but its step_state has shape {expr_shape(nxt)}: {nxt}"
            )
        if not same_layout(expr_shape(start), want):
            raise ModelError(f"scan: the state {symbol} has shape {want} but its init has shape {expr_shape(start)}")
    length = expr_shape(sequences[0])[0]
    for symbol, seq in zip(inputs, sequences):
        rows, cols = expr_shape(seq)
        if batch != 1:
            if expr_shape(symbol) != (batch, cols):
                raise ModelError(f"scan: the input {symbol} (shape {expr_shape(symbol)}) stands for one step of the "
                                 f"sequence {seq} (shape {(rows, cols)}), batch={batch} rows: it must be "
                                 f"{batch} x {cols}")
        elif not is_vector(expr_shape(symbol)) or entries(expr_shape(symbol)) != cols:
            raise ModelError(
                f"scan: the input {symbol} (shape {expr_shape(symbol)}) stands for one row of the sequence {seq} "
                f"(shape {(rows, cols)}): it must be a vector of {cols} entries"
            )
        if rows != length:
            raise ModelError(f"scan: the sequences have different numbers of rows ({length} and {rows})")
    for out in outputs:
        if batch != 1:
            if expr_shape(out)[0] != batch:
                raise ModelError(f"scan: with batch={batch}, a step output has {batch} rows (one a sequence); "
                                 f"got shape {expr_shape(out)}")
        elif not is_vector(expr_shape(out)):
            raise ModelError(f"scan: a step output must be a vector (one row of the outputs); got shape {expr_shape(out)}")


def final_state(result: Any) -> Any:
    """The state after the last step of a scan.

    Args:
        result: what `scan` returned (one of its outputs, or a final state).

    Returns:
        A ScanFinal matrix expression shaped like the state; a tuple of them
        for a tuple of states.

    Raises:
        ModelError: `result` does not come from `scan`.
    """
    spec = getattr(result, "spec", None)
    if not isinstance(result, (ScanOutput, ScanFinal)) or not isinstance(spec, ScanSpec):
        raise ModelError(f"final_state needs the result of symbackprop.scan; got {result!r}")
    finals = tuple(ScanFinal(spec, k) for k in range(len(spec.states)))
    return finals if len(finals) > 1 else finals[0]
