"""sbp.from_torch translates a network exactly or refuses it naming the
module path and the construct (issue 44): hooks, in-place writes and their
aliases, frozen parameters, torch.no_grad() and detach. Each translation is
checked against the same network run by PyTorch in float64 (output, loss,
every trainable parameter's gradient from autograd); each refusal's message
names the module path."""

from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402

tnn = torch.nn
F = torch.nn.functional
RTOL = 1e-12


def _against_torch(net, name, batch=5, features=3):
    """from_torch(net) compiled, against torch autograd on one batch: the
    output, the MSE loss and each trainable parameter's gradient; returns
    (model, params, module, x, t)."""
    torch.manual_seed(0)
    net = net.double()
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((batch, features))
    model, params = sbp.from_torch(net, x, loss="mse", name=name)
    mod = sbp.compile(model)
    y = net(torch.from_numpy(x.copy()))
    t = rng.standard_normal(tuple(y.shape))
    net.zero_grad()
    y = net(torch.from_numpy(x.copy()))
    expected = F.mse_loss(y, torch.from_numpy(t))
    expected.backward()
    out = mod.forward(X=x, T=t, **params)
    np.testing.assert_allclose(out["Y"], y.detach().numpy(), rtol=RTOL, atol=1e-14)
    value, grads = mod.value_and_grad(X=x, T=t, **params)
    assert value == pytest.approx(expected.item(), rel=RTOL, abs=1e-15)
    ours = params.state_dict(grads)
    trainable = {key for key, p in net.named_parameters() if p.requires_grad}
    assert set(ours) == trainable
    for key in trainable:
        grad = net.get_parameter(key).grad
        if grad is None:  # no gradient reached it (a detach, torch.no_grad()): 0
            grad = torch.zeros_like(net.get_parameter(key))
        assert (ours[key] - grad).abs().max().item() <= RTOL * max(grad.abs().max().item(), 1e-300), (name, key)
    return model, params, mod, x, t


def _refused(net, message, features=3):
    with pytest.raises(sbp.ModelError, match=message) as caught:
        sbp.from_torch(net.double(), np.zeros((2, features)))
    return str(caught.value)


def _mlp():
    return tnn.Sequential(tnn.Linear(3, 4), tnn.Tanh(), tnn.Sequential(OrderedDict(inner=tnn.Linear(4, 2))))


# --- hooks: refused, named by the module they are on ------------------------------------


def _double(module, args, output):
    return output * 2


def test_a_forward_hook_on_a_layer_is_refused():
    net = _mlp()
    net[0].register_forward_hook(_double)
    _refused(net, r"^0: a forward hook is registered on Linear")


def test_a_forward_hook_on_the_root_is_refused():
    """The issue's case: a Linear whose hook doubles its output (torch 2.641, from_torch gave 1.343)."""
    lin = tnn.Linear(3, 2)
    lin.register_forward_hook(_double)
    _refused(lin, r"^the module \(Linear\): a forward hook")
    net = _mlp()
    net.register_forward_hook(_double)
    _refused(net, r"^the module \(Sequential\): a forward hook")


def test_a_forward_pre_hook_is_refused():
    net = _mlp()
    net[2].inner.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    _refused(net, r"^2\.inner: a forward pre-hook is registered on Linear")


def test_a_forward_hook_with_kwargs_is_refused():
    net = _mlp()
    net[2].register_forward_hook(lambda module, args, kwargs, output: output, with_kwargs=True)
    _refused(net, r"^2: a forward hook is registered on Sequential")
    net = _mlp()
    net[1].register_forward_pre_hook(lambda module, args, kwargs: (args, kwargs), with_kwargs=True)
    _refused(net, r"^1: a forward pre-hook is registered on Tanh")


def test_backward_hooks_and_gradient_hooks_are_refused():
    net = _mlp()
    net[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    _refused(net, r"^0: a backward hook is registered on Linear")
    net = _mlp()
    net[2].inner.register_full_backward_pre_hook(lambda module, grad_out: None)
    _refused(net, r"^2\.inner: a backward pre-hook")
    net = _mlp()
    net[2].inner.bias.register_hook(lambda grad: grad * 0)
    _refused(net, r"^2\.inner\.bias: a gradient hook")


def test_a_global_hook_and_a_parametrization_are_refused():
    handle = tnn.modules.module.register_module_forward_hook(_double)
    try:
        _refused(_mlp(), r"a global module forward hook")
    finally:
        handle.remove()
    net = _mlp()
    torch.nn.utils.parametrizations.weight_norm(net[2].inner)  # weight = g * v / |v|, computed
    _refused(net, r"^2\.inner: a parametrization \(weight\)")


# --- in-place writes ------------------------------------------------------------------


class _Written(tnn.Module):
    """h = a(x), then `write(self, h)` (in place, its result unused) and b(h)."""

    def __init__(self, write, width=4):
        super().__init__()
        self.a = tnn.Linear(3, width)
        self.b = tnn.Linear(width, 2)
        self.act = tnn.ReLU(inplace=True)
        self.drop = tnn.Dropout(0.3)
        self.write = write

    def forward(self, x):
        h = self.a(x)
        self.write(self, h)
        return self.b(h)


def _alias_add(m, h):
    a = h
    a += 1.5  # h += 1.5: the same tensor


def _alias_through_dropout(m, h):
    a = m.drop(h)  # Dropout in eval returns h itself
    a.add_(0.25, alpha=2)
    a.mul_(3)


def _chain(m, h):
    h.mul_(-0.5)
    h.add_(0.3)
    h.sub_(0.1, alpha=2)
    h.div_(0.7)
    h.pow_(2)
    h.tanh_()


@pytest.mark.parametrize("write", [
    pytest.param(lambda m, h: h.mul_(2), id="mul_"),
    pytest.param(_alias_add, id="add_through_alias"),
    pytest.param(_alias_through_dropout, id="add_through_dropout_alias"),
    pytest.param(lambda m, h: torch.relu_(h), id="torch_relu_"),
    pytest.param(lambda m, h: F.relu(h, inplace=True), id="F_relu_inplace"),
    pytest.param(lambda m, h: m.act(h), id="ReLU_inplace_module"),
    pytest.param(lambda m, h: h.sigmoid_(), id="sigmoid_"),
    pytest.param(lambda m, h: h.tanh_(), id="tanh_"),
    pytest.param(_chain, id="mul_add_sub_div_pow_tanh_chain"),
])
def test_an_in_place_write_whose_result_is_unused_is_translated(write):
    """Dead-code elimination dropped these writes (their result unused): now
    every later use of h reads what was written, as in torch."""
    net = _Written(write).eval()
    _, _, _, x, _ = _against_torch(net, "from_torch_written")
    plain = tnn.Sequential(net.a, net.b).double()  # without the write: a different function
    mod = sbp.compile(sbp.from_torch(plain, x, loss=None, name="from_torch_unwritten")[0])
    with torch.no_grad():
        assert not np.allclose(net(torch.from_numpy(x)).numpy(), plain(torch.from_numpy(x)).numpy())
    assert mod is not None


def test_in_place_relu_in_a_sequential_equals_torch():
    net = tnn.Sequential(tnn.Linear(3, 6), tnn.ReLU(inplace=True), tnn.Linear(6, 6), tnn.LeakyReLU(0.1, inplace=True),
                         tnn.Dropout(0.2, inplace=True), tnn.Linear(6, 2)).eval()
    _against_torch(net, "from_torch_inplace_relu_sequential")


class _InputWritten(tnn.Module):
    def __init__(self):
        super().__init__()
        self.lin = tnn.Linear(3, 2)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x) + self.lin(x) * 0.5


def test_a_write_into_the_input_is_translated():
    _against_torch(_InputWritten(), "from_torch_input_written")


@pytest.mark.parametrize("write, message", [
    (lambda m, h: h[:, :2].mul_(3), r"^_Written\.forward: Tensor\.mul_\(\) on a view \(operator\.getitem\)"),
    (lambda m, h: h.t().mul_(3), r"^_Written\.forward: Tensor\.mul_\(\) on a view \(Tensor\.t\(\)\)"),
    (lambda m, h: h.T.add_(1), r"^_Written\.forward: Tensor\.add_\(\) on a view \(Tensor\.T\)"),
    (lambda m, h: m.a.weight.data.mul_(2), r"^_Written\.forward: Tensor\.mul_\(\) writes into the parameter"),
    (lambda m, h: torch.add(h, 1, out=h), r"^_Written\.forward: torch\.add with out="),
    (lambda m, h: h.clamp_(0, 1), r"^_Written\.forward: Tensor\.clamp_\(\) is not supported yet"),
    (lambda m, h: torch.nn.init.normal_(h), r"^_Written\.forward: normal_ is not supported yet"),
])
def test_an_in_place_write_it_cannot_translate_is_refused(write, message):
    _refused(_Written(write).eval(), message)


class _ViewThenWrite(tnn.Module):
    def __init__(self):
        super().__init__()
        self.a = tnn.Linear(3, 3)

    def forward(self, x):
        h = self.a(x)
        v = h.t()  # a view of h: it sees the write below
        h.mul_(2)
        return h + v.t()


def test_a_write_into_a_tensor_with_a_view_in_use_is_refused():
    _refused(_ViewThenWrite(), r"^_ViewThenWrite\.forward: Tensor\.mul_\(\) of a tensor with a view \(Tensor\.t\(\)\)")


def test_an_in_place_write_into_a_view_in_a_child_is_named_by_its_path():
    class Child(tnn.Module):
        def forward(self, h):
            h.t().mul_(2)
            return h

    net = tnn.Sequential(OrderedDict(inp=tnn.Linear(3, 4), block=tnn.Sequential(OrderedDict(child=Child()))))
    _refused(net, r"^block\.child: Tensor\.mul_\(\) on a view")


# --- frozen parameters ------------------------------------------------------------------


def _frozen_mlp():
    torch.manual_seed(3)
    net = tnn.Sequential(tnn.Linear(3, 5), tnn.Tanh(), tnn.Linear(5, 4), tnn.GELU(), tnn.Linear(4, 2))
    net[0].requires_grad_(False)  # a frozen first layer
    net[2].bias.requires_grad_(False)  # and one frozen bias
    return net


def test_frozen_parameters_are_inputs_not_params():
    model, params, _, _, _ = _against_torch(_frozen_mlp(), "from_torch_frozen")
    assert params.frozen == ("l0_weight", "l0_bias", "l2_bias")
    assert [str(p) for p in model.params] == ["l2_weight", "l4_weight", "l4_bias"]
    assert {str(s) for s in model.inputs} >= {"X", "T", "l0_weight", "l0_bias", "l2_bias"}


def test_a_frozen_weight_alone():
    torch.manual_seed(4)
    net = tnn.Sequential(tnn.Linear(3, 4), tnn.ReLU(), tnn.Linear(4, 2))
    net[2].weight.requires_grad_(False)
    _against_torch(net, "from_torch_frozen_weight")


def test_train_step_leaves_frozen_parameters_as_they_are():
    """One SGD step: the frozen arrays unchanged bit for bit, the others as torch.optim.SGD moves them."""
    net = _frozen_mlp().double()
    rng = np.random.default_rng(9)
    x, t = rng.standard_normal((6, 3)), rng.standard_normal((6, 2))
    model, params = sbp.from_torch(net, x, loss="mse", name="from_torch_frozen_train")
    mod = sbp.compile(model, optimizer=sbp.SGD(lr=0.1))
    before = {name: value.copy() for name, value in params.items()}
    loss = mod.train_step(X=x, T=t, **params)
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    expected = F.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(t))
    expected.backward()
    optimizer.step()
    assert loss == pytest.approx(expected.item(), rel=RTOL)
    for name in params.frozen:
        assert np.array_equal(params[name], before[name]), name
    for key, value in params.state_dict(params).items():
        torch.testing.assert_close(value, net.state_dict()[key], rtol=RTOL, atol=1e-15)
    assert any(not np.array_equal(params[name], before[name]) for name in params if name not in params.frozen)


# --- torch.no_grad() and detach ---------------------------------------------------------


class _Stopped(tnn.Module):
    def __init__(self, stop):
        super().__init__()
        self.a = tnn.Linear(3, 3)
        self.b = tnn.Linear(3, 2)
        self.stop = stop

    def forward(self, x):
        h = self.a(x)
        return self.b(h * self.stop(self, x, h))


def _no_grad_of_h(m, x, h):
    with torch.no_grad():
        return torch.sigmoid(h) * 2


def _no_grad_of_x(m, x, h):
    with torch.no_grad():
        return torch.tanh(x) + 1


@pytest.mark.parametrize("stop", [
    pytest.param(_no_grad_of_h, id="no_grad_of_parameters"),
    pytest.param(lambda m, x, h: h.detach(), id="detach_of_parameters"),
    pytest.param(lambda m, x, h: torch.detach(m.a(x)), id="torch_detach_of_parameters"),
])
def test_what_autograd_does_not_differentiate_through_is_stopped_as_torch(stop):
    """sbp.stop_gradient where a detached (or no_grad) value depends on a
    parameter: the gradients equal torch's, which flow only through the
    other use of h."""
    _against_torch(_Stopped(stop), "from_torch_stopped_params")


def test_a_no_grad_child_forward_is_stopped_and_its_layer_gets_no_gradient():
    class Frozen(tnn.Module):
        def __init__(self):
            super().__init__()
            self.lin = tnn.Linear(4, 4)

        @torch.no_grad()
        def forward(self, h):
            return self.lin(h)

    net = tnn.Sequential(OrderedDict(inp=tnn.Linear(3, 4), frozen=Frozen(), out=tnn.Linear(4, 2)))
    _, params, mod, x, t = _against_torch(net, "from_torch_no_grad_child")
    grads = params.state_dict(mod.value_and_grad(X=x, T=t, **params)[1])
    assert not grads["frozen.lin.weight"].any() and not grads["inp.weight"].any()


@pytest.mark.parametrize("stop", [
    pytest.param(_no_grad_of_x, id="no_grad_of_the_input"),
    pytest.param(lambda m, x, h: x.detach() ** 2, id="detach_of_the_input"),
])
def test_a_stopped_value_of_no_parameter_is_translated(stop):
    _against_torch(_Stopped(stop), "from_torch_stopped_input")


def test_from_torch_inside_no_grad_translates_as_with_grad():
    """Called in a `with torch.no_grad():` (an evaluation script), the forward is still read with autograd on."""
    net = tnn.Sequential(tnn.Linear(3, 4), tnn.ReLU(inplace=True), tnn.Linear(4, 2)).double()
    with torch.no_grad():
        model, _ = sbp.from_torch(net, np.zeros((2, 3)), name="from_torch_in_no_grad")
    assert [str(p) for p in model.params] == ["l0_weight", "l0_bias", "l2_weight", "l2_bias"]
