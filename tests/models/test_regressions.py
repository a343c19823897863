"""Mismatches and crashes found by the robustness tests (most by
test_fuzz.py), each as the smallest model that showed it, with where the
fix went."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from helpers import assert_gradients_match, random_data

import symbackprop as sbp
from symbackprop.declare import nn

n = sp.Symbol("n", integer=True, positive=True)


def _check(model, dims=None, seed=0):
    dims = dims or {}
    mod = sbp.compile(model)
    assert_gradients_match(mod, model, random_data(model, np.random.default_rng(seed), dims), dims)
    return mod


@pytest.mark.parametrize("k", [1, 2, 3])
def test_loss_that_is_itself_a_product(k):
    """sum(D1 @ D2) of a row and a column is the product itself: its seed,
    the constant 1, reached the product's rule and was multiplied as an
    array never stored ("grad_loss undeclared"). Fixed in ir.matmul:
    constant factors fold into sums."""
    D1, D2 = sp.MatrixSymbol("D1", 1, k), sp.MatrixSymbol("D2", k, 1)
    _check(sbp.Model("product_loss", inputs=[D2], params=[D1], loss=nn.sum_all(D1 * D2), outputs={"body": D1 * D2}))
    _check(sbp.Model("product_loss_bare", inputs=[D1], params=[D2], loss=D1 * D2))


def test_one_by_one_elementwise_functions_sympy_rewrites():
    """SymPy's applyfunc on a 1x1 matrix applies the function to the
    matrix: sqrt(M) becomes M**(1/2) (MatPow), Abs(M) becomes
    (M*Adjoint(M.T))**(1/2), and OneMatrix(1, 1) in a sum becomes
    Identity(1); each was an "unsupported matrix operation". Fixed in ir.py
    (MatPow, Adjoint and Identity lowered where they are elementwise)."""
    M, P = sp.MatrixSymbol("M", 1, 1), sp.MatrixSymbol("P", 1, 2)
    positive = sp.HadamardPower(M, 2) + nn.ones(1, 1)
    loss = (nn.sum_all(positive.applyfunc(sp.sqrt)) + nn.sum_all(M.applyfunc(sp.Abs))
            + nn.sum_all(positive.applyfunc(sp.log)) + nn.sum_all(P.T * M * P))
    _check(sbp.Model("one_by_one", inputs=[], params=[M, P], loss=loss))


@pytest.mark.parametrize("rows", [2, n])
def test_product_of_a_matrix_with_itself(rows):
    """SymPy writes A*A as A**2 (MatPow), which was an "unsupported matrix
    operation" (and S**(1/2) of a larger matrix still is). Fixed in ir.py:
    whole powers lower to chains of products."""
    A, X = sp.MatrixSymbol("A", rows, rows), sp.MatrixSymbol("X", n, rows)
    loss = nn.sum_all(A * A) + nn.sum_all(X * A * A * A)
    assert any(isinstance(e, sp.MatPow) for e in sp.preorder_traversal(loss))
    _check(sbp.Model("matpow", inputs=[X], params=[A], loss=loss), {n: 3})


def test_workspace_offset_of_a_squared_dimension():
    """Index arithmetic printed n**2 as pow(n, 2), a double: 'double *t0 =
    work + pow(n, 2)' did not compile. Fixed in codegen.py (IndexPrinter)."""
    D1, D2 = sp.MatrixSymbol("D1", n, 2), sp.MatrixSymbol("D2", 2, n)
    model = sbp.Model("square_dim", inputs=[D1, D2], params=[sp.Symbol("s")],
                      loss=nn.sum_all(D1 * D2), outputs={"body": D1 * D2})
    _check(model, {n: 3})


def test_relu_of_a_one_by_one_matrix():
    """SymPy's applyfunc on a 1x1 matrix calls the function on the matrix,
    and Max(M, 0) raised 'not comparable'. Fixed in nn.py."""
    M = sp.MatrixSymbol("M", 1, 1)
    _check(sbp.Model("relu_1x1", inputs=[], params=[M], loss=nn.sum_all(nn.relu(M))))


def test_function_without_c_is_a_model_error():
    """A function (or a derivative) with no C raised SymPy's
    PrintMethodNotImplementedError. Fixed in codegen.py. (gamma and
    loggamma, whose derivatives need polygamma, compile since polygamma has
    a C helper: tests/ops/test_special_functions.py.)"""
    a = sp.Symbol("a")
    with pytest.raises(sbp.ModelError, match="besselj"):
        sbp.compile(sbp.Model("no_c", inputs=[], params=[a], loss=sp.besselj(0, a)))


def test_a_square_leaf_binds_its_dimension_once():
    """A first leaf of shape (n, n) listed n twice among the dimensions, so
    the runtime passed it twice ("work_len() takes exactly one argument (2
    given)"). Fixed in ir.lower."""
    X, W = sp.MatrixSymbol("X", n, n), sp.MatrixSymbol("W", n, 1)
    mod = _check(sbp.Model("square_leaf", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W))), {n: 3})
    assert mod.plan.lowered.dims == (n,)


def test_relu_of_a_one_by_one_matrix_transposed():
    """SymPy rebuilt a 1x1 elementwise function when transposing it, and
    Max(M.T, 0) raised 'not comparable'. Fixed in nn.py."""
    M, W = sp.MatrixSymbol("M", 1, 1), sp.MatrixSymbol("W", 1, 2)
    _check(sbp.Model("relu_1x1_t", inputs=[], params=[M, W], loss=nn.sum_all(nn.relu(M).T * W)))


def test_a_row_added_without_a_broadcast_is_a_model_error():
    """X + b with b (1 x k) was silently broadcast (and only in one term
    order); SymPy's sums need equal shapes, so now it names the term."""
    X, b = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("b", 1, 3)
    with pytest.raises(sbp.ModelError, match=r"b has shape \(1, 3\)"):
        sbp.compile(sbp.Model("row_sum", inputs=[X], params=[b], loss=nn.sum_all(X + b)))


@pytest.mark.parametrize("retain", [False, True])
def test_sum_of_an_explicit_matrix_of_entries_compiles(retain):
    """The adjoint of a summed explicit matrix is a constant, never stored:
    its entries fold to the constant (the C once read an undeclared
    grad_t3). Closed form: d sum(Z*V) / dZ = V, / dV = Z, / dY = 1."""
    Z, V = sp.MatrixSymbol("Z", 1, 3), sp.MatrixSymbol("V", 1, 3)
    entries = sp.Matrix(1, 3, lambda i, j: Z[0, j] * V[0, j])
    model = sbp.Model("explicit_entries", params=[Z, V], loss=nn.sum_all(entries),
                      outputs={"Y": entries} if retain else {})
    mod = sbp.compile(model, wrt=["Z", "V", "Y"] if retain else None)
    z, v = np.array([[1.0, 2.0, 3.0]]), np.array([[4.0, -5.0, 6.0]])
    loss, grads = mod.value_and_grad(Z=z, V=v)
    assert loss == pytest.approx(float((z * v).sum()))
    np.testing.assert_array_equal(grads["Z"], v)
    np.testing.assert_array_equal(grads["V"], z)
    if retain:
        np.testing.assert_array_equal(grads["Y"], np.ones((1, 3)))
