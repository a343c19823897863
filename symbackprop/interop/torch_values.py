"""The values from_torch's converters compute on (symbackprop.interop.torch_ops
and torch_images): a SymPy matrix (the batch, a parameter), a Python
number, `Images`, or a convolution's `Kernel`; and the checks and
broadcasts every converter shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp

from symbackprop.declare import nn
from symbackprop.declare.conv import Images
from symbackprop.errors import ModelError
from symbackprop.interop.torch_rnn import Sequence


def torch_module() -> Any:
    import torch

    return torch


def is_number(v: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Kernel:
    """A convolution's weight, torch's (C_out, C_in, kh, kw), as the
    C_out x (C_in*kh*kw) matrix of the same memory."""

    matrix: sp.MatrixExpr
    shape: tuple[int, int, int, int]


@dataclass(frozen=True)
class Positions:
    """A batch of sequences for attention: `matrix` the example-major
    (n*L) x features rows (sequence e's L consecutive rows, torch's
    batch_first (n, L, F) memory), or an Index of n*L token ids; `length`
    L, `batch` n's symbol, `batch_first` the layout torch's tensor has
    (for its shape: (n, L, F) or (L, n, F))."""

    matrix: Any
    length: int
    batch: sp.Symbol
    batch_first: bool

    def shape(self) -> tuple:
        """torch's shape of the tensor (the batch as its symbol)."""
        dims = (self.batch, self.length) if self.batch_first else (self.length, self.batch)
        return dims if getattr(self.matrix, "is_index", False) else (*dims, self.matrix.shape[1])

    def like(self, matrix: Any) -> Positions:
        """matrix (computed per position from this one's) as sequences of the same layout."""
        return Positions(matrix, self.length, self.batch, self.batch_first)


def as_matrix(v: Any, what: str) -> sp.MatrixExpr:
    if isinstance(v, Images):
        raise ModelError(f"{what} of images (batch, {v.channels}, {v.height}, {v.width}) is not translated; "
                         "flatten them first (torch.flatten(x, 1), nn.Flatten())")
    if isinstance(v, Kernel):
        raise ModelError(f"{what} of a convolution's 4-D weight {v.shape} is not translated (only F.conv2d takes it)")
    if isinstance(v, Sequence):
        raise ModelError(f"{what} of a sequence (L, batch, features) is not translated; from_torch takes a "
                         "recurrent layer's last step (out[:, -1] batch_first, out[-1] otherwise) or its final "
                         "state (h_n[-1])")
    if isinstance(v, Positions):
        raise ModelError(f"{what} of sequences {v.shape()} is not translated; on sequences from_torch translates "
                         "per-position layers (Linear, LayerNorm, the activations, Dropout in eval), elementwise "
                         "arithmetic with a number or a (features,) row, residual additions, and "
                         "MultiheadAttention")
    if getattr(v, "is_index", False):
        raise ModelError(f"{what} of the integer ids {v} is not translated; only an Embedding takes them")
    if not isinstance(v, (sp.MatrixExpr, sp.MatrixBase)):
        raise ModelError(f"{what} takes a tensor; got {v!r}")
    return v


def expand(x: sp.MatrixExpr, rows: Any, cols: Any) -> sp.MatrixExpr:
    """x broadcast to (rows, cols), as torch broadcasts a row or a column."""
    if x.shape[0] == 1 and rows != 1:
        x = nn.ones(rows, 1) * x
    if x.shape[1] == 1 and cols != 1:
        x = x * nn.ones(1, cols)
    return x


def shape_of(x: Any, what: str) -> tuple:
    """A tensor's shape as torch gives it: (n, C, H, W) of images, (n, k) of a batch (n the batch's symbol)."""
    if isinstance(x, Images):
        return (x.matrix.shape[0], x.channels, x.height, x.width)
    if isinstance(x, Positions):
        return x.shape()
    return tuple(as_matrix(x, what).shape)


def example_inputs(example: Any) -> list:
    """The forward's example inputs: one, or a tuple of tensors or arrays
    (x, mask), (x, h0), or of tuples of them after the first (x, (h0, c0))."""
    def tensors(e: Any) -> bool:
        return hasattr(e, "shape") or (isinstance(e, tuple) and len(e) > 0 and all(map(tensors, e)))

    if isinstance(example, tuple) and len(example) > 1 and hasattr(example[0], "shape") and all(map(tensors, example)):
        return list(example)
    return [example]


__all__ = ["Kernel", "Positions", "as_matrix", "example_inputs", "expand", "is_number", "shape_of", "torch_module"]
