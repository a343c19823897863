"""A fused loop's member values keep selects, comparisons, Abs and sign as
they stand (schedule/scheduler.py `_member_values`): over the inlined
values SymPy could decide a condition (the Abs of u**2 + 1 with u real) or drop an
Abs, and evaluating them was most of saddle's scheduling time. Values and
gradients against numpy and central differences."""

import numpy as np
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn

N = 5
x = sp.MatrixSymbol("x", 1, N)
VALUES = np.array([[-2.0, -0.5, 0.25, 1.5, 3.0]])


def test_selects_abs_and_sign_over_inlined_values_match_numpy():
    u = sp.Matrix(1, N, lambda i, j: sp.sin(x[i, j]) * x[i, j])  # a value the select's members inline
    sel = sbp.where([[sp.StrictGreaterThan(u[0, j], sp.Rational(1, 10)) for j in range(N)]],
                    sp.Matrix(1, N, lambda i, j: sp.Abs(u[i, j] ** 2 + 1) * u[i, j]),
                    sp.Matrix(1, N, lambda i, j: -u[i, j]))
    frozen = sp.Matrix(1, N, lambda i, j: 1 - sp.sign(sp.Abs(u[i, j] - u[i, j] + x[i, j] ** 2)))
    y = sel + frozen
    mod = sbp.compile(sbp.Model("member_values_as_they_stand", inputs=[], params=[x], loss=nn.sum_all(y),
                                outputs={"y": y}))
    v = np.sin(VALUES) * VALUES
    want = np.where(v > 0.1, (v**2 + 1) * v, -v) + 1 - np.sign(VALUES**2)
    np.testing.assert_allclose(mod.forward(x=VALUES)["y"], want, rtol=1e-14)
    _, grads = mod.value_and_grad(x=VALUES)
    dv = np.cos(VALUES) * VALUES + np.sin(VALUES)
    np.testing.assert_allclose(grads["x"], np.where(v > 0.1, 3 * v**2 + 1, -1) * dv, rtol=1e-13)
    fd = central_differences(lambda d: mod.value_and_grad(**d)[0], {"x": VALUES}, "x")
    assert relative_error(grads["x"], fd) < 1e-8
