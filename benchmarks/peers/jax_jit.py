"""JAX: jax.jit(jax.value_and_grad(loss)) on the CPU.

Compile time "cold" is lowering plus XLA compilation with an empty
persistent compilation cache; "cached" is the same after jax.clear_caches(),
served from that on-disk cache.

The example workloads: W5-W8 are the losses of ``_example_losses.py``; W9
runs the LSTM with ``jax.lax.scan``; W6J (a forward workload) is
``jax.jit`` of ``jax.vmap(jax.jacfwd(residual of one observation))``;
W10/W10B (the CNN) use ``lax.conv_general_dilated`` and ``lax.reduce_window``;
W11/W11B (the transformer) reshape the heads and mask with ``jnp.where``;
W12/W12B (the batched LSTM) run ``lax.scan`` over the steps of a batch.

W9 has two variants: ``jax_jit`` computes the input projections X W of
all steps as one matrix product before the scan (as torch.nn.LSTM does);
``jax_jit.x_in_loop`` computes x_t W inside each step, as the example's
``symbackprop.scan`` step does.
"""

from __future__ import annotations

import functools
import types

import jax

jax.config.update("jax_enable_x64", True)  # noqa: E402 (before any array exists)

import jax.numpy as jnp  # noqa: E402

from .. import workloads  # noqa: E402
from . import _example_losses  # noqa: E402
from ._common import Ops, Variant, cache_root, mlp_loss, timed  # noqa: E402

VERSION = jax.__version__
OPS = Ops(
    activations={"sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "relu": jax.nn.relu},
    logsumexp_rows=lambda z: jax.nn.logsumexp(z, axis=1),
    sum_rows=lambda z: z.sum(axis=1),
)
# what _example_losses needs, called positionally
F = types.SimpleNamespace(exp=jnp.exp, log=jnp.log, sqrt=jnp.sqrt, sin=jnp.sin, cos=jnp.cos,
                          where=jnp.where, stack=jnp.stack, logsumexp=jax.nn.logsumexp)

jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def lstm_loss(inputs, params, x_in_loop=False):
    """W9: the gate equations of examples/lstm_lm.py (PyTorch's LSTMCell,
    one bias a gate) under lax.scan; the input projections of all steps are
    one matrix product before the scan, or with ``x_in_loop`` one product
    a step inside it."""
    cat = lambda m: jnp.concatenate([params[f"{m}_{g}"] for g in workloads.LSTM_GATES], 1)
    Wc, Uc, bc = cat("W"), cat("U"), cat("b")
    H = Uc.shape[0]

    def step(state, x):
        h, c = state
        z = (x @ Wc + bc[0] if x_in_loop else x) + h @ Uc
        s = jax.nn.sigmoid(z)
        c = s[H:2 * H] * c + s[:H] * jnp.tanh(z[2 * H:3 * H])
        h = s[3 * H:] * jnp.tanh(c)
        return (h, c), h

    zero = jnp.zeros(H, dtype=Wc.dtype)
    xs = inputs["X"] if x_in_loop else inputs["X"] @ Wc + bc
    _, hs = jax.lax.scan(step, (zero, zero), xs)
    logits = hs @ params["V"] + params["c"]
    return (jax.nn.logsumexp(logits, 1) - (inputs["Y"] * logits).sum(1)).mean()


def cnn_loss(inputs, params):
    """W10/W10B: examples/cnn_digits.py's net with jax.lax.conv_general_dilated
    (NCHW, OIHW weights) and lax.reduce_window for the max pools."""
    side = workloads.CNN_SIDE
    h = inputs["X"].reshape(-1, 1, side, side)
    for w, b in (("K1", "c1"), ("K2", "c2")):
        weight = params[w].reshape(params[w].shape[0], h.shape[1], 3, 3)
        z = jax.lax.conv_general_dilated(h, weight, (1, 1), ((1, 1), (1, 1)),
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        a = jax.nn.relu(z + params[b].reshape(1, -1, 1, 1))
        h = jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    z = jax.nn.relu(h.reshape(len(h), -1) @ params["W1"] + params["b1"]) @ params["W2"] + params["b2"]
    return (jax.nn.logsumexp(z, 1) - (inputs["T"] * z).sum(1)).mean()


def _layer_norm(x, gamma, beta, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * gamma + beta


def transformer_loss(inputs, params):
    """W11/W11B: examples/transformer_lm.py's model, the heads by reshaping
    (n, 64, heads, d/heads), the causal mask by jnp.where, gelu exact (erf)."""
    w = params
    L, d, heads = workloads.TRANSFORMER_CONTEXT, workloads.TRANSFORMER_D, workloads.TRANSFORMER_HEADS
    dh = d // heads
    causal = jnp.tril(jnp.ones((L, L), dtype=bool))

    def attention(h, b):
        n = h.shape[0] // L
        q, k, v = ((h @ w[f"W{c}{b}"]).reshape(n, L, heads, dh).transpose(0, 2, 1, 3) for c in "qkv")
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / dh**0.5, -jnp.inf)
        return (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(n * L, d) @ w[f"Wo{b}"]

    x = w["E"][inputs["ids"]] + w["P"][inputs["positions"]]
    for b in range(workloads.TRANSFORMER_BLOCKS):
        x = x + attention(_layer_norm(x, w[f"g{b}a"], w[f"b{b}a"]), b)
        h = jax.nn.gelu(_layer_norm(x, w[f"g{b}m"], w[f"b{b}m"]) @ w[f"W{b}up"] + w[f"c{b}up"], approximate=False)
        x = x + h @ w[f"W{b}down"] + w[f"c{b}down"]
    logits = _layer_norm(x, w["gf"], w["bf"]) @ w["Wout"]
    picked = jnp.take_along_axis(logits, inputs["targets"][:, None], axis=1)[:, 0]
    return (jax.nn.logsumexp(logits, 1) - picked).mean()


def lstm_batched_loss(inputs, params, batch):
    """W12/W12B: W9's gates over a batch of windows under lax.scan, rows
    time-major (t*batch + s), X W before the scan."""
    cat = lambda m: jnp.concatenate([params[f"{m}_{g}"] for g in workloads.LSTM_GATES], 1)
    Wc, Uc, bc = cat("W"), cat("U"), cat("b")
    H = Uc.shape[0]

    def step(state, xw):
        h, c = state
        z = xw + h @ Uc
        s = jax.nn.sigmoid(z)
        c = s[:, H:2 * H] * c + s[:, :H] * jnp.tanh(z[:, 2 * H:3 * H])
        h = s[:, 3 * H:] * jnp.tanh(c)
        return (h, c), h

    zero = jnp.zeros((batch, H), dtype=Wc.dtype)
    _, hs = jax.lax.scan(step, (zero, zero), (inputs["X"] @ Wc + bc).reshape(-1, batch, 4 * H))
    logits = hs.reshape(-1, H) @ params["V"] + params["c"]
    return (jax.nn.logsumexp(logits, 1) - (inputs["Y"] * logits).sum(1)).mean()


def _one_observation(c, X, w, u):
    r = _example_losses.ba_residual(F, c, X, w, u)
    return r, r


# d residual / d (camera, point, weight) of one observation, forward mode
_BA_JACOBIAN = jax.vmap(jax.jacfwd(_one_observation, argnums=(0, 1, 2), has_aux=True))


def ba_forward(params, inputs):
    """W6J: the loss, the residuals and each observation's 2 x 15 Jacobian, row-major."""
    c, X = params["cams"][inputs["cam"]], params["pts"][inputs["pt"]]
    (jc, jX, jw), r = _BA_JACOBIAN(c, X, params["weights"], inputs["feats"])
    jacobian = jnp.concatenate([jc, jX, jw], -1).reshape(len(r), 30)
    return (r * r).sum(), {"residual": r, "jacobian": jacobian}


def _function(workload, x_in_loop=False):
    """The jitted function of (params, inputs)."""
    if workload.name == "W6J":
        return ba_forward
    if not workloads.is_example(workload):
        loss = functools.partial(mlp_loss, workload, OPS)
    elif workload.name == "W9":
        loss = functools.partial(lstm_loss, x_in_loop=x_in_loop)
    elif workload.example == "cnn_digits":
        loss = cnn_loss
    elif workload.example == "transformer_lm":
        loss = transformer_loss
    elif workload.example == "lstm_lm_batched":
        loss = functools.partial(lstm_batched_loss, batch=dict(workload.size)["batch"])
    else:
        loss = functools.partial(_example_losses.LOSSES[workload.name], F)
    return jax.value_and_grad(lambda p, i: loss(i, p))


def _compile(function, ji, jp):
    jax.clear_caches()
    return timed(lambda: jax.jit(function).lower(jp, ji).compile())


def _variant(label, function, ji, jp, **kwargs):
    _, cold = _compile(function, ji, jp)
    compiled, cached = _compile(function, ji, jp)
    call = lambda: jax.block_until_ready(compiled(jp, ji))
    return Variant(label, call, compile_cold_s=cold, compile_cached_s=cached, **kwargs)


def setup(workload, dtype, inputs, params):
    ji = {k: jnp.asarray(v) for k, v in inputs.items()}
    jp = {k: jnp.asarray(v) for k, v in params.items()}
    variants = [_variant("jax_jit", _function(workload), ji, jp)]
    if workload.name == "W9":
        variants.append(_variant("jax_jit.x_in_loop", _function(workload, x_in_loop=True), ji, jp,
                                 notes=["x_t W computed inside each scan step, as the example's step"]))
    return variants
