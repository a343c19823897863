"""Independent oracles for gradients: central finite differences and plain
numpy evaluations of the example models."""

from __future__ import annotations

from typing import Callable

import numpy as np


def central_differences(loss: Callable[[dict], float], data: dict, name: str, step: float = 1e-6) -> np.ndarray:
    """dloss/d data[name] by central differences, entry by entry."""
    base = np.asarray(data[name], dtype=np.float64)
    grad = np.zeros_like(base)
    for index in np.ndindex(base.shape):
        values = []
        for sign in (1.0, -1.0):
            shifted = base.copy()
            shifted[index] += sign * step
            values.append(loss({**data, name: shifted}))
        grad[index] = (values[0] - values[1]) / (2 * step)
    return grad


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    scale = max(float(np.abs(expected).max()), 1e-12)
    return float(np.abs(actual - expected).max() / scale)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def mlp_loss(d: dict) -> float:
    hidden = sigmoid(d["X"] @ d["W1"] + d["b1"])
    y = hidden @ d["W2"] + d["b2"]
    return float(np.mean((y - d["T"]) ** 2))


def relu_net_loss(d: dict) -> float:
    hidden = np.maximum(d["W1"] @ d["x"], 0.0)
    y = d["W2"] @ hidden
    return float(0.5 * np.sum((y - d["t"]) ** 2))


def mnist_mlp_loss(d: dict) -> float:
    hidden = np.tanh(d["X"] @ d["W1"] + d["b1"])
    z = hidden @ d["W2"] + d["b2"]
    zmax = z.max(axis=1, keepdims=True)
    lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(axis=1))
    return float(np.mean(lse - (d["T"] * z).sum(axis=1)))


def lstm_sequence_outputs(d: dict, steps: int = 8) -> np.ndarray:
    """The logit of examples/lstm_sequence.py: an LSTM (PyTorch's LSTMCell
    equations, one bias a gate) over x1 ... x8 from the zero state, then a
    linear layer."""
    h = c = None
    for t in range(1, steps + 1):
        x = d[f"x{t}"]
        z = {g: x @ d[f"W_{g}"] + d[f"b_{g}"] + (0.0 if h is None else h @ d[f"U_{g}"]) for g in "ifgo"}
        i, f, g, o = sigmoid(z["i"]), sigmoid(z["f"]), np.tanh(z["g"]), sigmoid(z["o"])
        c = i * g if c is None else f * c + i * g
        h = o * np.tanh(c)
    return h @ d["V"] + d["c0"]


def lstm_sequence_loss(d: dict) -> float:
    """Binary cross-entropy with logits, in the form log(1 + exp(z)) - y z."""
    z = lstm_sequence_outputs(d)
    return float(np.mean(np.logaddexp(0.0, z) - d["y"] * z))


NUMPY_LOSSES = {
    "mlp": mlp_loss,
    "relu_net": relu_net_loss,
    "mnist_mlp": mnist_mlp_loss,
    "digits_mlp": mnist_mlp_loss,  # the same network: tanh MLP, softmax cross-entropy
    "lstm_sequence": lstm_sequence_loss,
}
