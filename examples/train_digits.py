"""Train the digits classifier of examples/digits_mlp.py end to end.

    python examples/train_digits.py [--epochs 20] [--batch-size 32] [--lr 0.003]

needs scikit-learn (pip install -e '.[examples]'). Each epoch is one C call
(`train_epoch`) over the training set in a fresh random order; the script
prints the loss per epoch with a progress bar, the test accuracy, and the
median time per epoch. When PyTorch is installed it trains the same model
from the same initialization in the same data order (float64, torch.optim.Adam)
and prints both loss curves' largest difference and both timings side by
side, with a Python loop of `train_step` calls as a third column.

This file defines no Model, so `symbackprop build` skips it; nothing runs
at import.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np


def load_model_file():
    """examples/digits_mlp.py, imported by path (examples/ is no package)."""
    path = Path(__file__).resolve().parent / "digits_mlp.py"
    spec = importlib.util.spec_from_file_location("digits_mlp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup(seed: int = 0, epochs: int = 20) -> dict:
    """The data, the initial parameters and one row order per epoch, all
    from `seed`: what both trainers start from."""
    digits = load_model_file()
    data = digits.load_data(seed)
    rng = np.random.default_rng(seed + 1)
    params = digits.init_params(rng)
    rows = len(data["y_train"])
    orders = [rng.permutation(rows) for _ in range(epochs)]
    return {"digits": digits, "data": data, "params": params, "orders": orders}


def train_symbackprop(setup_: dict, batch_size: int, lr: float, mode: str = "epoch", epochs: int | None = None):
    """Train with symbackprop: mode "epoch" (one train_epoch call an epoch)
    or "step" (a Python loop of train_step calls). Returns the trained
    parameters, the losses of every minibatch (one row an epoch) and the
    seconds each epoch took."""
    import symbackprop as sbp
    from symbackprop.optim import Adam

    digits, data = setup_["digits"], setup_["data"]
    orders = setup_["orders"][:epochs]
    mod = sbp.compile(digits.model, optimizer=Adam(lr=lr))
    _ = mod.trainer  # builds (or loads) train_step and train_epoch now, not in the first epoch
    params = {k: v.copy() for k, v in setup_["params"].items()}
    X, T = data["X_train"], digits.one_hot(data["y_train"])
    curves, seconds = [], []
    for order in orders:
        start = time.perf_counter()
        if mode == "epoch":
            losses = mod.train_epoch(batch_size, order, X=X, T=T, **params)
        else:
            losses = np.array([
                mod.train_step(X=X[rows], T=T[rows], **params)
                for rows in (order[s:s + batch_size] for s in range(0, len(order), batch_size))
            ])
        seconds.append(time.perf_counter() - start)
        curves.append(losses)
    return mod, params, np.array(curves), np.array(seconds)


def accuracy(mod, params: dict, X: np.ndarray, labels: np.ndarray, classes: int) -> float:
    logits = mod.forward(X=X, T=np.zeros((len(X), classes)), **params)["logits"]
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def train_torch(setup_: dict, batch_size: int, lr: float, epochs: int | None = None):
    """The same model in PyTorch (float64): the same initial parameters, the
    same minibatches in the same order, torch.optim.Adam. Returns the losses
    of every minibatch (one row an epoch), the seconds of each epoch and the
    trained parameters in symbackprop's layout."""
    import torch

    digits, data = setup_["digits"], setup_["data"]
    p = setup_["params"]
    model = torch.nn.Sequential(
        torch.nn.Linear(digits.PIXELS, digits.HIDDEN), torch.nn.Tanh(), torch.nn.Linear(digits.HIDDEN, digits.CLASSES)
    ).double()
    with torch.no_grad():  # symbackprop's W is (in, out); torch's weight is (out, in)
        model[0].weight.copy_(torch.from_numpy(p["W1"].T.copy()))
        model[0].bias.copy_(torch.from_numpy(p["b1"][0]))
        model[2].weight.copy_(torch.from_numpy(p["W2"].T.copy()))
        model[2].bias.copy_(torch.from_numpy(p["b2"][0]))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    X = torch.from_numpy(data["X_train"])
    y = torch.from_numpy(data["y_train"])
    curves, seconds = [], []
    for order in setup_["orders"][:epochs]:
        index = torch.from_numpy(order)
        start = time.perf_counter()
        losses = []
        for s in range(0, len(order), batch_size):  # DataLoader(shuffle, drop_last=False) batches
            rows = index[s:s + batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(X[rows]), y[rows])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        curves.append(losses)
    trained = {
        "W1": model[0].weight.detach().numpy().T.copy(), "b1": model[0].bias.detach().numpy()[None, :].copy(),
        "W2": model[2].weight.detach().numpy().T.copy(), "b2": model[2].bias.detach().numpy()[None, :].copy(),
    }
    return np.array(curves), np.array(seconds), trained


def progress(done: int, total: int, width: int = 24) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--torch-threads", type=int, default=None, help="PyTorch's threads (default: its own choice)")
    args = parser.parse_args(argv)

    s = setup(args.seed, args.epochs)
    digits, data = s["digits"], s["data"]
    print(f"digits: {len(data['y_train'])} training and {len(data['y_test'])} test images of 8x8 pixels; "
          f"MLP 64 -> {digits.HIDDEN} (tanh) -> 10; Adam lr={args.lr}, batch size {args.batch_size}")
    start = time.perf_counter()
    mod, params, curves, seconds = train_symbackprop(s, args.batch_size, args.lr, "epoch")
    total = time.perf_counter() - start
    for epoch, (losses, sec) in enumerate(zip(curves, seconds), 1):
        print(f"epoch {epoch:3d}/{args.epochs} {progress(epoch, args.epochs)} "
              f"loss {losses.mean():.5f}  {sec * 1e3:7.3f} ms", flush=True)
    acc = accuracy(mod, params, data["X_test"], data["y_test"], digits.CLASSES)
    train_acc = accuracy(mod, params, data["X_train"], data["y_train"], digits.CLASSES)
    print(f"accuracy: test {acc:.2%}, train {train_acc:.2%} (total {total:.2f} s with compiling or loading)")

    _, _, step_curves, step_seconds = train_symbackprop(s, args.batch_size, args.lr, "step")
    assert np.array_equal(step_curves, curves), "train_epoch and train_step calls differ"
    columns = [("symbackprop train_epoch", seconds), ("symbackprop train_step loop", step_seconds)]
    try:
        import torch
    except ImportError:
        torch = None
        print("PyTorch is not installed: no comparison")
    if torch is not None and not args.no_torch:
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        torch_curves, torch_seconds, torch_params = train_torch(s, args.batch_size, args.lr)
        difference = float(np.abs(torch_curves - curves).max())
        torch_acc = accuracy(mod, torch_params, data["X_test"], data["y_test"], digits.CLASSES)
        print(f"PyTorch {torch.__version__} ({torch.get_num_threads()} threads), same start and data order: "
              f"largest loss difference {difference:.2e} over {curves.size} steps; test accuracy {torch_acc:.2%}")
        columns.append((f"PyTorch {torch.__version__}", torch_seconds))
    print("median time per epoch: " + " | ".join(f"{name} {np.median(sec) * 1e3:.3f} ms" for name, sec in columns))
    return 0 if acc >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
