"""An optimizer on a model with grad_inputs updates its params only: the
input it also differentiates (an adversarial example's X) is the caller's
data, left bit for bit as it was by train_step and train_epoch, with a
symbolic batch and a fixed one; the params move as torch.optim's float64
SGD, SGD with momentum and Adam move them; value_and_grad still returns
the input's gradient (checked against torch autograd)."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn

OPTIMIZERS = [sbp.SGD(lr=0.1), sbp.SGD(lr=0.05, momentum=0.9, weight_decay=0.01), sbp.Adam(lr=0.02)]
ROWS = 8


def _model(fixed: bool) -> sbp.Model:
    n = ROWS if fixed else sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
    W1, b1 = sp.MatrixSymbol("W1", 3, 4), sp.MatrixSymbol("b1", 1, 4)
    W2, b2 = sp.MatrixSymbol("W2", 4, 2), sp.MatrixSymbol("b2", 1, 2)
    y = nn.linear(nn.tanh(nn.linear(X, W1, b1)), W2, b2)
    return sbp.Model(f"grad_inputs_train_{'fixed' if fixed else 'symbolic'}", inputs=[X, T],
                     params=[W1, b1, W2, b2], loss=nn.mse(y, T), grad_inputs=[X])


def _data(seed: int = 0, rows: int = ROWS):
    rng = np.random.default_rng(seed)
    data = {"X": rng.standard_normal((rows, 3)), "T": rng.standard_normal((rows, 2))}
    params = {"W1": rng.standard_normal((3, 4)) * 0.5, "b1": rng.standard_normal((1, 4)) * 0.1,
              "W2": rng.standard_normal((4, 2)) * 0.5, "b2": rng.standard_normal((1, 2)) * 0.1}
    return data, params


def _torch_optimizer(torch, optimizer, tensors):
    if isinstance(optimizer, sbp.SGD):
        return torch.optim.SGD(tensors, lr=optimizer.lr, momentum=optimizer.momentum,
                               weight_decay=optimizer.weight_decay)
    return torch.optim.Adam(tensors, lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2),
                            eps=optimizer.eps, weight_decay=optimizer.weight_decay)


def _torch_loss(torch, tensors, data):
    x, t = torch.tensor(data["X"]), torch.tensor(data["T"])
    y = torch.tanh(x @ tensors["W1"] + tensors["b1"]) @ tensors["W2"] + tensors["b2"]
    return torch.mean((y - t) ** 2)


@pytest.mark.parametrize("fixed", [False, True], ids=["symbolic_batch", "fixed_batch"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
def test_train_step_updates_params_not_grad_inputs(fixed, optimizer):
    torch = pytest.importorskip("torch")
    mod = sbp.compile(_model(fixed), optimizer=optimizer)
    _, init = _data()
    ours = {k: v.copy() for k, v in init.items()}
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    opt = _torch_optimizer(torch, optimizer, list(tensors.values()))
    for step in range(5):
        batch, _ = _data(seed=10 + step)
        x_before = batch["X"].copy()
        loss = mod.train_step(**batch, **ours)
        assert np.array_equal(batch["X"], x_before)  # bit for bit: never written
        opt.zero_grad()
        expected = _torch_loss(torch, tensors, batch)
        expected.backward()
        opt.step()
        assert abs(loss - expected.item()) <= 1e-12 * abs(expected.item())
        for key, tensor in tensors.items():
            np.testing.assert_allclose(ours[key], tensor.detach().numpy(), rtol=1e-12, atol=1e-15)
    assert all(not name.endswith("_X") for name in mod.optimizer_state)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
def test_train_epoch_leaves_grad_inputs(optimizer):
    """train_epoch (symbolic batch) runs the same steps as train_step on each
    minibatch, and leaves the whole X as it was."""
    model = _model(False)
    data, init = _data(seed=3, rows=10)
    x_before = data["X"].copy()
    order = np.random.default_rng(4).permutation(10)
    epoch_params = {k: v.copy() for k, v in init.items()}
    losses = sbp.compile(model, optimizer=optimizer).train_epoch(4, order, **data, **epoch_params)
    assert np.array_equal(data["X"], x_before)
    stepper = sbp.compile(model, optimizer=optimizer)
    step_params = {k: v.copy() for k, v in init.items()}
    for k, start in enumerate(range(0, 10, 4)):
        rows = order[start:start + 4]
        batch = {name: np.ascontiguousarray(array[rows]) for name, array in data.items()}
        assert stepper.train_step(**batch, **step_params) == losses[k]
    for key in init:
        assert np.array_equal(epoch_params[key], step_params[key])
        assert not np.array_equal(epoch_params[key], init[key])


@pytest.mark.parametrize("fixed", [False, True], ids=["symbolic_batch", "fixed_batch"])
def test_value_and_grad_still_gives_the_input_gradient(fixed):
    torch = pytest.importorskip("torch")
    mod = sbp.compile(_model(fixed), optimizer=sbp.SGD(lr=0.1))
    data, params = _data(seed=5)
    loss, grads = mod.value_and_grad(**data, **params)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    x = torch.tensor(data["X"], requires_grad=True)
    y = torch.tanh(x @ tensors["W1"] + tensors["b1"]) @ tensors["W2"] + tensors["b2"]
    expected = torch.mean((y - torch.tensor(data["T"])) ** 2)
    expected.backward()
    assert abs(loss - expected.item()) <= 1e-12 * abs(expected.item())
    assert set(grads) == {"W1", "b1", "W2", "b2", "X"}
    np.testing.assert_allclose(grads["X"], x.grad.numpy(), rtol=1e-12, atol=1e-15)
    for key, tensor in tensors.items():
        np.testing.assert_allclose(grads[key], tensor.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_a_model_with_grad_inputs_only_is_refused_by_train_step():
    n = sp.Symbol("n", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", n, 2), sp.MatrixSymbol("W", 2, 1)
    model = sbp.Model("grad_inputs_only", inputs=[X, W], loss=nn.sum_all(X * W), grad_inputs=[X])
    mod = sbp.compile(model, optimizer=sbp.SGD(lr=0.1))
    x = np.ones((3, 2))
    with pytest.raises(sbp.ModelError, match="needs at least one param to update"):
        mod.train_step(X=x, W=np.ones((2, 1)))
    assert np.array_equal(x, np.ones((3, 2)))
