"""sbp.from_torch of torch's encoders as they are: MultiheadAttention
without a mask (every key), TransformerEncoderLayer (post-norm and
norm_first, relu and gelu as strings, functions and modules, both
layouts, dropout in eval mode or 0), TransformerEncoder (layers, masks,
final norm) and an encoder classifier (token and positional embeddings,
two layers, mean pool or first token, Linear, cross-entropy), against
the same network run by PyTorch in float64: the loss and every
parameter's gradient from torch autograd to 1e-12 relative; and the
refusals, named by the module's path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402
from symbackprop.errors import ModelError  # noqa: E402

tnn = torch.nn
F = torch.nn.functional


def _rows(t, batch_first):
    """A torch (n, L, ...) / (L, n, ...) tensor as the example-major rows the model takes."""
    t = t if batch_first else t.transpose(0, 1)
    return np.ascontiguousarray(t.reshape(t.shape[0] * t.shape[1], -1).numpy())


def _init(net, seed=1):
    torch.manual_seed(seed)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.5)


def _check_grads(net, params, grads):
    ours = params.state_dict(grads)
    assert sorted(ours) == sorted(key for key, _ in net.named_parameters())
    for key, grad in ours.items():
        want = net.get_parameter(key).grad
        np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-12, atol=1e-12 * float(want.abs().max()),
                                   err_msg=key)


def _check_sequences(net, batch_first, batch=3, length=4, d=8):
    """net's per-position outputs under an mse loss, ours against torch's."""
    shape = (batch, length, d) if batch_first else (length, batch, d)
    x, t = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    model, params = sbp.from_torch(net, x, loss="mse")
    loss, grads = sbp.compile(model).value_and_grad(X=_rows(x, batch_first), T=_rows(t, batch_first), **params)
    expected = F.mse_loss(net(x), t)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    _check_grads(net, params, grads)


class Attend(tnn.Module):
    def __init__(self, d, heads, batch_first, mask):
        super().__init__()
        self.attn = tnn.MultiheadAttention(d, heads, batch_first=batch_first)
        self.mask = mask
        self.register_buffer("nothing", torch.zeros(4, 4, dtype=torch.float64))   # masks no key

    def forward(self, x):
        if self.mask == "none":
            return self.attn(x, x, x)[0]
        return self.attn(x, x, x, attn_mask=self.nothing, need_weights=False)[0]


@pytest.mark.parametrize(("heads", "batch_first", "mask"), [(2, True, "none"), (1, False, "none"),
                                                            (4, True, "masks nothing")])
def test_multihead_attention_without_a_mask_reads_every_key(heads, batch_first, mask):
    net = Attend(8, heads, batch_first, mask).double()
    _init(net)
    _check_sequences(net, batch_first)


@pytest.mark.parametrize(("norm_first", "activation", "batch_first", "training"), [
    (False, "relu", True, False), (True, "gelu", True, False), (False, "gelu", False, False),
    (True, F.relu, False, False), (False, F.gelu, True, True),            # training with dropout=0
    (True, tnn.GELU(approximate="tanh"), True, False),
])
def test_encoder_layer_matches_torch(norm_first, activation, batch_first, training):
    dropout = 0.0 if training else 0.1     # eval mode: dropout off
    net = tnn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=dropout, activation=activation,
                                      batch_first=batch_first, norm_first=norm_first).double()
    net.train(training)
    _init(net, seed=2)
    _check_sequences(net, batch_first)


class Stack(tnn.Module):
    """A TransformerEncoder of two layers and a final norm, causal or not."""

    def __init__(self, causal, norm=True, length=4):
        super().__init__()
        layer = tnn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = tnn.TransformerEncoder(layer, 2, norm=tnn.LayerNorm(8) if norm else None,
                                              enable_nested_tensor=False)
        self.register_buffer("mask", tnn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64))
        self.causal = causal

    def forward(self, x):
        return self.encoder(x, mask=self.mask, is_causal=True) if self.causal else self.encoder(x)


@pytest.mark.parametrize(("causal", "norm"), [(False, True), (True, False)])
def test_encoder_stack_matches_torch(causal, norm):
    net = Stack(causal, norm).double()
    _init(net, seed=3)
    _check_sequences(net, True)


class Classifier(tnn.Module):
    """Token and positional embeddings, a 2-layer encoder, a pool, a Linear."""

    def __init__(self, pool, vocab=7, d=8, length=5, classes=3):
        super().__init__()
        self.tok, self.pos = tnn.Embedding(vocab, d), tnn.Embedding(length, d)
        layer = tnn.TransformerEncoderLayer(d, 2, dim_feedforward=16, batch_first=True, activation="gelu")
        self.encoder = tnn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = tnn.Linear(d, classes)
        self.pool = pool

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1)))
        x = self.encoder(x)
        return self.head(x.mean(dim=1) if self.pool == "mean" else x[:, 0])


@pytest.mark.parametrize("pool", ["mean", "first"])
def test_an_encoder_classifier_matches_torch_at_several_batch_sizes(pool):
    net = Classifier(pool).double().eval()      # dropout 0.1 off in eval mode
    _init(net, seed=4)
    model, params = sbp.from_torch(net, torch.randint(0, 7, (2, 5)), loss="cross_entropy_labels")
    assert [str(i) for i in model.inputs] == ["X", "T", "positions", "starts"]
    mod = sbp.compile(model)
    for batch in (3, 1, 4):                     # one module, any number of sequences of L = 5
        ids, labels = torch.randint(0, 7, (batch, 5)), torch.randint(0, 3, (batch,))
        loss, grads = mod.value_and_grad(X=ids.reshape(-1).numpy(), T=labels.numpy(),
                                         positions=sbp.position_ids(batch, 5),
                                         starts=sbp.sequence_starts(batch, 5), **params)
        net.zero_grad()
        expected = F.cross_entropy(net(ids), labels)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
        _check_grads(net, params, grads)


def _twice(t):
    return 2 * t


class Padded(tnn.Module):
    """forward(x, mask): attention, or an encoder and its first position, under a key padding mask."""

    def __init__(self, kind, causal=False, d=8, length=5):
        super().__init__()
        if kind == "encoder":
            layer = tnn.TransformerEncoderLayer(d, 2, dim_feedforward=12, batch_first=True, norm_first=True)
            self.encoder = tnn.TransformerEncoder(layer, 2, norm=tnn.LayerNorm(d), enable_nested_tensor=False)
            self.head = tnn.Linear(d, 3)
        else:
            self.attn = tnn.MultiheadAttention(d, 2, batch_first=kind == "attention")
        self.register_buffer("causal", torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1))
        self.kind, self.is_causal = kind, causal

    def forward(self, x, mask):
        if self.kind == "encoder":
            return self.head(self.encoder(x, src_key_padding_mask=mask)[:, 0])
        causal = self.causal if self.is_causal else None
        return self.attn(x, x, x, key_padding_mask=mask, attn_mask=causal)[0]


def _padding(batch, length, seed, dtype=torch.bool):
    """A key padding mask of sequences of random lengths 1..L (True past the end), as bool or float."""
    lengths = torch.randint(1, length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(length)[None, :] >= lengths[:, None]
    return mask if dtype == torch.bool else torch.zeros(batch, length, dtype=dtype).masked_fill(mask, -1e300)


@pytest.mark.parametrize(("kind", "causal", "dtype"), [
    ("attention", False, torch.bool), ("attention", True, torch.float64), ("attention time-major", False, torch.bool),
])
def test_a_key_padding_mask_is_an_input_of_the_module(kind, causal, dtype):
    net = Padded(kind, causal).double()
    _init(net, seed=6)
    batch_first = kind == "attention"
    shape = (3, 5, 8) if batch_first else (5, 3, 8)
    x, t = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    mask = _padding(3, 5, seed=1, dtype=dtype)
    model, params = sbp.from_torch(net, (x, mask), loss="mse")
    assert [str(i) for i in model.inputs] == ["X", "T", "padding"]
    loss, grads = sbp.compile(model).value_and_grad(X=_rows(x, batch_first), T=_rows(t, batch_first),
                                                    padding=sbp.key_padding(mask), **params)
    expected = F.mse_loss(net(x, mask), t)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    _check_grads(net, params, grads)


def test_an_encoder_classifier_of_padded_sequences_of_several_lengths():
    net = Padded("encoder").double().eval()
    _init(net, seed=7)
    model, params = sbp.from_torch(net, (torch.randn(2, 5, 8, dtype=torch.float64), _padding(2, 5, seed=0)),
                                   loss="cross_entropy_labels")
    mod = sbp.compile(model)
    for batch, seed in ((4, 2), (1, 3)):       # one module, sequences of 1..5 positions padded to 5
        x, labels, mask = torch.randn(batch, 5, 8, dtype=torch.float64), torch.randint(0, 3, (batch,)), \
            _padding(batch, 5, seed)
        loss, grads = mod.value_and_grad(X=_rows(x, True), T=labels.numpy(), padding=sbp.key_padding(mask),
                                         starts=sbp.sequence_starts(batch, 5), **params)
        net.zero_grad()
        expected = F.cross_entropy(net(x, mask), labels)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
        _check_grads(net, params, grads)


def test_example_inputs_after_the_first_are_one_padding_mask():
    x, mask = torch.randn(2, 5, 8, dtype=torch.float64), _padding(2, 5, seed=0)
    with pytest.raises(ModelError, match="one key padding mask"):
        sbp.from_torch(Padded("attention").double(), (x, mask, mask), loss=None)
    with pytest.raises(ModelError, match=r"one key padding mask \(batch, L\)"):
        sbp.from_torch(Padded("attention").double(), (x, mask[:, :4]), loss=None)
    with pytest.raises(ModelError, match="taken by a network with MultiheadAttention only"):
        sbp.from_torch(tnn.Linear(8, 2).double(), (x[:, 0], mask), loss=None)


class Pooled(tnn.Module):
    """An encoder layer of (L, n, d) sequences and their mean or first position, (n, d)."""

    def __init__(self, pool):
        super().__init__()
        self.layer = tnn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0)
        self.pool = pool

    def forward(self, x):
        x = self.layer(x)
        return torch.mean(x, dim=0) if self.pool == "mean" else x[0, :]


@pytest.mark.parametrize("pool", ["mean", "first"])
def test_time_major_sequences_pool_along_their_first_dimension(pool):
    net = Pooled(pool).double()
    _init(net, seed=5)
    x, t = torch.randn(4, 3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    model, params = sbp.from_torch(net, x, loss="mse")
    loss, grads = sbp.compile(model).value_and_grad(X=_rows(x, False), T=t.numpy(), starts=sbp.sequence_starts(3, 4),
                                                    **params)
    expected = F.mse_loss(net(x), t)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    _check_grads(net, params, grads)


class Bad(tnn.Module):
    """An encoder, or attention, as from_torch refuses it."""

    def __init__(self, how, d=4, length=3):
        super().__init__()
        options = {"add_bias_kv": True} if how == "bias kv" else {"add_zero_attn": True} if how == "zero attn" else {}
        self.attn = tnn.MultiheadAttention(d, 2, batch_first=True, **options)
        self.layer = tnn.TransformerEncoderLayer(d, 2, dim_feedforward=6, dropout=0.1, batch_first=True,
                                                 activation=_twice if how == "activation" else "relu")
        self.decoder = tnn.TransformerDecoderLayer(d, 2, dim_feedforward=6, batch_first=True)
        self.register_buffer("pattern", torch.randn(length, length, dtype=torch.float64))
        self.register_buffer("padding", torch.zeros(2, length, dtype=torch.bool))
        self.how = how

    def forward(self, x):
        if self.how in ("bias kv", "zero attn"):
            return self.attn(x, x, x)[0]
        if self.how == "float pattern":
            return self.layer(x, src_mask=self.pattern)
        if self.how == "padding":
            return self.layer(x, src_key_padding_mask=self.padding)
        if self.how == "decoder":
            return self.decoder(x, x)
        if self.how == "keepdim":
            return self.layer(x).mean(1, keepdim=True)
        if self.how == "second token":
            return self.layer(x)[:, 1]
        return self.layer(x)    # "training", "activation"


@pytest.mark.parametrize(("how", "where", "message"), [
    ("bias kv", "attn", "add_bias_kv=True"), ("zero attn", "attn", "add_zero_attn=True"),
    ("float pattern", "layer", r"self_attn: MultiheadAttention's attn_mask \(3, 3\) is neither the causal"),
    ("padding", "layer", "self_attn: MultiheadAttention's key_padding_mask is a constant of the module"),
    ("decoder", "decoder", "TransformerDecoderLayer is not translated: .*cross-attention"),
    ("training", "layer", r"TransformerEncoderLayer\(dropout=0.1\) in training mode"),
    ("activation", "layer", "activation=<function _twice"),
    ("keepdim", "", "Tensor.mean"), ("second token", "", "getitem of sequences is not translated"),
])
def test_refusals_name_the_module(how, where, message):
    net = Bad(how).double().train(how == "training")
    with pytest.raises(ModelError, match=message) as error:
        sbp.from_torch(net, torch.randn(2, 3, 4, dtype=torch.float64), loss=None)
    assert str(error.value).startswith(f"{where}: ") or not where
