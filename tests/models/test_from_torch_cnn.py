"""sbp.from_torch of CNNs as people write them in PyTorch (Conv2d, pools,
BatchNorm2d in eval mode, flatten into Linear layers), compiled by
symbackprop and checked against the same network run by PyTorch autograd:
the loss, the output and every parameter's gradient, in float64 to 1e-10
relative and in float32 loosely; and the refusals, each naming the module
path and what is not translated."""

from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402

tnn = torch.nn
F = torch.nn.functional
RTOL = 1e-10


def _relative(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-300))


def _check(net, shape, classes, name, seed=0, loss="cross_entropy_labels", dtype="float64", rtol=RTOL):
    """Compile from_torch(net) and compare its loss, output Y and every
    parameter gradient with torch float64 autograd of the same network;
    returns the largest relative error."""
    net = net.double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, dtype=torch.float64, generator=gen)
    if loss == "cross_entropy_labels":
        t = torch.randint(0, classes, (shape[0],), generator=gen)
        expected = F.cross_entropy(net(x), t)
    else:
        t = torch.randn(shape[0], classes, dtype=torch.float64, generator=gen)
        expected = F.mse_loss(net(x), t)
    net.zero_grad()
    expected.backward()
    model, params = sbp.from_torch(net, x, loss=loss, name=name)
    mod = sbp.compile(model, dtype=dtype)
    cast = {k: v.astype(dtype) for k, v in params.items()}
    inputs = {"X": x.numpy().reshape(shape[0], -1).astype(dtype),
              "T": t.numpy() if loss == "cross_entropy_labels" else t.numpy().astype(dtype)}
    value, grads = mod.value_and_grad(**inputs, **cast)
    errors = [abs(value - expected.item()) / abs(expected.item())]
    errors.append(_relative(mod.forward(**inputs, **cast)["Y"], net(x).detach().numpy()))
    ours = params.state_dict(grads)
    assert sorted(ours) == sorted(k for k, p in net.named_parameters() if p.requires_grad)
    for key, grad in ours.items():
        errors.append(_relative(grad.numpy(), net.get_parameter(key).grad.numpy()))
    assert max(errors) < rtol, errors
    return max(errors)


class LeNet5(tnn.Module):
    """LeNet-5 on 28x28 images as PyTorch tutorials write it (the pair of benchmarks/real_sizes.py's)."""

    def __init__(self):
        super().__init__()
        self.conv1 = tnn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = tnn.Conv2d(6, 16, 5)
        self.fc1 = tnn.Linear(16 * 5 * 5, 120)
        self.fc2 = tnn.Linear(120, 84)
        self.fc3 = tnn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), (2, 2))
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _vgg():
    """conv-relu-conv-relu-maxpool twice (inplace ReLUs, as torchvision's VGG), then Flatten and Linear."""
    def block(cin, cout):
        return [tnn.Conv2d(cin, cout, 3, padding=1), tnn.ReLU(inplace=True),
                tnn.Conv2d(cout, cout, 3, padding=1), tnn.ReLU(inplace=True), tnn.MaxPool2d(2, 2)]

    torch.manual_seed(1)
    return tnn.Sequential(OrderedDict(features=tnn.Sequential(*block(3, 4), *block(4, 6)), flat=tnn.Flatten(),
                                      classifier=tnn.Sequential(tnn.Dropout(0.5), tnn.Linear(6 * 2 * 3, 5)))).eval()


def test_lenet5_matches_torch_float64():
    torch.manual_seed(0)
    _check(LeNet5(), (3, 1, 28, 28), 10, "from_torch_cnn_lenet5")


def test_lenet5_float32_matches_torch_loosely():
    torch.manual_seed(0)
    _check(LeNet5(), (3, 1, 28, 28), 10, "from_torch_cnn_lenet5", dtype="float32", rtol=1e-4)


def test_a_vgg_style_stack_matches_torch():
    """Non-square images (8x12) and several channels: a flatten in another
    order than torch's NCHW would put the Linear's gradient columns wrong."""
    _check(_vgg(), (2, 3, 8, 12), 5, "from_torch_cnn_vgg")


class _Conv(tnn.Module):
    """One convolution of the given arguments, a tanh, then torch.flatten(x, 1) into a Linear."""

    def __init__(self, features, **conv):
        super().__init__()
        self.conv = tnn.Conv2d(2, 3, **conv)
        self.out = tnn.Linear(features, 4)

    def forward(self, x):
        return self.out(torch.flatten(torch.tanh(self.conv(x)), 1))


@pytest.mark.parametrize("conv, features", [
    ({"kernel_size": 3, "stride": 2, "padding": 1}, 3 * 4 * 5),
    ({"kernel_size": 4, "stride": 3, "padding": 0}, 3 * 2 * 2),
    ({"kernel_size": (3, 5), "stride": 1, "padding": 2, "bias": False}, 3 * 9 * 9),
    ({"kernel_size": 3, "padding": "same"}, 3 * 7 * 9),
    ({"kernel_size": 1, "stride": (2, 2), "padding": (1, 1), "bias": False}, 3 * 5 * 6),
    ({"kernel_size": (3, 5), "stride": (2, 3), "padding": (1, 2)}, 3 * 4 * 3),
    ({"kernel_size": (5, 2), "stride": (1, 2), "padding": (2, 0), "dilation": (1, 2)}, 3 * 7 * 4),
    ({"kernel_size": 3, "padding": "same", "dilation": 2, "bias": False}, 3 * 7 * 9),
])
def test_conv2d_stride_padding_kernel_and_bias_variants(conv, features):
    torch.manual_seed(2)
    _check(_Conv(features, **conv), (3, 2, 7, 9), 4, f"from_torch_cnn_conv_{len(conv)}_{features}", loss="mse")


class _Pools(tnn.Module):
    """AvgPool2d with a stride other than its window, sigmoid and a residual
    sum on images, then global average pooling and x.reshape(x.shape[0], -1)."""

    def __init__(self):
        super().__init__()
        self.conv = tnn.Conv2d(2, 4, 3, padding=1)
        self.pool = tnn.AvgPool2d(3, stride=2)
        self.conv2 = tnn.Conv2d(4, 4, 1)
        self.gap = tnn.AdaptiveAvgPool2d((1, 1))
        self.out = tnn.Linear(4, 3)

    def forward(self, x):
        h = self.pool(torch.sigmoid(self.conv(x)))
        h = F.silu(h + 0.5 * self.conv2(h))
        h = self.gap(h)
        return self.out(h.reshape(h.shape[0], -1))


def test_avg_pool_adaptive_pool_and_residual_on_images():
    torch.manual_seed(3)
    _check(_Pools(), (2, 2, 9, 9), 3, "from_torch_cnn_pools")


def test_padded_rectangular_pools():
    """MaxPool2d pads with -inf, AvgPool2d counts its padding's zeros (count_include_pad=True)."""
    torch.manual_seed(5)
    net = tnn.Sequential(tnn.Conv2d(2, 3, 3, padding=1), tnn.MaxPool2d((3, 2), stride=(2, 1), padding=1),
                         tnn.AvgPool2d((2, 3), stride=1, padding=(1, 1)), tnn.Tanh(),
                         tnn.AvgPool2d(2, count_include_pad=False), tnn.Flatten(), tnn.Linear(3 * 2 * 5, 4))
    _check(net, (2, 2, 7, 9), 4, "from_torch_cnn_padded_pools")


def _batch_norm_net(affine: bool):
    torch.manual_seed(4)
    net = tnn.Sequential(OrderedDict(conv=tnn.Conv2d(2, 3, 3, bias=False), bn=tnn.BatchNorm2d(3, affine=affine),
                                     act=tnn.ReLU(), pool=tnn.MaxPool2d(2), flat=tnn.Flatten(),
                                     fc=tnn.Linear(3 * 3 * 3, 4)))
    with torch.no_grad():  # running statistics and scales away from their initial 0, 1
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
        if affine:
            net.bn.weight.uniform_(0.5, 1.5)
            net.bn.bias.uniform_(-0.5, 0.5)
    return net.eval()


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm2d_in_eval_mode_is_its_running_statistics(affine):
    """BatchNorm2d in eval mode: the running statistics are inputs of the
    model (params.frozen), not differentiated; gamma and beta are parameters."""
    net = _batch_norm_net(affine)
    _check(net, (3, 2, 8, 8), 4, f"from_torch_cnn_bn_{affine}")
    _, params = sbp.from_torch(net.double(), np.zeros((1, 2, 8, 8)), name=f"from_torch_cnn_bn_{affine}")
    assert params.frozen == ("bn_running_mean", "bn_running_var")
    assert params["bn_running_var"].shape == (1, 3)


def test_conv_weights_are_torch_memory_and_state_dict_gives_them_back():
    net = tnn.Conv2d(2, 3, (2, 4)).double()
    _model, params = sbp.from_torch(tnn.Sequential(net, tnn.Flatten()), np.zeros((1, 2, 5, 6)), loss=None,
                                   name="from_torch_cnn_weights")
    assert params["l0_weight"].shape == (3, 2 * 2 * 4)
    assert np.array_equal(params["l0_weight"], net.weight.detach().numpy().reshape(3, -1))
    back = params.state_dict({"l0_weight": params["l0_weight"]})["0.weight"]
    assert torch.equal(back, net.weight.detach())


class _Functional(tnn.Module):
    """The functional forms with the module's own parameters."""

    def __init__(self):
        super().__init__()
        self.w = tnn.Parameter(torch.randn(3, 1, 3, 3) / 3)
        self.b = tnn.Parameter(torch.randn(3) / 3)
        self.out = tnn.Linear(3 * 2 * 2, 2)

    def forward(self, x):
        h = F.conv2d(x, self.w, self.b, stride=1, padding=1)
        h = F.avg_pool2d(F.leaky_relu(h, 0.1), 2)
        h = F.max_pool2d(h, kernel_size=2, stride=2)
        return self.out(h.flatten(1))


def test_functional_conv_and_pools():
    torch.manual_seed(5)
    _check(_Functional(), (2, 1, 8, 8), 2, "from_torch_cnn_functional")


class _Grouped(tnn.Module):
    def __init__(self, conv):
        super().__init__()
        self.stem = tnn.Sequential(OrderedDict(conv=conv))
        self.out = tnn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.flatten(self.stem(x), 1))


class _Softmax2d(tnn.Module):
    def forward(self, x):
        return F.softmax(x, 1)


class _Viewed(tnn.Module):
    def forward(self, x):
        return x.view(-1, 7)


class _Unsupported(tnn.Module):
    def __init__(self):
        super().__init__()
        self.up = tnn.Upsample(scale_factor=2)

    def forward(self, x):
        return torch.flatten(self.up(x), 1)


class _Reduce(tnn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("net, shape, message", [
    (_Grouped(tnn.Conv2d(2, 4, 3, groups=2)), (1, 2, 3, 3), r"^stem\.conv: Conv2d with groups=2: grouped .*; use groups=1"),
    (_Grouped(tnn.Conv2d(2, 4, 3, dilation=2)), (1, 2, 3, 3),
     r"^stem\.conv: conv2d's 3x3 window \(dilation \(2, 2\): it spans 5x5\) is larger than the 3x3 image"),
    (tnn.Sequential(OrderedDict(conv=tnn.Conv2d(1, 2, 3), bn=tnn.BatchNorm2d(2, momentum=None),
                                flat=tnn.Flatten())).train(), (2, 1, 5, 5), r"^bn: BatchNorm2d\(momentum=None\) in training"),
    (_Unsupported(), (1, 1, 2, 2), r"^up: Upsample is not supported yet; from_torch converts the layers .*Conv2d"),
    (tnn.Sequential(tnn.Conv2d(1, 2, 3, padding_mode="reflect"), tnn.Flatten()), (1, 1, 4, 4),
     r"^0: Conv2d with padding_mode='reflect'"),
    (tnn.Sequential(tnn.MaxPool2d(2, padding=(1, 2)), tnn.Flatten()), (1, 1, 4, 4),
     r"^0: MaxPool2d's padding \(1, 2\) is more than half its 2x2 window"),
    (tnn.Sequential(tnn.AvgPool2d(3, padding=1, count_include_pad=False), tnn.Flatten()), (1, 1, 4, 4),
     r"^0: AvgPool2d with count_include_pad=False and padding=1: .*count_include_pad=True"),
    (tnn.Sequential(tnn.MaxPool2d(2, ceil_mode=True), tnn.Flatten()), (1, 1, 5, 5),
     r"^0: MaxPool2d with ceil_mode=True .*partial window"),
    (tnn.Sequential(tnn.AvgPool2d(2, divisor_override=3), tnn.Flatten()), (1, 1, 4, 4),
     r"^0: AvgPool2d with divisor_override=3"),
    (tnn.Sequential(tnn.AdaptiveAvgPool2d(3), tnn.Flatten()), (1, 1, 4, 4), r"^0: AdaptiveAvgPool2d to 3 of 4x4"),
    (tnn.Sequential(tnn.Conv2d(1, 2, 3), tnn.Linear(2, 2)), (1, 1, 4, 4), r"^1: linear of images \(batch, 2, 2, 2\).*flatten"),
    (tnn.Sequential(tnn.Flatten(start_dim=2)), (1, 1, 4, 4), r"^0: flatten\(start_dim=2, end_dim=-1\) of images"),
    (tnn.Sequential(OrderedDict(c=tnn.Conv2d(1, 2, 3), s=_Softmax2d())), (1, 1, 4, 4),
     r"^s: softmax of images .*flatten them first"),
    (_Viewed(), (1, 1, 4, 4), r"^_Viewed\.forward: Tensor\.view\(\) of a tensor of shape .* to \(-1, 7\)"),
    (tnn.Sequential(tnn.Conv2d(1, 2, 3)), (1, 1, 4, 4), r"^Sequential\.forward returns images \(batch, 2, 2, 2\)"),
    (tnn.Conv2d(1, 2, 3), (1, 1, 4, 4), r"^the module: Conv2d returns images"),
    (tnn.Sequential(tnn.Linear(3, 3), tnn.Conv2d(1, 1, 1)), (2, 3), r"^1: conv2d takes images \(batch, C, H, W\)"),
    (_Reduce(lambda x: x.mean(1)), (1, 2, 3, 3), r"^_Reduce\.forward: mean over 1 of a tensor of shape"),
    (_Reduce(lambda x: torch.cat([x, x], 2).flatten(1)), (1, 2, 3, 3), r"^_Reduce\.forward: cat along dim 2"),
])
def test_what_is_not_translated_is_refused_with_the_module_path(net, shape, message):
    with pytest.raises(sbp.ModelError, match=message):
        sbp.from_torch(net.double(), np.zeros(shape))


class _Ids(tnn.Module):
    """An Embedding of one id per example (used twice: its gradient rows add) into a Linear."""

    def __init__(self):
        super().__init__()
        self.embed = tnn.Embedding(7, 4)
        self.out = tnn.Linear(4, 3)

    def forward(self, ids):
        h = self.embed(ids)
        return self.out(torch.tanh(h) + F.embedding(ids, self.embed.weight))


def test_an_embedding_of_one_id_per_example_matches_torch():
    torch.manual_seed(6)
    net = _Ids().double()
    ids = torch.tensor([3, 0, 3, 6, 1])
    t = torch.randn(5, 3, dtype=torch.float64)
    expected = F.mse_loss(net(ids), t)
    expected.backward()
    model, params = sbp.from_torch(net, ids, loss="mse", name="from_torch_cnn_ids")
    value, grads = sbp.compile(model).value_and_grad(X=ids.numpy(), T=t.numpy(), **params)
    assert value == pytest.approx(expected.item(), rel=RTOL)
    for key, grad in params.state_dict(grads).items():
        assert _relative(grad.numpy(), net.get_parameter(key).grad.numpy()) < RTOL
    assert not net.embed.weight.grad[2].any() and params.state_dict(grads)["embed.weight"][3].abs().sum() > 0


class _Arithmetic(tnn.Module):
    def forward(self, ids):
        return ids * 2.0


@pytest.mark.parametrize("net, message", [
    (tnn.Sequential(OrderedDict(e=tnn.Embedding(5, 2, padding_idx=0))), r"^e: Embedding with padding_idx=0"),
    (tnn.Sequential(OrderedDict(e=tnn.Embedding(5, 2, max_norm=1.0))), r"^e: Embedding with max_norm=1\.0"),
    (_Arithmetic(), r"^_Arithmetic\.forward: \* of the integer ids X is not translated"),
])
def test_what_an_embedding_does_not_translate_is_refused(net, message):
    with pytest.raises(sbp.ModelError, match=message):
        sbp.from_torch(net.double(), np.array([1, 2, 3]))


class _MnistExample(tnn.Module):
    """pytorch/examples' MNIST network (narrower): Dropout on images, F.log_softmax output."""

    def __init__(self):
        super().__init__()
        self.conv1 = tnn.Conv2d(1, 4, 3, 1)
        self.conv2 = tnn.Conv2d(4, 8, 3, 1)
        self.dropout1 = tnn.Dropout(0.25)
        self.dropout2 = tnn.Dropout2d(0.5)
        self.fc1 = tnn.Linear(8 * 12 * 12, 16)
        self.fc2 = tnn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout2(F.max_pool2d(x, 2))
        x = self.dropout1(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def test_the_pytorch_mnist_example_in_eval_mode():
    """Its loss is F.nll_loss of the log-probabilities: cross-entropy of
    them is the same (log_softmax of log-probabilities is themselves)."""
    torch.manual_seed(7)
    _check(_MnistExample().eval(), (2, 1, 28, 28), 10, "from_torch_cnn_mnist")


class _WriteThroughFlatten(tnn.Module):
    """An in-place write into the flattening of images is a write into them (the same memory)."""

    def __init__(self):
        super().__init__()
        self.conv = tnn.Conv2d(1, 2, 3)
        self.out = tnn.Linear(2 * 3 * 3, 2)

    def forward(self, x):
        h = self.conv(x)
        flat = torch.flatten(h, 1)
        flat.mul_(3.0)
        return self.out(torch.tanh(h).flatten(1)) + self.out(flat)


def test_a_write_into_the_flattened_images_is_seen_through_them():
    torch.manual_seed(8)
    _check(_WriteThroughFlatten(), (2, 1, 5, 5), 2, "from_torch_cnn_write_flat", loss="mse")


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm1d_in_eval_mode_after_a_flatten(affine):
    """BatchNorm1d of (batch, features) in eval mode, here of flattened images, as a CNN's head has it."""
    torch.manual_seed(9)
    net = tnn.Sequential(OrderedDict(conv=tnn.Conv2d(1, 2, 3), flat=tnn.Flatten(), fc=tnn.Linear(2 * 4 * 4, 6),
                                     bn=tnn.BatchNorm1d(6, affine=affine), act=tnn.ReLU(), out=tnn.Linear(6, 3)))
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
        if affine:
            net.bn.weight.uniform_(0.5, 1.5)
            net.bn.bias.uniform_(-0.5, 0.5)
    _check(net.eval(), (3, 1, 6, 6), 3, f"from_torch_cnn_bn1d_{affine}")


def test_batch_norm1d_with_a_cumulative_average_is_refused():
    net = tnn.Sequential(OrderedDict(fc=tnn.Linear(3, 4), norm=tnn.BatchNorm1d(4, momentum=None))).double()
    with pytest.raises(sbp.ModelError, match=r"^norm: BatchNorm1d\(momentum=None\) in training mode .*momentum"):
        sbp.from_torch(net, np.zeros((2, 3)))


class _BasicBlock(tnn.Module):
    """torchvision's ResNet basic block: conv-bn-relu-conv-bn plus the shortcut (a 1x1 projection where the shape changes)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(cout)
        self.relu = tnn.ReLU(inplace=True)
        self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = tnn.BatchNorm2d(cout)
        self.downsample = (tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False), tnn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class _SmallResNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.stem = tnn.Sequential(tnn.Conv2d(3, 4, 3, padding=1, bias=False), tnn.BatchNorm2d(4), tnn.ReLU(inplace=True))
        self.layer1 = _BasicBlock(4, 4, 1)
        self.layer2 = _BasicBlock(4, 6, 2)
        self.fc = tnn.Linear(6, 5)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(x.mean((2, 3)))


def test_a_small_resnet_in_eval_mode():
    """Basic blocks with BatchNorm2d (running statistics set by a few
    training batches), a projection shortcut, in-place sums and ReLUs, and
    the global average pool written x.mean((2, 3))."""
    torch.manual_seed(10)
    net = _SmallResNet().double()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(4, 3, 8, 8, dtype=torch.float64) * 2 + 1)
    _check(net.eval(), (2, 3, 8, 8), 5, "from_torch_cnn_resnet")


class _Inception(tnn.Module):
    """Branches concatenated along the channels, then AdaptiveAvgPool2d(1) and flatten."""

    def __init__(self):
        super().__init__()
        self.a = tnn.Conv2d(2, 3, 1)
        self.b = tnn.Conv2d(2, 2, 3, padding=1)
        self.pool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(3 + 2 + 2, 3)

    def forward(self, x):
        h = torch.cat([F.relu(self.a(x)), torch.tanh(self.b(x)), x], dim=1)
        return self.fc(torch.flatten(self.pool(h * h), 1))


def test_a_concatenation_along_the_channels():
    torch.manual_seed(11)
    _check(_Inception(), (2, 2, 5, 6), 3, "from_torch_cnn_inception")


def test_an_sgd_step_on_a_converted_cnn_is_torchs():
    """train_step updates the weights as torch.optim.SGD does and leaves
    BatchNorm2d's running statistics (frozen inputs) as they are."""
    net = _batch_norm_net(True).double()
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    t = torch.tensor([0, 3, 1])
    model, params = sbp.from_torch(net, x, loss="cross_entropy_labels", name="from_torch_cnn_bn_sgd")
    stats = params["bn_running_mean"].copy(), params["bn_running_var"].copy()
    sbp.compile(model, optimizer=sbp.SGD(lr=0.1)).train_step(X=x.numpy().reshape(3, -1), T=t.numpy(), **params)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    F.cross_entropy(net(x), t).backward()
    optimizer.step()
    for name, key in params.torch_names.items():
        expected = net.state_dict()[key].numpy().reshape(params[name].shape)
        np.testing.assert_allclose(params[name], expected, rtol=RTOL, atol=1e-15)
    assert np.array_equal(stats[0], params["bn_running_mean"]) and np.array_equal(stats[1], params["bn_running_var"])
