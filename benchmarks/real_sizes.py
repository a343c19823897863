"""Real sizes: LeNet-5 on 28x28 images at batch 64, a GPT-style decoder
(4 blocks, d=256, 4 heads, sequence 128, batch 8), the MNIST MLP
(784-256-10, batch 128) and a ResNet basic-block stack (32x32 images,
16-64 channels, batch 32): a training step and inference, symbackprop beside
PyTorch eager, torch.compile and JAX (the decoder, the MLP and the ResNet),
one thread (`--threads N`: N CPUs and threads, symbackprop built with OpenMP).

    python benchmarks/real_sizes.py                        # every model, float32 and float64, 15 rounds
    python benchmarks/real_sizes.py --models lenet5 --dtype float32 --rounds 9 --peers symbackprop,torch_eager
    python benchmarks/real_sizes.py --models gpt,mlp --clock cpu --rounds 5 --calls 3 --save NAME
    python benchmarks/real_sizes.py --layers               # each convolution's kernels alone
    python benchmarks/real_sizes.py --layers --models resnet --clock cpu --rounds 5 --calls 5
    python benchmarks/real_sizes.py --breakdown --models gpt,mlp --clock cpu --rounds 5 --calls 3 --save NAME
    python benchmarks/real_sizes.py --models resnet,lenet5 --threads 2 --clock cpu --rounds 5 --calls 3
    python benchmarks/real_sizes.py --save real-sizes-2026-12-06

`--clock cpu` times the process's CPU time (every thread's) instead of
the wall clock: on a machine shared with other work, the wall clock
measures the share of the CPU a process got as much as its own work.

LeNet-5 (padding 2 on the first convolution, as LeNet-5 on MNIST):

    1 x 28 x 28 -> conv 5x5 (6, padding 2) -> relu -> max pool 2 -> 6 x 14 x 14
                -> conv 5x5 (16) -> relu -> max pool 2 -> 16 x 5 x 5
                -> flatten (400) -> linear(120) -> relu -> linear(84) -> relu -> linear(10)
                -> softmax cross-entropy

What is timed: a training step with Adam (symbackprop's `train_step`, one C
call; PyTorch's zero_grad, forward, backward and `torch.optim.Adam.step`),
and inference (symbackprop's `forward`, the loss and logits; PyTorch's
forward under no_grad). Each peer runs in a process of its own (this
script with `--serve PEER`; `--one-process`: all in this one), every one
pinned to the same CPU with one thread (`os.sched_setaffinity`,
`torch.set_num_threads(1)`, `sbp.set_num_threads(1)`), so that no
library's thread pool or allocator shares a process with another's and
`--clock cpu` counts one peer's threads alone. After a warm-up, each round
runs one untimed call and then `--calls` timed calls of each peer in
turn (the untimed call finds the caches holding the last peer's data; a
pause alone, sleeping or busy waiting, slowed every peer's next calls on
this VM), and each peer's round median is kept. On several threads each
turn starts after a sleep of `--settle` seconds (50 ms), for the last
peer's thread pools, which spin a few ms after a call, to stop. Each peer's process keeps the memory it
frees and its heap on huge pages (glibc's tunables, PEER_MALLOC): in a
fresh process PyTorch's and JAX's steps page-faulted their arrays back
every call, up to 1.5x slower than in a long-running one. Printed and
saved: the median of the round medians, and each peer's ratio to
symbackprop's, round by round (its median and range). Before timing, the
loss and every gradient are checked once against PyTorch float64 autograd
from the same parameters (LeNet-5), or every peer's float64 loss and
gradients against symbackprop's (the decoder and the MLP, relative error
at most 1e-10).

The ResNet (resnet_convs, resnet_loss): a stem conv 3x3 3->16, then basic
blocks (conv 3x3 - batch norm - relu - conv 3x3 - batch norm, plus the
input, relu) at 16 channels on 32x32, 32 on 16x16 (stride 2) and 64 on
8x8 (stride 2), the last two adding a 1x1 convolution of stride 2 and a
batch norm of their input; global average pool, linear 64->10, softmax
cross-entropy. Every convolution is followed by nn.batch_norm in training
mode (the batch's statistics, the gradient through them), so inference is
the same forward pass; no convolution has a bias. PyTorch's loss is
torch.nn.functional's conv2d and batch_norm(training=True), JAX's
lax.conv_general_dilated (NCHW, OIHW) with the batch norm written out.

The decoder is examples/transformer_lm.py's pre-norm block at these sizes
(symbackprop's nn.self_attention and nn.layer_norm; a 64-token vocabulary
of random ids), each block's Q, K and V weights one d x 3d parameter
sliced, as PyTorch's MultiheadAttention and GPT-2 keep them (every peer
one product, split; `--qkv apart`: three d x d parameters, three products); its PyTorch loss is written with torch.nn.functional
(scaled_dot_product_attention), its JAX loss with jax.numpy. JAX's
training step is one jax.jit of value_and_grad and Adam's update; its
inference, one jax.jit of the loss and the logits. torch.compile compiles
the loss function (Adam's step stays eager); the seconds its first step
and inference took are printed and saved in the table's note.

`--layers` times each convolution's three kernels (forward, the gradient
by the images, the gradient by the weights) as small models of their own:
forward() of sum(conv(X, K) * G), then value_and_grad by K (adds the
weight gradient), then by X too (adds the input gradient); the
differences are the kernels' times, printed with their GFLOP/s beside
PyTorch's F.conv2d doing the same, and beside numpy's BLAS gemm of the
same sizes (C_out x C_in*k*k by C_in*k*k x pixels, per example and once
over the batch; run it with OPENBLAS_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np
import sympy as sp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import symbackprop as sbp
from symbackprop import nn

BATCH, SIDE, CLASSES = 64, 28, 10
LAYERS = (("K1", 6, 1, 5, 2), ("K2", 16, 6, 5, 0))  # (name, out channels, in channels, k, padding)
HIDDEN = (120, 84)
FLAT = 16 * 5 * 5
LR = 1e-3


def lenet5() -> sbp.Model:
    """LeNet-5 as a symbackprop Model (batch size a symbol)."""
    n = sp.Symbol("n", integer=True, positive=True)
    x = sbp.images("X", n, 1, SIDE, SIDE)
    t = sp.MatrixSymbol("T", n, CLASSES)
    params = []
    h = x
    for name, out, inp, k, pad in LAYERS:
        w, b = sbp.conv_weight(name, out, inp, k), sp.MatrixSymbol("c" + name[1:], 1, out)
        params += [w, b]
        h = nn.max_pool2d(nn.conv2d(h, w, b, padding=pad).map(nn.relu), 2)
    z = nn.flatten(h)
    sizes = (FLAT, *HIDDEN, CLASSES)
    for layer, (fan_in, fan_out) in enumerate(pairwise(sizes), 1):
        w, b = sp.MatrixSymbol(f"W{layer}", fan_in, fan_out), sp.MatrixSymbol(f"b{layer}", 1, fan_out)
        params += [w, b]
        z = nn.linear(z, w, b)
        if layer < len(sizes) - 1:
            z = nn.relu(z)
    return sbp.Model("lenet5", inputs=[x.matrix, t], params=params,
                     loss=nn.softmax_cross_entropy(z, t), outputs={"logits": z})


def shapes() -> list[tuple[str, tuple[int, int], int]]:
    """(name, shape in symbackprop, fan_in) of every parameter, in the model's order."""
    out = []
    for name, oc, ic, k, _ in LAYERS:
        out += [(name, (oc, ic * k * k), ic * k * k), ("c" + name[1:], (1, oc), ic * k * k)]
    sizes = (FLAT, *HIDDEN, CLASSES)
    for layer, (fan_in, fan_out) in enumerate(pairwise(sizes), 1):
        out += [(f"W{layer}", (fan_in, fan_out), fan_in), (f"b{layer}", (1, fan_out), fan_in)]
    return out


def make_data(dtype: str, seed: int = 0) -> tuple[dict, dict]:
    """(inputs, params): pixels U(0, 1), one-hot labels, PyTorch's default
    initialization U(-1/sqrt(fan_in), 1/sqrt(fan_in)); float32 is float64 rounded."""
    rng = np.random.default_rng(seed)
    x = rng.random((BATCH, SIDE * SIDE))
    t = np.eye(CLASSES)[rng.integers(0, CLASSES, size=BATCH)]
    params = {name: rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in) for name, shape, fan_in in shapes()}
    cast = {"X": x, "T": t, **params}
    cast = {k: np.ascontiguousarray(v, dtype=dtype) for k, v in cast.items()}
    return {k: cast[k] for k in ("X", "T")}, {k: cast[k] for k in params}


# --- PyTorch ---------------------------------------------------------------------


def torch_net(params: dict, dtype):
    """The same network in PyTorch, from the same parameters."""
    import torch

    layers: list = []
    for _name, oc, ic, k, pad in LAYERS:
        conv = torch.nn.Conv2d(ic, oc, k, padding=pad)
        layers += [conv, torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
    layers.append(torch.nn.Flatten())
    sizes = (FLAT, *HIDDEN, CLASSES)
    for fan_in, fan_out in pairwise(sizes):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1]).to(dtype)
    weighted = [m for m in net if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    names = [n for n, _, _ in shapes()]
    with torch.no_grad():
        for module, w, b in zip(weighted, names[::2], names[1::2]):
            weight = params[w].T if w.startswith("W") else params[w].reshape(module.weight.shape)
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
            module.bias.copy_(torch.from_numpy(np.ascontiguousarray(params[b][0])))
    return net


def torch_grads(net, inputs: dict) -> tuple[float, dict]:
    """PyTorch autograd's loss and gradients, named and shaped as symbackprop's."""
    import torch

    x = torch.from_numpy(inputs["X"]).reshape(-1, 1, SIDE, SIDE)
    labels = torch.from_numpy(np.argmax(inputs["T"], axis=1))
    net.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), labels)
    loss.backward()
    weighted = [m for m in net if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    names = [n for n, _, _ in shapes()]
    grads = {}
    for module, w, b in zip(weighted, names[::2], names[1::2]):
        g = module.weight.grad.numpy()
        grads[w] = g.T if w.startswith("W") else g.reshape(g.shape[0], -1)
        grads[b] = module.bias.grad.numpy()[None, :]
    return float(loss.detach()), grads


def lenet_torch_calls(inputs: dict, params: dict, dtype: str, compiled: bool) -> tuple[Callable, Callable]:
    """(training step, inference) of LeNet-5 in PyTorch, eager or torch.compile'd, calls of no arguments."""
    import torch

    x = torch.from_numpy(inputs["X"]).reshape(-1, 1, SIDE, SIDE)
    labels = torch.from_numpy(np.argmax(inputs["T"], axis=1))
    net = torch_net(params, getattr(torch, dtype))
    adam = torch.optim.Adam(net.parameters(), lr=LR)
    forward = torch.compile(net) if compiled else net

    def step():
        adam.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), labels)
        loss.backward()
        adam.step()
        return loss

    def infer():
        with torch.no_grad():
            return forward(x)

    return step, infer


# --- the check and the timing -------------------------------------------------------


def check(mod64, inputs: dict, params: dict) -> float:
    """The largest relative error (2-norm) of symbackprop's float64 loss and
    gradients against PyTorch float64 autograd."""
    import torch

    loss, grads = mod64.value_and_grad(**inputs, **params)
    ref_loss, ref = torch_grads(torch_net(params, torch.float64), inputs)
    errors = [abs(loss - ref_loss) / abs(ref_loss)]
    errors += [float(np.linalg.norm(grads[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref]
    return max(errors)


def check_lenet5(peers: list[str]) -> dict:
    """{"symbackprop": largest relative error} of symbackprop's float64 LeNet-5 against PyTorch float64
    autograd (the peers are the same PyTorch network); empty without a PyTorch peer."""
    if not any(p.startswith("torch") for p in peers):
        return {}
    inputs, params = make_data("float64")
    return {"symbackprop": check(sbp.compile(lenet5()), inputs, params)}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_calls(call: Callable, count: int, clock: str) -> list[float]:
    """Seconds of each of `count` calls in a row, on the clock named (see CLOCKS), after one call
    untimed: the turn's first call finds the caches holding the last peer's data and that peer's
    thread pools maybe still spinning (with a pause instead, of 50 ms before each turn, every
    peer's MNIST MLP step read 1.1-1.4x slower, sleeping or busy waiting)."""
    call()
    now, times = CLOCKS[clock], []
    for _ in range(count):
        t0 = now()
        call()
        times.append(now() - t0)
    return times


def interleave_samples(labels: list[str], sample: Callable[[str, int], list[float]], rounds: int, per_round: int,
                       settle: float = 0.0) -> dict:
    """{label: (median of round medians, (ratio median, low, high) to the first label)}: each round,
    sample(label, per_round) of each label in turn, after `settle` seconds of sleep where given."""
    medians: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(rounds):
        for label in labels:
            if settle:
                time.sleep(settle)
            medians[label].append(statistics.median(sample(label, per_round)))
    base = medians[labels[0]]
    out = {}
    for label, m in medians.items():
        ratios = [a / b for a, b in zip(m, base)]
        out[label] = (statistics.median(m), (statistics.median(ratios), min(ratios), max(ratios)))
    return out


def interleave(calls: dict, rounds: int, per_round: int, warmup: int = 3, clock: str = "wall",
               settle: float = 0.0) -> dict:
    """interleave_samples of calls in this process, each called `warmup` times first.
    clock "cpu": the process's CPU time (every thread's), which a CPU shared
    with other processes inflates far less than the wall clock."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    return interleave_samples(list(calls), lambda label, count: time_calls(calls[label], count, clock),
                              rounds, per_round, settle)


def pin_threads(threads: int = 1, torch_too: bool = True) -> None:
    """This process on its first `threads` CPUs (JAX's thread pool included: it ignores thread flags,
    and the affinity is what bounds it), `threads` threads for symbackprop and PyTorch (where
    torch_too: a peer's own process imports only its library)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:threads]))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    sbp.set_num_threads(threads)
    if not torch_too:
        return
    try:
        import torch
        torch.set_num_threads(threads)
    except ImportError:
        pass


def build_options(threads: int) -> sbp.BuildOptions | None:
    """symbackprop's build for `threads` threads: OpenMP on where there are several (docs/performance.md,
    Threads: the batch loops and a convolution's blocks of examples on OpenMP), the default otherwise."""
    return sbp.BuildOptions(openmp=True) if threads > 1 else None


def thread_label(threads: int) -> str:
    """The rows' suffix: nothing for one thread (the labels of the earlier results), else ", N threads"."""
    return "" if threads == 1 else f", {threads} threads"


# --- the GPT-style decoder and the MNIST MLP -----------------------------------------

GPT_D, GPT_HEADS, GPT_LEN, GPT_BLOCKS, GPT_BATCH, GPT_VOCAB = 256, 4, 128, 4, 8, 64
# "fused": each block's Q, K, V weights are one d x 3d parameter W{b}qkv, sliced (PyTorch's
# MultiheadAttention's in_proj_weight, GPT-2's c_attn); "apart": three d x d parameters (--qkv)
GPT_QKV = "fused"
MLP_BATCH, MLP_SIZES = 128, (784, 256, 10)  # examples/mnist_mlp.py (W3 of benchmarks/workloads.py)


def gpt_shapes() -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of the decoder's parameters, as examples/transformer_lm.py names them."""
    d = GPT_D
    blocks = [s for b in range(GPT_BLOCKS) for s in (
        (f"g{b}a", (1, d)), (f"b{b}a", (1, d)),
        *(((f"W{b}qkv", (d, 3 * d)), (f"Wo{b}", (d, d))) if GPT_QKV == "fused" else
          ((f"W{q}{b}", (d, d)) for q in "qkvo")),
        (f"g{b}m", (1, d)), (f"b{b}m", (1, d)), (f"W{b}up", (d, 4 * d)), (f"c{b}up", (1, 4 * d)),
        (f"W{b}down", (4 * d, d)), (f"c{b}down", (1, d)))]
    return [("E", (GPT_VOCAB, d)), ("P", (GPT_LEN, d)), *blocks, ("gf", (1, d)), ("bf", (1, d)),
            ("Wout", (d, GPT_VOCAB))]


def gpt() -> sbp.Model:
    """The 4-block pre-norm decoder of examples/transformer_lm.py at d=256, 4 heads, context 128:
    token and learned position embeddings, x + attn(ln(x)), x + mlp(ln(x)) (4d, exact gelu),
    ln, linear(vocabulary) without bias, softmax cross-entropy against the next token."""
    m = sp.Symbol("m", integer=True, positive=True)
    ids, positions, targets = sbp.Index("ids", m), sbp.Index("positions", m), sbp.Index("targets", m)
    p = {name: sp.MatrixSymbol(name, *shape) for name, shape in gpt_shapes()}
    x = nn.add_positions(nn.embedding(p["E"], ids, GPT_LEN), p["P"], positions)
    for b in range(GPT_BLOCKS):
        h = nn.layer_norm(x, p[f"g{b}a"], p[f"b{b}a"])
        qkv = ([p[f"W{b}qkv"][:, i * GPT_D:(i + 1) * GPT_D] for i in range(3)] if GPT_QKV == "fused" else
               [p[f"W{q}{b}"] for q in "qkv"])
        x = x + nn.self_attention(h, *qkv, p[f"Wo{b}"], GPT_HEADS)
        up = nn.layer_norm(x, p[f"g{b}m"], p[f"b{b}m"]).map(
            lambda h, b=b: nn.gelu(nn.linear(h, p[f"W{b}up"], p[f"c{b}up"])))
        x = x + up.map(lambda h, b=b: nn.linear(h, p[f"W{b}down"], p[f"c{b}down"]))
    logits = nn.layer_norm(x, p["gf"], p["bf"]).matrix * p["Wout"]
    return sbp.Model("gpt_decoder", inputs=[ids, positions, targets], params=list(p.values()),
                     loss=nn.softmax_cross_entropy(logits, nn.one_hot(targets, GPT_VOCAB)),
                     outputs={"logits": logits})


def gpt_data(dtype: str, seed: int = 0) -> tuple[dict, dict]:
    """Random tokens (the targets the next ones), GPT-2's N(0, 0.02^2) embeddings, PyTorch's
    U(+-1/sqrt(fan_in)) linear layers, norms 1 and 0; float32 is float64 rounded."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GPT_VOCAB, size=(GPT_BATCH, GPT_LEN + 1))
    inputs = {"ids": tokens[:, :-1].ravel().astype(np.int64), "targets": tokens[:, 1:].ravel().astype(np.int64),
              "positions": sbp.position_ids(GPT_BATCH, GPT_LEN)}
    shapes = dict(gpt_shapes())
    params = {}
    for name, shape in gpt_shapes():
        if name in ("E", "P"):
            value = 0.02 * rng.standard_normal(shape)
        elif name[0] in "gb":  # norms: near 1 and 0, so that their gradients are checked
            value = (name[0] == "g") + 0.1 * rng.standard_normal(shape)
        else:  # weights (in x out), their biases c (1 x out)
            fan_in = shapes["W" + name[1:]][0] if name[0] == "c" else shape[0]
            value = rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in)
        params[name] = np.ascontiguousarray(value, dtype=dtype)
    return inputs, params


def mlp() -> sbp.Model:
    """examples/mnist_mlp.py: X (n x 784) -> linear(256) -> tanh -> linear(10) -> softmax cross-entropy."""
    n = sp.Symbol("n", integer=True, positive=True)
    pixels, hidden, classes = MLP_SIZES
    x, t = sp.MatrixSymbol("X", n, pixels), sp.MatrixSymbol("T", n, classes)
    w1, b1 = sp.MatrixSymbol("W1", pixels, hidden), sp.MatrixSymbol("b1", 1, hidden)
    w2, b2 = sp.MatrixSymbol("W2", hidden, classes), sp.MatrixSymbol("b2", 1, classes)
    z = nn.linear(nn.tanh(nn.linear(x, w1, b1)), w2, b2)
    return sbp.Model("mnist_mlp_real", inputs=[x, t], params=[w1, b1, w2, b2],
                     loss=nn.softmax_cross_entropy(z, t), outputs={"logits": z})


def mlp_data(dtype: str, seed: int = 0) -> tuple[dict, dict]:
    """Pixels U(0, 1), one-hot labels, PyTorch's default initialization."""
    rng = np.random.default_rng(seed)
    pixels, _, classes = MLP_SIZES
    inputs = {"X": rng.random((MLP_BATCH, pixels)), "T": np.eye(classes)[rng.integers(0, classes, size=MLP_BATCH)]}
    params = {}
    for layer, (fan_in, fan_out) in enumerate(pairwise(MLP_SIZES), 1):
        params[f"W{layer}"] = rng.uniform(-1, 1, size=(fan_in, fan_out)) / np.sqrt(fan_in)
        params[f"b{layer}"] = rng.uniform(-1, 1, size=(1, fan_out)) / np.sqrt(fan_in)
    cast = lambda d: {k: np.ascontiguousarray(v, dtype=dtype) for k, v in d.items()}  # noqa: E731
    return cast(inputs), cast(params)


def gpt_loss(F, lib: str):
    """The decoder's loss(params, ids, positions, targets) -> (loss, logits), written apart from
    symbackprop's with PyTorch's functional API (lib "torch") or jax.numpy (lib "jax")."""
    d, heads, length = GPT_D, GPT_HEADS, GPT_LEN
    dh = d // heads

    def projections(h, w, b):
        """Q, K, V: one product by the fused weight, split (as MultiheadAttention), or three."""
        if GPT_QKV == "fused":
            qkv = h @ w[f"W{b}qkv"]
            return qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
        return tuple(h @ w[f"W{c}{b}"] for c in "qkv")

    if lib == "torch":
        import torch

        def norm(x, w, g, b):
            return F.layer_norm(x, (d,), w[g][0], w[b][0])

        def attention(h, w, b):
            q, k, v = projections(h, w, b)
            q, k, v = (z.reshape(-1, length, heads, dh).transpose(1, 2) for z in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2).reshape(-1, d) @ w[f"Wo{b}"]

        def cross_entropy(logits, targets):
            return F.cross_entropy(logits, targets)

        gelu = F.gelu
        take = lambda table, rows: table[rows]  # noqa: E731
        _ = torch
    else:
        import jax
        import jax.numpy as jnp

        def norm(x, w, g, b):
            mean = x.mean(axis=1, keepdims=True)
            var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
            return (x - mean) / jnp.sqrt(var + 1e-5) * w[g] + w[b]

        def attention(h, w, b):
            q, k, v = projections(h, w, b)
            q, k, v = (z.reshape(-1, length, heads, dh) for z in (q, k, v))
            # by hand: jax.nn.dot_product_attention takes the softmax in float32, also of float64 scores
            scores = jnp.einsum("nthk,nshk->nhts", q, k) / np.sqrt(dh)
            causal = np.tril(np.ones((length, length), dtype=bool))
            weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
            return jnp.einsum("nhts,nshk->nthk", weights, v).reshape(-1, d) @ w[f"Wo{b}"]

        def cross_entropy(logits, targets):
            picked = jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
            return (jax.nn.logsumexp(logits, axis=1) - picked).mean()

        gelu = lambda z: jax.nn.gelu(z, approximate=False)  # noqa: E731
        take = lambda table, rows: table[rows]  # noqa: E731

    def loss(w, ids, positions, targets):
        x = take(w["E"], ids) + take(w["P"], positions)
        for b in range(GPT_BLOCKS):
            x = x + attention(norm(x, w, f"g{b}a", f"b{b}a"), w, b)
            h = gelu(norm(x, w, f"g{b}m", f"b{b}m") @ w[f"W{b}up"] + w[f"c{b}up"])
            x = x + h @ w[f"W{b}down"] + w[f"c{b}down"]
        logits = norm(x, w, "gf", "bf") @ w["Wout"]
        return cross_entropy(logits, targets), logits

    return loss


def mlp_loss(F, lib: str):
    """The MLP's loss(params, X, T) -> (loss, logits), in PyTorch or jax.numpy."""
    if lib == "torch":
        import torch

        def loss(w, x, t):
            z = torch.tanh(x @ w["W1"] + w["b1"]) @ w["W2"] + w["b2"]
            return F.cross_entropy(z, t.argmax(dim=1)), z
    else:
        import jax
        import jax.numpy as jnp

        def loss(w, x, t):
            z = jnp.tanh(x @ w["W1"] + w["b1"]) @ w["W2"] + w["b2"]
            return (jax.nn.logsumexp(z, axis=1) - (z * t).sum(axis=1)).mean(), z
    return loss


# --- the ResNet basic-block stack ------------------------------------------------------

RES_BATCH, RES_SIDE, RES_IN = 32, 32, 3
# (name, in channels, out channels, stride) of each basic block: conv3x3 (stride) - batch norm - relu -
# conv3x3 - batch norm, plus the input (a 1x1 convolution of that stride and a batch norm where the
# channels or the size change), then relu
RES_BLOCKS = (("r1", 16, 16, 1), ("r2", 16, 32, 2), ("r3", 32, 64, 2))
RES_STEM = 16


def resnet_convs() -> list[tuple[str, int, int, int, int, int, int]]:
    """(name, in channels, input side, out channels, k, stride, padding) of every convolution, in order;
    each is followed by a batch norm g<name>, b<name>."""
    convs = [("K0", RES_IN, RES_SIDE, RES_STEM, 3, 1, 1)]
    side = RES_SIDE
    for name, inp, out, stride in RES_BLOCKS:
        convs.append((f"K{name}a", inp, side, out, 3, stride, 1))
        convs.append((f"K{name}b", out, side // stride, out, 3, 1, 1))
        if stride != 1 or inp != out:
            convs.append((f"K{name}p", inp, side, out, 1, stride, 0))
        side //= stride
    return convs


def resnet_shapes() -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of the ResNet's parameters: each convolution's weights (no bias: a batch norm
    follows), its batch norm's scale g and shift b (1 x C), the classifier's W (64 x 10) and c."""
    out = []
    for name, inp, _, oc, k, _, _ in resnet_convs():
        out += [(name, (oc, inp * k * k)), ("g" + name[1:], (1, oc)), ("b" + name[1:], (1, oc))]
    return [*out, ("W", (RES_BLOCKS[-1][2], CLASSES)), ("c", (1, CLASSES))]


def resnet() -> sbp.Model:
    """3 x 32 x 32 -> conv 3x3 (16) - batch norm - relu -> basic block 16 -> basic block 32 (stride 2,
    1x1 projection) -> basic block 64 (stride 2, 1x1 projection) -> global average pool (64 x 8 x 8 -> 64)
    -> linear(10) -> softmax cross-entropy. Batch norm in training mode (the batch's statistics)."""
    n = sp.Symbol("n", integer=True, positive=True)
    x = sbp.images("X", n, RES_IN, RES_SIDE, RES_SIDE)
    t = sp.MatrixSymbol("T", n, CLASSES)
    p = {name: sp.MatrixSymbol(name, *shape) for name, shape in resnet_shapes()}
    geometry = {name: (stride, pad) for name, _, _, _, _, stride, pad in resnet_convs()}

    def conv_bn(h, name):
        stride, pad = geometry[name]
        y = nn.conv2d(h, p[name], stride=stride, padding=pad)
        return nn.batch_norm(y, p["g" + name[1:]], p["b" + name[1:]])

    h = conv_bn(x, "K0").map(nn.relu)
    for name, _, _, _ in RES_BLOCKS:
        y = conv_bn(conv_bn(h, f"K{name}a").map(nn.relu), f"K{name}b")
        skip = conv_bn(h, f"K{name}p") if f"K{name}p" in geometry else h
        h = sbp.Images(y.matrix + skip.matrix, y.channels, y.height, y.width).map(nn.relu)
    z = nn.linear(nn.flatten(nn.avg_pool2d(h, h.height)), p["W"], p["c"])
    return sbp.Model("resnet_blocks", inputs=[x.matrix, t], params=list(p.values()),
                     loss=nn.softmax_cross_entropy(z, t), outputs={"logits": z})


def resnet_data(dtype: str, seed: int = 0) -> tuple[dict, dict]:
    """Pixels U(0, 1), one-hot labels, PyTorch's default initialization of the convolutions and the
    linear layer; batch-norm scales near 1 and shifts near 0 (so that their gradients are checked)."""
    rng = np.random.default_rng(seed)
    inputs = {"X": rng.random((RES_BATCH, RES_IN * RES_SIDE * RES_SIDE)),
              "T": np.eye(CLASSES)[rng.integers(0, CLASSES, size=RES_BATCH)]}
    params = {}
    for name, shape in resnet_shapes():
        if name[0] in "gb":
            params[name] = (name[0] == "g") + 0.1 * rng.standard_normal(shape)
        else:
            fan_in = RES_BLOCKS[-1][2] if name == "c" else shape[0] if name == "W" else shape[1]
            params[name] = rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in)
    cast = lambda d: {k: np.ascontiguousarray(v, dtype=dtype) for k, v in d.items()}  # noqa: E731
    return cast(inputs), cast(params)


def resnet_loss(F, lib: str):
    """The ResNet's loss(params, X, T) -> (loss, logits), written apart from symbackprop's with
    torch.nn.functional (conv2d, batch_norm in training mode) or jax.lax.conv_general_dilated."""
    convs = {name: (inp, oc, k, stride, pad) for name, inp, _, oc, k, stride, pad in resnet_convs()}
    if lib == "torch":
        def conv_bn(h, w, name):
            inp, oc, k, stride, pad = convs[name]
            y = F.conv2d(h, w[name].reshape(oc, inp, k, k), stride=stride, padding=pad)
            return F.batch_norm(y, None, None, w["g" + name[1:]][0], w["b" + name[1:]][0], training=True, eps=1e-5)

        def cross_entropy(z, t):
            return F.cross_entropy(z, t.argmax(dim=1))

        relu = F.relu
    else:
        import jax
        import jax.numpy as jnp
        from jax import lax

        def conv_bn(h, w, name):
            inp, oc, k, stride, pad = convs[name]
            y = lax.conv_general_dilated(h, w[name].reshape(oc, inp, k, k), (stride, stride),
                                         [(pad, pad), (pad, pad)], dimension_numbers=("NCHW", "OIHW", "NCHW"))
            mean = y.mean(axis=(0, 2, 3), keepdims=True)
            var = ((y - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
            g, b = (w[c + name[1:]].reshape(1, oc, 1, 1) for c in "gb")
            return (y - mean) / jnp.sqrt(var + 1e-5) * g + b

        def cross_entropy(z, t):
            return (jax.nn.logsumexp(z, axis=1) - (z * t).sum(axis=1)).mean()

        relu = jax.nn.relu

    def loss(w, x, t):
        h = relu(conv_bn(x.reshape(-1, RES_IN, RES_SIDE, RES_SIDE), w, "K0"))
        for name, _, _, _ in RES_BLOCKS:
            y = conv_bn(relu(conv_bn(h, w, f"K{name}a")), w, f"K{name}b")
            h = relu(y + (conv_bn(h, w, f"K{name}p") if f"K{name}p" in convs else h))
        z = h.mean(axis=(2, 3)) @ w["W"] + w["c"]
        return cross_entropy(z, t), z

    return loss


WORKLOADS = {  # name: (title, model, data, the peers' loss, the inputs' order)
    "gpt": (f"GPT-style decoder ({GPT_BLOCKS} blocks, d={GPT_D}, {GPT_HEADS} heads, sequence {GPT_LEN}, "
            f"batch {GPT_BATCH})", gpt, gpt_data, gpt_loss, ("ids", "positions", "targets")),
    "mlp": (f"MNIST MLP (784-256-10 tanh, batch {MLP_BATCH})", mlp, mlp_data, mlp_loss, ("X", "T")),
    "resnet": (f"ResNet basic blocks (16-32-64 channels, batch norm, 32x32 images, batch {RES_BATCH})", resnet,
               resnet_data, resnet_loss, ("X", "T")),
}


def torch_functional(workload: str, inputs: dict, params: dict, compiled: bool):
    """(weights, step, infer, grads) of PyTorch: a dict of leaf tensors (symbackprop's names and
    shapes), a training step with torch.optim.Adam, inference under no_grad, and
    grads() -> (loss, {name: gradient}) at the weights as they are."""
    import torch

    loss_of = WORKLOADS[workload][3](torch.nn.functional, "torch")
    weights = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    args = [torch.from_numpy(inputs[k]) for k in WORKLOADS[workload][4]]
    forward = torch.compile(loss_of) if compiled else loss_of
    adam = torch.optim.Adam(weights.values(), lr=LR)

    def step():
        adam.zero_grad()
        loss = forward(weights, *args)[0]
        loss.backward()
        adam.step()
        return loss

    def infer():
        with torch.no_grad():
            return forward(weights, *args)

    def grads():
        for w in weights.values():
            w.grad = None
        loss = forward(weights, *args)[0]
        loss.backward()
        return float(loss.detach()), {k: w.grad.numpy().copy() for k, w in weights.items()}

    return weights, step, infer, grads


def jax_functional(workload: str, inputs: dict, params: dict):
    """(step, infer, grads) of JAX: one jax.jit of value_and_grad and Adam's update (the
    state carried from call to call, its buffers donated), jax.jit of the loss and
    logits, and grads() -> (loss, {name: gradient}) from the first parameters."""
    import jax
    import jax.numpy as jnp

    loss_of = WORKLOADS[workload][3](None, "jax")
    args = [jnp.asarray(inputs[k]) for k in WORKLOADS[workload][4]]
    value_and_grad = jax.jit(jax.value_and_grad(lambda w, *a: loss_of(w, *a)[0]))
    b1, b2, eps = 0.9, 0.999, 1e-8

    def update(state, *a):
        w, m, v, t = state
        loss, g = jax.value_and_grad(lambda w: loss_of(w, *a)[0])(w)
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        scale_m, scale_v = 1 / (1 - b1 ** t), 1 / (1 - b2 ** t)
        w = jax.tree.map(lambda w, m, v: w - LR * (m * scale_m) / (jnp.sqrt(v * scale_v) + eps), w, m, v)
        return (w, m, v, t), loss

    update = jax.jit(update, donate_argnums=0)
    start = {k: jnp.asarray(v) for k, v in params.items()}
    dtype = next(iter(params.values())).dtype
    zeros = lambda: jax.tree.map(jnp.zeros_like, start)  # noqa: E731
    state = [({k: jnp.asarray(v) for k, v in params.items()}, zeros(), zeros(), jnp.zeros((), dtype))]
    forward = jax.jit(loss_of)

    def step():
        state[0], loss = update(state[0], *args)
        return loss.block_until_ready()

    def infer():
        return jax.block_until_ready(forward(start, *args))

    def grads():
        loss, g = value_and_grad(start, *args)
        return float(loss), {k: np.asarray(v) for k, v in g.items()}

    return step, infer, grads


def check_peer(mod64, inputs: dict, params: dict, grads) -> float:
    """The largest relative error (2-norm) of a peer's float64 loss and gradients
    (grads() -> (loss, {name: gradient})) against symbackprop's."""
    loss, ours = mod64.value_and_grad(**inputs, **params)
    ref_loss, ref = grads()
    errors = [abs(loss - ref_loss) / abs(ref_loss)]
    errors += [float(np.linalg.norm(ours[k] - np.reshape(ref[k], ours[k].shape)) / np.linalg.norm(ours[k]))
               for k in ours]
    return max(errors)


def model_and_data(model: str) -> tuple[Callable[[], sbp.Model], Callable[[str], tuple[dict, dict]]]:
    """(the symbackprop Model's builder, data(dtype) -> (inputs, params)) of a model's name."""
    return (lenet5, make_data) if model == "lenet5" else WORKLOADS[model][1:3]


def title(model: str) -> str:
    """The rows' name of a model."""
    return "LeNet-5" if model == "lenet5" else WORKLOADS[model][0]


def peer_calls(model: str, dtype: str, peer: str, threads: int = 1) -> tuple[Callable, Callable, float] | None:
    """(training step, inference, seconds to set both up and call each once) of one peer on a model in
    one dtype, calls of no arguments, each called twice more (warm); None where the peer has none
    (JAX's LeNet-5, an unknown peer)."""
    build, data = model_and_data(model)
    inputs, params = data(dtype)
    start = time.perf_counter()
    if peer == "symbackprop":
        mod = sbp.compile(build(), dtype=dtype, optimizer=sbp.Adam(lr=LR), options=build_options(threads))
        sbp_params = {k: v.copy() for k, v in params.items()}

        def step():
            return mod.train_step(**inputs, **sbp_params)

        def infer():
            return mod.forward(**inputs, **params)
    elif peer in ("torch_eager", "torch_compile") and model == "lenet5":
        step, infer = lenet_torch_calls(inputs, params, dtype, peer == "torch_compile")
    elif peer in ("torch_eager", "torch_compile"):
        _, step, infer, _ = torch_functional(model, inputs, params, peer == "torch_compile")
    elif peer == "jax_jit" and model != "lenet5":
        step, infer, _ = jax_functional(model, inputs, params)
    else:
        return None
    step(), infer()  # symbackprop builds train_step, torch.compile and JAX compile, here
    seconds = time.perf_counter() - start
    for call in (step, infer, step, infer):
        call()
    return step, infer, seconds


def symbackprop_first(peers: list[str]) -> list[str]:
    """The peers to time, symbackprop's first (the ratios' base) whether or not it is named."""
    return ["symbackprop", *(p for p in peers if p != "symbackprop")]


def note_setup(notes: dict, model: str, dtype: str, peer: str, seconds: float) -> None:
    """Print the seconds a peer took to set up and call once; torch.compile's go into the table's note."""
    print(f"{title(model)} {dtype}: {peer}'s set-up and first step and inference {seconds:.1f} s", flush=True)
    if peer == "torch_compile":
        notes.setdefault("torch_compile", []).append(f"{model} {dtype} {seconds:.0f} s")


WHAT = {"step": "training step (Adam)", "infer": "inference"}


class InProcess:
    """Every peer's calls in this process (--one-process, and --breakdown): `calls[peer]` is
    (training step, inference), symbackprop's first."""

    def __init__(self, model: str, dtype: str, peers: list[str], notes: dict, threads: int = 1, clock: str = "wall"):
        self.calls: dict[str, tuple[Callable, Callable]] = {}
        for peer in symbackprop_first(peers):
            made = peer_calls(model, dtype, peer, threads)
            if made is not None:
                self.calls[peer] = made[:2]
                note_setup(notes, model, dtype, peer, made[2])
        self.peers, self.clock = list(self.calls), clock

    def sample(self, peer: str, what: str, count: int) -> list[float]:
        return time_calls(self.calls[peer][what == "infer"], count, self.clock)

    def close(self) -> None:
        pass


# glibc's malloc in each peer's process: freed memory kept, not returned to the system after every
# call, and the heap on transparent huge pages. Fresh processes otherwise page-faulted their step's
# arrays back every call (PyTorch's ResNet float32 step: about 5,000 page faults, torch.compile
# 45-53 ms against 34-35 ms, eager 60-70 against 43-44, JAX 85 against 63; symbackprop, whose
# workspace stays, level): the peers at their best, as in a long-running process.
PEER_MALLOC = "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"


def peer_environment() -> dict[str, str]:
    """This process's environment, with PEER_MALLOC added to any GLIBC_TUNABLES set."""
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), PEER_MALLOC) if t)
    return {**os.environ, "GLIBC_TUNABLES": tunables}


class PeerProcesses:
    """One process per peer (this script with --serve PEER), pinned and threaded as this one, its
    malloc set as PEER_MALLOC: no library's thread pool, allocator or caches share a process with
    another's, and the CPU clock counts one peer's threads alone. sample() asks a peer's process
    for timed calls."""

    def __init__(self, model: str, dtype: str, peers: list[str], notes: dict, threads: int = 1, clock: str = "wall"):
        self.processes: dict[str, subprocess.Popen] = {}
        try:
            for peer in symbackprop_first(peers):
                command = [sys.executable, str(Path(__file__).resolve()), "--serve", peer, "--models", model,
                           "--dtype", dtype, "--threads", str(threads), "--clock", clock, "--qkv", GPT_QKV]
                self.processes[peer] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                        text=True, env=peer_environment())
                ready = self._answer(peer)
                if ready["ready"]:
                    note_setup(notes, model, dtype, peer, ready["seconds"])
                else:
                    self._stop(peer)
        except BaseException:
            self.close()
            raise
        self.peers = list(self.processes)

    def _answer(self, peer: str):
        line = self.processes[peer].stdout.readline()
        if not line:
            raise RuntimeError(f"{peer}'s process ended (exit status {self.processes[peer].wait()}): see its errors above")
        return json.loads(line)

    def _stop(self, peer: str) -> None:
        process = self.processes.pop(peer)
        process.stdin.close()
        process.wait()

    def sample(self, peer: str, what: str, count: int) -> list[float]:
        self.processes[peer].stdin.write(f"{what} {count}\n")
        self.processes[peer].stdin.flush()
        return self._answer(peer)

    def close(self) -> None:
        for peer in list(self.processes):
            self._stop(peer)


def serve(model: str, dtype: str, peer: str, threads: int, clock: str) -> int:
    """(A peer's process) set the peer up, say so, then answer each line `step N` or `infer N` with
    N timed calls in seconds. Answers go to the stdout it started with; what the libraries print,
    to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    pin_threads(threads, torch_too=peer.startswith("torch"))
    if peer == "jax_jit":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64
    made = peer_calls(model, dtype, peer, threads)
    if made is None:
        answers.write(json.dumps({"ready": False}) + "\n")
        return 0
    step, infer, seconds = made
    calls = {"step": step, "infer": infer}
    answers.write(json.dumps({"ready": True, "seconds": seconds}) + "\n")
    for line in sys.stdin:
        what, count = line.split()
        answers.write(json.dumps(time_calls(calls[what], int(count), clock)) + "\n")
    return 0


def functional_calls(workload: str, dtype: str, peers: list[str], notes: dict, threads: int = 1) -> tuple[dict, dict]:
    """({peer: training step}, {peer: inference}) in this process, symbackprop's first (--breakdown)."""
    calls = InProcess(workload, dtype, peers, notes, threads).calls
    return {peer: c[0] for peer, c in calls.items()}, {peer: c[1] for peer, c in calls.items()}


def time_rows(model: str, dtype: str, peers: list[str], timing: tuple, notes: dict, threads: int = 1,
              apart: bool = True, settle: float = 0.0) -> list[dict]:
    """The rows of one model in one dtype, the training step then inference: each peer's median and its
    ratio to symbackprop's, its calls in a process of its own (apart) or all in this one."""
    rounds, per_round, clock = timing
    peers_of = (PeerProcesses if apart else InProcess)(model, dtype, peers, notes, threads, clock)
    rows = []
    try:
        for what, label in WHAT.items():
            result = interleave_samples(peers_of.peers, lambda peer, count, what=what: peers_of.sample(peer, what, count),
                                        rounds, per_round, settle)
            row = {"label": f"{title(model)} {dtype}, {label}{thread_label(threads)}",
                   "seconds": {k: v[0] for k, v in result.items()},
                   "ratios": {k: [round(r, 3) for r in v[1]] for k, v in result.items() if k != "symbackprop"}}
            rows.append(row)
            print(f"{row['label']}:")
            for peer, (seconds, (ratio, low, high)) in result.items():
                print(f"  {peer:14} {seconds * 1e3:8.3f} ms   ratio to symbackprop {ratio:5.2f} ({low:.2f}-{high:.2f})")
    finally:
        peers_of.close()
    return rows


def check_functional(workload: str, peers: list[str]) -> dict:
    """{peer: largest relative error} of each peer's float64 loss and gradients against symbackprop's."""
    _, model, data, _, _ = WORKLOADS[workload]
    inputs, params = data("float64")
    mod64 = sbp.compile(model())
    errors = {}
    for peer in peers:
        if peer in ("torch_eager", "torch_compile"):
            errors[peer] = check_peer(mod64, inputs, params,
                                      torch_functional(workload, inputs, params, peer == "torch_compile")[3])
        elif peer == "jax_jit":
            errors[peer] = check_peer(mod64, inputs, params, jax_functional(workload, inputs, params)[2])
    return errors


# --- one convolution's kernels alone (--layers) ------------------------------------------


def layer_models(c_in: int, side: int, c_out: int, k: int, pad: int, stride: int = 1) -> dict:
    """sum(conv(X, K) * G) as two models: by K, and by K and X (forward() of the first: the forward alone)."""
    n = sp.Symbol("n", integer=True, positive=True)
    x = sbp.images("X", n, c_in, side, side)
    w = sbp.conv_weight("K", c_out, c_in, k)
    y = nn.conv2d(x, w, stride=stride, padding=pad)
    g = sp.MatrixSymbol("G", n, y.matrix.shape[1])
    loss = nn.sum_all(sp.HadamardProduct(y.matrix, g))
    name = f"conv{c_in}x{side}to{c_out}k{k}p{pad}s{stride}"
    return {"by_k": sbp.Model(name + "_k", inputs=[x.matrix, g], params=[w], loss=loss),
            "by_kx": sbp.Model(name + "_kx", inputs=[x.matrix, g], params=[w], loss=loss, grad_inputs=[x.matrix])}


def conv_layers(model: str) -> tuple[int, list[tuple[str, int, int, int, int, int, int]]]:
    """(batch, [(name, in channels, input side, out channels, k, stride, padding)]) of a model's convolutions."""
    if model == "resnet":
        return RES_BATCH, resnet_convs()
    side, out = SIDE, []
    for name, c_out, c_in, k, pad in LAYERS:
        out.append((name, c_in, side, c_out, k, 1, pad))
        side = (side + 2 * pad - k + 1) // 2
    return BATCH, out


def gemm_seconds(m: int, k: int, n: int, dtype: str, repeat: int, clock: str) -> float:
    """The fastest of `repeat` timings of an m x k by k x n product (numpy's BLAS)."""
    rng = np.random.default_rng(1)
    a, b = rng.random((m, k)).astype(dtype), rng.random((k, n)).astype(dtype)
    out = np.empty((m, n), dtype=dtype)
    now, best = CLOCKS[clock], float("inf")
    for _ in range(repeat):
        t0 = now()
        np.matmul(a, b, out=out)
        best = min(best, now() - t0)
    return best


def torch_conv(x, w, conv: tuple, wrt: tuple) -> None:
    """sum(conv2d(x, w) * g) in PyTorch, its gradient by w ("w" in wrt) and x ("x" in wrt)."""
    import torch

    conv2d, stride, pad, g = conv
    xs, ws = x.detach().requires_grad_("x" in wrt), w.detach().requires_grad_("w" in wrt)
    if not wrt:
        with torch.no_grad():
            (conv2d(xs, ws, stride=stride, padding=pad) * g).sum()
        return
    (conv2d(xs, ws, stride=stride, padding=pad) * g).sum().backward()


def kernels(result: dict, prefix: str, flops: int) -> str:
    """The forward, weight-gradient and input-gradient times and GFLOP/s from the three calls' medians."""
    fwd, wk, wkx = (result[prefix + label][0] for label in ("forward", "by_K", "by_K_X"))
    return ", ".join(f"{what} {s * 1e3:.3f} ms {flops / s / 1e9:.1f} GFLOP/s" for what, s in
                     (("forward", fwd), ("weight grad", wk - fwd), ("input grad", wkx - wk)))


def time_layers(dtype: str, rounds: int, per_round: int, model: str = "lenet5", clock: str = "wall",
                torch_too: bool = True) -> None:
    """Each convolution's forward, weight gradient and input gradient: milliseconds and GFLOP/s
    (2 * batch * C_out * output pixels * C_in*k*k per kernel), beside PyTorch's and the BLAS's own
    gemm of the same sizes (C_out x C_in*k*k by C_in*k*k x pixels: per example, batch times,
    and once over the whole batch's columns)."""
    rng = np.random.default_rng(0)
    batch, layers = conv_layers(model)
    print(f"{model} {dtype}: gemm 512x512 by 512x512 "
          f"{2 * 512 ** 3 / gemm_seconds(512, 512, 512, dtype, 10, clock) / 1e9:.1f} GFLOP/s", flush=True)
    for name, c_in, side, c_out, k, stride, pad in layers:
        models = layer_models(c_in, side, c_out, k, pad, stride)
        out_side = (side + 2 * pad - k) // stride + 1
        arrays = {"X": rng.random((batch, c_in * side * side)).astype(dtype),
                  "G": rng.standard_normal((batch, c_out * out_side ** 2)).astype(dtype),
                  "K": rng.standard_normal((c_out, c_in * k * k)).astype(dtype)}
        by_k = sbp.compile(models["by_k"], dtype=dtype)
        by_kx = sbp.compile(models["by_kx"], dtype=dtype)
        calls = {"forward": by_k.prepare("forward", **arrays), "by_K": by_k.prepare("value_and_grad", **arrays),
                 "by_K_X": by_kx.prepare("value_and_grad", **arrays)}
        if torch_too:
            import torch
            import torch.nn.functional as F

            x = torch.from_numpy(arrays["X"]).reshape(batch, c_in, side, side)
            g = torch.from_numpy(arrays["G"]).reshape(batch, c_out, out_side, out_side)
            w = torch.from_numpy(arrays["K"]).reshape(c_out, c_in, k, k)

            conv = (F.conv2d, stride, pad, g)
            calls |= {"torch forward": lambda a=(x, w, conv): torch_conv(*a, ()),
                      "torch by_K": lambda a=(x, w, conv): torch_conv(*a, ("w",)),
                      "torch by_K_X": lambda a=(x, w, conv): torch_conv(*a, ("w", "x"))}
        result = interleave(calls, rounds, per_round, clock=clock)
        flops = 2 * batch * c_out * out_side ** 2 * c_in * k * k
        pixels = out_side ** 2
        per_example = gemm_seconds(c_out, c_in * k * k, pixels, dtype, 200, clock) * batch
        whole = gemm_seconds(c_out, c_in * k * k, pixels * batch, dtype, 20, clock)

        print(f"{name} {dtype} ({c_in}x{side}x{side} -> {c_out}, {k}x{k}, stride {stride}, padding {pad}; "
              f"gemm {c_out}x{c_in * k * k}x{pixels}, {flops / 1e6:.1f} MFLOP):\n"
              f"  symbackprop: {kernels(result, '', flops)}\n"
              + (f"  PyTorch:     {kernels(result, 'torch ', flops)}\n" if torch_too else "")
              + f"  gemm {c_out}x{c_in * k * k} by {c_in * k * k}x{pixels}, {batch} times: "
              f"{flops / per_example / 1e9:.1f} GFLOP/s; by {c_in * k * k}x{pixels * batch} once: "
              f"{flops / whole / 1e9:.1f} GFLOP/s", flush=True)


def breakdown(models: list[str], dtypes: list[str], peers: list[str], timing: tuple, notes: dict,
              save: str | None, argv: list[str] | None, threads: int = 1) -> int:
    """--breakdown: each model's calls in parts (benchmarks/real_sizes_breakdown.py), saved as NAME."""
    from benchmarks import real_sizes_breakdown as parts

    rows = [row for name in models for dtype in dtypes
            for row in parts.breakdown_rows(name, dtype, peers, timing, notes, threads)]
    if save:
        parts.save(save, models, rows, argv if argv is not None else sys.argv[1:], peers, notes, threads, timing[2])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="lenet5,gpt,mlp,resnet", help="comma list of lenet5, gpt, mlp, resnet")
    p.add_argument("--dtype", default="float32,float64")
    p.add_argument("--peers", default="symbackprop,torch_eager,torch_compile,jax_jit")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10, help="calls of each peer per round")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time; cpu: the process's CPU time (on a shared, loaded machine)")
    p.add_argument("--threads", type=int, default=1, help="CPUs pinned and threads of every peer")
    p.add_argument("--layers", action="store_true", help="time each convolution's kernels alone")
    p.add_argument("--breakdown", action="store_true",
                   help="the decoder's and the MLP's calls in parts: products, attention, the rest "
                        "(benchmarks/real_sizes_breakdown.py)")
    p.add_argument("--qkv", choices=("fused", "apart"), default="fused",
                   help="the decoder's Q, K, V weights: one d x 3d parameter per block (sliced, as PyTorch's "
                        "in_proj_weight) or three d x d parameters")
    p.add_argument("--one-process", action="store_true",
                   help="every peer in this process (by default each peer runs in a process of its own)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds of sleep before each peer's turn, for the last peer's thread pools to stop spinning "
                        "(default: none on one thread, 0.05 on several; each turn's first call is untimed)")
    p.add_argument("--serve", metavar="PEER", help=argparse.SUPPRESS)  # a peer's own process (PeerProcesses)
    p.add_argument("--note", action="append", default=[], help="a note shown under the saved table")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    if args.settle is None:  # libgomp's and PyTorch's idle threads spin a few ms after a call
        args.settle = 0.05 if args.threads > 1 else 0.0
    global GPT_QKV
    GPT_QKV = args.qkv
    if args.serve:
        return serve(args.models, args.dtype, args.serve, args.threads, args.clock)
    pin_threads(args.threads)
    dtypes = args.dtype.split(",")
    peers, models = args.peers.split(","), args.models.split(",")
    if args.layers:
        for dtype in dtypes:
            for model in models:
                time_layers(dtype, args.rounds, args.calls, model, args.clock, "torch_eager" in peers)
        return 0
    if "jax_jit" in peers:
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64
    rows: list[dict] = []
    notes: dict[str, list[str]] = {}
    if args.breakdown:
        return breakdown(models, dtypes, peers, (args.rounds, args.calls, args.clock), notes, args.save, argv,
                         args.threads)
    timing = (args.rounds, args.calls, args.clock)
    for name in models:
        errors = check_lenet5(peers) if name == "lenet5" else check_functional(name, peers)
        print(f"{title(name)}: float64 loss and gradients against the reference, largest relative error: "
              + ", ".join(f"{peer} {e:.1e}" for peer, e in errors.items()))
        if any(e > 1e-10 for e in errors.values()):
            print("they disagree: not timing", file=sys.stderr)
            return 1
        rows += [row for dtype in dtypes for row in time_rows(name, dtype, peers, timing, notes, args.threads,
                                                              not args.one_process, args.settle)]
    if args.save:
        from benchmarks import tables

        labels = {"symbackprop": "symbackprop", "torch_eager": "PyTorch eager", "torch_compile": "torch.compile",
                  "jax_jit": "JAX jit"}
        shown = [p for p in labels if p in peers]
        note = " ".join(args.note)
        if notes.get("torch_compile"):
            note += " torch.compile's first training step and inference took " + ", ".join(notes["torch_compile"]) + "."
        if note:
            for row in rows:
                row["note"] = note.strip()
        data = {
            "title": "Real sizes, a training step with Adam and inference: " + ", ".join(
                "LeNet-5 on 28x28 images, batch 64" if m == "lenet5" else WORKLOADS[m][0] for m in models),
            **tables.provenance(),
            "command": "python benchmarks/real_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "conditions": ("every peer in one process" if args.one_process else
                           "each peer in a process of its own, its malloc keeping freed memory, on huge pages,")
                          + (" pinned to one CPU, one thread; " if args.threads == 1 else
                             f" pinned to the same {args.threads} CPUs, {args.threads} threads; ")
                          + "each turn's first call untimed; "
                          + (f"{args.settle * 1e3:.0f} ms of sleep before each turn; " if args.settle else "")
                          + ("the process's CPU time (all its threads); " if args.clock == "cpu" else "")
                          + "rounds of calls of each "
                          "peer in turn; median of the round medians; the ratio is the median of the per-round "
                          "ratios (peer over symbackprop) and their range; float64 losses and gradients of every "
                          "peer checked against symbackprop's (relative error under 1e-10) before timing",
            "source": "benchmarks/real_sizes.py",
            "row_header": "workload",
            "baseline": "symbackprop",
            "columns": [{"key": k, "label": labels[k], "ratio": k != "symbackprop"} for k in shown],
            "rows": rows,
        }
        print(f"wrote {tables.save(args.save, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
