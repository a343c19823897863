"""Linear algebra of square matrices: determinant, log-determinant, solve,
Cholesky factor and triangular solve, each one op of the compiler (its own
C kernel, its derivatives by matrix rules, never an expansion into scalars).

The matrices may be of a symbolic size n, bound when the module is called::

    A = sp.MatrixSymbol("A", n, n)
    B = sp.MatrixSymbol("B", n, k)
    loss = sbp.logdet(A) + nn.sum_all(sbp.solve(A, B))

Each function returns an unevaluated SymPy node (a scalar for det and
logdet); the compiler lowers it to its op (symbackprop.ops.linalg).

Explicit matrices (sp.Matrix of scalar expressions, as in a map_examples
body, where each example has its own small matrix) of at most
MAX_CLOSED_FORM rows get closed forms in scalars instead, which the map's
scalar derivatives differentiate: det by Berkowitz (division-free), solve
as adjugate(A) B / det(A) (no pivot to choose), Cholesky and substitution
as the C helpers do them.
"""

from __future__ import annotations

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.declare.standing import Standing
from symbackprop.errors import ModelError
from symbackprop.messages import described, short


def _matrix(value: object, what: str) -> sp.MatrixExpr:
    if isinstance(value, sp.MatrixBase):
        return sp.ImmutableMatrix(value)
    if not isinstance(value, sp.MatrixExpr):
        raise ModelError(f"{what} must be a SymPy matrix expression; got {short(repr(value))} of type {type(value).__name__}")
    return value


def _square(value: object, what: str) -> sp.MatrixExpr:
    """A square matrix expression (n x n, n a number or a dimension)."""
    a = _matrix(value, what)
    if sp.simplify(a.shape[0] - a.shape[1]) != 0:
        raise ModelError(f"{what} must be a square matrix; it has shape {a.shape}: {described(a)}")
    return a


def _right_side(value: object, a: sp.MatrixExpr, what: str) -> sp.MatrixExpr:
    """The right-hand side of a solve: a matrix of n rows (n x k)."""
    b = _matrix(value, what)
    if sp.simplify(b.shape[0] - a.shape[0]) != 0:
        raise ModelError(f"{what} must have the {a.shape[0]} rows of the matrix solved with; it has shape "
                         f"{b.shape}: {described(b)}")
    return b


# An explicit matrix (entries given, as in a map_examples body) of at most
# this size gets its closed form in scalars, which a per-example body needs.
MAX_CLOSED_FORM = 4


def _explicit(*values: sp.Basic) -> bool:
    """Whether every matrix is explicit and the first (square) one small."""
    return all(isinstance(v, sp.MatrixBase) for v in values) and values[0].shape[0] <= MAX_CLOSED_FORM


def _closed_det(a: sp.MatrixBase) -> sp.Expr:
    return a.det(method="berkowitz")  # division-free: no pivot to choose


class LinalgExpr(Standing, sp.MatrixExpr):
    """What the linear-algebra nodes share: entries by index."""

    def _entry(self, i, j, **kwargs):
        return MatrixElement(self, i, j)


class Det(LinalgExpr):
    """det(A), a 1x1 matrix. Build one with `det`."""

    @property
    def shape(self) -> tuple:
        """1 x 1."""
        return (sp.Integer(1), sp.Integer(1))


class LogDet(LinalgExpr):
    """log|det(A)|, a 1x1 matrix. Build one with `logdet`."""

    @property
    def shape(self) -> tuple:
        """1 x 1."""
        return (sp.Integer(1), sp.Integer(1))


class Solve(LinalgExpr):
    """X with A X = B, of B's shape. Build one with `solve`."""

    @property
    def shape(self) -> tuple:
        """The shape of B."""
        return self.args[1].shape


class Cholesky(LinalgExpr):
    """The lower Cholesky factor of (A + A^T)/2. Build one with `cholesky`."""

    @property
    def shape(self) -> tuple:
        """The shape of A."""
        return self.args[0].shape


class TriangularSolve(LinalgExpr):
    """X with T X = B, T the lower or upper triangle of L (or of L^T with
    `transpose`). Build one with `triangular_solve`. args: (L, B, lower, transpose)."""

    @property
    def lower(self) -> bool:
        """Whether L's lower triangle is read (else its upper)."""
        return bool(self.args[2])

    @property
    def transpose(self) -> bool:
        """Whether the system is L^T X = B."""
        return bool(self.args[3])

    @property
    def shape(self) -> tuple:
        """The shape of B."""
        return self.args[1].shape


def det(a: sp.MatrixExpr) -> sp.Expr:
    """The determinant of the square matrix `a` (n x n, n a number or a
    dimension bound at call time), by LU factorization with partial pivoting.

    Its gradient is g * det(A) * A^{-T} (one solve); a singular A has
    determinant 0 (exactly, where the elimination meets a zero column) and a
    gradient of inf or NaN entries, as JAX's; a NaN entry gives NaN.

    An explicit matrix (sp.Matrix, as in a map_examples body) of at most 4
    rows gets its closed form in scalars (symbackprop.declare.linalg).

    Args:
        a: a square matrix expression.

    Returns:
        A scalar expression.

    Raises:
        ModelError: `a` is not a square matrix expression.
    """
    square = _square(a, "the matrix of det")
    return _closed_det(square) if _explicit(square) else MatrixElement(Det(square), 0, 0)


def logdet(a: sp.MatrixExpr) -> sp.Expr:
    """log|det(a)| of the square matrix `a`: numpy's `slogdet(a)[1]`, the log
    of the determinant's absolute value, whatever its sign (torch.logdet
    differs for a negative determinant: NaN there). A singular `a` gives
    -inf (and a gradient of inf or NaN entries); a NaN entry gives NaN.
    Its gradient is g * A^{-T}, for either sign of the determinant.

    An explicit matrix (sp.Matrix, as in a map_examples body) of at most 4
    rows gets its closed form in scalars (symbackprop.declare.linalg).

    Args:
        a: a square matrix expression (for a symmetric positive definite
            matrix, log det a).

    Returns:
        A scalar expression.

    Raises:
        ModelError: `a` is not a square matrix expression.
    """
    square = _square(a, "the matrix of logdet")
    return sp.log(sp.Abs(_closed_det(square))) if _explicit(square) else MatrixElement(LogDet(square), 0, 0)


def solve(a: sp.MatrixExpr, b: sp.MatrixExpr) -> sp.MatrixExpr:
    """X with a X = b (numpy.linalg.solve of an n x k right-hand side), by LU
    factorization with partial pivoting. For a singular `a` (a zero pivot)
    X has inf or NaN entries (JAX's answer; numpy raises), never a silent
    finite value. Its derivatives are solves with a^T: b-bar = a^{-T} G,
    a-bar = -b-bar X^T.

    An explicit matrix (sp.Matrix, as in a map_examples body) of at most 4
    rows gets its closed form in scalars (symbackprop.declare.linalg).

    Args:
        a: a square matrix expression (n x n).
        b: a matrix expression of n rows.

    Returns:
        A matrix expression of b's shape.

    Raises:
        ModelError: `a` is not square, or `b` does not have a's rows.
    """
    square = _square(a, "the matrix of solve")
    rhs = _right_side(b, square, "the right-hand side of solve")
    if _explicit(square, rhs):  # adjugate / det: no pivoting, exact for these sizes
        return sp.ImmutableMatrix(square.adjugate(method="berkowitz") * rhs / _closed_det(square))
    return Solve(square, rhs)


def cholesky(a: sp.MatrixExpr) -> sp.MatrixExpr:
    """The lower-triangular L with L L^T = a, for a symmetric positive
    definite `a` (numpy.linalg.cholesky). It factors the symmetric part
    (a + a^T)/2, so its gradient is symmetric, as JAX's and PyTorch's.
    A matrix that is not positive definite gives NaN entries from the first
    non-positive pivot on (JAX's answer; numpy and PyTorch raise); a zero
    pivot gives inf or NaN below it.

    An explicit matrix (sp.Matrix, as in a map_examples body) of at most 4
    rows gets its closed form in scalars (symbackprop.declare.linalg).

    Args:
        a: a square matrix expression.

    Returns:
        A matrix expression of a's shape, zero above the diagonal.

    Raises:
        ModelError: `a` is not a square matrix expression.
    """
    square = _square(a, "the matrix of cholesky")
    if _explicit(square):
        return _closed_cholesky((square + square.T) / 2)
    return Cholesky(square)


def triangular_solve(l: sp.MatrixExpr, b: sp.MatrixExpr, lower: bool = True, transpose: bool = False) -> sp.MatrixExpr:  # noqa: E741
    """X with T X = b, T the lower (or, `lower=False`, upper) triangle of `l`
    with its diagonal; with `transpose`, T^T X = b (scipy's
    solve_triangular(l, b, lower=lower, trans=transpose)). The other
    triangle of `l` is never read, and its gradient there is 0. A zero on
    the diagonal gives inf or NaN entries.

    An explicit matrix (sp.Matrix, as in a map_examples body) of at most 4
    rows gets its closed form in scalars (symbackprop.declare.linalg).

    Args:
        l: a square matrix expression.
        b: a matrix expression of l's rows.
        lower: read the lower triangle (else the upper).
        transpose: solve with the triangle's transpose.

    Returns:
        A matrix expression of b's shape.

    Raises:
        ModelError: `l` is not square, or `b` does not have its rows.
    """
    t = _square(l, "the matrix of triangular_solve")
    rhs = _right_side(b, t, "the right-hand side of triangular_solve")
    if _explicit(t, rhs):
        triangle = sp.Matrix(t).lower_triangular() if lower else sp.Matrix(t).upper_triangular()
        triangle = triangle.T if transpose else triangle
        rows = range(t.shape[0]) if lower != bool(transpose) else range(t.shape[0] - 1, -1, -1)
        return _closed_substitution(triangle, sp.Matrix(rhs), rows)
    return TriangularSolve(t, rhs, sp.Integer(int(bool(lower))), sp.Integer(int(bool(transpose))))


def _closed_cholesky(s: sp.MatrixBase) -> sp.ImmutableMatrix:
    """The Cholesky factor of the symmetric s, column by column (as the C helper)."""
    size = s.shape[0]
    low = sp.zeros(size, size)
    for j in range(size):
        low[j, j] = sp.sqrt(s[j, j] - sum(low[j, m] ** 2 for m in range(j)))
        for i in range(j + 1, size):
            low[i, j] = (s[i, j] - sum(low[i, m] * low[j, m] for m in range(j))) / low[j, j]
    return sp.ImmutableMatrix(low)


def _closed_substitution(triangle: sp.Matrix, x: sp.Matrix, rows: range) -> sp.ImmutableMatrix:
    """triangle^{-1} x by substitution, its rows in the order given (those
    already solved first)."""
    done: list[int] = []
    for i in rows:
        x[i, :] = (x[i, :] - sum((triangle[i, j] * x[j, :] for j in done), sp.zeros(1, x.shape[1]))) / triangle[i, i]
        done.append(i)
    return sp.ImmutableMatrix(x)
