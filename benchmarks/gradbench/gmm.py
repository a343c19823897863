"""GradBench `gmm`: the log-posterior of a Gaussian mixture (ADBench's GMM).

Definition (cpp/gradbench/evals/gmm.hpp): K components in d dimensions, N points;
component k has a weight logit alpha_k, a mean mu_k and a precision factor Q_k,
lower triangular with exp(q_k) on its diagonal and l_k below it, stored column by
column (for i < d, for j > i: Q[j, i] = l[next]). With m = 0 and gamma = 1,

    objective = -N d/2 log(2 pi) + sum_i logsumexp_k(alpha_k + sum(q_k) - |Q_k (x_i - mu_k)|^2 / 2)
                - N logsumexp(alpha) - sum_k (gamma^2/2 (|exp(q_k)|^2 + |l_k|^2) - m sum(q_k)) + K C,
    C = n' d (log gamma - log(2)/2) - log Gamma_d(n'/2),  n' = d + m + 1.

`objective` returns it; `jacobian` its gradient with respect to alpha, mu, q and l.
Data (evals/gmm/run.py `generate`): rng = numpy.random.default_rng(31337); x: N rows
of rng.normal(size=d); mu: K rows of rng.uniform(size=d); q: K rows of
rng.normal(size=d); l: K rows of rng.normal(size=d(d-1)/2); alpha: rng.normal(size=K).
Published sizes: d in (2, 10, 20, 32, 64) x K in (5, 10, 25, 50, 100), N = 1000.

symbackprop: the per-(point, component) term is one scalar body of O(d^2) operations,
mapped over every pair; JAX and PyTorch: the same formula vectorised over (N, K, d).
The derivative reference is JAX's (no hand-written numpy gradient); the objective is
also checked against a direct numpy evaluation, and the gradient against finite
differences at small sizes.
"""

from __future__ import annotations

import math

import numpy as np

from ._common import jax_module, jax_value_grad_pair, torch_module, torch_value_grad_pair

NAME = "gmm"
PRIMAL, DERIVATIVE = "objective", "jacobian"
SIZES = sorted(({"d": d, "k": k, "n": 1000} for d in (2, 10, 20, 32, 64) for k in (5, 10, 25, 50, 100)),
               key=lambda s: s["d"] * s["k"])
DEFAULT = {"d": 20, "k": 25, "n": 1000}  # issue 15's table
SMALL = {"d": 2, "k": 5, "n": 1000}
SCALING = [{"d": d, "k": 25, "n": 1000} for d in (2, 10, 20, 32)]
PARAMS = ("alpha", "mu", "q", "l")
GAMMA, M = 1.0, 0


def label(size: dict) -> str:
    return f"d={size['d']},K={size['k']},N={size['n']}"


def work(size: dict) -> float:
    return float(size["n"] * size["k"] * size["d"] ** 2)


def generate(size: dict) -> dict:
    d, k, n = size["d"], size["k"], size["n"]
    rng = np.random.default_rng(seed=31337)
    x = np.array([rng.normal(size=d) for _ in range(n)])
    mu = np.array([rng.uniform(size=d) for _ in range(k)])
    q = np.array([rng.normal(size=d) for _ in range(k)])
    low = np.array([rng.normal(size=d * (d - 1) // 2) for _ in range(k)]).reshape(k, d * (d - 1) // 2)
    alpha = rng.normal(size=k)
    return {"x": x, "alpha": alpha, "mu": mu, "q": q, "l": low}


def _tril(d: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of l's entries in Q, GradBench's column-by-column order."""
    pairs = [(j, i) for i in range(d) for j in range(i + 1, d)]
    return (np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64))


def _constant(d: int, k: int, n: int) -> float:
    nw = d + M + 1
    log_gamma_d = 0.25 * d * (d - 1) * math.log(math.pi) + sum(math.lgamma(0.5 * nw + 0.5 * (1 - j))
                                                              for j in range(1, d + 1))
    C = nw * d * (math.log(GAMMA) - 0.5 * math.log(2)) - log_gamma_d
    return -n * d * 0.5 * math.log(2 * math.pi) + k * C


def objective(data: dict) -> float:
    """The objective in plain numpy (loops over components)."""
    x, alpha, mu, q, low = (data[k] for k in ("x", "alpha", "mu", "q", "l"))
    n, d = x.shape
    k = len(alpha)
    rows, cols = _tril(d)
    terms = np.empty((n, k))
    for j in range(k):
        Q = np.diag(np.exp(q[j]))
        Q[rows, cols] = low[j]
        z = (x - mu[j]) @ Q.T
        terms[:, j] = alpha[j] + q[j].sum() - 0.5 * (z * z).sum(1)
    def lse(a, axis=None):
        m = a.max(axis=axis, keepdims=True)
        return np.squeeze(m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True)), axis=axis)
    prior = -(0.5 * GAMMA**2 * ((np.exp(q) ** 2).sum() + (low**2).sum()) - M * q.sum())
    return float(_constant(d, k, n) + lse(terms, 1).sum() - n * lse(alpha) + prior)


def reference(data: dict) -> tuple[dict, dict | None]:
    return {"value": objective(data)}, None


def fd_error(data: dict, deriv: dict, eps: float = 1e-6) -> float:
    """Relative error of the directional derivative along a random direction
    (central differences of the numpy objective)."""
    rng = np.random.default_rng(1)
    v = {p: rng.standard_normal(np.shape(data[p])) for p in PARAMS}
    plus = objective({**data, **{p: data[p] + eps * v[p] for p in PARAMS}})
    minus = objective({**data, **{p: data[p] - eps * v[p] for p in PARAMS}})
    fd = (plus - minus) / (2 * eps)
    got = sum(float(np.sum(np.asarray(deriv[p]).reshape(np.shape(v[p])) * v[p])) for p in PARAMS)
    return abs(got - fd) / max(abs(fd), 1e-300)


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    d = size["d"]
    nl = d * (d - 1) // 2
    N, K = sp.symbols("N K", integer=True, positive=True)
    X = sp.MatrixSymbol("x", N, d)
    alpha = sp.MatrixSymbol("alpha", K, 1)
    means = sp.MatrixSymbol("mu", K, d)
    qs = sp.MatrixSymbol("q", K, d)
    ls = sp.MatrixSymbol("l", K, max(nl, 1))
    x = sp.symbols(f"x0:{d}", real=True)
    mu = sp.symbols(f"mu0:{d}", real=True)
    q = sp.symbols(f"q0:{d}", real=True)
    low = sp.symbols(f"l0:{max(nl, 1)}", real=True)
    a = sp.Symbol("a", real=True)
    xc = [x[i] - mu[i] for i in range(d)]
    z = [sp.exp(q[j]) * xc[j] for j in range(d)]
    idx = 0
    for i in range(d):
        for j in range(i + 1, d):
            z[j] = z[j] + low[idx] * xc[i]
            idx += 1
    term = a + sum(q) - sum(v**2 for v in z) / 2
    terms = sbp.map_examples(term, [(sp.Matrix(x), X), (sp.Matrix(mu), means), (sp.Matrix(q), qs),
                                    (sp.Matrix(low), ls), (a, alpha)])  # N x K
    nw = d + M + 1
    log_gamma_d = 0.25 * d * (d - 1) * math.log(math.pi) + sum(math.lgamma(0.5 * nw + 0.5 * (1 - j))
                                                              for j in range(1, d + 1))
    C = nw * d * (math.log(GAMMA) - 0.5 * math.log(2)) - log_gamma_d
    constant = (-N * d * sp.log(2 * sp.pi) / 2 + K * sp.Float(C)) * sp.Identity(1)
    lsum = nl and nn.sum_all(sp.HadamardPower(ls, 2))
    prior = -(sp.Float(GAMMA**2 / 2) * (nn.sum_all(qs.applyfunc(lambda v: sp.exp(2 * v))) + lsum)
              - M * nn.sum_all(qs))
    loss = constant + nn.sum_all(sbp.reduce("logsumexp", terms, 1)) - N * sbp.reduce("logsumexp", alpha, 0) + prior
    return sbp.Model(f"gradbench_gmm_d{d}", inputs=[X], params=[alpha, means, qs, ls], loss=loss)


SBP_FUNCTIONS = ("forward", "value_and_grad")


def sbp_calls(mod, data: dict):
    arrays = {"x": data["x"], "alpha": data["alpha"].reshape(-1, 1), "mu": data["mu"], "q": data["q"],
              "l": data["l"] if data["l"].shape[1] else np.zeros((len(data["alpha"]), 1))}
    nl = data["l"].shape[1]

    def derivative():
        g = mod.value_and_grad(**arrays)[1]
        return {"alpha": g["alpha"].ravel(), "mu": g["mu"], "q": g["q"], "l": g["l"][:, :nl]}

    return (lambda: {"value": mod.forward(**arrays)["loss"]}), derivative


def _loss(xp, lse, rows, cols, const):
    def loss(p, c):
        x, alpha, mu, q, low = c["x"], p["alpha"], p["mu"], p["q"], p["l"]
        k, d = mu.shape
        Q = xp.zeros((k, d * d), dtype=x.dtype)
        Q = _put(Q, rows * d + cols, low)
        Q = Q.reshape(k, d, d)
        xc = x[:, None, :] - mu[None, :, :]  # N x K x d
        z = xp.exp(q)[None] * xc + (Q[None] @ xc[..., None])[..., 0]
        terms = alpha[None] + q.sum(1)[None] - 0.5 * (z * z).sum(2)
        prior = -(0.5 * GAMMA**2 * ((xp.exp(q) ** 2).sum() + (low * low).sum()) - M * q.sum())
        return const + lse(terms, 1).sum() - x.shape[0] * lse(alpha, 0) + prior
    return loss


def _put(Q, flat, low):
    if hasattr(Q, "at"):
        return Q.at[:, flat].set(low)
    Q = Q.clone()
    Q[:, flat] = low
    return Q


def _parts(data):
    d, k, n = data["mu"].shape[1], len(data["alpha"]), len(data["x"])
    rows, cols = _tril(d)
    params = {p: data[p] for p in PARAMS}
    return rows, cols, _constant(d, k, n), params, {"x": data["x"]}


def jax_calls(data: dict):
    jax = jax_module()
    import jax.numpy as jnp

    rows, cols, const, params, consts = _parts(data)
    return jax_value_grad_pair(_loss(jnp, lambda a, ax: jax.nn.logsumexp(a, axis=ax), rows, cols, const),
                               params, consts)


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()

    rows, cols, const, params, consts = _parts(data)
    loss = _loss(torch, torch.logsumexp, torch.from_numpy(rows), torch.from_numpy(cols), const)
    return torch_value_grad_pair(loss, params, consts, compiled)
