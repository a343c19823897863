"""sbp.from_torch: a torch.nn.Sequential, or a custom module traced by
torch.fx, compiled by symbackprop against the same network run by PyTorch
in float64 (outputs, loss, every parameter's gradient from torch autograd),
at a batch of 1 and an odd batch."""

from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402
from symbackprop import nn  # noqa: E402

tnn = torch.nn
F = torch.nn.functional
RTOL = 1e-10


def _one_hot_cross_entropy(y, t):
    return torch.nn.functional.cross_entropy(y, t)


def _huber_ours(Y, T):
    return nn.huber(Y, T, 1)


class ResidualMLP(tnn.Module):
    """x + block(x), twice, between two Linear layers."""

    def __init__(self):
        super().__init__()
        self.inp = tnn.Linear(3, 6)
        self.blocks = tnn.ModuleList(tnn.Sequential(tnn.LayerNorm(6), tnn.Linear(6, 6), tnn.GELU(), tnn.Linear(6, 6))
                                     for _ in range(2))
        self.out = tnn.Linear(6, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class Functional(tnn.Module):
    """Activations, arithmetic, cat and layer_norm called in forward, not as layers."""

    def __init__(self):
        super().__init__()
        self.a = tnn.Linear(3, 5)
        self.b = tnn.Linear(10, 4)
        self.norm = tnn.LayerNorm(10)

    def forward(self, x):
        h = self.a(x)
        u = F.gelu(h, approximate="tanh") * 0.5 - torch.tanh(h) / 3 + 1 + F.silu(h) + h.relu() + F.softplus(h, beta=2)
        v = 2.0 * torch.sigmoid(h) - F.leaky_relu(h, 0.1) + F.elu(-h, alpha=0.7) + F.relu(-h) ** 2
        w = torch.cat([u, F.dropout(v, 0.3, self.training)], dim=1)
        w = F.layer_norm(w, (10,), self.norm.weight, self.norm.bias, 1e-3)
        return F.log_softmax(self.b(w), dim=-1)


class RawParameters(tnn.Module):
    """nn.Parameters used directly: a matmul, a 1-D bias and scale, F.linear, a tied weight and its transpose."""

    def __init__(self):
        super().__init__()
        self.w = tnn.Parameter(torch.randn(3, 5))
        self.bias = tnn.Parameter(torch.randn(5))
        self.scale = tnn.Parameter(torch.randn(5))
        self.proj = tnn.Parameter(torch.randn(4, 5))
        self.proj_bias = tnn.Parameter(torch.randn(4))

    def forward(self, x):
        h = torch.tanh(x @ self.w + self.bias) * self.scale
        h = h + torch.sigmoid(h @ self.w.T) @ self.w  # the same weight twice, once transposed
        return F.linear(h, self.proj, self.proj_bias)


class Gate(tnn.Module):
    """h * sigmoid(gate(h)): a custom block of its own."""

    def __init__(self, width):
        super().__init__()
        self.gate = tnn.Linear(width, width)

    def forward(self, h):
        return h * torch.sigmoid(self.gate(h))


class Residual(tnn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return h + self.inner(h)


class InPlace(tnn.Module):
    """In-place activations: what they overwrite, used again, is their result (as torch computes it)."""

    def __init__(self):
        super().__init__()
        self.a = tnn.Linear(3, 4)
        self.act = tnn.ReLU(inplace=True)

    def forward(self, x):
        y = self.a(x)
        y += x @ self.a.weight.T  # a rebinding, as torch.fx records it
        z = self.act(y)  # y is now z
        u = y * 0.5 - 1
        v = F.elu(u, 0.5, True)  # u is now v
        return y * 2 + z + u * v


def _nested_custom():
    return tnn.Sequential(tnn.Linear(3, 6), Residual(tnn.Sequential(Gate(6), tnn.Tanh(), Residual(Gate(6)))),
                          tnn.ReLU(), Gate(6), tnn.Linear(6, 4))


def _labels_sum(y, t):
    return F.cross_entropy(y, t, reduction="sum")


def _mse_sum(y, t):
    return F.mse_loss(y, t, reduction="sum")


# name -> (network builder, loss as from_torch takes it (or (loss, reduction)), the same loss in torch,
#          targets: values, probabilities or labels)
STACKS = {
    "linear": (lambda: tnn.Linear(3, 2), "mse", torch.nn.functional.mse_loss, "values"),
    "linear_relu_linear": (lambda: tnn.Sequential(tnn.Linear(3, 6), tnn.ReLU(), tnn.Linear(6, 2)),
                           "mse", torch.nn.functional.mse_loss, "values"),
    "tanh_dropout": (lambda: tnn.Sequential(tnn.Linear(3, 5), tnn.Tanh(), tnn.Dropout(0.3), tnn.Linear(5, 4)),
                     "cross_entropy", _one_hot_cross_entropy, "probabilities"),
    "layernorm_gelu": (lambda: tnn.Sequential(tnn.Linear(3, 6), tnn.LayerNorm(6), tnn.GELU(), tnn.Linear(6, 2)),
                       "mse", torch.nn.functional.mse_loss, "values"),
    "flatten_softplus": (lambda: tnn.Sequential(tnn.Flatten(), tnn.Linear(3, 4), tnn.Sigmoid(), tnn.Linear(4, 2),
                                                tnn.Softplus()),
                         _huber_ours, torch.nn.functional.huber_loss, "values"),
    "nested": (lambda: tnn.Sequential(
        tnn.Sequential(tnn.Linear(3, 5), tnn.SiLU(), tnn.LayerNorm(5, elementwise_affine=False)),
        tnn.Sequential(OrderedDict(hidden=tnn.Linear(5, 5), act=tnn.GELU(approximate="tanh"))),
        tnn.LeakyReLU(0.2), tnn.Identity(), tnn.Linear(5, 4, bias=False), tnn.ELU(0.7), tnn.Softplus(beta=2.0),
        tnn.Linear(4, 3), tnn.LogSoftmax(dim=1)),
        "mse", torch.nn.functional.mse_loss, "values"),
    # modules that are not a Sequential, traced by torch.fx
    "residual_mlp": (ResidualMLP, "cross_entropy_labels", F.cross_entropy, "labels"),
    "functional": (Functional, "mse", F.mse_loss, "values"),
    "raw_parameters": (RawParameters, ("mse", "sum"), _mse_sum, "values"),
    "in_place": (InPlace, "mse", F.mse_loss, "values"),
    "nested_custom": (_nested_custom, ("cross_entropy_labels", "sum"), _labels_sum, "labels"),
}


def _targets(rng, kind, batch, outputs):
    if kind == "labels":
        return rng.integers(0, outputs, size=batch)
    if kind == "probabilities":
        return rng.dirichlet(np.ones(outputs), size=batch)
    return rng.standard_normal((batch, outputs))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_against_torch_autograd(stack):
    build, loss, torch_loss, targets = STACKS[stack]
    torch.manual_seed(len(stack))
    net = build().double().eval()
    rng = np.random.default_rng(len(stack))
    loss, reduction = loss if isinstance(loss, tuple) else (loss, "mean")
    model, params = sbp.from_torch(net, torch.zeros(2, 3, dtype=torch.float64), loss=loss, name=f"from_torch_{stack}",
                                   reduction=reduction)
    mod = sbp.compile(model)
    assert set(params.torch_names.values()) == set(net.state_dict())
    for batch in (1, 7):
        x = rng.standard_normal((batch, 3))
        outputs = net(torch.from_numpy(x)).shape[1]
        t = _targets(rng, targets, batch, outputs)
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


class _Untraceable(tnn.Module):
    def forward(self, h):
        if h.sum() > 0:  # control flow on the data: torch.fx cannot trace it
            return h
        return -h


class _Block(tnn.Module):
    def __init__(self, inner=None, op=None):
        super().__init__()
        self.lin = tnn.Linear(3, 3)
        self.inner = inner if inner is not None else tnn.Identity()
        self.op = op

    def forward(self, h):
        h = self.inner(self.lin(h))
        return self.op(h) if self.op is not None else h


class _Buffered(tnn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.ones(3))

    def forward(self, h):
        return h + self.shift


class _Vector(tnn.Module):
    def __init__(self):
        super().__init__()
        self.v = tnn.Parameter(torch.ones(3))

    def forward(self, h):
        return h @ self.v  # (batch,): not a (batch, outputs) matrix


class _TwoInputs(tnn.Module):
    def forward(self, a, b):
        return a + b


class _Attention(tnn.Module):
    def __init__(self, cross=False):
        super().__init__()
        self.attn = tnn.MultiheadAttention(3, 1)
        self.cross = cross

    def forward(self, h):
        return self.attn(h, 2 * h, h)[0] if self.cross else self.attn(h, h, h)[0]


@pytest.mark.parametrize("net, message", [
    (tnn.Sequential(tnn.Linear(3, 3), _Block(inner=tnn.Sequential(_Untraceable()))),
     r"^1\.inner\.0: torch\.fx cannot trace _Untraceable\.forward \(TraceError: .*control flow"),
    (tnn.Sequential(OrderedDict(block=_Block(op=lambda h: torch.cumsum(h, 1)))),
     r"^block: torch\.cumsum is not supported yet; from_torch converts .*F\.gelu"),
    (tnn.Sequential(OrderedDict(block=_Attention())), r"^block\.attn: MultiheadAttention takes sequences"),
    (_Block(op=lambda h: torch.cat([h, h], dim=0)), r"^_Block\.forward: cat along dim 0: only along the features"),
    (_Block(op=lambda h: F.softmax(h, dim=0)), r"^_Block\.forward: softmax along dim 0"),
    (_Block(op=lambda h: h.exp_()), r"^_Block\.forward: Tensor\.exp_\(\) is not supported yet"),
    (_Block(op=lambda h: h.sum(1)), r"^_Block\.forward: Tensor\.sum\(\) is not supported yet"),
    (_Block(op=lambda h: torch.cat([h, h], axis=1)), r"^_Block\.forward: torch\.cat: arguments from_torch does not"),
    (_Block(op=lambda h: F.softmax(h, 1, dtype=torch.float32)), r"softmax in float32: from_torch computes in float64"),
    (_Block(op=lambda h: h.log_softmax(1, torch.float32)), r"log_softmax in float32: from_torch computes in float64"),
    (_Buffered(), r"^shift: a tensor that is not a parameter"),
    (_Vector(), r"^_Vector\.forward: @ of shapes \(n, 3\) and \(1, 3\) \(a 1-D parameter is a row"),
    (_TwoInputs(), r"_TwoInputs\.forward takes \['a', 'b'\]; from_torch converts a forward of one input"),
    (_Block(op=lambda h: (h, h)), r"_Block\.forward returns .*one \(batch, outputs\) tensor"),
    (tnn.Conv1d(1, 1, 3), r"^the module: Conv1d is not supported yet"),
])
def test_what_it_cannot_translate_is_named_with_its_module(net, message):
    with pytest.raises(sbp.ModelError, match=message):
        sbp.from_torch(net.double(), np.zeros((2, 3)))


def test_cross_entropy_of_class_labels_against_torch():
    """nn.softmax_cross_entropy of an Index of labels (the one-hot rows it gathers) against
    F.cross_entropy with integer targets: loss and gradient, both reductions, batches 1, 4 and 7."""
    rng = np.random.default_rng(5)
    net = tnn.Linear(3, 5).double()
    for reduction in ("mean", "sum"):
        model, params = sbp.from_torch(net, np.zeros((1, 3)), loss="cross_entropy_labels", reduction=reduction,
                                       name=f"from_torch_labels_{reduction}")
        assert isinstance(model.inputs[1], sbp.Index)
        mod = sbp.compile(model)
        for batch in (1, 4, 7):
            x, labels = 3 * rng.standard_normal((batch, 3)), rng.integers(0, 5, size=batch)
            net.zero_grad()
            expected = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels), reduction=reduction)
            expected.backward()
            value, grads = mod.value_and_grad(X=x, T=labels, **params)
            assert value == pytest.approx(expected.item(), rel=RTOL)
            for key, grad in params.state_dict(grads).items():
                p = net.get_parameter(key)
                assert (grad - p.grad).abs().max().item() <= RTOL * p.grad.abs().max().item(), (reduction, batch, key)
    with pytest.raises(sbp.ArgumentError, match="T"):
        mod.value_and_grad(X=x, T=np.array([0, 5, 1, 1, 1, 1, 1]), **params)  # class 5 of 5


def test_reduction_needs_a_named_loss():
    with pytest.raises(sbp.ModelError, match="reduction 'sum' applies to a named loss"):
        sbp.from_torch(tnn.Linear(3, 2), np.zeros((2, 3)), loss=_huber_ours, reduction="sum")
    with pytest.raises(sbp.ModelError, match="reduction is one of"):
        sbp.from_torch(tnn.Linear(3, 2), np.zeros((2, 3)), reduction="none")


def test_a_shared_layer_is_one_parameter():
    """A layer called twice (and a weight used by two paths) is one param whose gradient is the sum, as torch's."""
    class Twice(tnn.Module):
        def __init__(self):
            super().__init__()
            self.lin = tnn.Linear(3, 3)

        def forward(self, h):
            return self.lin(torch.tanh(self.lin(h))) + h @ self.lin.weight

    torch.manual_seed(2)
    net = Twice().double()
    model, params = sbp.from_torch(net, np.zeros((1, 3)), name="from_torch_twice")
    assert sorted(params.torch_names.values()) == ["lin.bias", "lin.weight"]
    x, t = np.random.default_rng(2).standard_normal((2, 5, 3))
    expected = F.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(t))
    expected.backward()
    value, grads = sbp.compile(model).value_and_grad(X=x, T=t, **params)
    assert value == pytest.approx(expected.item(), rel=RTOL)
    for key, grad in params.state_dict(grads).items():
        torch.testing.assert_close(grad, net.get_parameter(key).grad, rtol=RTOL, atol=1e-14)


class _Tokens(tnn.Module):
    def __init__(self):
        super().__init__()
        self.embed = tnn.Embedding(20, 4)
        self.head = tnn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.embed(ids))


@pytest.mark.parametrize("net, example, message", [
    (tnn.Sequential(OrderedDict(emb=tnn.Embedding(10, 3))), np.zeros((2, 3, 4)), r"^emb: Embedding .*nn\.embedding"),
    (tnn.Sequential(OrderedDict(c=tnn.Conv1d(1, 1, 3))), np.zeros((2, 1, 8)), r"^c: Conv1d .*\(2, 1, 8\).*nn\.conv2d"),
    (tnn.Sequential(OrderedDict(block=_Attention(cross=True))), np.zeros((2, 3, 3)),
     r"^block\.attn: MultiheadAttention with different query, key and value \(cross-attention\)"),
    (_Tokens(), np.zeros((2, 5), dtype=np.int64), r"^embed: Embedding of \(n, 5\): .*one id per example.*nn\.embedding"),
    (tnn.Sequential(OrderedDict(rnn=tnn.GRUCell(3, 3))), np.zeros((2, 3)), r"^rnn: GRUCell .*nn\.gru_cell"),
])
def test_a_layer_it_does_not_convert_is_named_with_the_built_in_to_use(net, example, message):
    """A network of a layer from_torch does not convert (Conv1d, Embedding)
    is refused by naming that layer and its built-in, not by its input's shape."""
    with pytest.raises(sbp.ModelError, match=message) as caught:
        sbp.from_torch(net.double(), example)
    assert "example input; got shape" not in str(caught.value)
