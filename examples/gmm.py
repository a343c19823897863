"""A Gaussian mixture model's negative log-likelihood (the ADBench GMM
objective): K components in D dimensions fitted to N points.

Each component k has a weight logit alpha_k, a mean mu_k and a precision
factor Q_k: lower triangular, its diagonal exp(qd_k) (so log-det Q_k is
sum(qd_k)) and its strictly lower part ql_k, row by row. A Wishart-style
prior keeps the precisions bounded. The per-(point, component) term is one
symbolic body, mapped over every pair in one C loop; the C grows with D^2
(the body's size), never with N or K.
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

D = 3  # dimensions: the body has O(D^2) operations
N, K = sp.symbols("N K", integer=True, positive=True)
X = sp.MatrixSymbol("X", N, D)
alpha = sp.MatrixSymbol("alpha", K, 1)
means = sp.MatrixSymbol("means", K, D)
qd = sp.MatrixSymbol("qd", K, D)  # log of Q's diagonal
ql = sp.MatrixSymbol("ql", K, D * (D - 1) // 2)  # Q's strictly lower part, row by row
GAMMA, M_DOF = sp.Rational(1, 1), 0  # the prior's scale and extra degrees of freedom

x = sp.Matrix(sp.symbols(f"x0:{D}", real=True))
mu = sp.Matrix(sp.symbols(f"mu0:{D}", real=True))
d = sp.Matrix(sp.symbols(f"d0:{D}", real=True))
low = sp.Matrix(sp.symbols(f"l0:{D * (D - 1) // 2}", real=True))
a = sp.Symbol("a", real=True)


def precision_factor(d: sp.Matrix, low: sp.Matrix) -> sp.Matrix:
    """Q: exp(d) on the diagonal, the entries of `low` below it, row by row."""
    Q = sp.zeros(D, D)
    entries = iter(low)
    for i in range(D):
        Q[i, i] = sp.exp(d[i])
        for j in range(i):
            Q[i, j] = next(entries)
    return Q


z = precision_factor(d, low) * (x - mu)
# log of component k's weighted density at point i, up to the constants
term = a + sum(d) - sum(v**2 for v in z) / 2
log_density = sbp.map_examples(term, [(x, X), (mu, means), (d, qd), (low, ql), (a, alpha)])  # N x K

# every term is 1 x 1; a number joins a sum of matrices as number * Identity(1)
log_likelihood = (nn.sum_all(sbp.reduce("logsumexp", log_density, 1)) - N * sbp.reduce("logsumexp", alpha, 0)
                  - N * D * sp.log(2 * sp.pi) / 2 * sp.Identity(1))
prior = (GAMMA**2 / 2 * (nn.sum_all(qd.applyfunc(lambda v: sp.exp(2 * v))) + nn.sum_all(sp.HadamardPower(ql, 2)))
         - M_DOF * nn.sum_all(qd))
loss = prior - log_likelihood

model = sbp.Model("gmm", inputs=[X], params=[alpha, means, qd, ql], loss=loss,
                  outputs={"log_density": log_density})


def sample_data(rng: np.random.Generator, points: int = 20, components: int = 4) -> dict:
    return {
        "X": rng.standard_normal((points, D)),
        "alpha": rng.standard_normal((components, 1)),
        "means": rng.standard_normal((components, D)),
        "qd": 0.3 * rng.standard_normal((components, D)),
        "ql": 0.3 * rng.standard_normal((components, D * (D - 1) // 2)),
    }
