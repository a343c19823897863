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


NUMPY_LOSSES = {"mlp": mlp_loss, "relu_net": relu_net_loss, "mnist_mlp": mnist_mlp_loss}
