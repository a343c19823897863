"""Attention and the transformer layers (symbackprop.declare.attention,
symbackprop.ops.attention): the compiled values and gradients against
PyTorch autograd in float64, with one sequence and several, an odd length,
a shorter last sequence, one and several heads, and the masked positions.
(tests/ops/test_op_rules.py checks the same ops' rules by finite differences
through the interpreter, without torch or C.)"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.declare.attention import CausalSoftmax
from symbackprop.toolchain.builder import BuildOptions, find_blas

torch = pytest.importorskip("torch")
F = torch.nn.functional

m = sp.Symbol("m", integer=True, positive=True)  # the positions: n sequences of L rows

# The products run on BLAS (gemm, trmm) when the build links it, else as loops: both checked.
BUILDS = pytest.mark.parametrize("blas", [pytest.param(False, id="loops"), pytest.param(
    True, id="blas", marks=pytest.mark.skipif(find_blas() is None, reason="no BLAS: pip install scipy-openblas32"))])


def _close(got, want, what):
    want = want.detach().numpy().reshape(np.shape(got))
    scale = max(np.abs(want).max(), 1e-300)
    assert np.abs(np.asarray(got) - want).max() <= 1e-10 * scale, what


def _check(model, reference, arrays, wrt, blas=None):
    """Compile `model` (with BLAS or not; None: when installed); its loss and
    gradients by `wrt` against reference(tensors) -> loss under autograd (float64)."""
    mod = sbp.compile(model, options=BuildOptions(blas=blas))
    loss, grads = mod.value_and_grad(**arrays)
    tensors = {k: torch.tensor(a, requires_grad=a.dtype == np.float64) for k, a in arrays.items()}
    want = reference(tensors)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    for name in wrt:
        _close(grads[name], tensors[name].grad, f"d loss / d {name}")
    return mod, grads


def _torch_attention(q, k, v, length, heads, causal=True):
    """Causal attention per sequence of `length` rows (the last may be
    shorter) and per head, the mask as -inf scores (PyTorch's recipe);
    without the mask where not causal."""
    rows, d = q.shape
    dh = d // heads
    out = []
    for first in range(0, rows, length):
        at = slice(first, min(first + length, rows))
        size = at.stop - at.start
        qe, ke, ve = (z[at].reshape(size, heads, dh).transpose(0, 1) for z in (q, k, v))
        scores = qe @ ke.transpose(1, 2) / dh**0.5
        masked = torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1) & causal
        weights = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
        out.append((weights @ ve).transpose(0, 1).reshape(size, d))
    return torch.cat(out)


@BUILDS
@pytest.mark.parametrize(("rows", "length", "heads"), [(5, 5, 1), (15, 5, 3), (13, 5, 3), (7, 3, 2)])
def test_causal_attention(rows, length, heads, blas):
    """One sequence, three, three with a shorter last one (13 = 5+5+3), and length 3."""
    d = 6
    q, k, v = (sbp.sequences(s, m, length, d) for s in ("q", "k", "v"))
    out = nn.causal_attention(q, k, v, heads)
    model = sbp.Model("attn", inputs=[q.matrix, k.matrix, v.matrix], grad_inputs=[q.matrix, k.matrix, v.matrix],
                      params=[], loss=nn.sum_all(out.matrix.applyfunc(sp.sin)))
    rng = np.random.default_rng(rows + heads)
    arrays = {s: rng.standard_normal((rows, d)) for s in ("q", "k", "v")}
    _check(model, lambda t: torch.sin(_torch_attention(t["q"], t["k"], t["v"], length, heads)).sum(), arrays, "qkv",
           blas)


@BUILDS
@pytest.mark.parametrize(("rows", "length", "heads"), [(5, 5, 1), (13, 5, 3), (7, 3, 2), (4, 1, 2)])
def test_attention_over_every_key(rows, length, heads, blas):
    """nn.attention (no mask): every key of its sequence, a shorter last one's too (13 = 5+5+3, 7 = 3+3+1)."""
    d = 6
    q, k, v = (sbp.sequences(s, m, length, d) for s in ("q", "k", "v"))
    out = nn.attention(q, k, v, heads)
    model = sbp.Model("attn_all_keys", inputs=[q.matrix, k.matrix, v.matrix],
                      grad_inputs=[q.matrix, k.matrix, v.matrix], params=[],
                      loss=nn.sum_all(out.matrix.applyfunc(sp.sin)))
    rng = np.random.default_rng(rows + 7 * heads)
    arrays = {s: rng.standard_normal((rows, d)) for s in ("q", "k", "v")}
    _check(model, lambda t: torch.sin(_torch_attention(t["q"], t["k"], t["v"], length, heads, causal=False)).sum(),
           arrays, "qkv", blas)


@BUILDS
@pytest.mark.parametrize("causal", [False, True])
def test_a_key_bias_masks_keys_per_sequence(causal, blas):
    """key_bias (PyTorch's key_padding_mask as a column, -inf where True) on
    both attentions, against torch's masked_fill of the scores; no
    gradient is NaN although -inf is in the arithmetic."""
    n, length, d, heads = 3, 4, 6, 2
    q, k, v = (sbp.sequences(s, m, length, d) for s in ("q", "k", "v"))
    bias = sp.MatrixSymbol("bias", m, 1)
    out = (nn.causal_attention if causal else nn.attention)(q, k, v, heads, key_bias=bias)
    model = sbp.Model("attn_key_bias", inputs=[q.matrix, k.matrix, v.matrix, bias],
                      grad_inputs=[q.matrix, k.matrix, v.matrix], params=[],
                      loss=nn.sum_all(out.matrix.applyfunc(sp.sin)))
    mask = np.array([[False, False, True, True], [False] * 4, [False, True, False, True]])
    rng = np.random.default_rng(5)
    arrays = {s: rng.standard_normal((n * length, d)) for s in ("q", "k", "v")}

    def reference(t):
        qq, kk, vv = (t[s].reshape(n, length, heads, d // heads).transpose(1, 2) for s in ("q", "k", "v"))
        scores = (qq @ kk.transpose(-1, -2) / (d // heads) ** 0.5).masked_fill(torch.tensor(mask)[:, None, None, :],
                                                                               float("-inf"))
        if causal:
            scores = scores.masked_fill(torch.triu(torch.ones(length, length, dtype=torch.bool), 1), float("-inf"))
        return torch.sin((torch.softmax(scores, -1) @ vv).transpose(1, 2).reshape(n * length, d)).sum()

    _, grads = _check(model, reference, {**arrays, "bias": sbp.key_padding(mask)}, "qkv", blas)
    assert all(np.isfinite(grads[s]).all() for s in "qkv")


def test_masked_weights_and_their_gradients_are_exactly_zero():
    """Weights of keys after the query are 0, and so is the gradient of
    their scores: exactly, not nearly (no -inf reaches any arithmetic)."""
    length, heads = 4, 2
    s = sp.MatrixSymbol("s", m, heads * length)
    p = CausalSoftmax(s, length, heads)
    model = sbp.Model("masked", inputs=[s], grad_inputs=[s], params=[], loss=nn.sum_all(p.applyfunc(sp.sin)),
                      outputs={"p": p})
    rng = np.random.default_rng(0)
    arrays = {"s": 3 * rng.standard_normal((2 * length, heads * length))}

    def reference(t):
        blocks = t["s"].reshape(2, length, heads, length)
        masked = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, :, None, :]
        return torch.sin(torch.softmax(blocks.masked_fill(masked, float("-inf")), dim=-1)).sum()

    mod, grads = _check(model, reference, arrays, ["s"])
    after = np.triu(np.ones((length, length), dtype=bool), 1)[None, :, None, :]
    weights = mod.forward(**arrays)["p"].reshape(2, length, heads, length)
    assert np.all(weights[np.broadcast_to(after, weights.shape)] == 0.0)
    assert np.all(grads["s"].reshape(weights.shape)[np.broadcast_to(after, weights.shape)] == 0.0)
    np.testing.assert_allclose(weights.sum(axis=3), 1.0, rtol=1e-14)


def test_layer_norm():
    x = sp.MatrixSymbol("x", m, 5)
    gamma, beta = sp.MatrixSymbol("gamma", 1, 5), sp.MatrixSymbol("beta", 1, 5)
    model = sbp.Model("ln", inputs=[x], grad_inputs=[x], params=[gamma, beta],
                      loss=nn.sum_all(nn.layer_norm(x, gamma, beta).applyfunc(sp.sin)))
    rng = np.random.default_rng(1)
    arrays = {"x": rng.standard_normal((7, 5)), "gamma": rng.standard_normal((1, 5)), "beta": rng.standard_normal((1, 5))}
    _check(model, lambda t: torch.sin(F.layer_norm(t["x"], (5,), t["gamma"][0], t["beta"][0])).sum(), arrays,
           ["x", "gamma", "beta"])


def _block(x, p, heads):
    """A pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""
    x = x + nn.self_attention(nn.layer_norm(x, p["g1"], p["b1"]), p["Wq"], p["Wk"], p["Wv"], p["Wo"], heads)
    hidden = nn.layer_norm(x, p["g2"], p["b2"]).map(lambda h: nn.gelu(nn.linear(h, p["W1"], p["c1"])))
    return x + hidden.map(lambda h: nn.linear(h, p["W2"], p["c2"]))


def _torch_block(x, t, length, heads):
    h = F.layer_norm(x, (x.shape[1],), t["g1"][0], t["b1"][0])
    x = x + _torch_attention(h @ t["Wq"], h @ t["Wk"], h @ t["Wv"], length, heads) @ t["Wo"]
    h = F.gelu(F.layer_norm(x, (x.shape[1],), t["g2"][0], t["b2"][0]) @ t["W1"] + t["c1"])
    return x + h @ t["W2"] + t["c2"]


@BUILDS
@pytest.mark.parametrize("sequences", [1, 3])
def test_embedding_positions_and_a_transformer_block(sequences, blas):
    """Token and position embeddings (gathers: repeated tokens add their
    gradients), a pre-norm block with gelu MLP and residuals, a linear head
    and cross-entropy against the next tokens."""
    vocab, length, d, heads = 7, 5, 8, 2
    ids, positions, targets = sbp.Index("ids", m), sbp.Index("positions", m), sp.MatrixSymbol("T", m, vocab)
    shapes = {"E": (vocab, d), "P": (length, d), "Wq": (d, d), "Wk": (d, d), "Wv": (d, d), "Wo": (d, d),
              "g1": (1, d), "b1": (1, d), "g2": (1, d), "b2": (1, d), "W1": (d, 2 * d), "c1": (1, 2 * d),
              "W2": (2 * d, d), "c2": (1, d), "H": (d, vocab)}
    p = {name: sp.MatrixSymbol(name, *shape) for name, shape in shapes.items()}
    x = nn.add_positions(nn.embedding(p["E"], ids, length), p["P"], positions)
    logits = _block(x, p, heads).matrix * p["H"]
    model = sbp.Model("block", inputs=[ids, positions, targets], params=list(p.values()),
                      loss=nn.softmax_cross_entropy(logits, targets))
    rng = np.random.default_rng(sequences)
    tokens = rng.integers(0, vocab, sequences * length)
    arrays = {name: rng.standard_normal(shape) / np.sqrt(shape[0]) for name, shape in shapes.items()}
    arrays.update(ids=tokens, positions=sbp.position_ids(sequences, length), T=np.eye(vocab)[np.roll(tokens, -1)])

    def reference(t):
        x = t["E"][t["ids"]] + t["P"][t["positions"]]
        logits = _torch_block(x, t, length, heads) @ t["H"]
        return -(t["T"] * torch.log_softmax(logits, dim=1)).sum() / logits.shape[0]

    _check(model, reference, arrays, list(shapes), blas)


def test_bad_declarations_are_named():
    x = sbp.sequences("x", m, 4, 6)
    w = sp.MatrixSymbol("w", 6, 6)
    with pytest.raises(sbp.ModelError, match="do not split into 4 heads"):
        nn.causal_attention(x, x, x, 4)
    with pytest.raises(sbp.ModelError, match="takes Sequences"):
        nn.self_attention(x.matrix, w, w, w, w, 2)
    with pytest.raises(sbp.ModelError, match="positional table is 4 x 6"):
        nn.add_positions(x, sp.MatrixSymbol("P", 5, 6), sbp.Index("pos", m))
    with pytest.raises(sbp.ModelError, match="length must be an int"):
        sbp.sequences("y", m, 0, 6)


def test_transformer_lm_example_trains_beside_pytorch_for_a_few_steps():
    """examples/transformer_lm.py's own training functions, on its first 48
    sequences for one epoch (6 Adam steps of 8 sequences): the loss falls,
    and PyTorch's run of the same minibatches agrees step for step (the
    whole run, 4 epochs of 191 sequences to its exit status: the slow test
    below)."""
    from conftest import load_example

    example = load_example("transformer_lm")
    sequences, batch_size = 48, 8
    data = {name: rows[:sequences * example.CONTEXT] for name, rows in example.windows(example.encode(example.TEXT)).items()}
    rng = np.random.default_rng(0)
    start = example.init_params(rng)
    orders = example.row_orders(rng, sequences, 1)
    params = {k: v.copy() for k, v in start.items()}
    _, curves, _ = example.train_symbackprop(params, data, orders, batch_size, 3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example runs it
    try:
        torch_curves, _ = example.train_torch(start, data, orders, batch_size, 3e-3)
    finally:
        torch.set_num_threads(threads)
    assert curves.shape == torch_curves.shape == (1, sequences // batch_size)
    assert curves[0, -1] < curves[0, 0] - 0.5, curves
    assert np.abs(torch_curves - curves).max() < 1e-9


@pytest.mark.slow
def test_transformer_lm_example_trains_beside_pytorch(capsys):
    """examples/transformer_lm.py: the loss falls below 0.8 of the unigram
    entropy (its exit status), and the PyTorch run agrees step for step."""
    from conftest import load_example

    assert load_example("transformer_lm").main([]) == 0
    out = capsys.readouterr().out
    assert "unigram entropy" in out and "largest loss difference" in out
    difference = float(out.split("largest loss difference ")[1].split()[0])
    assert difference < 1e-9
