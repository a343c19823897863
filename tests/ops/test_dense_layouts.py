"""Dense layers with the weights stored as torch.nn.Linear stores them,
(out, in), the layer written x @ W^T: gradients against torch autograd, and
the weight gradient written by its matrix product straight in W's layout
(no product into a temporary followed by a transposed copy)."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate

torch = pytest.importorskip("torch")


def linear_out_in_model() -> sbp.Model:
    n = sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 7), sp.MatrixSymbol("T", n, 3)
    W1, b1 = sp.MatrixSymbol("W1", 5, 7), sp.MatrixSymbol("b1", 1, 5)
    W2, b2 = sp.MatrixSymbol("W2", 3, 5), sp.MatrixSymbol("b2", 1, 3)
    hidden = nn.tanh(nn.linear(X, W1.T, b1))
    loss = nn.softmax_cross_entropy(nn.linear(hidden, W2.T, b2), T)
    return sbp.Model("linear_out_in", inputs=[X, T], params=[W1, b1, W2, b2], loss=loss)


def torch_loss(t: dict):
    linear = torch.nn.functional.linear  # x @ W^T + b, W of shape (out, in)
    z = linear(torch.tanh(linear(t["X"], t["W1"], t["b1"][0])), t["W2"], t["b2"][0])
    return torch.mean(torch.logsumexp(z, 1) - torch.sum(t["T"] * z, 1))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_equal_torch_autograd(dtype):
    rng = np.random.default_rng(3)
    n = 40  # a product of n*5*7 multiply-adds: above the BLAS threshold, so both paths
    data = {
        "X": rng.standard_normal((n, 7)),
        "T": np.eye(3)[rng.integers(0, 3, n)],
        "W1": rng.standard_normal((5, 7)),
        "b1": rng.standard_normal((1, 5)),
        "W2": rng.standard_normal((3, 5)),
        "b2": rng.standard_normal((1, 3)),
    }
    mod = sbp.compile(linear_out_in_model(), dtype=dtype)
    loss, grads = mod.value_and_grad(**{k: v.astype(dtype) for k, v in data.items()})
    t = {k: torch.tensor(v, requires_grad=k in grads) for k, v in data.items()}
    expected = torch_loss(t)
    expected.backward()
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    assert abs(float(np.asarray(loss).ravel()[0]) - expected.item()) <= tolerance * 10
    for name, grad in grads.items():
        want = t[name].grad.numpy()
        assert np.linalg.norm(grad - want) <= tolerance * np.linalg.norm(want), name


def test_weight_gradient_is_one_product_in_place():
    source = generate(linear_out_in_model(), functions=("value_and_grad",))[0].source
    # the product lands in grad_W1 itself: W1's gradient is g^T @ X, no copy of (X^T @ g)^T
    assert re.search(r"_matmul\([^;]*, grad_W1\);", source)
    assert re.search(r"_matmul\([^;]*, grad_W2\);", source)
    assert not re.search(r"grad_W[12]\[[^]]*\] = ", source)


@pytest.mark.parametrize("n", [5, 203])
def test_column_sums_of_a_wide_batch(n):
    """Sums down the columns (a bias's gradient), all columns in one pass
    (sum_columns): 150 columns, blocks of 64 and a partial one; 203 rows,
    past the 8 running sums and a tail. Against numpy."""
    rows = sp.Symbol("n", integer=True, positive=True)
    X = sp.MatrixSymbol("X", rows, 150)
    S = sbp.reduce("sum", X.applyfunc(sp.sin), 0)  # 1 x 150
    mod = sbp.compile(sbp.Model("column_sums", params=[X], loss=S * S.T))
    assert "_sum_columns(" in mod.source
    x = np.random.default_rng(5).standard_normal((n, 150))
    loss, grads = mod.value_and_grad(X=x)
    sums = np.sin(x).sum(axis=0)
    assert np.isclose(float(np.asarray(loss).ravel()[0]), sums @ sums, rtol=1e-13)
    np.testing.assert_allclose(grads["X"], 2 * sums * np.cos(x), rtol=1e-12, atol=1e-12)
