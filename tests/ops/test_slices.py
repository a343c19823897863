"""SymPy's MatrixSlice in a model (ops/slices.py): a view of its parent's
memory, whose adjoint scatters into the sliced rows and columns. Values
and every gradient against PyTorch autograd in float64, for slices of
params, inputs, intermediates and transposes, at the first rows, in the
middle, at the last columns and with steps; products small enough for
inline loops and large enough for the BLAS (strided operands fall back
to the loops)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.pipeline import generate

torch = pytest.importorskip("torch")

n = sp.Symbol("n", integer=True, positive=True)


def _fused_projection(d: int, name: str):
    """q, k, v from one fused (3d x d) weight and (1 x 3d) bias, as
    PyTorch's in_proj_weight: q k^T v-like mixing of them, a step slice
    slices of a transpose and of an intermediate of fixed rows; returns
    the model and torch's loss."""
    x, w, b = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("Win", 3 * d, d), sp.MatrixSymbol("bin", 1, 3 * d)
    u = sp.MatrixSymbol("U", d, d)
    ones = nn.ones(n, 1)
    q = x * w[0:d, :].T + ones * b[:, 0:d]  # first rows
    k = x * w[d:2 * d, :].T + ones * b[:, d:2 * d]  # middle rows
    v = x * w[2 * d:3 * d, :].T + ones * b[:, 2 * d:3 * d]  # last rows, last columns of the bias
    h = sp.HadamardProduct(q.applyfunc(sp.tanh), k) + v * u.T[:, 0:d]  # a slice of a transpose (all of it)
    stepped = x[:, 0:d:2] * w.T[0:d:2, d:2 * d]  # steps of 2 (d even), a transpose's middle columns
    loss = nn.sum_all(h.applyfunc(sp.sin)) + nn.sum_all(stepped.applyfunc(sp.cos)) + nn.sum_all((u * w.T)[d - 2:d, d:3 * d:2])
    model = sbp.Model(name, inputs=[x], params=[w, b, u], loss=loss, outputs={"Q": q, "Wk": w[d:2 * d, :]})

    def reference(tx, tw, tb, tu):
        tq, tk, tv = (tx @ tw[i * d:(i + 1) * d].T + tb[:, i * d:(i + 1) * d] for i in range(3))
        th = torch.tanh(tq) * tk + tv @ tu.T
        ts = tx[:, 0:d:2] @ tw.T[0:d:2, d:2 * d]
        return torch.sin(th).sum() + torch.cos(ts).sum() + (tu @ tw.T)[d - 2:d, d:3 * d:2].sum(), tq

    return model, reference


@pytest.mark.parametrize(("d", "batch"), [(2, 3), (4, 5), (32, 64)], ids=["tiny", "small", "blas"])
def test_slices_of_a_fused_weight_match_pytorch(d, batch):
    model, reference = _fused_projection(d, f"slices_fused_{d}")
    rng = np.random.default_rng(d)
    arrays = {"X": rng.normal(size=(batch, d)), "Win": rng.normal(size=(3 * d, d)) / np.sqrt(d),
              "bin": rng.normal(size=(1, 3 * d)), "U": rng.normal(size=(d, d)) / np.sqrt(d)}
    mod = sbp.compile(model, wrt=["X", "Win", "bin", "U"])
    loss, grads = mod.value_and_grad(**arrays)
    tensors = {key: torch.tensor(value, requires_grad=True) for key, value in arrays.items()}
    expected, q = reference(tensors["X"], tensors["Win"], tensors["bin"], tensors["U"])
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    for key, tensor in tensors.items():
        np.testing.assert_allclose(grads[key], tensor.grad.numpy(), rtol=1e-12, atol=1e-12 * np.abs(tensor.grad.numpy()).max(),
                                   err_msg=key)
    out = mod.forward(**arrays)
    np.testing.assert_allclose(out["Q"], q.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(out["Wk"], arrays["Win"][d:2 * d])


def test_a_slice_hessian_vector_product_matches_pytorch():
    """Second order: the slice's adjoint (slice_scatter) differentiated again."""
    model, reference = _fused_projection(4, "slices_hvp")
    rng = np.random.default_rng(7)
    arrays = {"X": rng.normal(size=(5, 4)), "Win": rng.normal(size=(12, 4)) / 2, "bin": rng.normal(size=(1, 12)),
              "U": rng.normal(size=(4, 4)) / 2}
    direction = {key: rng.normal(size=value.shape) for key, value in arrays.items() if key != "X"}
    mod = sbp.compile(model)
    hvp = mod.hvp(direction, **arrays)
    params = [torch.tensor(arrays[key], requires_grad=True) for key in ("Win", "bin", "U")]
    expected, _ = reference(torch.tensor(arrays["X"]), *params)
    grads = torch.autograd.grad(expected, params, create_graph=True)
    dot = sum((g * torch.tensor(direction[key])).sum() for g, key in zip(grads, ("Win", "bin", "U")))
    second = torch.autograd.grad(dot, params)
    for key, value in zip(("Win", "bin", "U"), second):
        np.testing.assert_allclose(hvp[key], value.numpy(), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize(("make", "message"), [
    (lambda w, x: x[:, sp.Symbol("r", integer=True):2], "start must be a number"),
    (lambda w, x: w[0:3:2, :], "step 2 does not divide its length 3"),
    (lambda w, x: x[1:, :].T * x[1:, :], r"takes rows 1:n:1 of n, which is bound at call time: a call with fewer rows"),
])
def test_slices_it_cannot_compile_are_named(make, message):
    x, w = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("W", 3, 3)
    expr = make(w, x)
    with pytest.raises(sbp.ModelError, match=message):
        sbp.compile(sbp.Model("slices_refused", inputs=[x], params=[w], loss=nn.sum_all(x * w) + nn.sum_all(expr)))


def test_an_lstms_stacked_gates_sliced_inside_a_scan_match_torch_lstm():
    """torch.nn.LSTM's weight_ih, weight_hh (4H x in, gates i, f, g, o
    stacked) and bias as one parameter each, sliced per gate inside a
    scan's step (nn.lstm_cell's gate order is torch's)."""
    steps, hidden, features = sp.Symbol("T", integer=True, positive=True), 3, 2
    x_seq, target = sp.MatrixSymbol("X", steps, features), sp.MatrixSymbol("target", steps, 1)
    w_ih, w_hh = sp.MatrixSymbol("Wih", 4 * hidden, features), sp.MatrixSymbol("Whh", 4 * hidden, hidden)
    b_ih, v = sp.MatrixSymbol("bih", 1, 4 * hidden), sp.MatrixSymbol("v", hidden, 1)
    gates = [slice(g * hidden, (g + 1) * hidden) for g in range(4)]
    h, c, x = sp.MatrixSymbol("h", 1, hidden), sp.MatrixSymbol("c", 1, hidden), sp.MatrixSymbol("x", 1, features)
    h_next, c_next = nn.lstm_cell(x, h, c, [w_ih[g, :].T for g in gates], [w_hh[g, :].T for g in gates],
                                  [b_ih[:, g] for g in gates])
    zero = sp.ZeroMatrix(1, hidden)
    y = sbp.scan((h_next, c_next), h_next * v, (h, c), x, (zero, zero), x_seq)
    model = sbp.Model("slices_lstm", inputs=[x_seq, target], params=[w_ih, w_hh, b_ih, v], loss=nn.mse(y, target))
    rng = np.random.default_rng(0)
    arrays = {"X": rng.standard_normal((7, features)), "target": rng.standard_normal((7, 1))}
    arrays.update({p.name: rng.uniform(-0.5, 0.5, p.shape) for p in model.params})
    loss, grads = sbp.compile(model).value_and_grad(**arrays)

    lstm = torch.nn.LSTM(features, hidden).double()
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.tensor(arrays["Wih"]))
        lstm.weight_hh_l0.copy_(torch.tensor(arrays["Whh"]))
        lstm.bias_ih_l0.copy_(torch.tensor(arrays["bih"][0]))
        lstm.bias_hh_l0.zero_()
    tv = torch.tensor(arrays["v"], requires_grad=True)
    out, _ = lstm(torch.tensor(arrays["X"])[:, None, :])
    expected = torch.nn.functional.mse_loss(out[:, 0, :] @ tv, torch.tensor(arrays["target"]))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    for key, want in (("Wih", lstm.weight_ih_l0.grad), ("Whh", lstm.weight_hh_l0.grad), ("bih", lstm.bias_ih_l0.grad),
                      ("v", tv.grad)):
        want = want.numpy().reshape(grads[key].shape)
        np.testing.assert_allclose(grads[key], want, rtol=1e-12, atol=1e-12 * np.abs(want).max(), err_msg=key)


@pytest.mark.parametrize("blocks", [4, 7])
def test_the_adjoint_of_evenly_spaced_row_blocks_is_one_loop_and_matches_pytorch(blocks):
    """The gradients of `blocks` row pairs of a weight two rows apart (rows
    0 and 1 no block's: zero) land through one copy loop over a table of
    their pointers (ops/slices.py, STACKED_MIN), each in its own rows."""
    d, batch = 3, 4
    x, w = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W", 2 + 2 * blocks, d)
    loss = sp.Add(*[(t + 1) * nn.sum_all((x * w[2 + 2 * t:4 + 2 * t, :].T).applyfunc(sp.sin)) for t in range(blocks)])
    model = sbp.Model(f"slices_blocks_{blocks}", inputs=[x], params=[w], loss=loss)
    assert "stacked[at]" in generate(model)[0].source
    rng = np.random.default_rng(blocks)
    arrays = {"X": rng.normal(size=(batch, d)), "W": rng.normal(size=(2 + 2 * blocks, d))}
    value, grads = sbp.compile(model).value_and_grad(**arrays)
    tx, tw = (torch.tensor(arrays[k], requires_grad=True) for k in ("X", "W"))
    expected = sum((t + 1) * torch.sin(tx @ tw[2 + 2 * t:4 + 2 * t].T).sum() for t in range(blocks))
    expected.backward()
    assert value == pytest.approx(expected.item(), rel=1e-12)
    np.testing.assert_allclose(grads["W"], tw.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert not grads["W"][:2].any()
