"""A two-layer MLP: batch x 3 -> linear(4) -> sigmoid -> linear(2) -> MSE.

The batch size n is symbolic: it is bound from the arrays at call time.
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
T = sp.MatrixSymbol("T", n, 2)
W1 = sp.MatrixSymbol("W1", 3, 4)
b1 = sp.MatrixSymbol("b1", 1, 4)
W2 = sp.MatrixSymbol("W2", 4, 2)
b2 = sp.MatrixSymbol("b2", 1, 2)

H = nn.sigmoid(nn.linear(X, W1, b1))
Y = nn.linear(H, W2, b2)

model = sbp.Model("mlp", inputs=[X, T], params=[W1, b1, W2, b2], loss=nn.mse(Y, T), outputs={"Y": Y})


def sample_data(rng: np.random.Generator, batch: int = 8) -> dict:
    return {
        "X": rng.standard_normal((batch, 3)),
        "T": rng.standard_normal((batch, 2)),
        "W1": rng.standard_normal((3, 4)) / np.sqrt(3),
        "b1": 0.1 * rng.standard_normal((1, 4)),
        "W2": rng.standard_normal((4, 2)) / 2.0,
        "b2": 0.1 * rng.standard_normal((1, 2)),
    }
