"""Forward does no derivative work: in the shared forward-and-gradient
function, a per-example loop that computes the loss's terms and adds into
a shared row's gradient in one pass has a value-only variant, which a
forward call runs (issue 15: llsq's primal cost as much as its gradient)."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.pipeline import generate


def _least_squares(m: int) -> sbp.Model:
    n = sp.Symbol("N", integer=True, positive=True)
    points = sp.MatrixSymbol("ts", n, 2)
    coeffs = sp.MatrixSymbol("c", 1, m)
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{m}", real=True)
    residual = s - sum(k[j] * t**j for j in range(m))
    sq = sbp.map_examples(residual**2, [((t, s), points), (sp.Matrix(k), coeffs)])
    return sbp.Model(f"forward_only_{m}", inputs=[points], params=[coeffs], loss=sbp.reduce("sum", sq, 0) / 2)


def _data(m: int, rows: int = 37, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (rows, 2)), rng.normal(size=(1, m))


def _closed_form(ts: np.ndarray, c: np.ndarray) -> tuple[float, np.ndarray]:
    powers = ts[:, :1] ** np.arange(c.shape[1])[None, :]
    r = ts[:, 1] - powers @ c[0]
    return 0.5 * float(r @ r), -(r @ powers)[None, :]


def test_the_forward_branch_adds_into_no_gradient():
    emitted, _ = generate(_least_squares(6), functions=("forward", "value_and_grad"))
    source = emitted.source
    assert "if (with_grads) {" in source
    forward = source[source.index("/* the forward values only */"):]
    forward = forward[: forward.index("\n    }\n")]
    assert "grad_" not in forward and "+=" not in forward
    assert re.search(r"emap_c\[i\] = ", forward)  # the loss's terms (a map over c) are still computed


@pytest.mark.parametrize("m", [1, 3, 9])
def test_forward_and_value_and_grad_agree_with_the_closed_form(m):
    mod = sbp.compile(_least_squares(m), functions=("forward", "value_and_grad"))
    ts, c = _data(m)
    want_loss, want_grad = _closed_form(ts, c)
    loss = mod.forward(ts=ts, c=c)["loss"]
    value, grads = mod.value_and_grad(ts=ts, c=c)
    assert float(loss) == pytest.approx(want_loss, rel=1e-12)
    assert float(loss) == float(value)  # the same arithmetic in both loops
    np.testing.assert_allclose(grads["c"], want_grad, rtol=1e-10, atol=1e-12)
