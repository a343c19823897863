"""The classic hand-worked backprop example: one example x (2x1), a hidden
ReLU layer h = relu(W1 x), an output y = W2 h, no biases, and the squared
error L = (y - t)^2 / 2.

At x = [1, 2], W1 = [[1, -1], [0, 1]], W2 = [[2, -1]], t = 0:
L = 2, dL/dW2 = [[0, -4]], dL/dW1 = [[0, 0], [2, 4]].
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

x = sp.MatrixSymbol("x", 2, 1)
t = sp.MatrixSymbol("t", 1, 1)
W1 = sp.MatrixSymbol("W1", 2, 2)
W2 = sp.MatrixSymbol("W2", 1, 2)

h = nn.relu(W1 * x)
y = W2 * h
loss = sp.HadamardPower(y - t, 2) / 2

model = sbp.Model("relu_net", inputs=[x, t], params=[W1, W2], loss=loss, outputs={"y": y})


def sample_data(rng: np.random.Generator | None = None) -> dict:
    """The worked example's numbers (rng unused: they are fixed)."""
    return {
        "x": np.array([[1.0], [2.0]]),
        "t": np.array([[0.0]]),
        "W1": np.array([[1.0, -1.0], [0.0, 1.0]]),
        "W2": np.array([[2.0, -1.0]]),
    }
