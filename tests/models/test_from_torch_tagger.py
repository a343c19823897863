"""sbp.from_torch of an LSTM tagger as a whole model: nn.Embedding of token
ids -> nn.LSTM (or GRU; batch_first or not, 1 or 2 layers, bidirectional)
-> nn.Linear on every step's output -> cross-entropy per token, the mean
over all tokens. Against the same network run by PyTorch in float64: the
loss and every parameter's gradient from torch autograd to 1e-12 relative,
at several sequence lengths and batch sizes with one compiled module, and
training steps equal to torch.optim's SGD and Adam."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402

tnn = torch.nn
VOCAB, EMBED, HIDDEN, TAGS = 11, 5, 4, 3
CONFIGS = {  # name: (kind, num_layers, batch_first, bidirectional)
    "lstm": ("LSTM", 1, True, False),
    "lstm_stacked_time_major": ("LSTM", 2, False, False),
    "lstm_bidirectional": ("LSTM", 1, True, True),
    "gru_stacked_bidirectional_time_major": ("GRU", 2, False, True),
}


class Tagger(tnn.Module):
    def __init__(self, kind, layers, batch_first, bidirectional):
        super().__init__()
        self.embed = tnn.Embedding(VOCAB, EMBED)
        self.rnn = getattr(tnn, kind)(EMBED, HIDDEN, num_layers=layers, batch_first=batch_first,
                                      bidirectional=bidirectional)
        self.tag = tnn.Linear(HIDDEN * (2 if bidirectional else 1), TAGS)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.tag(out)  # (n, L, tags) or (L, n, tags): a score per token


def _net(config):
    torch.manual_seed(3)
    net = Tagger(*CONFIGS[config]).double()
    for p in net.parameters():
        torch.nn.init.uniform_(p, -0.7, 0.7)
    return net


@functools.cache
def _compiled(config, optimizer=None):
    """One module a configuration: compiled from an example of 2 sequences of 4 tokens."""
    net = _net(config)
    example = torch.zeros((2, 4) if net.rnn.batch_first else (4, 2), dtype=torch.int64)
    model, params = sbp.from_torch(net, example, loss="cross_entropy_labels", name=f"tagger_{config}")
    return sbp.compile(model, optimizer=optimizer), params


def _batch(batch, steps, seed, batch_first):
    """Token ids and tags of `batch` sequences of `steps` tokens, as the
    network takes them, and their time-major rows (X and T)."""
    gen = torch.Generator().manual_seed(seed)
    ids, tags = torch.randint(0, VOCAB, (batch, steps), generator=gen), torch.randint(0, TAGS, (batch, steps),
                                                                                     generator=gen)
    rows = {"X": ids.T.reshape(-1).numpy(), "T": tags.T.reshape(-1).numpy(), "batch": np.arange(batch)}
    return (ids, tags) if batch_first else (ids.T, tags.T), rows


def _torch_loss(net, ids, tags):
    return torch.nn.functional.cross_entropy(net(ids).reshape(-1, TAGS), tags.reshape(-1))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_tagger_matches_torch_at_every_length_with_one_module(config):
    mod, params = _compiled(config)
    net = _net(config)
    assert sorted(params.torch_names.values()) == sorted(key for key, _ in net.named_parameters())
    for seed, (batch, steps) in enumerate([(2, 4), (3, 1), (1, 7), (4, 3)]):
        (ids, tags), rows = _batch(batch, steps, seed, net.rnn.batch_first)
        loss, grads = mod.value_and_grad(**rows, **params)
        net.zero_grad()
        expected = _torch_loss(net, ids, tags)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
        ours = params.state_dict(grads)
        assert sorted(ours) == sorted(params.torch_names.values())  # every parameter, by torch's name
        for key, grad in ours.items():
            want = net.get_parameter(key).grad
            np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-12,
                                       atol=1e-12 * float(want.abs().max()), err_msg=f"{key} at {batch}x{steps}")


@pytest.mark.parametrize("optimizer", [sbp.SGD(lr=0.3, momentum=0.9), sbp.Adam(lr=0.05)], ids=repr)
def test_training_steps_match_torch_optim(optimizer):
    config = "lstm_bidirectional"
    mod, init = _compiled(config, optimizer)
    params = {name: value.copy() for name, value in init.items()}
    net = _net(config)
    if isinstance(optimizer, sbp.SGD):
        opt = torch.optim.SGD(net.parameters(), lr=optimizer.lr, momentum=optimizer.momentum)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2),
                               eps=optimizer.eps)
    for seed, (batch, steps) in enumerate([(2, 5), (3, 2)]):  # two lengths: one module
        (ids, tags), rows = _batch(batch, steps, 10 + seed, True)
        loss = mod.train_step(**rows, **params)
        opt.zero_grad()
        expected = _torch_loss(net, ids, tags)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
    before = init.state_dict(dict(init))
    for key, value in init.state_dict(params).items():
        want = net.get_parameter(key).detach()
        assert float((want - before[key]).abs().max()) > 1e-3, key  # moved: the comparison means something
        np.testing.assert_allclose(value.numpy(), want.numpy(), rtol=1e-11, atol=1e-12, err_msg=key)


def test_the_directions_are_never_placed_side_by_side():
    """Both directions' outputs feed the next layer's step and the Linear as
    two blocks, each times its columns of the weights (nn.linear of
    nn.concat_columns): no 0/1 placing product is left in the model."""
    import sympy as sp

    net = _net("gru_stacked_bidirectional_time_major")
    model, _ = sbp.from_torch(net, torch.zeros(4, 2, dtype=torch.int64), loss="cross_entropy_labels")
    assert not model.loss.atoms(sp.ImmutableMatrix)  # atoms reach into the scans' steps


def test_the_batch_input_gives_the_number_of_sequences():
    """X and T have L*n rows: `batch` (np.arange(n)) binds n; rows that are not
    whole steps of it are refused, not read as other sequences."""
    mod, params = _compiled("lstm")
    _, rows = _batch(3, 4, 0, True)
    assert [str(i) for i in mod.model.inputs] == ["X", "T", "batch"]
    with pytest.raises(sbp.ArgumentError, match="not a multiple of its batch"):
        mod.value_and_grad(**{**rows, "batch": np.arange(5)}, **params)
