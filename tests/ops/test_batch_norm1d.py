"""nn.batch_norm of a plain n x C matrix (BatchNorm1d): values and
gradients (x, gamma, beta) against torch.nn.functional.batch_norm in
float64 autograd, in training mode (the batch's statistics, the gradient
through them) and eval mode (running statistics as inputs), at several
batch sizes of one compiled module and several widths; nn.batch_stats of
the matrix against torch's batch mean and biased variance."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

torch = pytest.importorskip("torch")
F = torch.nn.functional

n = sp.Symbol("n", integer=True, positive=True)
ROWS = (2, 3, 7, 16)
REL = 1e-12


def _close(got, want, what, scale=0.0):
    """Within REL of the largest entry, or of `scale`: the size of the terms
    a training-mode input gradient is the difference of (gamma / sigma
    times |dy| <= 1), where they cancel to far less (at n = 2 above all)."""
    want = want.detach().numpy().reshape(np.shape(got))
    assert np.abs(got - want).max() <= REL * max(np.abs(want).max(), scale, 1e-300), what


def _model(channels: int, training: bool) -> sbp.Model:
    x = sp.MatrixSymbol("x", n, channels)
    gamma, beta = sp.MatrixSymbol("gamma", 1, channels), sp.MatrixSymbol("beta", 1, channels)
    mean, var = sp.MatrixSymbol("mean", 1, channels), sp.MatrixSymbol("var", 1, channels)
    y = nn.batch_norm(x, gamma, beta, eps=1e-5, running=None if training else (mean, var))
    assert isinstance(y, sp.MatrixExpr) and y.shape == (n, channels)  # a matrix, not Images
    mu, sigma2 = nn.batch_stats(x)
    inputs = [x] if training else [x, mean, var]
    return sbp.Model(f"bn1d_{'train' if training else 'eval'}_{channels}", inputs=inputs, params=[gamma, beta],
                     grad_inputs=[x], loss=nn.sum_all(y.applyfunc(sp.sin)), outputs={"y": y, "mu": mu, "sigma2": sigma2})


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
@pytest.mark.parametrize("channels", [1, 4, 9])
def test_batch_norm_of_a_matrix_matches_torch(channels, training):
    mod = sbp.compile(_model(channels, training))
    for rows in ROWS:
        rng = np.random.default_rng(rows * 10 + channels)
        arrays = {"x": rng.standard_normal((rows, channels)) * 2 + 1,
                  "gamma": rng.standard_normal((1, channels)), "beta": rng.standard_normal((1, channels))}
        if not training:
            arrays |= {"mean": rng.standard_normal((1, channels)), "var": rng.random((1, channels)) + 0.5}
        loss, grads = mod.value_and_grad(**arrays)
        outputs = mod.forward(**arrays)
        t = {k: torch.tensor(v, requires_grad=k in ("x", "gamma", "beta")) for k, v in arrays.items()}
        running = (None, None) if training else (t["mean"][0], t["var"][0])
        y = F.batch_norm(t["x"], *running, t["gamma"][0], t["beta"][0], training=training, eps=1e-5)
        want = torch.sin(y).sum()
        want.backward()
        assert abs(loss - want.item()) <= REL * max(abs(want.item()), 1.0), (rows, channels)
        _close(outputs["y"], y, f"y at n={rows}")
        _close(outputs["mu"], t["x"].mean(0), f"batch mean at n={rows}")
        _close(outputs["sigma2"], t["x"].var(0, unbiased=False), f"batch variance at n={rows}")
        sigma = np.sqrt((outputs["sigma2"] if training else arrays["var"]) + 1e-5)
        cancelled = float(np.max(np.abs(arrays["gamma"]) / sigma))
        for name in ("x", "gamma", "beta"):
            _close(grads[name], t[name].grad, f"d loss / d {name} at n={rows}", cancelled if name == "x" and training else 0.0)


def test_batch_norm_of_a_matrix_checks_its_rows():
    x = sp.MatrixSymbol("x", n, 3)
    with pytest.raises(sbp.ModelError, match=r"batch_norm's gamma must be 1 x 3"):
        nn.batch_norm(x, sp.MatrixSymbol("g", 1, 2), sp.MatrixSymbol("b", 1, 3))
    with pytest.raises(sbp.ModelError, match=r"batch_norm's var must be 1 x 3"):
        nn.batch_norm(x, sp.MatrixSymbol("g", 1, 3), sp.MatrixSymbol("b", 1, 3),
                      running=(sp.MatrixSymbol("m", 1, 3), sp.MatrixSymbol("v", 3, 1)))
    with pytest.raises(sbp.ModelError, match=r"takes Images .* or an n x C matrix; got int"):
        nn.batch_norm(3, sp.MatrixSymbol("g", 1, 3), sp.MatrixSymbol("b", 1, 3))
