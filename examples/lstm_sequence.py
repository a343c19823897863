"""A recurrent model: an LSTM read over a sequence of 8 numbers, unrolled,
that learns whether the sequence's sum is positive.

    x1 ... x8 (batch x 1 each) -> lstm_cell x 8 (hidden 8) -> linear(1) -> logit
    loss: binary cross-entropy with logits against the label (sum > 0)

The batch size n is symbolic. `python examples/lstm_sequence.py` generates
the task's data, trains the model (one train_epoch call an epoch) and
prints the loss and the accuracy on held-out sequences.
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

STEPS, HIDDEN = 8, 8
GATES = ("i", "f", "g", "o")  # input, forget, cell, output

n = sp.Symbol("n", integer=True, positive=True)
xs = [sp.MatrixSymbol(f"x{t}", n, 1) for t in range(1, STEPS + 1)]
y = sp.MatrixSymbol("y", n, 1)  # 1 where the sum is positive, else 0
W = [sp.MatrixSymbol(f"W_{g}", 1, HIDDEN) for g in GATES]
U = [sp.MatrixSymbol(f"U_{g}", HIDDEN, HIDDEN) for g in GATES]
b = [sp.MatrixSymbol(f"b_{g}", 1, HIDDEN) for g in GATES]
V = sp.MatrixSymbol("V", HIDDEN, 1)
c0 = sp.MatrixSymbol("c0", 1, 1)

h = c = None  # the zero state
for x in xs:
    h, c = nn.lstm_cell(x, h, c, W, U, b)
# nn.shallow: helpers applied to the unrolled state must not re-simplify it
logit = nn.shallow(nn.linear, h, V, c0)

model = sbp.Model(
    "lstm_sequence",
    inputs=[*xs, y],
    params=[*W, *U, *b, V, c0],
    loss=nn.shallow(nn.binary_cross_entropy_with_logits, logit, y),
    outputs={"logit": logit},
)


def init_params(rng: np.random.Generator) -> dict:
    """PyTorch's default for LSTMCell and Linear: U(-1/sqrt(hidden), 1/sqrt(hidden))."""
    bound = 1.0 / np.sqrt(HIDDEN)
    params = {}
    for g in GATES:
        params[f"W_{g}"] = rng.uniform(-bound, bound, (1, HIDDEN))
        params[f"U_{g}"] = rng.uniform(-bound, bound, (HIDDEN, HIDDEN))
        params[f"b_{g}"] = rng.uniform(-bound, bound, (1, HIDDEN))
    params["V"] = rng.uniform(-bound, bound, (HIDDEN, 1))
    params["c0"] = rng.uniform(-bound, bound, (1, 1))
    return params


def make_task(rng: np.random.Generator, count: int) -> dict:
    """`count` sequences of 8 numbers from N(0, 1) and their labels, as the
    model's inputs x1 ... x8 and y."""
    seq = rng.standard_normal((count, STEPS))
    data = {f"x{t + 1}": np.ascontiguousarray(seq[:, t:t + 1]) for t in range(STEPS)}
    data["y"] = (seq.sum(axis=1, keepdims=True) > 0).astype(np.float64)
    return data


def sample_data(rng: np.random.Generator, batch: int = 8) -> dict:
    return {**make_task(rng, batch), **init_params(rng)}


def accuracy(mod, params: dict, data: dict) -> float:
    logits = mod.forward(**data, **params)["logit"]
    return float(np.mean((logits > 0) == (data["y"] > 0.5)))


def main(epochs: int = 30, batch_size: int = 32, lr: float = 1e-2, seed: int = 0) -> float:
    import time

    from symbackprop.optim import Adam

    rng = np.random.default_rng(seed)
    train, test = make_task(rng, 2048), make_task(rng, 512)
    params = init_params(rng)
    start = time.perf_counter()
    mod = sbp.compile(model, optimizer=Adam(lr=lr))
    _ = mod.trainer  # builds train_step and train_epoch now, not in the first epoch
    print(f"compiled in {time.perf_counter() - start:.1f} s")
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        losses = mod.train_epoch(batch_size, rng.permutation(2048), **train, **params)
        seconds = time.perf_counter() - start
        if epoch == 1 or epoch % 5 == 0:
            print(f"epoch {epoch:3d}: loss {losses.mean():.4f}, test accuracy {accuracy(mod, params, test):.2%} "
                  f"({seconds * 1e3:.1f} ms)")
    return accuracy(mod, params, test)


if __name__ == "__main__":
    main()
