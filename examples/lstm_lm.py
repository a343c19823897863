"""A character language model: an LSTM run over a whole text with
symbackprop.scan, a C loop over the characters (never unrolled), trained to
predict each next character.

    X[t] (one-hot of character t) -> lstm_cell (hidden 16) -> h_t V + c -> logits[t]
    loss: softmax cross-entropy of logits[t] against character t + 1, mean over t

The text's length T is a symbolic dimension, bound at call time: the same
compiled module takes 48 characters or 100 000. The backward pass keeps
every 32nd state only (`checkpoint_every=32`) and recomputes the others,
one segment of 32 steps at a time. `python examples/lstm_lm.py` trains it
on this file's text (a few thousand characters) and prints the loss in bits
per character, then a greedy continuation of a prompt.
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

TEXT = (
    "the quick brown fox jumps over the lazy dog. a backprop compiler differentiates a model "
    "declared in sympy, removes common subexpressions and writes readable c. a recurrence is "
    "a loop: the state of each step is a function of the state before it and of the next "
    "character of the text, and the gradient runs the same loop backwards over the states the "
    "forward pass kept. "
)
CHARS = sorted(set(TEXT))
VOCAB, HIDDEN, CHECKPOINT = len(CHARS), 16, 32
GATES = ("i", "f", "g", "o")  # input, forget, cell, output

T = sp.Symbol("T", integer=True, positive=True)  # characters read
X = sp.MatrixSymbol("X", T, VOCAB)  # one-hot: character t
Y = sp.MatrixSymbol("Y", T, VOCAB)  # one-hot: character t + 1
W = [sp.MatrixSymbol(f"W_{g}", VOCAB, HIDDEN) for g in GATES]
U = [sp.MatrixSymbol(f"U_{g}", HIDDEN, HIDDEN) for g in GATES]
b = [sp.MatrixSymbol(f"b_{g}", 1, HIDDEN) for g in GATES]
V = sp.MatrixSymbol("V", HIDDEN, VOCAB)
c = sp.MatrixSymbol("c", 1, VOCAB)

# one step: the state (h, cell) and one row x of X stand for step t's values
h, cell, x = sp.MatrixSymbol("h", 1, HIDDEN), sp.MatrixSymbol("cell", 1, HIDDEN), sp.MatrixSymbol("x", 1, VOCAB)
h_next, cell_next = nn.lstm_cell(x, h, cell, W, U, b)
zero = sp.ZeroMatrix(1, HIDDEN)
logits = sbp.scan((h_next, cell_next), h_next * V + c, (h, cell), x, (zero, zero), X,
                  checkpoint_every=CHECKPOINT)  # T x VOCAB

model = sbp.Model(
    "lstm_lm",
    inputs=[X, Y],
    params=[*W, *U, *b, V, c],
    loss=nn.softmax_cross_entropy(logits, Y),
    outputs={"logits": logits},
)


def one_hot(text: str) -> np.ndarray:
    return np.eye(VOCAB)[[CHARS.index(ch) for ch in text]]


def text_data(text: str) -> dict:
    """The model's inputs for a text: each character but the last, and the next one."""
    codes = one_hot(text)
    return {"X": np.ascontiguousarray(codes[:-1]), "Y": np.ascontiguousarray(codes[1:])}


def init_params(rng: np.random.Generator) -> dict:
    """PyTorch's default for LSTMCell and Linear: U(-1/sqrt(hidden), 1/sqrt(hidden))."""
    bound = 1.0 / np.sqrt(HIDDEN)
    params = {}
    for g in GATES:
        params[f"W_{g}"] = rng.uniform(-bound, bound, (VOCAB, HIDDEN))
        params[f"U_{g}"] = rng.uniform(-bound, bound, (HIDDEN, HIDDEN))
        params[f"b_{g}"] = rng.uniform(-bound, bound, (1, HIDDEN))
    params["V"] = rng.uniform(-bound, bound, (HIDDEN, VOCAB))
    params["c"] = rng.uniform(-bound, bound, (1, VOCAB))
    return params


def sample_data(rng: np.random.Generator, length: int = 48) -> dict:
    """A piece of the text and parameters from U(-1, 1): a random point,
    with gradients well above the noise of finite differences."""
    start = int(rng.integers(0, len(TEXT) - length - 1))
    params = {name: 4 * value for name, value in init_params(rng).items()}
    return {**text_data(TEXT[start:start + length + 1]), **params}


def continue_text(mod, params: dict, prompt: str, count: int) -> str:
    """Greedy decoding: the most likely next character, one at a time (each
    call runs the loop over the whole text so far)."""
    text = prompt
    for _ in range(count):
        data = text_data(text + text[-1])  # Y is not used by the logits
        text += CHARS[int(np.argmax(mod.forward(**data, **params)["logits"][-1]))]
    return text


def main(steps: int = 300, lr: float = 1e-2, seed: int = 0) -> float:
    import time

    from symbackprop.optim import Adam

    rng = np.random.default_rng(seed)
    data = text_data(TEXT * 8)  # 8 passes over the text in one sequence: T = 8 len(TEXT) - 1
    params = init_params(rng)
    start = time.perf_counter()
    mod = sbp.compile(model, optimizer=Adam(lr=lr))
    _ = mod.trainer  # builds train_step now, not in the first step
    print(f"compiled in {time.perf_counter() - start:.1f} s; T = {len(data['X'])} characters; "
          f"memory for backward: {mod.memory(T=len(data['X']))['kept_for_backward'] / 1e3:.0f} kB")
    bits = np.log2(np.e)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        loss = mod.train_step(**data, **params)  # forward, backward over all T steps, Adam: one C call
        if step == 1 or step % 50 == 0:
            print(f"step {step:4d}: {loss * bits:.3f} bits/char ({(time.perf_counter() - start) * 1e3:.1f} ms)")
    print(repr(continue_text(mod, params, "the quick", 40)))
    return float(loss)


if __name__ == "__main__":
    main()
