"""Hand-written numpy forward and backward passes of the example workloads
(W5-W10B): the reference the other peers are checked against, and the
numpy_ref peer's timed code.

Each function takes ``(inputs, params)`` and returns ``(loss, {name:
array})``: the params' gradients, or for ``ba_forward`` the forward outputs
(residuals and per-observation Jacobians). Everything is vectorised over
the data except the LSTM's recurrence, a Python loop over the steps.
``benchmarks/test_harness.py`` checks every gradient against finite
differences and every loss against the independent numpy losses in
``tests/oracles.py``.
"""

from __future__ import annotations

import numpy as np

from .. import workloads


def _logsumexp(z, axis):
    top = z.max(axis=axis, keepdims=True)
    return (top + np.log(np.exp(z - top).sum(axis=axis, keepdims=True))).squeeze(axis)


def _softmax(z, axis):
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


# --------------------------------------------------------------------------
# W5: examples/gmm.py


def gmm(inputs, params):
    X, alpha, means = inputs["X"], params["alpha"][:, 0], params["means"]
    qd, ql = params["qd"], params["ql"]
    n, D = X.shape
    K = len(alpha)
    rows, cols = np.tril_indices(D, -1)  # row by row, as the example
    diag = np.arange(D)
    Q = np.zeros((K, D, D), dtype=X.dtype)
    Q[:, rows, cols] = ql
    Q[:, diag, diag] = np.exp(qd)
    diff = X[:, None, :] - means[None, :, :]  # (n, K, D)
    z = np.einsum("kij,nkj->nki", Q, diff)  # Q_k (x_n - mu_k)
    terms = alpha + qd.sum(axis=1) - 0.5 * (z * z).sum(axis=2)  # (n, K)
    log_likelihood = (_logsumexp(terms, 1).sum() - n * _logsumexp(alpha, 0)
                      - n * D * np.log(2 * np.pi) / 2)
    prior = 0.5 * (np.exp(2 * qd).sum() + (ql * ql).sum())
    loss = float(prior - log_likelihood)

    r = _softmax(terms, 1)  # dloss/dterms = -r
    g_z = r[:, :, None] * z  # dterms/dz = -z
    g_Q = np.einsum("nki,nkj->kij", g_z, diff)
    g_diff = np.einsum("kij,nki->nkj", Q, g_z)
    grads = {
        "alpha": (n * _softmax(alpha, 0) - r.sum(axis=0))[:, None],
        "means": -g_diff.sum(axis=0),
        "qd": -r.sum(axis=0)[:, None] + g_Q[:, diag, diag] * np.exp(qd) + np.exp(2 * qd),
        "ql": g_Q[:, rows, cols] + ql,
    }
    return loss, grads


# --------------------------------------------------------------------------
# W6: examples/bundle_adjustment.py

SMALL_ANGLE_SQ = 1e-20  # below it, the first-order rotation (as the example)


def _dot(a, b):
    return (a * b).sum(axis=-1)


def ba_vjp(c, X, w, u, seeds):
    """Residuals of each observation (camera rows ``c``, points ``X``,
    weights ``w`` (n, 1), features ``u``), and for each seed (n, 2) the
    vector-Jacobian products ``(g_c, g_X, g_w)``, per observation."""
    rot, centre, f = c[:, 0:3], c[:, 3:6], c[:, 6:7]
    k1, k2 = c[:, 9:10], c[:, 10:11]
    v = X - centre
    theta_sq = _dot(rot, rot)[:, None]
    big = theta_sq > SMALL_ANGLE_SQ
    theta = np.sqrt(np.where(big, theta_sq, 1.0))
    a = rot / theta
    co, si = np.cos(theta), np.sin(theta)
    a_cross_v = np.cross(a, v)
    s = _dot(a, v)[:, None]
    R = np.where(big, v * co + a_cross_v * si + a * s * (1 - co), v + np.cross(rot, v))
    p = -R[:, 0:2] / R[:, 2:3]
    r_sq = _dot(p, p)[:, None]
    distortion = 1 + k1 * r_sq + k2 * r_sq * r_sq
    projected = f * distortion * p + c[:, 7:9]
    residual = w * (projected - u)

    results = []
    for g_res in seeds:
        g_w = _dot(g_res, projected - u)[:, None]
        g_proj = w * g_res
        g_f = _dot(g_proj, distortion * p)[:, None]
        g_dist = f * _dot(g_proj, p)[:, None]
        g_r_sq = g_dist * (k1 + 2 * k2 * r_sq)
        g_p = f * distortion * g_proj + 2 * p * g_r_sq
        g_R = np.concatenate([-g_p / R[:, 2:3], _dot(g_p, R[:, 0:2])[:, None] / R[:, 2:3] ** 2], axis=1)
        # the full rotation: R = v cos + (a x v) sin + a (a.v)(1 - cos), a = rot / theta
        g_a_dot = _dot(g_R, a)[:, None]
        g_v_full = g_R * co + si * np.cross(g_R, a) + (1 - co) * g_a_dot * a
        g_a = si * np.cross(v, g_R) + (1 - co) * (s * g_R + g_a_dot * v)
        g_theta = -si * (_dot(g_R, v)[:, None] - g_a_dot * s) + co * _dot(g_R, a_cross_v)[:, None]
        g_theta = g_theta - _dot(g_a, rot)[:, None] / theta**2
        g_rot_full = g_a / theta + g_theta * rot / theta
        # the small-angle one: R = v + rot x v
        g_v = np.where(big, g_v_full, g_R + np.cross(g_R, rot))
        g_rot = np.where(big, g_rot_full, np.cross(v, g_R))
        g_c = np.concatenate([g_rot, -g_v, g_f, g_proj, g_dist * r_sq, g_dist * r_sq * r_sq], axis=1)
        results.append((g_c, g_v, g_w))
    return residual, results


def _gathered(inputs, params):
    c = params["cams"][inputs["cam"]]
    X = params["pts"][inputs["pt"]]
    return c, X, params["weights"], inputs["feats"]


def _scatter_rows(index, values, rows):
    """out[index[i]] += values[i], one bincount per column."""
    return np.stack([np.bincount(index, weights=values[:, j], minlength=rows)
                     for j in range(values.shape[1])], axis=1).astype(values.dtype, copy=False)


def ba(inputs, params):
    c, X, w, u = _gathered(inputs, params)
    residual, _ = ba_vjp(c, X, w, u, [])
    _, [(g_c, g_X, g_w)] = ba_vjp(c, X, w, u, [2 * residual])
    loss = float((residual * residual).sum())
    return loss, {
        "cams": _scatter_rows(inputs["cam"], g_c, len(params["cams"])),
        "pts": _scatter_rows(inputs["pt"], g_X, len(params["pts"])),
        "weights": g_w,
    }


def ba_forward(inputs, params):
    """The loss, the residuals and each observation's 2 x 15 Jacobian with
    respect to its camera, point and weight, row-major (the example's
    ``jacobian`` output): one vector-Jacobian product per residual row."""
    c, X, w, u = _gathered(inputs, params)
    n = len(w)
    seeds = [np.zeros((n, 2), dtype=w.dtype) for _ in range(2)]
    seeds[0][:, 0] = 1
    seeds[1][:, 1] = 1
    residual, rows = ba_vjp(c, X, w, u, seeds)
    jacobian = np.stack([np.concatenate(row, axis=1) for row in rows], axis=1)  # (n, 2, 15)
    return float((residual * residual).sum()), {"residual": residual,
                                                "jacobian": jacobian.reshape(n, 30)}


# --------------------------------------------------------------------------
# W7: examples/polynomial_fit.py


def polynomial_fit(inputs, params):
    points, coeffs = inputs["points"], params["coeffs"]
    x, y = points[:, 0], points[:, 1]
    powers = np.empty((len(x), coeffs.shape[1]), dtype=x.dtype)  # x**j, by products (no pow)
    powers[:, 0] = 1
    for j in range(1, coeffs.shape[1]):
        powers[:, j] = powers[:, j - 1] * x
    d = powers @ coeffs[0] - y
    n = len(x)
    return float(d @ d / n), {"coeffs": ((2.0 / n) * (d @ powers))[None, :]}


# --------------------------------------------------------------------------
# W8: examples/big_logsumexp.py


def big_logsumexp(inputs, params):
    v = params["v"]
    top = v.max()
    e = np.exp(v - top)
    total = e.sum()
    return float(top + np.log(total)), {"v": e / total}


# --------------------------------------------------------------------------
# W9: examples/lstm_lm.py


def lstm_lm(inputs, params):
    """The LSTM (PyTorch's LSTMCell equations, one bias a gate, gates i, f,
    g, o) from the zero state over the rows of X, logits h V + c, softmax
    cross-entropy against Y, mean over the steps; backpropagation through
    time by hand."""
    X, Y = inputs["X"], inputs["Y"]
    gates = workloads.LSTM_GATES
    Wc = np.concatenate([params[f"W_{g}"] for g in gates], axis=1)  # (vocab, 4H)
    Uc = np.concatenate([params[f"U_{g}"] for g in gates], axis=1)  # (H, 4H)
    bc = np.concatenate([params[f"b_{g}"] for g in gates], axis=1)  # (1, 4H)
    T, H = len(X), Uc.shape[0]
    XW = X @ Wc + bc
    acts = np.empty((T, 4 * H), dtype=X.dtype)  # i, f, g, o after their nonlinearity
    cells = np.empty((T + 1, H), dtype=X.dtype)  # cells[t + 1] is step t's cell
    hs = np.empty((T + 1, H), dtype=X.dtype)  # hs[t + 1] is step t's h
    tanh_c = np.empty((T, H), dtype=X.dtype)
    cells[0] = hs[0] = 0
    for t in range(T):
        z = XW[t] + hs[t] @ Uc
        a = acts[t]
        a[: 2 * H] = _sigmoid(z[: 2 * H])
        a[2 * H: 3 * H] = np.tanh(z[2 * H: 3 * H])
        a[3 * H:] = _sigmoid(z[3 * H:])
        cells[t + 1] = a[H: 2 * H] * cells[t] + a[:H] * a[2 * H: 3 * H]
        tanh_c[t] = np.tanh(cells[t + 1])
        hs[t + 1] = a[3 * H:] * tanh_c[t]
    V, c = params["V"], params["c"]
    logits = hs[1:] @ V + c
    loss = float(np.mean(_logsumexp(logits, 1) - (Y * logits).sum(axis=1)))

    d_logits = (_softmax(logits, 1) * Y.sum(axis=1, keepdims=True) - Y) / T
    d_hs = d_logits @ V.T
    dZ = np.empty_like(acts)
    dh_next = np.zeros(H, dtype=X.dtype)
    dc_next = np.zeros(H, dtype=X.dtype)
    for t in range(T - 1, -1, -1):
        a = acts[t]
        i, f, g, o = a[:H], a[H: 2 * H], a[2 * H: 3 * H], a[3 * H:]
        dh = d_hs[t] + dh_next
        dc = dh * o * (1 - tanh_c[t] ** 2) + dc_next
        dz = dZ[t]
        dz[:H] = dc * g * i * (1 - i)
        dz[H: 2 * H] = dc * cells[t] * f * (1 - f)
        dz[2 * H: 3 * H] = dc * i * (1 - g * g)
        dz[3 * H:] = dh * tanh_c[t] * o * (1 - o)
        dc_next = dc * f
        dh_next = Uc @ dz
    gW, gU, gb = X.T @ dZ, hs[:-1].T @ dZ, dZ.sum(axis=0, keepdims=True)
    grads = {}
    for k, g in enumerate(gates):
        cut = slice(k * H, (k + 1) * H)
        grads[f"W_{g}"], grads[f"U_{g}"], grads[f"b_{g}"] = gW[:, cut], gU[:, cut], gb[:, cut]
    grads["V"] = hs[1:].T @ d_logits
    grads["c"] = d_logits.sum(axis=0, keepdims=True)
    return loss, grads


# --------------------------------------------------------------------------
# W10, W10B: examples/cnn_digits.py


def _conv3x3(x, w):
    """A 3x3 convolution, stride 1, zero padding 1 (PyTorch's Conv2d, no
    bias) of ``x`` (n, C, H, W) by ``w`` (C_out, C*9); returns the output
    (n, C_out, H, W) and the windows (n*H*W, C*9) its backward needs."""
    n, C, H, W = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # n, C, H, W, 3, 3
    cols = np.ascontiguousarray(windows.transpose(0, 2, 3, 1, 4, 5)).reshape(n * H * W, C * 9)
    return (cols @ w.T).reshape(n, H, W, -1).transpose(0, 3, 1, 2), cols


def _conv3x3_backward(d_out, cols, w, x_shape):
    """Gradients of the weights and of the input of ``_conv3x3``."""
    n, C, H, W = x_shape
    d_rows = d_out.transpose(0, 2, 3, 1).reshape(n * H * W, -1)  # n*H*W, C_out
    d_cols = (d_rows @ w).reshape(n, H, W, C, 3, 3)
    d_padded = np.zeros((n, C, H + 2, W + 2), dtype=d_out.dtype)
    for i in range(3):
        for j in range(3):
            d_padded[:, :, i:i + H, j:j + W] += d_cols[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return d_rows.T @ cols, d_padded[:, :, 1:-1, 1:-1]


def _max_pool2(x):
    """2 x 2 max pool, stride 2; returns the output and each window's
    first largest entry (PyTorch's choice for the gradient)."""
    n, C, H, W = x.shape
    windows = x.reshape(n, C, H // 2, 2, W // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, C, H // 2, W // 2, 4)
    first = windows.argmax(axis=-1)
    return np.take_along_axis(windows, first[..., None], -1)[..., 0], first


def _max_pool2_backward(d_out, first, x_shape):
    n, C, H, W = x_shape
    d_windows = (np.arange(4) == first[..., None]) * d_out[..., None]  # n, C, H/2, W/2, 4
    return d_windows.reshape(n, C, H // 2, W // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(x_shape)


def _conv_block(x, w, b):
    """conv 3x3 (padding 1) + bias -> relu -> max pool 2, and what its backward needs."""
    z, cols = _conv3x3(x, w)
    a = np.maximum(z + b.reshape(1, -1, 1, 1), 0)
    pooled, first = _max_pool2(a)
    return pooled, (x.shape, cols, a.shape, a > 0, first)


def _conv_block_backward(d_pooled, w, saved):
    x_shape, cols, a_shape, positive, first = saved
    dz = _max_pool2_backward(d_pooled, first, a_shape) * positive
    dw, dx = _conv3x3_backward(dz, cols, w, x_shape)
    return dw, dz.sum(axis=(0, 2, 3))[None, :], dx


def cnn_digits(inputs, params):
    """The LeNet-style net of examples/cnn_digits.py: images as NCHW rows,
    two conv-relu-pool blocks, flatten (NCHW order, as torch.flatten),
    linear-relu-linear, softmax cross-entropy, mean over the batch."""
    X, T = inputs["X"], inputs["T"]
    n, side = len(X), workloads.CNN_SIDE
    p = params
    h1, saved1 = _conv_block(X.reshape(n, 1, side, side), p["K1"], p["c1"])
    h2, saved2 = _conv_block(h1, p["K2"], p["c2"])
    flat = h2.reshape(n, -1)
    z1 = flat @ p["W1"] + p["b1"]
    a1 = np.maximum(z1, 0)
    logits = a1 @ p["W2"] + p["b2"]
    loss = float(np.mean(_logsumexp(logits, 1) - (T * logits).sum(axis=1)))

    d_logits = (_softmax(logits, 1) * T.sum(axis=1, keepdims=True) - T) / n
    d_z1 = (d_logits @ p["W2"].T) * (z1 > 0)
    grads = {"W2": a1.T @ d_logits, "b2": d_logits.sum(axis=0, keepdims=True),
             "W1": flat.T @ d_z1, "b1": d_z1.sum(axis=0, keepdims=True)}
    d_h2 = (d_z1 @ p["W1"].T).reshape(h2.shape)
    grads["K2"], grads["c2"], d_h1 = _conv_block_backward(d_h2, p["K2"], saved2)
    grads["K1"], grads["c1"], _ = _conv_block_backward(d_h1, p["K1"], saved1)
    return loss, {name: grads[name] for name in ("K1", "c1", "K2", "c2", "W1", "b1", "W2", "b2")}


# by workload name: W6 and W6J share the example
FUNCTIONS = {
    "W5": gmm,
    "W6": ba,
    "W6J": ba_forward,
    "W7": polynomial_fit,
    "W8": big_logsumexp,
    "W9": lstm_lm,
    "W10": cnn_digits,
    "W10B": cnn_digits,
}
