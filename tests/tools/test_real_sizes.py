"""benchmarks/real_sizes.py's ResNet: the model symbackprop times is the one its peers time
(float64 loss and every gradient against PyTorch autograd of the network written with
torch.nn.functional), and its convolutions' geometry is the one --layers times."""

import sys
from pathlib import Path

import numpy as np
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


def test_the_breakdown_times_each_weight_product_of_the_decoder_and_the_mlp():
    """Its gemm list is the models' weights: one forward product per weight, m rows."""
    from benchmarks import real_sizes_breakdown as parts

    for workload, shapes in (("gpt", real_sizes.gpt_shapes()), ("mlp", [("W1", real_sizes.MLP_SIZES[:2]),
                                                                       ("W2", real_sizes.MLP_SIZES[1:])])):
        weights = sorted(tuple(shape) for name, shape in shapes if name.startswith("W"))
        listed = sorted((k, n) for _, k, n, count, _ in parts.PRODUCTS[workload] for _ in range(count))
        assert listed == weights, workload
    step = parts.gemms("mlp", training=True)
    assert [g[0].split()[0] for g in step] == ["X", "X^T", "X", "dY", "X^T"]  # no gradient by the pixels
    assert len(parts.gemms("gpt", training=True)) == 3 * len(parts.gemms("gpt", training=False))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_breakdowns_blas_call_multiplies_as_numpy_does(dtype):
    """Cblas.call's transposes and leading dimensions, against numpy's product."""
    from benchmarks import real_sizes_breakdown as parts

    rng = np.random.default_rng(0)
    cblas = parts.Cblas(dtype)
    for ta, tb in ((False, False), (False, True), (True, False)):
        a = rng.standard_normal((5, 3) if ta else (3, 5)).astype(dtype)
        b = rng.standard_normal((4, 5) if tb else (5, 4)).astype(dtype)
        c = np.full((3, 4), np.nan, dtype=dtype)
        cblas.call(a, b, c, ta, tb)()
        want = (a.T if ta else a) @ (b.T if tb else b)
        np.testing.assert_allclose(c, want, rtol=1e-5 if dtype == "float32" else 1e-12)


def test_each_peer_runs_in_a_process_of_its_own_and_answers_timed_calls():
    """PeerProcesses: a peer without the model (JAX has no LeNet-5 here; an unknown name) drops out,
    and each turn's answer is the number of calls asked for, in seconds, from the peer's own process."""
    notes: dict = {}
    peers = real_sizes.PeerProcesses("mlp", "float64", ["symbackprop", "no_such_peer"], notes, clock="cpu")
    try:
        assert peers.peers == ["symbackprop"]
        for what in ("step", "infer"):
            times = peers.sample("symbackprop", what, 3)
            assert len(times) == 3 and all(0 < t < 10 for t in times)
        pid = peers.processes["symbackprop"].pid
        assert pid != __import__("os").getpid()
    finally:
        peers.close()
    assert peers.processes == {}


def test_interleave_takes_ratios_round_by_round():
    """The ratio is the median of each round's ratio to the first label's, not a ratio of medians."""
    script = {"a": iter([[1.0], [2.0], [4.0]]), "b": iter([[3.0], [2.0], [2.0]])}
    result = real_sizes.interleave_samples(["a", "b"], lambda label, count: next(script[label]), 3, 1)
    assert result["a"] == (2.0, (1.0, 1.0, 1.0))
    assert result["b"] == (2.0, (1.0, 0.5, 3.0))


def test_each_turn_opens_with_an_untimed_call():
    """time_calls calls once more than it times: the turn's first call warms the caches."""
    made = []
    times = real_sizes.time_calls(lambda: made.append(1), 4, "wall")
    assert len(times) == 4 and len(made) == 5


def test_the_peers_malloc_settings_join_any_the_user_set(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    env = real_sizes.peer_environment()
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + real_sizes.PEER_MALLOC
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert real_sizes.peer_environment()["GLIBC_TUNABLES"] == real_sizes.PEER_MALLOC
