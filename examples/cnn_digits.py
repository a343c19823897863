"""A LeNet-style convolutional classifier of scikit-learn's 8x8 digits
(bundled with scikit-learn, no download):

    1 x 8 x 8 -> conv 3x3 (16 channels, padding 1) -> relu -> max pool 2 -> 16 x 4 x 4
              -> conv 3x3 (32 channels, padding 1) -> relu -> max pool 2 -> 32 x 2 x 2
              -> flatten (128) -> linear(64) -> relu -> linear(10) -> softmax cross-entropy

A batch of images is a matrix, one row per example, its pixels in NCHW
order (docs/conv.md); the batch size n is bound at call time.

    python examples/cnn_digits.py [--epochs 10] [--batch-size 32] [--lr 0.005]

trains it with `train_epoch` (one C call an epoch), prints the test
accuracy and the time per epoch, and, when PyTorch is installed, trains the
same network from the same initialization in the same data order (float64,
torch.optim.Adam, the same cosine decay of the learning rate over the
epochs, both on one thread) and prints its times beside and the two loss
curves' largest difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

SIDE, CLASSES = 8, 10
C1, C2, HIDDEN = 16, 32, 64

n = sp.Symbol("n", integer=True, positive=True)
X = sbp.images("X", n, 1, SIDE, SIDE)
T = sp.MatrixSymbol("T", n, CLASSES)
K1, c1 = sbp.conv_weight("K1", C1, 1, 3), sp.MatrixSymbol("c1", 1, C1)
K2, c2 = sbp.conv_weight("K2", C2, C1, 3), sp.MatrixSymbol("c2", 1, C2)
FLAT = C2 * (SIDE // 4) ** 2
W1, b1 = sp.MatrixSymbol("W1", FLAT, HIDDEN), sp.MatrixSymbol("b1", 1, HIDDEN)
W2, b2 = sp.MatrixSymbol("W2", HIDDEN, CLASSES), sp.MatrixSymbol("b2", 1, CLASSES)

h = nn.max_pool2d(nn.conv2d(X, K1, c1, padding=1).map(nn.relu), 2)   # 16 x 4 x 4
h = nn.max_pool2d(nn.conv2d(h, K2, c2, padding=1).map(nn.relu), 2)   # 32 x 2 x 2
Z = nn.linear(nn.relu(nn.linear(nn.flatten(h), W1, b1)), W2, b2)

model = sbp.Model("cnn_digits", inputs=[X, T], params=[K1, c1, K2, c2, W1, b1, W2, b2],
                  loss=nn.softmax_cross_entropy(Z, T), outputs={"logits": Z})
optimizer = sbp.Adam(lr=5e-3)

# (name, shape in symbackprop, fan_in); a conv's weights are PyTorch's (C_out, C_in, 3, 3) as C_out x (C_in*9)
SHAPES = [("K1", (C1, 9), 9), ("c1", (1, C1), 9), ("K2", (C2, C1 * 9), C1 * 9), ("c2", (1, C2), C1 * 9),
          ("W1", (FLAT, HIDDEN), FLAT), ("b1", (1, HIDDEN), FLAT), ("W2", (HIDDEN, CLASSES), HIDDEN),
          ("b2", (1, CLASSES), HIDDEN)]


def init_params(rng: np.random.Generator) -> dict:
    """PyTorch's default for Conv2d and Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return {name: rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in) for name, shape, fan_in in SHAPES}


def one_hot(labels: np.ndarray) -> np.ndarray:
    return np.eye(CLASSES)[labels]


def sample_data(rng: np.random.Generator, batch: int = 5) -> dict:
    """Random images (pixels in [0, 1] as in load_data) and labels."""
    return {"X": rng.random((batch, SIDE * SIDE)), "T": one_hot(rng.integers(0, CLASSES, size=batch)),
            **init_params(rng)}


def load_data(seed: int = 0) -> dict:
    """The digits, split as examples/digits_mlp.py splits them (needs scikit-learn)."""
    path = Path(__file__).resolve().parent / "digits_mlp.py"
    spec = importlib.util.spec_from_file_location("digits_mlp", path)
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    return digits.load_data(seed)


# --- training (python examples/cnn_digits.py) ----------------------------------


def learning_rate(lr: float, epoch: int, epochs: int) -> float:
    """A cosine decay over the epochs (per epoch, the same in both trainers)."""
    return lr * 0.5 * (1 + np.cos(np.pi * epoch / epochs))


def train_symbackprop(params: dict, data: dict, orders: list, batch_size: int, lr: float):
    """One train_epoch call an epoch; the module single-threaded (no OpenMP,
    no BLAS threads). Returns the module, the minibatch losses (a row an
    epoch) and the seconds of each epoch."""
    sbp.set_num_threads(1)  # the linear layers' products, when BLAS is installed
    mod = sbp.compile(model, optimizer=sbp.Adam(lr=lr))
    _ = mod.trainer  # builds (or loads) train_epoch now, not in the first epoch
    x, t = data["X_train"], one_hot(data["y_train"])
    curves, seconds = [], []
    for epoch, order in enumerate(orders):
        mod.trainer.hyperparameters["lr"] = learning_rate(lr, epoch, len(orders))
        start = time.perf_counter()
        curves.append(mod.train_epoch(batch_size, order, X=x, T=t, **params))
        seconds.append(time.perf_counter() - start)
    return mod, np.array(curves), np.array(seconds)


def torch_model(params: dict):
    """The same network in PyTorch (float64), from the same parameters."""
    import torch

    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, C1, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(C1, C2, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(FLAT, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES),
    ).double()
    with torch.no_grad():
        for layer, (w, b) in zip((net[0], net[3], net[7], net[9]), (("K1", "c1"), ("K2", "c2"), ("W1", "b1"), ("W2", "b2"))):
            weight = params[w].T if w.startswith("W") else params[w].reshape(layer.weight.shape)  # Linear: (out, in)
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
            layer.bias.copy_(torch.from_numpy(params[b][0]))
    return net


def train_torch(params: dict, data: dict, orders: list, batch_size: int, lr: float):
    """PyTorch eager, the same minibatches in the same order, torch.optim.Adam."""
    import torch

    net = torch_model(params)
    adam = torch.optim.Adam(net.parameters(), lr=lr)
    x = torch.from_numpy(data["X_train"]).reshape(-1, 1, SIDE, SIDE)
    y = torch.from_numpy(data["y_train"])
    curves, seconds = [], []
    for epoch, order in enumerate(orders):
        adam.param_groups[0]["lr"] = learning_rate(lr, epoch, len(orders))
        index = torch.from_numpy(order)
        start = time.perf_counter()
        losses = []
        for s in range(0, len(order), batch_size):
            rows = index[s:s + batch_size]
            adam.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[rows]), y[rows])
            loss.backward()
            adam.step()
            losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        curves.append(losses)
    return net, np.array(curves), np.array(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    start_params = init_params(rng)
    orders = [rng.permutation(len(data["y_train"])) for _ in range(args.epochs)]
    print(f"digits: {len(data['y_train'])} training and {len(data['y_test'])} test images of 8x8; LeNet-style CNN; "
          f"Adam lr={args.lr}, batch size {args.batch_size}, {args.epochs} epochs")

    params = {k: v.copy() for k, v in start_params.items()}
    mod, curves, seconds = train_symbackprop(params, data, orders, args.batch_size, args.lr)
    logits = mod.forward(X=data["X_test"], T=np.zeros((len(data["X_test"]), CLASSES)), **params)["logits"]
    acc = float(np.mean(np.argmax(logits, axis=1) == data["y_test"]))
    print(f"symbackprop: final epoch's mean loss {curves[-1].mean():.4f}, test accuracy {acc:.2%}")
    columns = [("symbackprop train_epoch", seconds)]
    try:
        import torch
    except ImportError:
        torch = None
        print("PyTorch is not installed: no comparison")
    if torch is not None and not args.no_torch:
        torch.set_num_threads(1)
        net, torch_curves, torch_seconds = train_torch(start_params, data, orders, args.batch_size, args.lr)
        with torch.no_grad():
            out = net(torch.from_numpy(data["X_test"]).reshape(-1, 1, SIDE, SIDE)).numpy()
        torch_acc = float(np.mean(np.argmax(out, axis=1) == data["y_test"]))
        difference = float(np.abs(torch_curves - curves).max())
        print(f"PyTorch {torch.__version__} eager (1 thread): test accuracy {torch_acc:.2%}; largest loss "
              f"difference {difference:.2e} over {curves.size} steps")
        columns.append((f"PyTorch {torch.__version__} eager", torch_seconds))
    print("median time per epoch: " + " | ".join(f"{name} {np.median(s) * 1e3:.2f} ms" for name, s in columns))
    return 0 if acc >= 0.98 else 1


if __name__ == "__main__":
    sys.exit(main())
