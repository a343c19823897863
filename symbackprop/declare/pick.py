"""``pick(array, index)``: one entry a row, at the column an Index names.

Row i of the result is ``array[i, index[i]]`` (PyTorch's
``x.gather(1, idx[:, None])``). A softmax cross-entropy against class
numbers needs only the target's logit of each row: picking it reads m
numbers where multiplying by one-hot rows read and wrote m x classes
(ops.pick; its gradient places each row's adjoint at that column).
"""

from __future__ import annotations

import sympy as sp

from symbackprop.declare.tensor import Index, ReadAtIndex
from symbackprop.errors import ModelError


class Pick(ReadAtIndex):
    """The column `index` names in each row of `array`: an (index rows x 1) column."""

    op = "pick"
    chooses = "columns"

    def __new__(cls, array: sp.MatrixExpr, index: Index) -> Pick:
        """Build the Pick (ReadAtIndex's checks, and one index entry a row).

        Raises:
            ModelError: `index` is not an Index, `array` is not a matrix, or
                their rows differ.
        """
        picked = super().__new__(cls, array, index)
        if sp.simplify(picked.array.shape[0] - index.shape[0]) != 0:
            raise ModelError(f"pick: the matrix has {picked.array.shape[0]} rows and the Index {index} "
                             f"{index.shape[0]}; one column number a row is needed")
        return picked

    @property
    def shape(self) -> tuple:
        return (self.index.shape[0], sp.Integer(1))


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
