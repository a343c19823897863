"""The example workloads' losses (W5-W8) for autodiff frameworks, written once
for torch and jax.numpy.

``F`` is a namespace of the few functions they need (``exp``, ``log``,
``sqrt``, ``sin``, ``cos``, ``where``, ``stack``, ``logsumexp(x, axis)``),
all called positionally, which is where torch and jax.numpy agree; the
rest is operators and indexing. Everything is vectorised over the data:
the gathers ``cams[cam]`` and ``pts[pt]`` are integer indexing, whose
gradients the frameworks scatter-add. The LSTM (W9) needs a loop, which
each framework writes its own way (``_torch.py``, ``jax_jit.py``).
"""

from __future__ import annotations

import math

from .. import workloads


def gmm(F, inputs, params):
    """W5: examples/gmm.py. z = Q_k (x - mu_k) written out entry by entry
    for the example's D = 3 (Q_k: exp(qd_k) on the diagonal, ql_k below
    it, row by row)."""
    X, alpha, means = inputs["X"], params["alpha"][:, 0], params["means"]
    qd, ql = params["qd"], params["ql"]
    n, D = X.shape
    diff = X[:, None, :] - means[None, :, :]  # (n, K, D)
    sq, low = 0.0, 0
    for i in range(D):
        z = F.exp(qd[:, i]) * diff[:, :, i]
        for j in range(i):
            z = z + ql[:, low] * diff[:, :, j]
            low += 1
        sq = sq + z * z
    terms = alpha + qd.sum(1) - 0.5 * sq  # (n, K)
    log_likelihood = (F.logsumexp(terms, 1).sum() - n * F.logsumexp(alpha, 0)
                      - n * D * math.log(2 * math.pi) / 2)
    prior = 0.5 * (F.exp(2 * qd).sum() + (ql * ql).sum())
    return prior - log_likelihood


def _dot(a, b):
    return (a * b).sum(-1)


def _cross(F, a, b):
    return F.stack([a[..., 1] * b[..., 2] - a[..., 2] * b[..., 1],
                    a[..., 2] * b[..., 0] - a[..., 0] * b[..., 2],
                    a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]], -1)


def ba_residual(F, c, X, w, u):
    """W6: examples/bundle_adjustment.py's residual w (projection - u) of
    observations with camera rows c (..., 11), points X (..., 3), weights
    w (..., 1) and features u (..., 2): batched, or one observation.
    The small-angle branch is selected with ``where`` on a safe angle (no
    NaN in the unused branch's gradient)."""
    rot, centre = c[..., 0:3], c[..., 3:6]
    v = X - centre
    theta_sq = _dot(rot, rot)[..., None]
    big = theta_sq > 1e-20
    theta = F.sqrt(F.where(big, theta_sq, 1.0))
    a = rot / theta
    co, si = F.cos(theta), F.sin(theta)
    full = v * co + _cross(F, a, v) * si + a * _dot(a, v)[..., None] * (1 - co)
    rotated = F.where(big, full, v + _cross(F, rot, v))
    p = -rotated[..., 0:2] / rotated[..., 2:3]
    r_sq = _dot(p, p)[..., None]
    distortion = 1 + c[..., 9:10] * r_sq + c[..., 10:11] * r_sq * r_sq
    return w * (c[..., 6:7] * distortion * p + c[..., 7:9] - u)


def ba(F, inputs, params):
    """W6: the sum of squared residuals, cameras and points gathered by index."""
    r = ba_residual(F, params["cams"][inputs["cam"]], params["pts"][inputs["pt"]],
                    params["weights"], inputs["feats"])
    return (r * r).sum()


def polynomial_fit(F, inputs, params):
    """W7: examples/polynomial_fit.py, the polynomial by Horner's rule."""
    x, y, k = inputs["points"][:, 0], inputs["points"][:, 1], params["coeffs"][0]
    p = k[workloads.POLY_DEGREE]
    for j in range(workloads.POLY_DEGREE - 1, -1, -1):
        p = p * x + k[j]
    d = p - y
    return (d * d).mean()


def big_logsumexp(F, inputs, params):
    """W8: examples/big_logsumexp.py."""
    return F.logsumexp(params["v"][:, 0], 0)


LOSSES = {"W5": gmm, "W6": ba, "W7": polynomial_fit, "W8": big_logsumexp}
