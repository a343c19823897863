"""The ops added through the op registry alone (symbackprop/ops): the
product over an axis (sbp.reduce("prod", ...)) and the cumulative sum
(sbp.cumsum), compiled to C and compared with PyTorch in float64, on
shapes with one row or one column, through transposed (strided) operands,
and, for the product, at zeros, where its gradient (the product of the
other entries) must be exact. Their rules are checked without C in
test_op_rules.py."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ModelError

torch = pytest.importorskip("torch", reason="PyTorch is the reference (pip install torch==2.13.0)")

n, m = sp.symbols("n m", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, m)
SHAPES = [(1, 1), (1, 5), (6, 1), (4, 7)]


def _apply(op: str, z, axis: int, reverse: bool):
    if op == "prod":
        return sbp.reduce("prod", z, axis)
    return sbp.cumsum(z, axis, reverse)


def _torch(op: str, z: torch.Tensor, axis: int, reverse: bool) -> torch.Tensor:
    if op == "prod":
        return z.prod(dim=axis, keepdim=True)
    if reverse:
        return z.flip(axis).cumsum(dim=axis).flip(axis)
    return z.cumsum(dim=axis)


CASES = [("prod", 0, False, False), ("prod", 1, False, True), ("cumsum", 0, False, False),
         ("cumsum", 1, False, False), ("cumsum", 0, True, True), ("cumsum", 1, True, False)]


@pytest.mark.parametrize(("op", "axis", "reverse", "transposed"), CASES)
def test_compiled_against_torch(op, axis, reverse, transposed):
    """loss = sum(sin(op(Z)) * C) with Z = X or X^T: value, gradient and a
    Jacobian-vector product against torch.autograd, for every shape."""
    z = X.T if transposed else X
    rows, cols = (m, n) if transposed else (n, m)
    out_shape = (1, cols) if op == "prod" and axis == 0 else (rows, 1) if op == "prod" else (rows, cols)
    C = sp.MatrixSymbol("C", *out_shape)
    loss = nn.sum_all(sp.HadamardProduct(_apply(op, z, axis, reverse).applyfunc(sp.sin), C))
    module = sbp.compile(sbp.Model(f"axis_{op}_{axis}_{int(reverse)}_{int(transposed)}", inputs=[C], params=[X], loss=loss))
    rng = np.random.default_rng(7)
    for shape in SHAPES:
        x = rng.uniform(-1.5, 1.5, size=shape)
        tx = torch.tensor(x, requires_grad=True)
        value = _torch(op, tx.T if transposed else tx, axis, reverse)
        c = rng.standard_normal(tuple(value.shape))
        expected = (torch.sin(value) * torch.tensor(c)).sum()
        (grad,) = torch.autograd.grad(expected, tx)
        loss_value, grads = module.value_and_grad(X=x, C=c)
        assert loss_value == pytest.approx(expected.item(), rel=1e-12, abs=1e-13), shape
        np.testing.assert_allclose(grads["X"], grad.numpy(), rtol=1e-11, atol=1e-13, err_msg=str(shape))


@pytest.mark.parametrize("axis", [0, 1])
def test_product_gradient_is_exact_at_zeros(axis):
    """One zero in a line: its entry's gradient is the product of the
    others, the rest 0; two zeros: all 0. A division would give nan."""
    loss = nn.sum_all(sbp.reduce("prod", X, axis))
    module = sbp.compile(sbp.Model(f"prod_zeros_{axis}", inputs=[], params=[X], loss=loss))
    x = np.random.default_rng(3).uniform(0.5, 2.0, size=(5, 4))
    x[1, 2] = 0.0  # one zero in row 1 and column 2
    x[3, 0] = x[3, 3] = 0.0  # two in row 3
    x[0, 1] = x[4, 1] = 0.0  # two in column 1
    tx = torch.tensor(x, requires_grad=True)
    tx.prod(dim=axis).sum().backward()
    value, grads = module.value_and_grad(X=x)
    assert value == pytest.approx(x.prod(axis=axis).sum(), rel=1e-13)
    assert np.isfinite(grads["X"]).all()
    np.testing.assert_allclose(grads["X"], tx.grad.numpy(), rtol=1e-13, atol=0)
    assert (grads["X"] != 0).any()


def test_second_derivative_through_a_product_is_refused():
    loss = nn.sum_all(sbp.reduce("prod", X, 1))
    module = sbp.compile(sbp.Model("prod_hvp", inputs=[], params=[X], loss=loss))
    with pytest.raises(ModelError, match="second derivatives through sbp.reduce\\('prod'"):
        module.hvp({"X": np.ones((2, 3))}, X=np.ones((2, 3)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_of_long_rows_match_numpy_with_nan_and_infinities(op, dtype):
    """Rows of 64 entries and more take the vector helper (_min_vector,
    _max_vector): the same result as numpy's, NaN wherever a row holds one
    (first, in a lane, in the tail), infinities and signed zeros kept."""
    Z = sp.MatrixSymbol("Z", sp.Symbol("R", integer=True, positive=True), sp.Symbol("L", integer=True, positive=True))
    mod = sbp.compile(sbp.Model(f"long_{op}", inputs=[Z], outputs={"y": sbp.reduce(op, Z, 1)}),
                      functions=("forward",), dtype=dtype)
    rng = np.random.default_rng(11)
    for length in (63, 64, 71, 200):
        z = rng.standard_normal((8, length)).astype(dtype)
        z[1, 0] = np.nan
        z[2, 37 % length] = np.nan
        z[3, length - 1] = np.nan
        z[4, 5] = np.inf
        z[5, 9] = -np.inf
        z[6] = 0.0
        z[6, 1::2] = -0.0
        got = mod.forward(Z=z)["y"][:, 0]
        np.testing.assert_array_equal(got, getattr(np, op)(z, axis=1))
        assert np.isnan(got[1:4]).all()
