"""benchmarks/real_sizes.py's ResNet: the model symbackprop times is the one its peers time
(float64 loss and every gradient against PyTorch autograd of the network written with
torch.nn.functional), and its convolutions' geometry is the one --layers times."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import real_sizes  # noqa: E402


def test_the_resnet_convolutions_end_at_64_channels_of_8x8():
    batch, convs = real_sizes.conv_layers("resnet")
    assert batch == 32
    sides = {name: (side + 2 * pad - k) // stride + 1 for name, _, side, _, k, stride, pad in convs}
    assert sides["K0"] == 32 and sides["Kr2a"] == sides["Kr2p"] == 16 and sides["Kr3b"] == sides["Kr3p"] == 8
    assert [c[3] for c in convs] == [16, 16, 16, 32, 32, 32, 64, 64, 64]
    assert real_sizes.conv_layers("lenet5")[1][1][2] == 14  # LeNet-5's second conv reads the pooled 14x14


@pytest.mark.slow
def test_the_resnet_gradients_equal_pytorch_float64():
    pytest.importorskip("torch")
    errors = real_sizes.check_functional("resnet", ["torch_eager"])
    assert errors["torch_eager"] < 1e-10
