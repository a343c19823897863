"""Polynomial least squares: the mean squared error of a degree-5
polynomial through N points. The coefficients are shared by every
example (a one-row source), so their gradient adds up over the examples
inside the same loop."""

import numpy as np
import sympy as sp

import symbackprop as sbp

DEGREE = 5
N = sp.Symbol("N", integer=True, positive=True)
points = sp.MatrixSymbol("points", N, 2)  # (x, y) per row
coeffs = sp.MatrixSymbol("coeffs", 1, DEGREE + 1)

x, y = sp.symbols("x y", real=True)
k = sp.Matrix(sp.symbols(f"k0:{DEGREE + 1}", real=True))
polynomial = sum(k[j] * x**j for j in range(DEGREE + 1))
squared_error = sbp.map_examples((polynomial - y) ** 2, [((x, y), points), (k, coeffs)])  # N x 1

model = sbp.Model("polynomial_fit", inputs=[points], params=[coeffs],
                  loss=sbp.reduce("mean", squared_error, 0), outputs={"squared_error": squared_error})


def sample_data(rng: np.random.Generator, count: int = 30) -> dict:
    x = rng.uniform(-1, 1, count)
    return {
        "points": np.stack([x, np.cos(3 * x) + 0.1 * rng.standard_normal(count)], axis=1),
        "coeffs": rng.standard_normal((1, DEGREE + 1)),
    }
