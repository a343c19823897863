"""sbp.from_torch: a torch.nn.Sequential compiled by symbackprop against the
same network run by PyTorch in float64 (outputs, loss, every parameter's
gradient from torch autograd), at a batch of 1 and an odd batch."""

from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402
from symbackprop import nn  # noqa: E402

tnn = torch.nn
RTOL = 1e-10


def _one_hot_cross_entropy(y, t):
    return torch.nn.functional.cross_entropy(y, t)


def _huber_ours(Y, T):
    return nn.huber(Y, T, 1)


# name -> (network builder, loss as from_torch takes it, the same loss in torch, targets are class probabilities)
STACKS = {
    "linear": (lambda: tnn.Linear(3, 2), "mse", torch.nn.functional.mse_loss, False),
    "linear_relu_linear": (lambda: tnn.Sequential(tnn.Linear(3, 6), tnn.ReLU(), tnn.Linear(6, 2)),
                           "mse", torch.nn.functional.mse_loss, False),
    "tanh_dropout": (lambda: tnn.Sequential(tnn.Linear(3, 5), tnn.Tanh(), tnn.Dropout(0.3), tnn.Linear(5, 4)),
                     "cross_entropy", _one_hot_cross_entropy, True),
    "layernorm_gelu": (lambda: tnn.Sequential(tnn.Linear(3, 6), tnn.LayerNorm(6), tnn.GELU(), tnn.Linear(6, 2)),
                       "mse", torch.nn.functional.mse_loss, False),
    "flatten_softplus": (lambda: tnn.Sequential(tnn.Flatten(), tnn.Linear(3, 4), tnn.Sigmoid(), tnn.Linear(4, 2),
                                                tnn.Softplus()),
                         _huber_ours, torch.nn.functional.huber_loss, False),
    "nested": (lambda: tnn.Sequential(
        tnn.Sequential(tnn.Linear(3, 5), tnn.SiLU(), tnn.LayerNorm(5, elementwise_affine=False)),
        tnn.Sequential(OrderedDict(hidden=tnn.Linear(5, 5), act=tnn.GELU(approximate="tanh"))),
        tnn.LeakyReLU(0.2), tnn.Identity(), tnn.Linear(5, 4, bias=False), tnn.ELU(0.7), tnn.Softplus(beta=2.0),
        tnn.Linear(4, 3), tnn.LogSoftmax(dim=1)),
        "mse", torch.nn.functional.mse_loss, False),
}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_against_torch_autograd(stack):
    build, loss, torch_loss, probabilities = STACKS[stack]
    torch.manual_seed(len(stack))
    net = build().double().eval()
    rng = np.random.default_rng(len(stack))
    model, params = sbp.from_torch(net, torch.zeros(2, 3, dtype=torch.float64), loss=loss, name=f"from_torch_{stack}")
    mod = sbp.compile(model)
    assert set(params.torch_names.values()) == set(net.state_dict())
    for batch in (1, 7):
        x = rng.standard_normal((batch, 3))
        outputs = net(torch.from_numpy(x)).shape[1]
        t = rng.dirichlet(np.ones(outputs), size=batch) if probabilities else rng.standard_normal((batch, outputs))
        net.zero_grad()
        y = net(torch.from_numpy(x))
        expected = torch_loss(y, torch.from_numpy(t))
        expected.backward()
        out = mod.forward(X=x, T=t, **params)
        value, grads = mod.value_and_grad(X=x, T=t, **params)
        np.testing.assert_allclose(out["Y"], y.detach().numpy(), rtol=RTOL, atol=1e-14)
        assert value == pytest.approx(expected.item(), rel=RTOL)
        ours = params.state_dict(grads)
        assert set(ours) == {k for k, _ in net.named_parameters()}
        for key, p in net.named_parameters():
            scale = p.grad.abs().max().item()
            assert (ours[key] - p.grad).abs().max().item() <= RTOL * scale, (stack, batch, key)


def test_params_map_back_to_the_state_dict():
    net = tnn.Sequential(tnn.Linear(3, 4), tnn.Sequential(tnn.LayerNorm(4), tnn.Linear(4, 1))).double()
    model, params = sbp.from_torch(net, np.zeros((5, 3)))
    assert params.torch_names == {"l0_weight": "0.weight", "l0_bias": "0.bias", "l1_0_weight": "1.0.weight",
                                  "l1_0_bias": "1.0.bias", "l1_1_weight": "1.1.weight", "l1_1_bias": "1.1.bias"}
    assert params["l0_weight"].shape == (4, 3) and params["l0_bias"].shape == (1, 4)  # (out, in); a bias is a row
    assert [str(p) for p in model.params] == list(params)
    copy = tnn.Sequential(tnn.Linear(3, 4), tnn.Sequential(tnn.LayerNorm(4), tnn.Linear(4, 1))).double()
    copy.load_state_dict(params.state_dict(params))
    for key, value in net.state_dict().items():
        assert torch.equal(copy.state_dict()[key], value)


def test_unsupported_modules_are_named_by_their_path():
    net = tnn.Sequential(tnn.Linear(3, 4), tnn.Sequential(OrderedDict(conv=tnn.Conv1d(1, 1, 3))))
    with pytest.raises(sbp.ModelError, match=r"1\.conv: Conv1d is not supported yet"):
        sbp.from_torch(net, np.zeros((2, 3)))
    with pytest.raises(sbp.ModelError, match=r"1: Dropout in training mode"):
        sbp.from_torch(tnn.Sequential(tnn.Linear(3, 4), tnn.Dropout(0.5)).train(), np.zeros((2, 3)))
    with pytest.raises(sbp.ModelError, match=r"0: Linear takes 4 features; its input has 3"):
        sbp.from_torch(tnn.Sequential(tnn.Linear(4, 4)), np.zeros((2, 3)))
    with pytest.raises(sbp.ModelError, match="example input"):
        sbp.from_torch(tnn.Linear(3, 4), np.zeros((2, 1, 3)))
    with pytest.raises(sbp.ModelError, match="loss must be one of"):
        sbp.from_torch(tnn.Linear(3, 4), np.zeros((2, 3)), loss="nll")


def test_without_a_loss_the_model_has_only_its_output():
    net = tnn.Sequential(tnn.Linear(3, 2), tnn.Softmax(dim=-1)).double()
    model, params = sbp.from_torch(net, np.zeros((1, 3)), loss=None, name="from_torch_no_loss")
    x = np.random.default_rng(3).standard_normal((4, 3))
    y = sbp.compile(model).forward(X=x, **params)["Y"]
    np.testing.assert_allclose(y, net(torch.from_numpy(x)).detach().numpy(), rtol=1e-12)
