"""sbp.from_torch of torch.nn.MultiheadAttention as causal self-attention
(tests/models/test_from_torch_encoder.py: without a mask, and the encoders)
(its fused in_proj_weight / in_proj_bias sliced per q, k, v) and of a
2-layer GPT-style decoder around it (token and positional embeddings,
pre-norm blocks x + attn(ln1(x)), x + mlp(ln2(x)), a final LayerNorm and
Linear), against the same network run by PyTorch in float64: the loss and
every parameter's gradient from torch autograd to 1e-12 relative; and the
refusals, named by the module's path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402
from symbackprop.errors import ModelError  # noqa: E402

tnn = torch.nn


class Attend(tnn.Module):
    """x -> self-attention under a causal mask made as people make it."""

    def __init__(self, d, heads, length, batch_first, mask="bool", **options):
        super().__init__()
        self.attn = tnn.MultiheadAttention(d, heads, batch_first=batch_first, **options)
        self.length, self.mask = length, mask
        self.register_buffer("causal", tnn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64))

    def forward(self, x):
        if self.mask == "bool":     # computed in the forward: torch computes it when translating
            out, _ = self.attn(x, x, x, attn_mask=torch.triu(torch.ones(self.length, self.length, dtype=torch.bool),
                                                             diagonal=1))
            return out
        if self.mask == "float":    # a buffer of -inf above the diagonal; the weights unused
            return self.attn(x, x, x, attn_mask=self.causal)[0]
        return self.attn(x, x, x, attn_mask=self.causal, is_causal=True, need_weights=False)[0]


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


@pytest.mark.parametrize(("heads", "length", "batch", "batch_first", "mask"), [
    (1, 5, 3, True, "bool"), (2, 5, 3, False, "float"), (4, 5, 1, True, "is_causal"),
    (2, 1, 3, True, "float"), (4, 1, 1, False, "bool"), (1, 5, 1, False, "is_causal"),
])
def test_multihead_attention_matches_torch(heads, length, batch, batch_first, mask):
    d = 8
    net = Attend(d, heads, length, batch_first, mask, dropout=0.1).double().eval()   # dropout off in eval
    _init(net)
    shape = (batch, length, d) if batch_first else (length, batch, d)
    x, t = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    model, params = sbp.from_torch(net, x, loss="mse")
    loss, grads = sbp.compile(model).value_and_grad(X=_rows(x, batch_first), T=_rows(t, batch_first), **params)
    expected = torch.nn.functional.mse_loss(net(x), t)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    _check_grads(net, params, grads)


def test_multihead_attention_without_biases_outputs_its_rows():
    net = Attend(6, 3, 4, True, "bool", bias=False).double()
    _init(net)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    model, params = sbp.from_torch(net, x, loss=None)
    assert sorted(params.torch_names.values()) == ["attn.in_proj_weight", "attn.out_proj.weight"]
    y = sbp.compile(model).forward(X=_rows(x, True), **params)["Y"]
    np.testing.assert_allclose(y, _rows(net(x).detach(), True), rtol=1e-12, atol=1e-13)


class Block(tnn.Module):
    def __init__(self, d, heads, length):
        super().__init__()
        self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
        self.attn = tnn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = tnn.Sequential(tnn.Linear(d, 4 * d), tnn.GELU(), tnn.Linear(4 * d, d))
        self.register_buffer("mask", torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(tnn.Module):
    """A GPT-style decoder: token + positional embeddings, pre-norm blocks, a final LayerNorm and Linear."""

    def __init__(self, vocab, d, heads, length, layers=2, positions="embedding"):
        super().__init__()
        self.tok = tnn.Embedding(vocab, d)
        if positions == "embedding":
            self.pos = tnn.Embedding(length + 2, d)      # a longer table: the first L rows are read
        else:
            self.pos_table = tnn.Parameter(torch.zeros(length, d))
        self.blocks = tnn.ModuleList([Block(d, heads, length) for _ in range(layers)])
        self.ln, self.head = tnn.LayerNorm(d), tnn.Linear(d, vocab)
        self.length, self.positions = length, positions

    def forward(self, ids):
        x = self.tok(ids)
        length = ids.size(1)    # the L of the example input, as nanoGPT reads it
        x = x + (self.pos(torch.arange(length, device=ids.device)) if self.positions == "embedding" else self.pos_table)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _check_gpt(positions, batch=3, length=5, vocab=7, d=8, heads=2):
    net = GPT(vocab, d, heads, length, positions=positions).double()
    _init(net, seed=2)
    ids, targets = torch.randint(0, vocab, (batch, length)), torch.randint(0, vocab, (batch, length))
    model, params = sbp.from_torch(net, ids, loss="cross_entropy_labels")
    assert [str(i) for i in model.inputs] == ["X", "T", "positions"]
    loss, grads = sbp.compile(model).value_and_grad(X=ids.reshape(-1).numpy(), T=targets.reshape(-1).numpy(),
                                                    positions=sbp.position_ids(batch, length), **params)
    expected = torch.nn.functional.cross_entropy(net(ids).reshape(-1, vocab), targets.reshape(-1))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    _check_grads(net, params, grads)


def test_a_two_layer_gpt_decoder_matches_torch():
    _check_gpt("embedding")


@pytest.mark.slow
def test_a_gpt_decoder_with_a_positional_parameter_matches_torch():
    _check_gpt("parameter", batch=2, length=4)


class Bad(tnn.Module):
    """Attention as from_torch refuses it."""

    def __init__(self, how, d=4, length=3):
        super().__init__()
        options = {"kdim": 2, "vdim": 2} if how == "kdim" else {"dropout": 0.2} if how == "dropout" else {}
        self.attn = tnn.MultiheadAttention(d, 2, batch_first=True, **options)
        self.register_buffer("mask", torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1))
        self.register_buffer("padding", torch.zeros(2, length, dtype=torch.bool))
        self.how, self.proj = how, tnn.Linear(d, d)

    def forward(self, x):
        if self.how == "hint alone":
            return self.attn(x, x, x, is_causal=True, need_weights=False)[0]
        if self.how == "padding":
            return self.attn(x, x, x, attn_mask=self.mask, key_padding_mask=self.padding)[0]
        if self.how == "not causal":
            return self.attn(x, x, x, attn_mask=~self.mask)[0]
        if self.how == "cross":
            return self.attn(x, self.proj(x), x, attn_mask=self.mask)[0]
        if self.how == "weights":
            return self.attn(x, x, x, attn_mask=self.mask)[1]
        if self.how == "last step":
            return self.attn(x, x, x, attn_mask=self.mask)[0][:, -1]
        return self.attn(x, x, x, attn_mask=self.mask)[0]


@pytest.mark.parametrize(("how", "message"), [
    ("hint alone", "without an attn_mask"), ("padding", "key_padding_mask"), ("not causal", "neither the causal"),
    ("kdim", "kdim=2"), ("dropout", "training mode"), ("cross", "cross-attention"),
    ("weights", "attention weights of attn"), ("last step", "of sequences is not translated"),
])
def test_refusals_name_the_module(how, message):
    net = Bad(how).double()
    with pytest.raises(ModelError, match=message) as error:
        sbp.from_torch(net, torch.randn(2, 3, 4, dtype=torch.float64), loss=None)
    if how not in ("weights",):
        assert str(error.value).startswith("attn: ") or how == "last step"


def test_layouts_must_agree_and_2d_input_is_refused():
    net = tnn.Sequential()
    net.add_module("a", tnn.MultiheadAttention(4, 2, batch_first=True))
    net.add_module("b", tnn.MultiheadAttention(4, 2))
    with pytest.raises(ModelError, match="both layouts"):
        sbp.from_torch(net, torch.randn(2, 3, 4, dtype=torch.float64), loss=None)
    with pytest.raises(ModelError, match="takes sequences"):
        sbp.from_torch(Bad("ok"), torch.randn(2, 4), loss=None)


class TimeMajorTokens(tnn.Module):
    """(L, n) token ids -> Embedding -> attention (batch_first=False) -> Linear."""

    def __init__(self, vocab=6, d=4, length=4):
        super().__init__()
        self.tok, self.head = tnn.Embedding(vocab, d), tnn.Linear(d, vocab)
        self.attn = tnn.MultiheadAttention(d, 2)
        self.register_buffer("mask", tnn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64))

    def forward(self, ids):
        x = self.tok(ids)
        return self.head(x + self.attn(x, x, x, attn_mask=self.mask, need_weights=False)[0])


def test_time_major_token_ids_are_read_example_major():
    net = TimeMajorTokens().double()
    _init(net, seed=3)
    ids, targets = torch.randint(0, 6, (4, 3)), torch.randint(0, 6, (4, 3))    # (L, n)
    model, params = sbp.from_torch(net, ids, loss="cross_entropy_labels", reduction="sum")
    loss, grads = sbp.compile(model).value_and_grad(X=ids.T.reshape(-1).numpy(), T=targets.T.reshape(-1).numpy(),
                                                    **params)
    expected = torch.nn.functional.cross_entropy(net(ids).reshape(-1, 6), targets.reshape(-1), reduction="sum")
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    _check_grads(net, params, grads)
