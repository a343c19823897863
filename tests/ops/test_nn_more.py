"""The wider nn helpers: values against numpy, gradients against central
differences (and the kink conventions against PyTorch's)."""

import math

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn

ROWS, COLS = 4, 3


def _np_log_softmax(z):
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


# name -> (builder of a scalar loss from Z and T, numpy reference of the same)
CASES = {
    "softmax": (lambda Z, T: nn.sum_all(sp.HadamardProduct(nn.softmax(Z), T)),
                lambda z, t: float(np.sum(np.exp(_np_log_softmax(z)) * t))),
    "log_softmax": (lambda Z, T: nn.sum_all(sp.HadamardProduct(nn.log_softmax(Z), T)),
                    lambda z, t: float(np.sum(_np_log_softmax(z) * t))),
    "leaky_relu": (lambda Z, T: nn.sum_all(sp.HadamardProduct(nn.leaky_relu(Z), T)),
                   lambda z, t: float(np.sum(np.where(z > 0, z, 0.01 * z) * t))),
    "elu": (lambda Z, T: nn.sum_all(sp.HadamardProduct(nn.elu(Z), T)),
            lambda z, t: float(np.sum(np.where(z > 0, z, np.exp(z) - 1) * t))),
    "gelu": (lambda Z, T: nn.sum_all(sp.HadamardProduct(nn.gelu(Z), T)),
             lambda z, t: float(np.sum(0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2))) * t))),
    "gelu_tanh": (lambda Z, T: nn.sum_all(sp.HadamardProduct(nn.gelu(Z, approximate="tanh"), T)),
             lambda z, t: float(np.sum(0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))) * t))),
    "log_cosh": (lambda Z, T: nn.log_cosh(Z, T), lambda z, t: float(np.mean(np.log(np.cosh(z - t))))),
    "huber": (lambda Z, T: nn.huber(Z, T),
              lambda z, t: float(np.mean(np.where(np.abs(z - t) <= 1, (z - t) ** 2 / 2, np.abs(z - t) - 0.5)))),
    "bce_with_logits": (lambda Z, T: nn.binary_cross_entropy_with_logits(Z, T),
                        lambda z, t: float(np.mean(np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z)))))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_helper_value_and_gradient(name):
    build, reference = CASES[name]
    Z, T = sp.MatrixSymbol("Z", ROWS, COLS), sp.MatrixSymbol("T", ROWS, COLS)
    mod = sbp.compile(sbp.Model(f"nn_{name}", inputs=[T], params=[Z], loss=build(Z, T)))
    rng = np.random.default_rng(0)
    z = 2.5 * rng.standard_normal((ROWS, COLS))
    t = rng.random((ROWS, COLS)) if name == "bce_with_logits" else rng.standard_normal((ROWS, COLS))
    loss, grads = mod.value_and_grad(Z=z, T=t)
    assert loss == pytest.approx(reference(z, t), rel=1e-12, abs=1e-14)
    expected = central_differences(lambda d: reference(d["Z"], d["T"]), {"Z": z, "T": t}, "Z")
    assert relative_error(grads["Z"], expected) < 1e-6


def test_stable_losses_do_not_overflow():
    Z, T = sp.MatrixSymbol("Z", 1, 2), sp.MatrixSymbol("T", 1, 2)
    loss = nn.binary_cross_entropy_with_logits(Z, T) + nn.log_cosh(Z, T)
    mod = sbp.compile(sbp.Model("stable", inputs=[T], params=[Z], loss=loss))
    value, grads = mod.value_and_grad(Z=np.array([[800.0, -800.0]]), T=np.array([[0.0, 1.0]]))
    assert np.isfinite(value) and np.all(np.isfinite(grads["Z"]))
    # bce: mean(800, 800) = 800; log_cosh: mean(|d| - log 2) with d = 800, -801
    assert value == pytest.approx(800 + (800 + 801) / 2 - math.log(2), rel=1e-12)


def test_kinks_follow_pytorch():
    """At 0: leaky_relu' = slope, elu' = alpha (PyTorch's choices)."""
    x = sp.MatrixSymbol("x", 1, 2)
    mod = sbp.compile(sbp.Model("kinks", params=[x], loss=nn.sum_all(nn.leaky_relu(x, 0.2)) + nn.sum_all(nn.elu(x, 2))))
    _, grads = mod.value_and_grad(x=np.zeros((1, 2)))
    np.testing.assert_allclose(grads["x"], [[2.2, 2.2]])


def test_cross_entropy_of_an_index_of_labels_and_the_sum_reduction():
    """softmax_cross_entropy of an Index: logsumexp(z) - z[label] per row and the gradient
    softmax(z) - one_hot, in closed form; the sum reduction and mse's against numpy."""
    n = sp.Symbol("n", integer=True, positive=True)
    Z, Y = sp.MatrixSymbol("Z", n, COLS), sp.MatrixSymbol("Y", n, COLS)
    labels = sbp.Index("labels", n)
    loss = nn.softmax_cross_entropy(Z, labels, reduction="sum") + nn.mse(Z, Y, reduction="sum")
    mod = sbp.compile(sbp.Model("ce_labels_sum", inputs=[labels, Y], params=[Z], loss=loss))
    rng = np.random.default_rng(11)
    for rows in (1, 5):
        z, y, t = rng.standard_normal((rows, COLS)), rng.standard_normal((rows, COLS)), rng.integers(0, COLS, rows)
        value, grads = mod.value_and_grad(labels=t, Y=y, Z=z)
        log_p = _np_log_softmax(z)
        expected = -log_p[np.arange(rows), t].sum() + ((z - y) ** 2).sum()
        assert value == pytest.approx(expected, rel=1e-13)
        np.testing.assert_allclose(grads["Z"], np.exp(log_p) - np.eye(COLS)[t] + 2 * (z - y), rtol=1e-12, atol=1e-14)
    with pytest.raises(sbp.ModelError, match="number of classes as an integer"):
        nn.one_hot(labels, n)
    with pytest.raises(sbp.ModelError, match="reduction is one of"):
        nn.mse(Z, Y, reduction="none")


def test_blocks_side_by_side_and_a_linear_of_them():
    """concat_columns is numpy's hstack; nn.linear of it multiplies each block
    by its rows of the weights (no placing product left), with the gradients
    of the product of the hstack (central differences)."""
    n = sp.Symbol("n", integer=True, positive=True)
    A, B, W, bias = (sp.MatrixSymbol("A", n, 2), sp.MatrixSymbol("B", n, 3), sp.MatrixSymbol("W", 5, 4),
                     sp.MatrixSymbol("bias", 1, 4))
    both = nn.concat_columns([A, B])
    assert nn.column_blocks(both) == [(A, 0), (B, 2)]
    assert nn.column_blocks(A + A) is None and nn.column_blocks(A) is None
    Y = nn.linear(both, W, bias)
    assert not Y.atoms(sp.ImmutableMatrix)  # the placing matrices are gone
    loss = nn.sum_all(sp.HadamardProduct(Y, Y)) + nn.sum_all(both.applyfunc(sp.sin))
    mod = sbp.compile(sbp.Model("concat_linear", inputs=[A, B], params=[W, bias], loss=loss, grad_inputs=[A, B]))
    rng = np.random.default_rng(0)
    data = {"A": rng.standard_normal((3, 2)), "B": rng.standard_normal((3, 3)), "W": rng.standard_normal((5, 4)),
            "bias": rng.standard_normal((1, 4))}

    def reference(d):
        x = np.hstack([d["A"], d["B"]])
        y = x @ d["W"] + d["bias"]
        return float(np.sum(y * y) + np.sum(np.sin(x)))

    value, grads = mod.value_and_grad(**data)
    assert value == pytest.approx(reference(data), rel=1e-13)
    for name in data:
        assert relative_error(grads[name], central_differences(reference, data, name)) < 1e-7, name
