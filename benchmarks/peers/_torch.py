"""What torch_eager and torch_compile share: ops, tensors, the step, and
the example workloads' losses (W5-W12B)."""

from __future__ import annotations

import functools
import types

import torch

from .. import workloads
from . import _example_losses
from ._common import Ops, bench_threads, mlp_loss

torch.set_num_threads(bench_threads())

VERSION = torch.__version__
OPS = Ops(
    activations={"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu},
    logsumexp_rows=lambda z: torch.logsumexp(z, dim=1),
    sum_rows=lambda z: z.sum(dim=1),
)
# what _example_losses needs, called positionally
F = types.SimpleNamespace(exp=torch.exp, log=torch.log, sqrt=torch.sqrt, sin=torch.sin,
                          cos=torch.cos, where=torch.where, stack=torch.stack,
                          logsumexp=torch.logsumexp)


def tensors(arrays: dict, requires_grad: bool = False) -> dict:
    """Tensors sharing memory with the numpy arrays."""
    return {k: torch.from_numpy(v).requires_grad_(requires_grad) for k, v in arrays.items()}


def step_call(loss_fn, inputs: dict, params: dict):
    """A no-arg value_and_grad call: forward ``loss_fn``, then autograd.grad."""
    ti, tp = tensors(inputs), tensors(params, requires_grad=True)
    leaves = list(tp.values())

    def call():
        loss = loss_fn(ti, tp)
        grads = torch.autograd.grad(loss, leaves)
        return loss.detach(), dict(zip(tp, grads))

    return call


def forward_call(fn, inputs: dict, params: dict):
    """A no-arg call of a forward workload's ``fn(inputs, params) -> (loss, outputs)``."""
    ti, tp = tensors(inputs), tensors(params)
    return lambda: fn(ti, tp)


# --------------------------------------------------------------------------
# The loss (or forward function) of every workload


def loss_function(workload):
    """``fn(inputs, params)``: the scalar loss of a value_and_grad workload,
    ``(loss, {output: tensor})`` of a forward one (W6J)."""
    if not workloads.is_example(workload):
        return functools.partial(mlp_loss, workload, OPS)
    if workload.name == "W6J":
        return ba_forward
    if workload.name == "W9":
        return lstm_loss
    if workload.example == "cnn_digits":
        return cnn_loss
    if workload.example == "transformer_lm":
        return transformer_loss
    if workload.example == "lstm_lm_batched":
        return functools.partial(lstm_batched_loss, batch=dict(workload.size)["batch"])
    return functools.partial(_example_losses.LOSSES[workload.name], F)


def _one_observation(c, X, w, u):
    r = _example_losses.ba_residual(F, c, X, w, u)
    return r, r


# d residual / d (camera, point, weight) of one observation, reverse mode
# (2 outputs, 15 inputs), vectorised over the observations
_BA_JACOBIAN = torch.func.vmap(torch.func.jacrev(_one_observation, argnums=(0, 1, 2),
                                                 has_aux=True))


def ba_forward(inputs, params):
    """W6J: the loss, the residuals and each observation's 2 x 15 Jacobian,
    row-major, by torch.func.vmap(torch.func.jacrev(residual of one observation))."""
    c, X = params["cams"][inputs["cam"]], params["pts"][inputs["pt"]]
    (jc, jX, jw), r = _BA_JACOBIAN(c, X, params["weights"], inputs["feats"])
    jacobian = torch.cat([jc, jX, jw], -1).reshape(len(r), 30)
    return (r * r).sum(), {"residual": r, "jacobian": jacobian}


def cnn_loss(inputs, params):
    """W10/W10B: examples/cnn_digits.py's net with torch.nn.functional
    (conv2d, relu, max_pool2d, linear), on the example's arrays as views:
    NCHW rows reshaped to (n, 1, 8, 8), conv weights to (C_out, C_in, 3, 3)."""
    fn, side = torch.nn.functional, workloads.CNN_SIDE
    h = inputs["X"].reshape(-1, 1, side, side)
    for w, b in (("K1", "c1"), ("K2", "c2")):
        weight = params[w].reshape(params[w].shape[0], h.shape[1], 3, 3)
        h = fn.max_pool2d(torch.relu(fn.conv2d(h, weight, params[b][0], padding=1)), 2)
    z = torch.relu(h.flatten(1) @ params["W1"] + params["b1"]) @ params["W2"] + params["b2"]
    return (torch.logsumexp(z, 1) - (inputs["T"] * z).sum(1)).mean()


def transformer_loss(inputs, params):
    """W11/W11B: examples/transformer_lm.py's torch_model written with
    torch.nn.functional (layer_norm, gelu, softmax with a causal mask,
    cross_entropy); the heads by reshaping (n, 64, heads, d/heads)."""
    fn, w = torch.nn.functional, params
    L, d, heads = workloads.TRANSFORMER_CONTEXT, workloads.TRANSFORMER_D, workloads.TRANSFORMER_HEADS
    dh = d // heads
    masked = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)

    def attention(h, b):
        n = h.shape[0] // L
        q, k, v = (((h @ w[f"W{c}{b}"]).reshape(n, L, heads, dh).transpose(1, 2)) for c in "qkv")
        scores = (q @ k.transpose(2, 3) / dh**0.5).masked_fill(masked, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(n * L, d) @ w[f"Wo{b}"]

    x = w["E"][inputs["ids"]] + w["P"][inputs["positions"]]
    for b in range(workloads.TRANSFORMER_BLOCKS):
        x = x + attention(fn.layer_norm(x, (d,), w[f"g{b}a"][0], w[f"b{b}a"][0]), b)
        h = fn.gelu(fn.layer_norm(x, (d,), w[f"g{b}m"][0], w[f"b{b}m"][0]) @ w[f"W{b}up"] + w[f"c{b}up"])
        x = x + h @ w[f"W{b}down"] + w[f"c{b}down"]
    return fn.cross_entropy(fn.layer_norm(x, (d,), w["gf"][0], w["bf"][0]) @ w["Wout"], inputs["targets"])


def lstm_batched_loss(inputs, params, batch):
    """W12/W12B: examples/lstm_lm_batched.py's step, time-major rows (t*batch
    + s), the gates as W9's (one product a step for the four gates' recurrent
    products, the input projections of all steps one product before the loop)."""
    Wc, Uc, bc = _lstm_weights(params)
    H = Uc.shape[0]
    xw = (inputs["X"] @ Wc + bc).reshape(-1, batch, 4 * H)
    h = c = xw.new_zeros(batch, H)
    hs = []
    for t in range(len(xw)):
        z = xw[t] + h @ Uc
        s = torch.sigmoid(z)
        c = s[:, H:2 * H] * c + s[:, :H] * torch.tanh(z[:, 2 * H:3 * H])
        h = s[:, 3 * H:] * torch.tanh(c)
        hs.append(h)
    return _lm_loss(torch.cat(hs), inputs, params)


def reference_float64(workload, inputs, params):
    """The loss and gradients by autograd in float64: the reference of the
    workloads with no hand-written numpy backward (W11, W12)."""
    fn = loss_function(workload)
    loss, grads = step_call(fn, inputs, params)()
    return float(loss), {k: g.numpy() for k, g in grads.items()}


def _lstm_weights(params):
    gates = workloads.LSTM_GATES
    cat = lambda m: torch.cat([params[f"{m}_{g}"] for g in gates], 1)
    return cat("W"), cat("U"), cat("b")  # (vocab, 4H), (H, 4H), (1, 4H): gates i, f, g, o


def _lm_loss(hs, inputs, params):
    logits = hs @ params["V"] + params["c"]
    return (torch.logsumexp(logits, 1) - (inputs["Y"] * logits).sum(1)).mean()


def lstm_loss(inputs, params):
    """W9 written out: the gate equations of examples/lstm_lm.py (PyTorch's
    LSTMCell, one bias a gate), a Python loop over the steps; the input
    projections of all steps are one matrix product before the loop, the
    four gates' recurrent products one product a step."""
    Wc, Uc, bc = _lstm_weights(params)
    H = Uc.shape[0]
    xw = inputs["X"] @ Wc + bc
    h = c = xw.new_zeros(H)
    hs = []
    for t in range(len(xw)):
        z = xw[t] + h @ Uc
        s = torch.sigmoid(z)
        i, f, o = s[:H], s[H:2 * H], s[3 * H:]
        c = f * c + i * torch.tanh(z[2 * H:3 * H])
        h = o * torch.tanh(c)
        hs.append(h)
    return _lm_loss(torch.stack(hs), inputs, params)


@functools.lru_cache(maxsize=None)
def _lstm_module(vocab, hidden, dtype):
    return torch.nn.LSTM(vocab, hidden, batch_first=True, dtype=dtype)


def lstm_loss_nn(inputs, params):
    """W9 through torch.nn.LSTM (ATen's fused CPU LSTM), its weights the
    example's gates stacked (i, f, g, o: nn.LSTM's order), one bias."""
    Wc, Uc, bc = _lstm_weights(params)
    X = inputs["X"]
    lstm = _lstm_module(X.shape[1], Uc.shape[0], X.dtype)
    weights = {"weight_ih_l0": Wc.T, "weight_hh_l0": Uc.T, "bias_ih_l0": bc[0],
               "bias_hh_l0": torch.zeros_like(bc[0])}
    hs, _ = torch.func.functional_call(lstm, weights, (X[None],))
    return _lm_loss(hs[0], inputs, params)


def call_for(workload, fn, inputs, params):
    """The no-arg timed call of ``fn`` (see loss_function) on the workload."""
    if getattr(workload, "outputs", ()):
        return forward_call(fn, inputs, params)
    return step_call(fn, inputs, params)
