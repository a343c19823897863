"""nn.self_attention with PyTorch's biases and its weights as an output,
against torch.nn.MultiheadAttention itself (float64, batch_first, a causal
mask, bias=True): its fused in_proj_weight and in_proj_bias are one
parameter each, sliced (ops/slices.py); the outputs, the weights and every
gradient (input, in_proj_weight, in_proj_bias, out_proj's weight and bias)
to 1e-12 relative."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

torch = pytest.importorskip("torch")

m = sp.Symbol("m", integer=True, positive=True)


def _mha_model(length: int, d: int, heads: int, biases: bool, name: str) -> sbp.Model:
    x = nn.sequences("X", m, length, d)
    w_in, w_out = sp.MatrixSymbol("Win", 3 * d, d), sp.MatrixSymbol("Wout", d, d)
    b_in, b_out = sp.MatrixSymbol("bin", 1, 3 * d), sp.MatrixSymbol("bout", 1, d)
    weights = [w_in[i * d:(i + 1) * d, :].T for i in range(3)] + [w_out.T]
    bias_rows = [b_in[:, i * d:(i + 1) * d] for i in range(3)] + [b_out] if biases else None
    out, probabilities = nn.self_attention(x, *weights, heads, biases=bias_rows, weights=True)
    c = sp.MatrixSymbol("C", m, heads * length)  # a fixed weighting of the probabilities
    loss = nn.sum_all(out.matrix.applyfunc(sp.sin)) + nn.sum_all(sp.HadamardProduct(probabilities, c))
    params = [w_in, w_out] + ([b_in, b_out] if biases else [])
    return sbp.Model(name, inputs=[x.matrix, c], params=params, loss=loss, grad_inputs=[x.matrix],
                     outputs={"Y": out.matrix, "P": probabilities})


@pytest.mark.parametrize(("n", "length", "d", "heads", "biases"), [
    (1, 3, 4, 1, True), (3, 4, 6, 2, True), (2, 5, 8, 4, True), (2, 4, 6, 3, False),
])
def test_self_attention_is_multihead_attention(n, length, d, heads, biases):
    torch.manual_seed(n * 100 + d)
    mha = torch.nn.MultiheadAttention(d, heads, bias=biases, batch_first=True).double()
    if biases:  # torch starts them at 0
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    x = torch.randn(n, length, d, dtype=torch.float64, requires_grad=True)
    c = torch.randn(n * length, heads * length, dtype=torch.float64)
    mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    y, p = mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)  # p: (n, heads, L, L)
    p_rows = p.transpose(1, 2).reshape(n * length, heads * length)  # row (e, t), column h*L + s
    (torch.sin(y).sum() + (p_rows * c).sum()).backward()

    model = _mha_model(length, d, heads, biases, f"mha_{n}_{length}_{d}_{heads}_{int(biases)}")
    arrays = {"X": x.detach().numpy().reshape(-1, d), "C": c.numpy(),
              "Win": mha.in_proj_weight.detach().numpy(), "Wout": mha.out_proj.weight.detach().numpy()}
    if biases:
        arrays |= {"bin": mha.in_proj_bias.detach().numpy()[None, :], "bout": mha.out_proj.bias.detach().numpy()[None, :]}
    mod = sbp.compile(model)
    loss, grads = mod.value_and_grad(**arrays)
    out = mod.forward(**arrays)

    def close(got, want, what):
        want = want.detach().numpy().reshape(np.shape(got))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max(), err_msg=what)

    close(out["Y"], y, "outputs")
    close(out["P"], p_rows, "weights")
    close(grads["X"], x.grad, "d loss / d X")
    close(grads["Win"], mha.in_proj_weight.grad, "d loss / d in_proj_weight")
    close(grads["Wout"], mha.out_proj.weight.grad, "d loss / d out_proj.weight")
    if biases:
        close(grads["bin"], mha.in_proj_bias.grad, "d loss / d in_proj_bias")
        close(grads["bout"], mha.out_proj.bias.grad, "d loss / d out_proj.bias")
    assert loss == pytest.approx(torch.sin(y).sum().item() + (p_rows * c).sum().item(), rel=1e-12)


def test_self_attention_without_biases_is_unchanged():
    """biases=None builds the expression of the helper before biases: the same SymPy expression."""
    x = nn.sequences("X", m, 3, 4)
    w = [sp.MatrixSymbol(f"W{i}", 4, 4) for i in range(4)]
    plain = nn.self_attention(x, *w, 2)
    assert plain.matrix == nn.self_attention(x, *w, 2, biases=(None, None, None, None)).matrix
    q, k, v = (nn.Sequences(x.matrix * wi, 3) for wi in w[:3])
    assert plain.matrix == nn.causal_attention(q, k, v, 2).matrix * w[3]


def test_bad_biases_are_named():
    x = nn.sequences("X", m, 3, 4)
    w = [sp.MatrixSymbol(f"W{i}", 4, 4) for i in range(4)]
    with pytest.raises(sbp.ModelError, match="biases are rows of 1 x 4; b is"):
        nn.self_attention(x, *w, 2, biases=(None, sp.MatrixSymbol("b", 4, 1), None, None))
