"""A classifier of scikit-learn's handwritten digits (8x8 images, 10 classes,
bundled with scikit-learn, no download): batch x 64 pixels -> linear(64) ->
tanh -> linear(10) -> softmax cross-entropy.

The batch size n is symbolic, so one compiled module trains on minibatches
of any size (and `train_epoch` runs a whole epoch in one C call). Train it
with `python examples/train_digits.py`, or from C: examples/c/train_digits.c.
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

PIXELS, HIDDEN, CLASSES = 64, 64, 10

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, PIXELS)
T = sp.MatrixSymbol("T", n, CLASSES)
W1 = sp.MatrixSymbol("W1", PIXELS, HIDDEN)
b1 = sp.MatrixSymbol("b1", 1, HIDDEN)
W2 = sp.MatrixSymbol("W2", HIDDEN, CLASSES)
b2 = sp.MatrixSymbol("b2", 1, CLASSES)

H = nn.tanh(nn.linear(X, W1, b1))
Z = nn.linear(H, W2, b2)

model = sbp.Model(
    "digits_mlp",
    inputs=[X, T],
    params=[W1, b1, W2, b2],
    loss=nn.softmax_cross_entropy(Z, T),
    outputs={"logits": Z},
)

# `symbackprop build` also writes Adam's train_step and train_epoch into the
# C (docs/model_files.md); the C takes lr, beta1, ... as arguments, and
# examples/c/train_digits.c trains with them, without Python.
optimizer = sbp.Adam(lr=3e-3)


def init_params(rng: np.random.Generator) -> dict:
    """PyTorch's default for nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    def uniform(fan_in, shape):
        bound = 1.0 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=shape)

    return {
        "W1": uniform(PIXELS, (PIXELS, HIDDEN)),
        "b1": uniform(PIXELS, (1, HIDDEN)),
        "W2": uniform(HIDDEN, (HIDDEN, CLASSES)),
        "b2": uniform(HIDDEN, (1, CLASSES)),
    }


def one_hot(labels: np.ndarray) -> np.ndarray:
    return np.eye(CLASSES)[labels]


def sample_data(rng: np.random.Generator, batch: int = 8) -> dict:
    """Random images (pixels in [0, 1] as in load_data) and labels."""
    return {"X": rng.random((batch, PIXELS)), "T": one_hot(rng.integers(0, CLASSES, size=batch)), **init_params(rng)}


def load_data(seed: int = 0, test_fraction: float = 0.2) -> dict:
    """The digits (needs scikit-learn): pixels scaled to [0, 1], shuffled with
    `seed` and split into train and test sets; C-contiguous float64 arrays."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.data.astype(np.float64) / 16.0
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    test = round(len(labels) * test_fraction)
    test_rows, train_rows = order[:test], order[test:]
    return {
        "X_train": np.ascontiguousarray(images[train_rows]), "y_train": labels[train_rows],
        "X_test": np.ascontiguousarray(images[test_rows]), "y_test": labels[test_rows],
    }
