"""Tensor operations SymPy has no matrix expression for: integer index
inputs, gathers, per-example maps and reductions over an axis.

Each is a SymPy MatrixExpr, so it composes with ordinary SymPy (sums,
products, applyfunc, transposes) and is lowered by ir.py like any other::

    N, C = sp.symbols("N C", integer=True, positive=True)
    cams = sp.MatrixSymbol("cams", C, 9)        # a parameter per camera
    obs = sp.MatrixSymbol("obs", N, 2)          # an observation per row
    cam = symbackprop.Index("cam", N)           # int64: observation i's camera
    c = sp.Matrix(sp.symbols("c0:9"))           # one camera, as scalars
    u = sp.Matrix(sp.symbols("u0:2"))
    r = map_examples(project(c) - u, {c: gather(cams, cam), u: obs})   # N x 2

The body of a map is a function of one example, written with scalar
symbols; it is compiled as one C loop over the examples around its
CSE'd body, and its derivative as one more, whose size grows with the
body's operations, never with N.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sympy as sp
from sympy.core.symbol import Str

from symbackprop.base.registry import reductions
from symbackprop.base.scalar import partials
from symbackprop.declare.derivatives import in_body
from symbackprop.declare.standing import Standing
from symbackprop.errors import ModelError
from symbackprop.messages import short


class Index(sp.MatrixSymbol):
    """An input of integer row numbers (an int64 column of `rows` entries),
    for `gather`. Passed as a 1-D or (rows, 1) array of integers; every
    entry must lie within the rows of the arrays it gathers from (checked
    before each call, and again by the C).
    """

    is_index = True

    def __new__(cls, name: str, rows: sp.Expr, cols: sp.Expr = 1) -> Index:
        """Build the Index.

        Args:
            name: the argument's name.
            rows: how many row numbers (a dimension Symbol or an int).
            cols: always 1 (a parameter only so that SymPy can rebuild it).

        Raises:
            ModelError: cols is not 1.
        """
        if cols != 1:  # cols is a parameter only so that SymPy can rebuild it from its args
            raise ModelError(f"an Index is one column of row numbers; got {cols} columns for {name}")
        return super().__new__(cls, name, rows, 1)


class ReadAtIndex(Standing, sp.MatrixExpr):
    """A matrix expression reading `array` where an Index says (Gather,
    declare.pick.Pick): the arguments' checks, `array`, `index` and
    entries, one place for both. A subclass names itself in messages
    (`op`), says what the index's numbers choose (`chooses`) and gives
    its shape."""

    op = "read"
    chooses = "entries"

    def __new__(cls, array: sp.MatrixExpr, index: Index) -> ReadAtIndex:
        """Build the expression.

        Args:
            array: a matrix expression.
            index: an Index input.

        Raises:
            ModelError: `index` is not an Index, or `array` is not a matrix.
        """
        if not isinstance(index, Index):
            raise ModelError(f"{cls.op} needs an Index (integer input) to choose {cls.chooses} by; got {short(index)}")
        if not isinstance(array, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"{cls.op} takes {cls.chooses} of a matrix; got {short(array)}")
        return super().__new__(cls, sp.sympify(array), index)

    @property
    def array(self) -> sp.MatrixExpr:
        """The matrix read."""
        return self.args[0]

    @property
    def index(self) -> Index:
        """The row or column numbers, one a row of the result."""
        return self.args[1]

    def _entry(self, i, j, **kwargs):
        return sp.matrices.expressions.matexpr.MatrixElement(self, i, j)


class Gather(ReadAtIndex):
    """Rows of `array` chosen by `index`: row i is array[index[i], :]."""

    op = "gather"
    chooses = "rows"

    @property
    def shape(self) -> tuple:
        """(rows of the index, columns of the array)."""
        return (self.index.shape[0], self.array.shape[1])


def gather(array: sp.MatrixExpr, index: Index) -> Gather:
    """The rows of `array` at the row numbers in `index` (index.rows x
    array.cols). Its gradient adds each row's adjoint into the row it came
    from (a scatter-add), so a row gathered twice gets both contributions.

    Args:
        array: a matrix expression (the rows to choose among).
        index: an Index input, one row number per result row.

    Returns:
        A (index rows x array cols) matrix expression.

    Raises:
        ModelError: `index` is not an Index, or `array` is not a matrix.
    """
    return Gather(array, index)


def key_symbols(key: sp.Basic) -> tuple[sp.Symbol, ...]:
    """The scalar symbols of a binding's key, row-major.

    Args:
        key: a Symbol, or a matrix (or sequence) of Symbols.

    Raises:
        ModelError: `key` is not made of Symbols.
    """
    if isinstance(key, sp.Symbol):
        return (key,)
    if isinstance(key, (sp.MatrixBase, tuple, list, sp.Tuple)):
        symbols = tuple(key)
        if all(isinstance(s, sp.Symbol) for s in symbols):
            return symbols
    raise ModelError(f"a map binds Symbols or matrices of Symbols to rows; got {key!r}")


class ExampleMap(Standing, sp.MatrixExpr):
    """`body`, a function of one example, applied to every example.

    Use `map_examples` to build one; it checks the declaration.
    """

    def __new__(cls, body: sp.ImmutableMatrix, keys: sp.Tuple, sources: sp.Tuple) -> ExampleMap:
        """Build the ExampleMap.

        Args:
            body: a column of scalar expressions.
            keys: a Tuple of Tuples of Symbols, one per binding.
            sources: a Tuple of matrix expressions (or Gathers), one per binding.
        """
        return super().__new__(cls, body, keys, sources)

    @property
    def body(self) -> sp.ImmutableMatrix:
        """The per-example values, a column."""
        return self.args[0]

    @property
    def bindings(self) -> list[tuple[tuple[sp.Symbol, ...], sp.Basic]]:
        """(symbols, source) pairs in declaration order."""
        return [(tuple(key), source) for key, source in zip(self.args[1], self.args[2])]

    @property
    def loops(self) -> tuple:
        """The lengths looped over: the rows of the sources (the index's rows
        for a gather), distinct, in order of appearance; sources of one row
        are the same for every example."""
        loops: list = []
        for _, source in self.bindings:
            rows = source.shape[0]
            if rows != 1 and rows not in loops:
                loops.append(rows)
        return tuple(loops)

    @property
    def shape(self) -> tuple:
        """(examples, outputs), or (N, K) for a map over pairs."""
        loops = self.loops
        if len(loops) == 2:
            return (loops[0], loops[1])
        return (loops[0], len(self.body))

    def _entry(self, i, j, **kwargs):
        return sp.matrices.expressions.matexpr.MatrixElement(self, i, j)

    def jacobian(self, *wrt: sp.Basic) -> ExampleMap:
        """Per-example Jacobians of the body with respect to the symbols of
        one or more bindings' keys (their columns in the order given): row
        i holds example i's (outputs x inputs) Jacobian, row-major, derived
        symbolically and emitted as one CSE'd loop.

        Args:
            *wrt: keys of the map's bindings (Symbols, tuples or Matrices of them).

        Returns:
            An ExampleMap with outputs x inputs values per example.

        Raises:
            ModelError: a `wrt` is not the key of one of the map's bindings.
        """
        keys = [key for key, _ in self.bindings]
        symbols: list[sp.Symbol] = []
        for key in wrt:
            if key_symbols(key) not in keys:
                raise ModelError(f"{key} is not a key bound by this map")
            symbols += key_symbols(key)
        # reverse mode over each output's DAG: sp.diff by each symbol walked it as a tree
        # (bundle adjustment's projection by its 15 inputs: most of 4 s of declaring the model)
        rows = [d for output in self.body for d in partials(output, symbols)]
        return ExampleMap(sp.ImmutableMatrix(rows), self.args[1], self.args[2])


def map_examples(body: sp.Basic, bindings: Mapping[Any, sp.Basic] | Iterable[tuple[Any, sp.Basic]]) -> ExampleMap:
    """Apply `body`, written for one example, to every example.

    Args:
        body: a scalar SymPy expression, or a column/row Matrix of them,
            in the scalar symbols of `bindings`' keys (and of the model's
            scalar inputs and params, the same for every example).
        bindings: key -> source, as a dict or as (key, source) pairs (a
            mutable Matrix is not hashable: pass pairs, or a tuple of its
            symbols). A key is a Symbol, a tuple of Symbols or a Matrix of
            Symbols (its entries taken row-major); the source gives one row per
            example with as many columns as the key has symbols: a matrix
            expression with a row per example, `gather(array, index)`, or a
            1-row matrix that every example shares.

    Returns:
        With one length looped over (the sources' rows), an (examples x
        outputs) matrix: row i is the body at example i. With two lengths
        (sources of N rows and of K rows: every pair), an N x K matrix of
        the scalar body at each pair (i, k).

    Raises:
        ModelError: a key is not made of Symbols, a source's width differs
            from its key's, a symbol is bound twice, no source has a row per
            example, more than two lengths are looped over, or a body over
            two lengths is not scalar.
    """
    if isinstance(body, (sp.MatrixBase, sp.MatrixExpr)):
        if isinstance(body, sp.MatrixExpr) and not isinstance(body, sp.MatrixBase):
            body = body.as_explicit()
        rows, cols = body.shape
        if rows != 1 and cols != 1:
            raise ModelError(f"a map's body must be a scalar or a vector; got shape {body.shape}")
        entries = list(body)
    else:
        entries = [sp.sympify(body)]
    keys, sources, seen = [], [], set()
    pairs = bindings.items() if isinstance(bindings, Mapping) else bindings
    for key, source in pairs:
        symbols = key_symbols(key)
        for s in symbols:
            if s in seen:
                raise ModelError(f"{s} is bound twice in a map")
            seen.add(s)
        source = sp.sympify(source)
        if not isinstance(source, (sp.MatrixExpr, sp.MatrixBase)):
            source = sp.ImmutableMatrix([[source]])
        if source.shape[1] != len(symbols):
            raise ModelError(f"{key} has {len(symbols)} symbols but its source {source} has {source.shape[1]} columns")
        keys.append(sp.Tuple(*symbols))
        sources.append(source)
    entries = in_body(entries, {s for key in keys for s in key})  # grad and jvp by one example's symbols
    result = ExampleMap(sp.ImmutableMatrix(entries), sp.Tuple(*keys), sp.Tuple(*sources))
    loops = result.loops
    if not loops:
        raise ModelError("a map needs a source with a row per example (none has more than one row)")
    if len(loops) > 2:
        raise ModelError(f"a map loops over at most two lengths; its sources have rows {list(loops)}")
    if len(loops) == 2 and len(entries) != 1:
        raise ModelError(f"a map over every pair of {loops[0]} x {loops[1]} rows needs a scalar body")
    return result


class Reduce(Standing, sp.MatrixExpr):
    """sum, mean, prod, max, min or logsumexp of a matrix over an axis: 0
    down the rows (1 x cols), 1 along each row (rows x 1). See `reduce`.
    """

    @staticmethod
    def ops() -> tuple[str, ...]:
        """The reductions' names: the registered ones (symbackprop.ops.reduce) and mean."""
        return (*reductions(), "mean")

    def __new__(cls, op: str, x: sp.MatrixExpr, axis: int) -> Reduce:
        """Build the Reduce.

        Args:
            op: one of ops().
            x: a matrix expression.
            axis: 0 or 1.

        Raises:
            ModelError: an unknown op or axis, or x is not a matrix.
        """
        op = op.name if isinstance(op, Str) else op
        if op not in cls.ops():
            raise ModelError(f"unknown reduction {op!r}; one of {cls.ops()}")
        if axis not in (0, 1):
            raise ModelError(f"reduce over axis 0 (down the rows) or 1 (along each row); got {axis!r}")
        if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"{op} reduces a matrix; got {x!r}")
        return super().__new__(cls, Str(op), sp.sympify(x), sp.Integer(axis))

    @property
    def op(self) -> str:
        """The reduction's name."""
        return self.args[0].name

    @property
    def arg(self) -> sp.MatrixExpr:
        """The matrix reduced."""
        return self.args[1]

    @property
    def axis(self) -> int:
        """0: down the rows; 1: along each row."""
        return int(self.args[2])

    @property
    def shape(self) -> tuple:
        """(1, cols) for axis 0, (rows, 1) for axis 1."""
        return reduced_shape(self.arg.shape, self.axis)

    def _entry(self, i, j, **kwargs):
        return sp.matrices.expressions.matexpr.MatrixElement(self, i, j)


def reduced_shape(shape: tuple, axis: int) -> tuple:
    """The shape of a reduction's result: the one rule for the expression
    (Reduce) and the IR nodes.

    Args:
        shape: the reduced matrix's (rows, cols).
        axis: 0 (down the rows) or 1 (along each row).

    Returns:
        (1, cols) for axis 0, (rows, 1) for axis 1.
    """
    rows, cols = shape
    return (1, cols) if axis == 0 else (rows, 1)


def reduce(op: str, x: sp.MatrixExpr, axis: int | None = None) -> sp.MatrixExpr:
    """`op` ("sum", "mean", "prod", "max", "min", "logsumexp") of x over
    `axis` (0: down the rows, 1: along each row, None: every entry, giving 1 x 1).

    max and min pass the gradient to the extreme entry, split evenly among
    ties (over every entry: among the tied rows' extremes, then each
    row's tied entries); logsumexp subtracts the maximum before exp; prod's gradient is the
    product of the other entries (exact where an entry is 0).

    Args:
        op: "sum", "mean", "prod", "max", "min" or "logsumexp".
        x: a matrix expression.
        axis: 0, 1 or None.

    Returns:
        A (1 x cols), (rows x 1) or (1 x 1) matrix expression.

    Raises:
        ModelError: an unknown op or axis, or x is not a matrix.
    """
    if axis is None:
        return Reduce(op, Reduce(op, x, 1), 0)  # the mean of the rows' means: rows are of one length
    return Reduce(op, x, axis)


class _SameShape(Standing, sp.MatrixExpr):
    """An op on one matrix, args[0], whose result has its shape."""

    @property
    def arg(self) -> sp.MatrixExpr:
        """The matrix the op reads."""
        return self.args[0]

    @property
    def shape(self) -> tuple:
        """The shape of the matrix the op reads."""
        return self.arg.shape

    def _entry(self, i, j, **kwargs):
        return sp.matrices.expressions.matexpr.MatrixElement(self, i, j)


class _AlongAxis(_SameShape):
    """An op on one matrix along the axis args[1], keeping its shape."""

    @property
    def axis(self) -> int:
        """0: down each column; 1: along each row."""
        return int(self.args[1])


class Cumsum(_AlongAxis):
    """The running sum of a matrix along an axis, from the end when
    `reverse`. See `cumsum`.
    """

    def __new__(cls, x: sp.MatrixExpr, axis: int, reverse: bool = False) -> Cumsum:
        """Build the Cumsum.

        Args:
            x: a matrix expression.
            axis: 0 (down each column) or 1 (along each row).
            reverse: sum from the last entry back.

        Raises:
            ModelError: an unknown axis, or x is not a matrix.
        """
        if axis not in (0, 1):
            raise ModelError(f"cumsum along axis 0 (down each column) or 1 (along each row); got {axis!r}")
        if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"cumsum of a matrix; got {x!r}")
        return super().__new__(cls, sp.sympify(x), sp.Integer(axis), sp.Integer(int(bool(reverse))))

    @property
    def reverse(self) -> bool:
        """Whether the sums run from the last entry back."""
        return bool(self.args[2])


class Softmax(_AlongAxis):
    """softmax (or log_softmax, `log`) of a matrix along an axis: each row
    (axis 1) or column (axis 0) with its maximum subtracted before exp, as
    PyTorch's. One op, not exp(z - logsumexp(z)): there the log of the sum
    is lost against a large z (a row masked with -1e9 in float32 came out
    as 1 at every entry). See `nn.softmax`, `nn.log_softmax`.
    """

    def __new__(cls, x: sp.MatrixExpr, axis: int, log: bool = False) -> Softmax:
        """Build the Softmax.

        Args:
            x: a matrix expression.
            axis: 0 (down each column) or 1 (along each row).
            log: log_softmax instead.

        Raises:
            ModelError: an unknown axis, or x is not a matrix.
        """
        what = "log_softmax" if log else "softmax"
        if axis not in (0, 1):
            raise ModelError(f"{what} along axis 0 or 1; got {axis!r}")
        if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"{what} of a matrix; got {x!r}")
        return super().__new__(cls, sp.sympify(x), sp.Integer(axis), sp.Integer(int(bool(log))))

    @property
    def log(self) -> bool:
        """Whether it is the log_softmax."""
        return bool(self.args[2])


class Shift(_SameShape):
    """A matrix moved `k` entries along an axis, `fill` where nothing moves
    in. See `shift`."""

    def __new__(cls, x: sp.MatrixExpr, k: int, axis: int, fill: float | int = 0) -> Shift:
        """Build the Shift.

        Args:
            x: a matrix expression.
            k: entries moved (toward the end when positive).
            axis: 0 (down each column) or 1 (along each row).
            fill: a real number: the entries nothing moves into.

        Raises:
            ModelError: an unknown axis, a k that is not a whole number, a
                fill that is not a real number, or x is not a matrix.
        """
        if axis not in (0, 1):
            raise ModelError(f"shift along axis 0 (down each column) or 1 (along each row); got {axis!r}")
        if not isinstance(x, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"shift of a matrix; got {x!r}")
        if isinstance(k, bool) or not isinstance(k, (int, sp.Integer)):
            raise ModelError(f"shift by a whole number of entries; got {k!r}")
        value = sp.sympify(fill)
        if not (value.is_Number and value.is_real):
            raise ModelError(f"shift: fill must be a real number; got {fill!r}")
        return super().__new__(cls, sp.sympify(x), sp.Integer(k), sp.Integer(axis), value)

    @property
    def k(self) -> int:
        """Entries moved: toward the end when positive, toward the start when negative."""
        return int(self.args[1])

    @property
    def axis(self) -> int:
        """0: down each column; 1: along each row."""
        return int(self.args[2])

    @property
    def fill(self) -> sp.Expr:
        """The value of the |k| entries nothing moves into."""
        return self.args[3]


def shift(x: sp.MatrixExpr, k: int, axis: int = 0, fill: float | int = 0) -> sp.MatrixExpr:
    """x moved k entries along `axis`, `fill` where nothing moves in: entry
    i of the result is entry i - k of x (as numpy.roll, without the wrap).
    The length along `axis` may be symbolic; y_{i-1} of a recurrence along
    a vector y is `shift(y, 1)`.

    Args:
        x: a matrix expression.
        k: entries moved: toward the end when positive (the first k entries
            are `fill`), toward the start when negative (the last |k|).
        axis: 0 (down each column) or 1 (along each row).
        fill: a real number (0 by default): the entries nothing moves into.

    Returns:
        A matrix expression of x's shape. Its gradient is the opposite shift
        of the adjoint, filled with 0.

    Raises:
        ModelError: an unknown axis, a k that is not a whole number, a fill
            that is not a real number, or x is not a matrix.
    """
    return Shift(x, k, axis, fill)


def cumsum(x: sp.MatrixExpr, axis: int, reverse: bool = False) -> sp.MatrixExpr:
    """The cumulative sum of x along `axis` (as numpy.cumsum): entry k is
    the sum of entries 0..k (with `reverse`, of entries k..last).

    Args:
        x: a matrix expression.
        axis: 0 (down each column) or 1 (along each row).
        reverse: sum from the end.

    Returns:
        A matrix expression of x's shape.

    Raises:
        ModelError: an unknown axis, or x is not a matrix.
    """
    return Cumsum(x, axis, reverse)
