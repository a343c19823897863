"""from_torch of BatchNorm1d in an MLP (Linear -> BatchNorm1d -> ReLU ->
Linear) and BatchNorm2d in a CNN, in eval mode (running statistics) and in
training mode (the batch's statistics, the running ones' update as
outputs), against PyTorch float64 autograd: the loss and every parameter
gradient to 1e-12 relative, and the running statistics torch's forward
writes."""

from collections import OrderedDict

import numpy as np
import pytest

import symbackprop as sbp

torch = pytest.importorskip("torch")
tnn, F = torch.nn, torch.nn.functional
REL = 1e-12


def _randomize(bn: tnn.Module) -> None:
    """Running statistics, scale and shift away from their initial 0, 1."""
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        if bn.affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)


def _mlp(features: int, **bn_options) -> tnn.Module:
    torch.manual_seed(features)
    net = tnn.Sequential(OrderedDict(fc=tnn.Linear(3, features), bn=tnn.BatchNorm1d(features, **bn_options),
                                     act=tnn.ReLU(), out=tnn.Linear(features, 2))).double()
    _randomize(net.bn)
    return net


def _cnn(**bn_options) -> tnn.Module:
    torch.manual_seed(5)
    net = tnn.Sequential(OrderedDict(conv=tnn.Conv2d(2, 3, 3), bn=tnn.BatchNorm2d(3, **bn_options), act=tnn.ReLU(),
                                     flat=tnn.Flatten(), fc=tnn.Linear(3 * 4 * 4, 2))).double()
    _randomize(net.bn)
    return net


def _check(net: tnn.Module, x, name: str, training: bool) -> tuple:
    """The converted net's loss, gradients and running statistics against
    torch's, from one forward and backward of each on the batch x."""
    t = torch.randn(len(x), 2, dtype=torch.float64, generator=torch.Generator().manual_seed(len(x)))
    net.train(training)
    model, params = sbp.from_torch(net, x, loss="mse", name=name)
    mod = sbp.compile(model)
    arrays = {"X": x.numpy().reshape(len(x), -1), "T": t.numpy(), **params}
    loss, grads = mod.value_and_grad(**arrays)
    outputs = mod.forward(**arrays)
    net.zero_grad()
    expected = F.mse_loss(net(x), t)  # in training mode, torch's forward updates the running statistics
    expected.backward()
    assert abs(loss - expected.item()) <= REL * abs(expected.item())
    if not training:
        np.testing.assert_allclose(outputs["Y"], net(x).detach().numpy(), rtol=0, atol=1e-13)
    largest = max(float(p.grad.abs().max()) for p in net.parameters())
    for key, grad in params.state_dict(grads).items():
        want = net.get_parameter(key).grad
        error = float((grad - want).abs().max())
        if (training or net.bn.running_mean is None) and key == f"{_before_bn(net)}.bias":
            # the mean it adds is taken out again: its gradient is 0, both are rounding
            assert float(grad.abs().max()) <= REL * largest and float(want.abs().max()) <= REL * largest, key
        else:
            assert error <= REL * float(want.abs().max()), (key, error)
    return params, outputs


def _before_bn(net: tnn.Module) -> str:
    return "fc" if isinstance(net.bn, tnn.BatchNorm1d) else "conv"


@pytest.mark.parametrize("features", [1, 5])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm1d_in_an_mlp_in_eval_mode(features, affine):
    net = _mlp(features, affine=affine)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params, outputs = _check(net, x, f"ft_bn1d_eval_{features}_{affine}", training=False)
    assert params.frozen == ("bn_running_mean", "bn_running_var") and params.running == {}
    assert set(outputs) == {"Y", "loss"}


@pytest.mark.parametrize("rows", [2, 7])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm1d_in_an_mlp_in_training_mode(rows, affine):
    """The batch's statistics normalize, the gradient flows through them,
    and the outputs are what torch's forward writes into the running
    statistics (update_running copies them in)."""
    net = _mlp(5, affine=affine, momentum=0.3)
    x = torch.randn(rows, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
    before = net.bn.running_mean.clone()
    params, outputs = _check(net, x, f"ft_bn1d_train_{affine}", training=True)  # torch's one forward updates its buffers
    assert params.running == {"bn_running_mean_new": "bn_running_mean", "bn_running_var_new": "bn_running_var"}
    np.testing.assert_array_equal(params["bn_running_mean"][0], before.numpy())  # inputs, left as they were
    params.update_running(outputs)
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(params[f"bn_{name}"][0], getattr(net.bn, name).numpy(), rtol=REL, atol=1e-15)


def test_batch_norm_without_running_statistics_normalizes_by_the_batch_in_both_modes():
    net = _mlp(4, track_running_stats=False)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for training in (False, True):
        params, outputs = _check(net, x, "ft_bn1d_untracked", training=training)
        assert params.frozen == () and params.running == {} and set(outputs) == {"Y", "loss"}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "training"])
def test_batch_norm2d_in_a_cnn(training):
    net = _cnn(momentum=0.2)
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    _, outputs = _check(net, x, f"ft_bn2d_{training}", training=training)
    if not training:
        assert set(outputs) == {"Y", "loss"}
        return
    for name in ("running_mean", "running_var"):  # N / (N - 1) of the unbiased variance: N = 3 * 4 * 4
        np.testing.assert_allclose(outputs[f"bn_{name}_new"][0], getattr(net.bn, name).numpy(), rtol=REL, atol=1e-15)


def test_a_training_step_then_the_running_statistics():
    """train_step on the training-mode MLP updates the parameters as
    torch.optim.SGD; the running statistics (inputs) are left to
    update_running, which then equals torch's buffers."""
    net = _mlp(5).train()
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    t = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    model, params = sbp.from_torch(net, x, loss="mse", name="ft_bn1d_sgd")
    mod = sbp.compile(model, optimizer=sbp.SGD(lr=0.1, momentum=0.9))
    arrays = {"X": x.numpy(), "T": t.numpy()}
    params.update_running(mod.forward(**arrays, **params))  # the statistics of this batch, before the step
    loss = mod.train_step(**arrays, **params)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    expected = F.mse_loss(net(x), t)
    expected.backward()
    optimizer.step()
    assert abs(loss - expected.item()) <= REL * expected.item()
    for name, key in params.torch_names.items():
        want = net.state_dict()[key].numpy().reshape(params[name].shape)
        np.testing.assert_allclose(params[name], want, rtol=REL, atol=1e-15, err_msg=key)


def test_a_batch_norm_called_twice_in_training_mode_is_refused():
    class Twice(tnn.Module):
        def __init__(self):
            super().__init__()
            self.bn = tnn.BatchNorm1d(3)

        def forward(self, x):
            return self.bn(self.bn(x))

    with pytest.raises(sbp.ModelError, match=r"^bn: BatchNorm1d called twice in training mode"):
        sbp.from_torch(Twice().double(), torch.zeros(2, 3))


def test_train_epoch_in_training_mode_is_torchs_minibatch_steps():
    """train_epoch over minibatches of a training-mode MLP: each step
    normalizes by its minibatch's statistics, as torch's steps do."""
    net = _mlp(5).train()
    x = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    t = torch.randn(12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    model, params = sbp.from_torch(net, x, loss="mse", name="ft_bn1d_epoch")
    order = np.random.default_rng(13).permutation(12)
    losses = sbp.compile(model, optimizer=sbp.SGD(lr=0.1)).train_epoch(4, order, X=x.numpy(), T=t.numpy(), **params)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for k, start in enumerate(range(0, 12, 4)):
        rows = torch.from_numpy(order[start:start + 4])
        optimizer.zero_grad()
        expected = F.mse_loss(net(x[rows]), t[rows])
        expected.backward()
        optimizer.step()
        assert abs(losses[k] - expected.item()) <= REL * expected.item()
    for name, key in params.torch_names.items():
        if name not in params.frozen:
            want = net.state_dict()[key].numpy().reshape(params[name].shape)
            np.testing.assert_allclose(params[name], want, rtol=REL, atol=1e-15, err_msg=key)
