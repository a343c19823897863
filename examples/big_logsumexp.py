"""log(sum(exp(v))) of a long vector, computed stably (its maximum
subtracted first), and its gradient softmax(v). The length n is bound at
call time: the C is the same for ten entries and for a million."""

import numpy as np
import sympy as sp

import symbackprop as sbp

n = sp.Symbol("n", integer=True, positive=True)
v = sp.MatrixSymbol("v", n, 1)

model = sbp.Model("big_logsumexp", params=[v], loss=sbp.reduce("logsumexp", v, 0))


def sample_data(rng: np.random.Generator, length: int = 50) -> dict:
    return {"v": 30.0 * rng.standard_normal((length, 1))}
