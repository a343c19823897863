"""``pick(array, index)``: one entry a row, at the column an Index names.

Row i of the result is ``array[i, index[i]]`` (PyTorch's
``x.gather(1, idx[:, None])``). A softmax cross-entropy against class
numbers needs only the target's logit of each row: picking it reads m
numbers where multiplying by one-hot rows read and wrote m x classes
(ops.pick; its gradient places each row's adjoint at that column).
"""

from __future__ import annotations

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from symbackprop.declare.tensor import Index
from symbackprop.errors import ModelError
from symbackprop.messages import short


class Pick(sp.MatrixExpr):
    """The column `index` names in each row of `array`: an (index rows x 1) column."""

    def __new__(cls, array: sp.MatrixExpr, index: Index) -> Pick:
        """Build the Pick.

        Args:
            array: a matrix expression, one row per entry of `index`.
            index: an Index input of column numbers, 0 to array's columns - 1.

        Raises:
            ModelError: `index` is not an Index, `array` is not a matrix, or
                their rows differ.
        """
        if not isinstance(index, Index):
            raise ModelError(f"pick needs an Index (integer input) of column numbers; got {short(index)}")
        if not isinstance(array, (sp.MatrixExpr, sp.MatrixBase)):
            raise ModelError(f"pick takes entries of a matrix; got {short(array)}")
        if sp.simplify(array.shape[0] - index.shape[0]) != 0:
            raise ModelError(f"pick: the matrix has {array.shape[0]} rows and the Index {index} "
                             f"{index.shape[0]}; one column number a row is needed")
        return super().__new__(cls, sp.sympify(array), index)

    @property
    def array(self) -> sp.MatrixExpr:
        """The matrix whose entries are picked."""
        return self.args[0]

    @property
    def index(self) -> Index:
        """The column numbers, one a row."""
        return self.args[1]

    @property
    def shape(self) -> tuple:
        return (self.index.shape[0], sp.Integer(1))

    def _entry(self, i, j, **kwargs):
        return MatrixElement(self, i, j)


def pick(array: sp.MatrixExpr, index: Index) -> Pick:
    """Row i's entry at column index[i]: an (m x 1) column. Its gradient puts
    each row's adjoint at that column of the row, zeros elsewhere.

    Args:
        array: an (m x n) matrix expression.
        index: an Index input of m column numbers, each 0 to n - 1 (checked
            before each call, as any Index).

    Returns:
        An (m x 1) matrix expression.

    Raises:
        ModelError: `index` is not an Index, `array` is not a matrix, or
            their rows differ.
    """
    return Pick(array, index)
