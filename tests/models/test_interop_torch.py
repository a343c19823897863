"""The PyTorch bridge: gradients against PyTorch's own autograd on the same
model written in torch, and SGD steps against the same steps in torch."""

import numpy as np
import pytest
from conftest import load_example

torch = pytest.importorskip("torch")

# imported after the skip: symbackprop.interop.torch imports torch
import symbackprop as sbp  # noqa: E402
from symbackprop.interop.torch import SymbackpropModule, as_torch  # noqa: E402


def torch_mlp(t):
    """examples/mlp.py written in torch: the independent oracle."""
    hidden = torch.sigmoid(t["X"] @ t["W1"] + t["b1"])
    y = hidden @ t["W2"] + t["b2"]
    return ((y - t["T"]) ** 2).mean(), y


def leaves(data, grad=("W1", "b1", "W2", "b2")):
    return {k: torch.tensor(v, requires_grad=k in grad) for k, v in data.items()}


def test_gradients_equal_torch_autograd(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(0), batch=6)
    ours, theirs = leaves(data), leaves(data)
    loss = as_torch(mlp_module)(**ours)
    assert loss.shape == () and loss.dtype == torch.float64
    (3.0 * loss).backward()  # grad_output is carried through
    expected, _ = torch_mlp(theirs)
    (3.0 * expected).backward()
    assert abs(loss.item() - expected.item()) < 1e-12
    for name in ("W1", "b1", "W2", "b2"):
        assert ours[name].grad.shape == ours[name].shape
        np.testing.assert_allclose(ours[name].grad.numpy(), theirs[name].grad.numpy(), rtol=0, atol=1e-10)
    assert ours["X"].grad is None and ours["T"].grad is None


def test_gradients_through_outputs_and_chosen_inputs(mlp_example):
    mod = sbp.compile(mlp_example.model, wrt=["W1", "X"])
    data = mlp_example.sample_data(np.random.default_rng(1), batch=5)
    ours, theirs = leaves(data, ("W1", "X", "W2")), leaves(data, ("W1", "X", "W2"))
    loss, outs = mod.as_torch(outputs=["Y"])(**ours)
    (loss + torch.sin(outs["Y"]).sum()).backward()
    expected, y = torch_mlp(theirs)
    (expected + torch.sin(y).sum()).backward()
    np.testing.assert_allclose(outs["Y"].detach().numpy(), y.detach().numpy(), rtol=0, atol=1e-12)
    for name in ("W1", "X"):
        np.testing.assert_allclose(ours[name].grad.numpy(), theirs[name].grad.numpy(), rtol=0, atol=1e-10)
    assert ours["W2"].grad is None  # not in wrt: no gradient


def test_one_c_call_in_forward_and_none_without_grad(mlp_example, mlp_module, monkeypatch):
    data = mlp_example.sample_data(np.random.default_rng(2), batch=3)
    calls = []
    for kind in ("forward", "value_and_grad", "vjp"):
        real = getattr(mlp_module, kind)
        monkeypatch.setattr(mlp_module, kind, lambda *a, _real=real, _kind=kind, **k: calls.append(_kind) or _real(*a, **k))
    f = as_torch(mlp_module)
    f(**leaves(data)).backward()
    assert calls == ["value_and_grad"]
    calls.clear()
    with torch.no_grad():
        value = f(**leaves(data))
    assert calls == ["forward"] and value.item() == pytest.approx(torch_mlp(leaves(data))[0].item(), abs=1e-12)


def test_wrong_arguments_are_named(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(3), batch=2)
    f = as_torch(mlp_module)
    with pytest.raises(sbp.ArgumentError, match="missing \\['T'\\]"):
        f(**{k: torch.tensor(v) for k, v in data.items() if k != "T"})
    with pytest.raises(sbp.ArgumentError, match="dtype float64; got float32"):
        f(**{k: torch.tensor(v, dtype=torch.float32) for k, v in data.items()})
    with pytest.raises(sbp.ArgumentError, match="no output named"):
        as_torch(mlp_module, outputs=["Z"])


def test_sgd_steps_equal_pure_torch(mlp_example, mlp_module):
    data = mlp_example.sample_data(np.random.default_rng(4), batch=8)
    params = {k: data[k] for k in ("W1", "b1", "W2", "b2")}
    net = SymbackpropModule(mlp_module, params)
    assert [n for n, _ in net.named_parameters()] == ["W1", "b1", "W2", "b2"]
    reference = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    ours_opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    their_opt = torch.optim.SGD(reference.values(), lr=0.2, momentum=0.9)
    x, t = torch.tensor(data["X"]), torch.tensor(data["T"])
    losses = []
    for _ in range(5):
        ours_opt.zero_grad()
        loss = net(X=x, T=t)
        loss.backward()
        ours_opt.step()
        their_opt.zero_grad()
        expected, _ = torch_mlp({"X": x, "T": t, **reference})
        expected.backward()
        their_opt.step()
        losses.append(loss.item())
        assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert losses[-1] < losses[0]
    for name, p in reference.items():
        np.testing.assert_allclose(getattr(net, name).detach().numpy(), p.detach().numpy(), rtol=0, atol=1e-10)
    assert np.array_equal(params["W1"], data["W1"])  # initial values were copied, not trained in place


def test_index_inputs_pass_as_integer_tensors():
    ba = load_example("bundle_adjustment")
    mod = sbp.compile(ba.model)
    data = ba.sample_data(np.random.default_rng(5))
    tensors = {k: torch.tensor(v, requires_grad=k in ("cams", "pts")) for k, v in data.items()}
    loss = mod.as_torch()(**tensors)
    loss.backward()
    expected_loss, grads = mod.value_and_grad(**data)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-14)
    np.testing.assert_allclose(tensors["cams"].grad.numpy(), grads["cams"], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(tensors["pts"].grad.numpy(), grads["pts"], rtol=1e-13, atol=1e-15)
