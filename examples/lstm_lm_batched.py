"""A character language model trained on minibatches of sequences: the
LSTM of examples/lstm_lm.py run by one batched scan (`batch=BATCH`) over
BATCH windows of WINDOW characters at once, each step a matrix product per
gate (BATCH x VOCAB times VOCAB x HIDDEN) rather than BATCH separate scans.

    X[t*B + s] (one-hot of character t of window s) -> lstm_cell -> h V + c -> logits[t*B + s]
    loss: softmax cross-entropy against the next character, mean over the minibatch

A minibatch is WINDOW * BATCH rows, time-major (step t of the BATCH
windows is rows t*BATCH .. t*BATCH+BATCH-1): `train_epoch(WINDOW * BATCH)`
slices the epoch's data into minibatches in one C call. The window length
T = rows / BATCH is bound at call time.

    python examples/lstm_lm_batched.py [--epochs 20] [--hidden 64] [--no-torch]

prints each epoch's time and mean loss beside PyTorch's nn.LSTM (float64,
the same initialization, data order and Adam, one thread) and the two loss
curves' largest difference, then the time per step of the batched scan
beside the unbatched scan run once per window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lstm_lm import CHARS, GATES, TEXT, VOCAB  # the text and its alphabet

BATCH, WINDOW = 16, 32  # windows a minibatch, characters a window

N = sp.Symbol("N", integer=True, positive=True)  # rows: WINDOW * BATCH in training


def lm_model(hidden: int, batch: int, name: str) -> sbp.Model:
    """The LSTM language model over `batch` sequences a step (batch=1: one
    sequence, the unbatched scan)."""
    X, Y = sp.MatrixSymbol("X", N, VOCAB), sp.MatrixSymbol("Y", N, VOCAB)
    W = [sp.MatrixSymbol(f"W_{g}", VOCAB, hidden) for g in GATES]
    U = [sp.MatrixSymbol(f"U_{g}", hidden, hidden) for g in GATES]
    b = [sp.MatrixSymbol(f"b_{g}", 1, hidden) for g in GATES]
    V, c = sp.MatrixSymbol("V", hidden, VOCAB), sp.MatrixSymbol("c", 1, VOCAB)
    h, cell = sp.MatrixSymbol("h", batch, hidden), sp.MatrixSymbol("cell", batch, hidden)
    x = sp.MatrixSymbol("x", batch, VOCAB)
    h_next, cell_next = nn.lstm_cell(x, h, cell, W, U, b)
    zero = sp.ZeroMatrix(batch, hidden)
    logits = sbp.scan((h_next, cell_next), h_next * V + sp.OneMatrix(batch, 1) * c, (h, cell), x, (zero, zero), X,
                      batch=batch)  # (WINDOW * batch) x VOCAB
    return sbp.Model(name, inputs=[X, Y], params=[*W, *U, *b, V, c], loss=nn.softmax_cross_entropy(logits, Y),
                     outputs={"logits": logits})


def init_params(rng: np.random.Generator, hidden: int) -> dict:
    """PyTorch's default for LSTM and Linear: U(-1/sqrt(hidden), 1/sqrt(hidden))."""
    bound = 1.0 / np.sqrt(hidden)
    params = {}
    for g in GATES:
        params[f"W_{g}"] = rng.uniform(-bound, bound, (VOCAB, hidden))
        params[f"U_{g}"] = rng.uniform(-bound, bound, (hidden, hidden))
        params[f"b_{g}"] = rng.uniform(-bound, bound, (1, hidden))
    params["V"] = rng.uniform(-bound, bound, (hidden, VOCAB))
    params["c"] = rng.uniform(-bound, bound, (1, VOCAB))
    return params


def windows(text: str) -> np.ndarray:
    """Character codes of the text's windows of WINDOW + 1 characters (each
    window's last character is the next one's first), a row each."""
    codes = np.array([CHARS.index(ch) for ch in text])
    count = (len(codes) - 1) // WINDOW
    return np.stack([codes[k * WINDOW:k * WINDOW + WINDOW + 1] for k in range(count)])


def epoch_data(wins: np.ndarray, order: np.ndarray) -> dict:
    """The windows in `order`, whole minibatches of BATCH, each time-major:
    row m*WINDOW*BATCH + t*BATCH + s is character t of window m*BATCH + s."""
    used = order[:len(order) // BATCH * BATCH].reshape(-1, BATCH)  # minibatch m: windows used[m]
    codes = wins[used]  # (minibatches, BATCH, WINDOW + 1)
    steps = codes.transpose(0, 2, 1)  # (minibatches, WINDOW + 1, BATCH): time-major in each minibatch
    eye = np.eye(VOCAB)
    return {"X": np.ascontiguousarray(eye[steps[:, :-1].reshape(-1)]),
            "Y": np.ascontiguousarray(eye[steps[:, 1:].reshape(-1)])}


def train_symbackprop(params: dict, wins: np.ndarray, orders: list, hidden: int, lr: float):
    """One train_epoch call an epoch, one thread."""
    sbp.set_num_threads(1)
    mod = sbp.compile(lm_model(hidden, BATCH, f"lstm_lm_batched_{hidden}"), optimizer=sbp.Adam(lr=lr))
    _ = mod.trainer  # builds train_epoch now, not in the first epoch
    curves, seconds = [], []
    for order in orders:
        data = epoch_data(wins, order)
        start = time.perf_counter()
        curves.append(mod.train_epoch(WINDOW * BATCH, **data, **params))
        seconds.append(time.perf_counter() - start)
    return mod, np.array(curves), np.array(seconds)


def train_torch(params: dict, wins: np.ndarray, orders: list, hidden: int, lr: float):
    """torch.nn.LSTM + Linear, float64 eager, the same minibatches, torch.optim.Adam."""
    import torch

    lstm, head = torch.nn.LSTM(VOCAB, hidden, dtype=torch.float64), torch.nn.Linear(hidden, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.from_numpy(np.concatenate([params[f"W_{g}"].T for g in GATES])))
        lstm.weight_hh_l0.copy_(torch.from_numpy(np.concatenate([params[f"U_{g}"].T for g in GATES])))
        lstm.bias_ih_l0.copy_(torch.from_numpy(np.concatenate([params[f"b_{g}"][0] for g in GATES])))
        lstm.bias_hh_l0.zero_()
        head.weight.copy_(torch.from_numpy(params["V"].T.copy()))
        head.bias.copy_(torch.from_numpy(params["c"][0]))
    lstm.bias_hh_l0.requires_grad_(False)  # one bias a gate, as lstm_cell
    adam = torch.optim.Adam([p for p in (*lstm.parameters(), *head.parameters()) if p.requires_grad], lr=lr)
    curves, seconds = [], []
    for order in orders:
        data = epoch_data(wins, order)
        x = torch.from_numpy(data["X"]).reshape(-1, WINDOW, BATCH, VOCAB)
        y = torch.from_numpy(data["Y"].argmax(axis=1)).reshape(-1, WINDOW * BATCH)
        losses = []
        start = time.perf_counter()
        for m in range(x.shape[0]):
            adam.zero_grad()
            out, _ = lstm(x[m])  # (WINDOW, BATCH, hidden)
            loss = torch.nn.functional.cross_entropy(head(out.reshape(-1, hidden)), y[m])
            loss.backward()
            adam.step()
            losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        curves.append(losses)
    return np.array(curves), np.array(seconds)


def per_step_times(params: dict, wins: np.ndarray, hidden: int, repeats: int = 20) -> tuple[float, float]:
    """Seconds per character of value_and_grad: the batched scan over one
    minibatch, and the unbatched scan once per window of it."""
    batched = sbp.compile(lm_model(hidden, BATCH, f"lstm_lm_batched_{hidden}"))
    single = sbp.compile(lm_model(hidden, 1, f"lstm_lm_single_{hidden}"))
    data = epoch_data(wins, np.arange(BATCH))
    one = [{k: np.ascontiguousarray(v[s::BATCH]) for k, v in data.items()} for s in range(BATCH)]
    timings = []
    for run in (lambda: batched.value_and_grad(**data, **params),
                lambda: [single.value_and_grad(**d, **params) for d in one]):
        run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        timings.append((time.perf_counter() - start) / repeats / (WINDOW * BATCH))
    return timings[0], timings[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    wins = windows(TEXT * 8)
    start_params = init_params(rng, args.hidden)
    orders = [rng.permutation(len(wins)) for _ in range(args.epochs)]
    print(f"{len(wins)} windows of {WINDOW} characters, {BATCH} a minibatch; LSTM hidden {args.hidden}; "
          f"Adam lr={args.lr}; {args.epochs} epochs")
    params = {k: v.copy() for k, v in start_params.items()}
    start = time.perf_counter()
    _, curves, seconds = train_symbackprop(params, wins, orders, args.hidden, args.lr)
    bits = np.log2(np.e)
    print(f"symbackprop (compiled, trained in {time.perf_counter() - start:.1f} s): first epoch "
          f"{curves[0].mean() * bits:.3f}, last {curves[-1].mean() * bits:.3f} bits/char")
    columns = [("symbackprop train_epoch", seconds)]
    try:
        import torch
    except ImportError:
        torch = None
        print("PyTorch is not installed: no comparison")
    if torch is not None and not args.no_torch:
        torch.set_num_threads(1)
        torch_curves, torch_seconds = train_torch(start_params, wins, orders, args.hidden, args.lr)
        print(f"PyTorch {torch.__version__} nn.LSTM eager (1 thread): last epoch {torch_curves[-1].mean() * bits:.3f} "
              f"bits/char; largest loss difference {np.abs(torch_curves - curves).max():.2e} over {curves.size} steps")
        columns.append((f"PyTorch {torch.__version__} eager", torch_seconds))
    print("median time per epoch: " + " | ".join(f"{name} {np.median(s) * 1e3:.2f} ms" for name, s in columns))
    batched, single = per_step_times(start_params, wins, args.hidden)
    print(f"value_and_grad per character: batched scan {batched * 1e6:.2f} us, unbatched scan once per window "
          f"{single * 1e6:.2f} us ({single / batched:.1f}x)")
    return 0 if curves[-1].mean() < 0.8 * curves[0].mean() else 1


if __name__ == "__main__":
    sys.exit(main())
