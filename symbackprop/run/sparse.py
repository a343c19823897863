"""The sparsity pattern of a per-example Jacobian (`ExampleMap.jacobian`).

Example i of a map reads only its own rows: the rows its gathers choose
(by an Index), its own row of a per-example source, and the shared rows.
So the Jacobian of all the map's outputs with respect to the arrays its keys
are bound to is sparse, and its nonzeros are exactly the per-example
blocks the compiled `map.jacobian(*wrt)` output holds, row-major: entry
(i, r * inputs + k) of that output is d out[i, r] / d (input k of example
i). `SparseLayout` says where each of them lies in the whole Jacobian: the
row i * outputs + r, and the column of the array entry that input k reads.
The values stay the C function's output, unchanged (ravel it); the row and
column numbers depend on the Index arrays only, so a loop that refills the
data computes them once.

The whole Jacobian's columns are the entries of the arrays bound to the
`wrt` keys, each array flattened row-major, in order of first appearance
(bundle adjustment's cameras, then points, then weights). An array bound
twice (two gathers from one array) gives repeated (row, column) pairs,
which COO and CSR sum, as the derivative does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy as sp

from symbackprop.declare.tensor import ExampleMap, Gather, key_symbols
from symbackprop.errors import ArgumentError, ModelError


@dataclass(frozen=True)
class _Block:
    """The inputs of one `wrt` key: the `width` columns of `array` (a key
    binds a whole row), in the row `index` chooses, the example's own row,
    or row 0 (shared)."""

    array: str
    width: int
    how: str  # "gather", "own" or "shared"
    index: str | None


@dataclass(frozen=True)
class SparseLayout:
    """Where the values of a per-example Jacobian lie in the whole Jacobian.

    Made by `sparse_layout(map, *wrt)`, which passes:

    Args:
        outputs: the map's outputs per example.
        blocks: per `wrt` key, where its inputs come from.
        arrays: the arrays whose entries are the columns, in column order.
    """

    outputs: int
    blocks: tuple[_Block, ...]
    arrays: tuple[str, ...]

    @property
    def inputs(self) -> int:
        """The Jacobian entries of one example per output (its row of the block)."""
        return sum(b.width for b in self.blocks)

    def coo(self, arrays: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
        """Row and column numbers (int64) of the values, in the order of the
        compiled Jacobian output raveled, and the shape.

        Args:
            arrays: the call's arguments by name.

        Returns:
            (rows, cols, shape).

        Raises:
            ArgumentError: an array or Index the layout needs is missing, or
                an Index row number lies outside its array.
        """
        examples = self._examples(arrays)
        offsets, start = {}, 0
        for name in self.arrays:
            offsets[name] = start
            start += int(np.size(arrays[name]))
        per_example = np.concatenate([self._columns(b, arrays, examples, offsets[b.array]) for b in self.blocks], axis=1)
        cols = np.repeat(per_example, self.outputs, axis=0).reshape(-1)  # every output row of example i
        rows = np.repeat(np.arange(examples * self.outputs, dtype=np.int64), self.inputs)
        return rows, cols, (examples * self.outputs, start)

    def csr(self, arrays: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
        """CSR row pointers and column numbers of the values, as raveled.

        Args:
            arrays: the call's arguments by name.

        Returns:
            (indptr, indices, shape): every row holds `inputs` values.
        """
        _, cols, shape = self.coo(arrays)
        return np.arange(0, shape[0] * self.inputs + 1, self.inputs, dtype=np.int64), cols, shape

    def _examples(self, arrays: Mapping[str, Any]) -> int:
        for b in self.blocks:
            if b.how != "shared":
                return len(_array(arrays, b.index if b.how == "gather" else b.array))
        raise ModelError("a sparse Jacobian needs a key bound to rows per example")

    def _columns(self, b: _Block, arrays: Mapping[str, Any], examples: int, offset: int) -> np.ndarray:
        """examples x width column numbers of one key's inputs."""
        array = _array(arrays, b.array)
        row_width = array.shape[1] if array.ndim == 2 else 1
        if b.how == "gather":
            row = _array(arrays, b.index).reshape(-1).astype(np.int64)
            if row.size and (row.min() < 0 or row.max() >= len(array)):
                raise ArgumentError(f"{b.index} holds a row number outside the {len(array)} rows of {b.array}")
        elif b.how == "own":
            row = np.arange(examples, dtype=np.int64)
        else:
            row = np.zeros(examples, dtype=np.int64)
        return offset + row[:, None] * row_width + np.arange(b.width, dtype=np.int64)


def _array(arrays: Mapping[str, Any], name: str | None) -> np.ndarray:
    if name is None or name not in arrays:
        raise ArgumentError(f"the sparse Jacobian's layout needs the argument {name!r}")
    return np.asarray(arrays[name])


def sparse_layout(emap: ExampleMap, *wrt: sp.Basic) -> SparseLayout:
    """The layout of `emap.jacobian(*wrt)` in the whole Jacobian of the map's
    outputs with respect to the arrays the `wrt` keys are bound to.

    Args:
        emap: a map over one length (`map_examples`).
        *wrt: keys of its bindings, as given to `emap.jacobian`; each bound
            to a `gather(A, index)` of a MatrixSymbol A, to a MatrixSymbol
            with a row per example, or to a 1-row MatrixSymbol.

    Returns:
        The SparseLayout.

    Raises:
        ModelError: a map over pairs, a key that is not bound by the map, or
            one bound to another expression.
    """
    if not isinstance(emap, ExampleMap) or len(emap.loops) != 1:
        raise ModelError("a sparse Jacobian is for a map over one length (map_examples with a row per example)")
    (length,) = emap.loops
    bound = dict(emap.bindings)
    blocks, arrays = [], []
    for key in wrt:
        symbols = key_symbols(key)
        if symbols not in bound:
            raise ModelError(f"{key} is not a key bound by this map")
        source = bound[symbols]
        array, how, index = source, "own", None
        if isinstance(source, Gather):
            array, how, index = source.array, "gather", str(source.index.name)
        elif source.shape[0] == 1 and length != 1:
            how = "shared"
        if not isinstance(array, sp.MatrixSymbol) or array.shape[1] != len(symbols):
            raise ModelError(f"a sparse Jacobian's columns are entries of arrays: {key} is bound to {source}")
        blocks.append(_Block(str(array.name), len(symbols), how, index))
        arrays += [] if str(array.name) in arrays else [str(array.name)]
    return SparseLayout(len(emap.body), tuple(blocks), tuple(arrays))


__all__ = ["SparseLayout", "sparse_layout"]
