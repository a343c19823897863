"""Independent oracles for gradients: central finite differences and plain
numpy evaluations of the example models."""

from __future__ import annotations

import math
from collections.abc import Callable

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


def assert_matches_autograd(module, model, reference: Callable, arrays: dict) -> None:
    """The module's loss and every parameter's gradient against PyTorch's
    autograd of `reference` (a function of the arrays as float64 tensors),
    to 1e-10 relative (torch is imported here: the caller skips without it)."""
    import pytest
    import torch

    loss, grads = module.value_and_grad(**arrays)
    tensors = {k: torch.tensor(a, requires_grad=True) for k, a in arrays.items()}
    want = reference(tensors)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for p in model.params:
        expected = tensors[p.name].grad.numpy()
        assert np.abs(grads[p.name] - expected).max() <= 1e-10 * np.abs(expected).max(), p.name


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


def _conv_relu_pool(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PyTorch's conv2d (3x3, padding 1) + bias, relu, 2x2 max pool, by the
    definitions' loops; x: n x C x H x W, w: the C_out x (C*9) weights."""
    n, channels, height, width = x.shape
    w = w.reshape(-1, channels, 3, 3)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], height, width))
    for r in range(height):
        for c in range(width):
            out[:, :, r, c] = np.einsum("ncuv,ocuv->no", padded[:, :, r:r + 3, c:c + 3], w) + b[0]
    out = np.maximum(out, 0)
    return out.reshape(n, w.shape[0], height // 2, 2, width // 2, 2).max(axis=(3, 5))


def cnn_digits_loss(d: dict) -> float:
    """examples/cnn_digits.py: two conv-relu-pool blocks, relu MLP, softmax cross-entropy."""
    h = _conv_relu_pool(d["X"].reshape(-1, 1, 8, 8), d["K1"], d["c1"])
    h = _conv_relu_pool(h, d["K2"], d["c2"]).reshape(len(d["X"]), -1)
    z = np.maximum(h @ d["W1"] + d["b1"], 0) @ d["W2"] + d["b2"]
    zmax = z.max(axis=1, keepdims=True)
    lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(axis=1))
    return float(np.mean(lse - (d["T"] * z).sum(axis=1)))


def _layer_norm(x, gamma, beta, eps=1e-5):
    centred = x - x.mean(axis=1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(axis=1, keepdims=True) + eps) * gamma + beta


def _causal_attention(q, k, v, length, heads):
    n, d = q.shape[0] // length, q.shape[1]
    q, k, v = (z.reshape(n, length, heads, d // heads).transpose(0, 2, 1, 3) for z in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads)
    scores = np.where(np.tril(np.ones((length, length), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=3, keepdims=True))
    out = (weights / weights.sum(axis=3, keepdims=True)) @ v
    return out.transpose(0, 2, 1, 3).reshape(n * length, d)


def transformer_lm_loss(d: dict, length: int = 64, heads: int = 4, blocks: int = 2) -> float:
    """examples/transformer_lm.py: embeddings, pre-norm blocks (causal
    attention, gelu MLP), a final layer norm and cross-entropy of the next char."""
    erf = np.vectorize(math.erf)  # no scipy: not a dependency of the test extra

    x = d["E"][d["ids"]] + d["P"][d["positions"]]
    for b in range(blocks):
        h = _layer_norm(x, d[f"g{b}a"], d[f"b{b}a"])
        x = x + _causal_attention(h @ d[f"Wq{b}"], h @ d[f"Wk{b}"], h @ d[f"Wv{b}"], length, heads) @ d[f"Wo{b}"]
        u = _layer_norm(x, d[f"g{b}m"], d[f"b{b}m"]) @ d[f"W{b}up"] + d[f"c{b}up"]
        x = x + (u * (1 + erf(u / np.sqrt(2))) / 2) @ d[f"W{b}down"] + d[f"c{b}down"]
    z = _layer_norm(x, d["gf"], d["bf"]) @ d["Wout"]
    zmax = z.max(axis=1, keepdims=True)
    lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(axis=1))
    return float(np.mean(lse - z[np.arange(len(z)), d["targets"]]))


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


def _logsumexp(z: np.ndarray, axis: int) -> np.ndarray:
    top = z.max(axis=axis, keepdims=True)
    return (top + np.log(np.exp(z - top).sum(axis=axis, keepdims=True))).squeeze(axis)


def gmm_loss(d: dict) -> float:
    """ADBench's GMM objective, written with numpy's own linear algebra."""
    X, alpha, means, qd, ql = d["X"], d["alpha"][:, 0], d["means"], d["qd"], d["ql"]
    n, dim = X.shape
    terms = np.empty((n, len(alpha)))
    for k in range(len(alpha)):
        Q = np.diag(np.exp(qd[k]))
        Q[np.tril_indices(dim, -1)] = ql[k]  # row by row, as the example
        z = (X - means[k]) @ Q.T
        terms[:, k] = alpha[k] + qd[k].sum() - 0.5 * (z**2).sum(axis=1)
    log_likelihood = _logsumexp(terms, 1).sum() - n * _logsumexp(alpha, 0) - n * dim * np.log(2 * np.pi) / 2
    prior = 0.5 * ((np.exp(qd) ** 2).sum() + (ql**2).sum())
    return float(prior - log_likelihood)


def _rotate(rot: np.ndarray, v: np.ndarray) -> np.ndarray:
    theta = np.linalg.norm(rot)
    if theta**2 <= 1e-20:
        return v + np.cross(rot, v)
    axis = rot / theta
    return v * np.cos(theta) + np.cross(axis, v) * np.sin(theta) + axis * axis.dot(v) * (1 - np.cos(theta))


def bundle_adjustment_residuals(d: dict) -> np.ndarray:
    rows = []
    for i in range(len(d["cam"])):
        c, X = d["cams"][d["cam"][i]], d["pts"][d["pt"][i]]
        p = _rotate(c[0:3], X - c[3:6])
        p = -p[:2] / p[2]
        r_sq = p.dot(p)
        projected = c[6] * (1 + c[9] * r_sq + c[10] * r_sq**2) * p + c[7:9]
        rows.append(d["weights"][i, 0] * (projected - d["feats"][i]))
    return np.array(rows)


def bundle_adjustment_loss(d: dict) -> float:
    return float((bundle_adjustment_residuals(d) ** 2).sum())


def polynomial_fit_loss(d: dict) -> float:
    x, y = d["points"][:, 0], d["points"][:, 1]
    return float(np.mean((np.polyval(d["coeffs"][0, ::-1], x) - y) ** 2))


def big_logsumexp_loss(d: dict) -> float:
    return float(_logsumexp(d["v"][:, 0], 0))


def lstm_lm_loss(d: dict) -> float:
    """examples/lstm_lm.py: an LSTM (PyTorch's LSTMCell equations, one bias a
    gate) over the rows of X from the zero state, logits h V + c at each
    step, softmax cross-entropy against the rows of Y, mean over steps."""
    hidden = d["U_i"].shape[0]
    h = cell = np.zeros((1, hidden))
    logits = []
    for t in range(d["X"].shape[0]):
        z = {g: d["X"][t:t + 1] @ d[f"W_{g}"] + h @ d[f"U_{g}"] + d[f"b_{g}"] for g in "ifgo"}
        cell = sigmoid(z["f"]) * cell + sigmoid(z["i"]) * np.tanh(z["g"])
        h = sigmoid(z["o"]) * np.tanh(cell)
        logits.append(h @ d["V"] + d["c"])
    z = np.concatenate(logits)
    return float(np.mean(_logsumexp(z, 1) - (d["Y"] * z).sum(axis=1)))


def _mlp_and_second_derivative(d: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A two-hidden-layer tanh MLP of a column x and its second derivative
    in x, by the chain rule written out (tanh' = 1 - tanh^2)."""
    h1 = np.tanh(x @ d["W1"] + d["b1"])
    dh1 = (1 - h1**2) * d["W1"]
    d2h1 = -2 * h1 * (1 - h1**2) * d["W1"] ** 2
    h2 = np.tanh(h1 @ d["W2"] + d["b2"])
    dz2, d2z2 = dh1 @ d["W2"], d2h1 @ d["W2"]
    d2h2 = -2 * h2 * (1 - h2**2) * dz2**2 + (1 - h2**2) * d2z2
    return h2 @ d["W3"] + d["b3"], d2h2 @ d["W3"]


def pinn_poisson_loss(d: dict) -> float:
    """examples/pinn_poisson.py: mean (u'' + pi^2 sin(pi x))^2 + mean u(boundary)^2."""
    _, d2u = _mlp_and_second_derivative(d, d["x"])
    boundary, _ = _mlp_and_second_derivative(d, d["xb"])
    return float(np.mean((d2u + np.pi**2 * np.sin(np.pi * d["x"])) ** 2) + np.mean(boundary**2))


NUMPY_LOSSES = {
    "pinn_poisson": pinn_poisson_loss,
    "lstm_lm": lstm_lm_loss,
    "gmm": gmm_loss,
    "bundle_adjustment": bundle_adjustment_loss,
    "polynomial_fit": polynomial_fit_loss,
    "big_logsumexp": big_logsumexp_loss,
    "mlp": mlp_loss,
    "relu_net": relu_net_loss,
    "mnist_mlp": mnist_mlp_loss,
    "digits_mlp": mnist_mlp_loss,
    "cnn_digits": cnn_digits_loss,  # the same network: tanh MLP, softmax cross-entropy
    "lstm_sequence": lstm_sequence_loss,
    "transformer_lm": transformer_lm_loss,
}
