"""A character-level transformer language model on the docstrings of
Python's argparse module (they ship with Python, no download):

    chars -> token embedding + learned positions (d=64)
          -> 2 pre-norm blocks: x + attn(ln(x)), x + mlp(ln(x))   (4 heads, causal, context 64; mlp 256, gelu)
          -> ln -> linear(vocabulary) -> softmax cross-entropy against the next char

A batch of sequences is a matrix with one row per position (docs/attention.md):
m = n*64 rows, bound at call time by the token ids (an Index).

    python examples/transformer_lm.py [--epochs 4] [--batch-size 8] [--lr 0.003]

trains it with `train_epoch` (one C call an epoch; an epoch's order moves
whole sequences), prints the loss before and after beside the text's unigram
entropy, and, when PyTorch is installed, trains the same model from the same
initialization in the same order (float64, torch.optim.Adam, one thread) and
prints its epoch times beside and the two loss curves' largest difference.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

CONTEXT, D, HEADS, BLOCKS, CHARS = 64, 64, 4, 2, 12288


def corpus() -> str:
    """argparse's module and class/function docstrings, the first CHARS characters."""
    docs = [inspect.getdoc(o) or "" for _, o in inspect.getmembers(argparse)
            if (inspect.isclass(o) or inspect.isfunction(o)) and getattr(o, "__module__", "") == "argparse"]
    return ((argparse.__doc__ or "") + "\n".join(docs))[:CHARS]


TEXT = corpus()
ALPHABET = sorted(set(TEXT))
VOCAB = len(ALPHABET)

m = sp.Symbol("m", integer=True, positive=True)  # positions: sequences of CONTEXT rows
ids, positions, targets = sbp.Index("ids", m), sbp.Index("positions", m), sbp.Index("targets", m)


def _block_shapes(b: int) -> list[tuple[str, tuple[int, int]]]:
    return [(f"g{b}a", (1, D)), (f"b{b}a", (1, D)), *((f"W{q}{b}", (D, D)) for q in "qkvo"),
            (f"g{b}m", (1, D)), (f"b{b}m", (1, D)), (f"W{b}up", (D, 4 * D)), (f"c{b}up", (1, 4 * D)),
            (f"W{b}down", (4 * D, D)), (f"c{b}down", (1, D))]


SHAPES = [("E", (VOCAB, D)), ("P", (CONTEXT, D)), *(s for b in range(BLOCKS) for s in _block_shapes(b)),
          ("gf", (1, D)), ("bf", (1, D)), ("Wout", (D, VOCAB))]
p = {name: sp.MatrixSymbol(name, *shape) for name, shape in SHAPES}

x = nn.add_positions(nn.embedding(p["E"], ids, CONTEXT), p["P"], positions)
for b in range(BLOCKS):
    x = x + nn.self_attention(nn.layer_norm(x, p[f"g{b}a"], p[f"b{b}a"]), *(p[f"W{q}{b}"] for q in "qkvo"), HEADS)
    up = nn.layer_norm(x, p[f"g{b}m"], p[f"b{b}m"]).map(lambda h, b=b: nn.gelu(nn.linear(h, p[f"W{b}up"], p[f"c{b}up"])))
    x = x + up.map(lambda h, b=b: nn.linear(h, p[f"W{b}down"], p[f"c{b}down"]))
logits = nn.layer_norm(x, p["gf"], p["bf"]).matrix * p["Wout"]

model = sbp.Model("transformer_lm", inputs=[ids, positions, targets], params=list(p.values()),
                  loss=nn.softmax_cross_entropy(logits, nn.one_hot(targets, VOCAB)))
optimizer = sbp.Adam(lr=3e-3)


def init_params(rng: np.random.Generator) -> dict:
    """Embeddings N(0, 0.02^2) as GPT-2's; linear layers U(+-1/sqrt(fan_in)) as PyTorch's; norms 1 and 0."""
    params = {}
    for name, shape in SHAPES:
        if name in ("E", "P"):
            params[name] = 0.02 * rng.standard_normal(shape)
        elif name[0] == "g":
            params[name] = np.ones(shape)
        elif name[0] == "b":
            params[name] = np.zeros(shape)
        else:  # weights (in x out) and their biases c (1 x out), fan_in the weight's rows
            fan_in = dict(SHAPES)["W" + name[1:]][0] if name[0] == "c" else shape[0]
            params[name] = rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in)
    return params


def encode(text: str) -> np.ndarray:
    return np.array([ALPHABET.index(c) for c in text], dtype=np.int64)


def windows(codes: np.ndarray) -> dict:
    """The text as sequences of CONTEXT chars (rows) and the chars after each."""
    count = (len(codes) - 1) // CONTEXT
    rows = np.arange(count * CONTEXT)
    return {"ids": codes[rows], "targets": codes[rows + 1], "positions": sbp.position_ids(count, CONTEXT)}


def sample_data(rng: np.random.Generator, sequences: int = 2) -> dict:
    """Two sequences of the text from a random start, and random parameters."""
    start = int(rng.integers(0, len(TEXT) - sequences * CONTEXT - 1))
    data = windows(encode(TEXT[start:start + sequences * CONTEXT + 1]))
    params = init_params(rng)
    params["E"], params["P"] = 50 * params["E"], 50 * params["P"]  # gradients well above rounding
    for b in range(BLOCKS):
        params[f"Wq{b}"], params[f"Wk{b}"] = 4 * params[f"Wq{b}"], 4 * params[f"Wk{b}"]  # attention far from uniform
    return {**data, **params}


def unigram_entropy(codes: np.ndarray) -> float:
    """The cross-entropy (nats) of predicting every char by the text's char frequencies."""
    freq = np.bincount(codes, minlength=VOCAB) / len(codes)
    return float(-(freq[freq > 0] * np.log(freq[freq > 0])).sum())


def row_orders(rng: np.random.Generator, sequences: int, epochs: int) -> list[np.ndarray]:
    """Each epoch's row order: the sequences shuffled, each one's rows kept together and in order."""
    return [(rng.permutation(sequences)[:, None] * CONTEXT + np.arange(CONTEXT)).ravel() for _ in range(epochs)]


# --- training (python examples/transformer_lm.py) ----------------------------------


def train_symbackprop(params: dict, data: dict, orders: list, batch_size: int, lr: float):
    """One train_epoch call an epoch, single-threaded. Returns the module,
    the minibatch losses (a row an epoch) and the seconds of each epoch."""
    sbp.set_num_threads(1)
    mod = sbp.compile(model, optimizer=sbp.Adam(lr=lr))
    _ = mod.trainer  # builds (or loads) train_epoch now, not in the first epoch
    curves, seconds = [], []
    for order in orders:
        start = time.perf_counter()
        curves.append(mod.train_epoch(batch_size * CONTEXT, order, **data, **params))
        seconds.append(time.perf_counter() - start)
    return mod, np.array(curves), np.array(seconds)


def torch_model(params: dict):
    """The same model in PyTorch (float64), its parameters the same arrays' copies."""
    import torch

    F = torch.nn.functional
    weights = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}

    def attention(h, b):
        q, k, v = (h @ weights[f"W{c}{b}"] for c in "qkv")
        n, dh = h.shape[0] // CONTEXT, D // HEADS
        q, k, v = (z.reshape(n, CONTEXT, HEADS, dh).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(2, 3) / dh**0.5
        masked = torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), diagonal=1)
        out = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1) @ v
        return out.transpose(1, 2).reshape(n * CONTEXT, D) @ weights[f"Wo{b}"]

    def loss(ids, positions, targets):
        w = weights
        x = w["E"][ids] + w["P"][positions]
        for b in range(BLOCKS):
            x = x + attention(F.layer_norm(x, (D,), w[f"g{b}a"][0], w[f"b{b}a"][0]), b)
            h = F.gelu(F.layer_norm(x, (D,), w[f"g{b}m"][0], w[f"b{b}m"][0]) @ w[f"W{b}up"] + w[f"c{b}up"])
            x = x + h @ w[f"W{b}down"] + w[f"c{b}down"]
        return F.cross_entropy(F.layer_norm(x, (D,), w["gf"][0], w["bf"][0]) @ w["Wout"], targets)

    return weights, loss


def train_torch(params: dict, data: dict, orders: list, batch_size: int, lr: float):
    """PyTorch eager, the same minibatches in the same order, torch.optim.Adam."""
    import torch

    weights, loss_of = torch_model(params)
    adam = torch.optim.Adam(weights.values(), lr=lr)
    tensors = {k: torch.from_numpy(v) for k, v in data.items()}
    curves, seconds = [], []
    for order in orders:
        index = torch.from_numpy(order)
        start = time.perf_counter()
        losses = []
        for s in range(0, len(order), batch_size * CONTEXT):
            rows = index[s:s + batch_size * CONTEXT]
            adam.zero_grad()
            loss = loss_of(*(tensors[k][rows] for k in ("ids", "positions", "targets")))
            loss.backward()
            adam.step()
            losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        curves.append(losses)
    return np.array(curves), np.array(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per minibatch")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    args = parser.parse_args(argv)

    codes = encode(TEXT)
    data = windows(codes)
    sequences = len(data["ids"]) // CONTEXT
    rng = np.random.default_rng(args.seed)
    start_params = init_params(rng)
    orders = row_orders(rng, sequences, args.epochs)
    entropy = unigram_entropy(codes)
    print(f"argparse's docstrings: {len(TEXT)} chars, {VOCAB} distinct, {sequences} sequences of {CONTEXT}; "
          f"{BLOCKS} pre-norm blocks, d={D}, {HEADS} heads; Adam lr={args.lr}, {args.batch_size} sequences "
          f"a step, {args.epochs} epochs")

    params = {k: v.copy() for k, v in start_params.items()}
    mod, curves, seconds = train_symbackprop(params, data, orders, args.batch_size, args.lr)
    before = mod.forward(**data, **start_params)["loss"]
    after = mod.forward(**data, **params)["loss"]
    print(f"symbackprop: loss {before:.3f} -> {after:.3f} nats a char (the unigram entropy: {entropy:.3f})")
    columns = [("symbackprop train_epoch", seconds)]
    try:
        import torch
    except ImportError:
        torch = None
        print("PyTorch is not installed: no comparison")
    if torch is not None and not args.no_torch:
        torch.set_num_threads(1)
        torch_curves, torch_seconds = train_torch(start_params, data, orders, args.batch_size, args.lr)
        difference = float(np.abs(torch_curves - curves).max())
        print(f"PyTorch {torch.__version__} eager (1 thread): last step's loss {torch_curves[-1, -1]:.3f} "
              f"(symbackprop's {curves[-1, -1]:.3f}); largest "
              f"loss difference {difference:.2e} over {curves.size} steps")
        columns.append((f"PyTorch {torch.__version__} eager", torch_seconds))
    print("median time per epoch: " + " | ".join(f"{name} {np.median(s) * 1e3:.0f} ms" for name, s in columns))
    return 0 if after < 0.8 * entropy else 1


if __name__ == "__main__":
    sys.exit(main())
