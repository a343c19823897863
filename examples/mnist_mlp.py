"""An MNIST-sized classifier: batch 128 x 784 -> linear(256) -> tanh ->
linear(10) -> softmax cross-entropy (log-sum-exp with the max subtracted)."""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

BATCH, PIXELS, HIDDEN, CLASSES = 128, 784, 256, 10

X = sp.MatrixSymbol("X", BATCH, PIXELS)
T = sp.MatrixSymbol("T", BATCH, CLASSES)
W1 = sp.MatrixSymbol("W1", PIXELS, HIDDEN)
b1 = sp.MatrixSymbol("b1", 1, HIDDEN)
W2 = sp.MatrixSymbol("W2", HIDDEN, CLASSES)
b2 = sp.MatrixSymbol("b2", 1, CLASSES)

H = nn.tanh(nn.linear(X, W1, b1))
Z = nn.linear(H, W2, b2)

model = sbp.Model(
    "mnist_mlp",
    inputs=[X, T],
    params=[W1, b1, W2, b2],
    loss=nn.softmax_cross_entropy(Z, T),
    outputs={"logits": Z},
)


def sample_data(rng: np.random.Generator) -> dict:
    labels = rng.integers(0, CLASSES, size=BATCH)
    return {
        "X": rng.random((BATCH, PIXELS)),
        "T": np.eye(CLASSES)[labels],
        "W1": rng.standard_normal((PIXELS, HIDDEN)) / np.sqrt(PIXELS),
        "b1": 0.01 * rng.standard_normal((1, HIDDEN)),
        "W2": rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
        "b2": 0.01 * rng.standard_normal((1, CLASSES)),
    }
