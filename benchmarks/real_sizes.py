"""LeNet-5 on 28x28 images at batch 64: a training step and inference,
symbackprop beside PyTorch eager (and torch.compile), one thread.

    python benchmarks/real_sizes.py                        # float32 and float64, 15 rounds
    python benchmarks/real_sizes.py --dtype float32 --rounds 9 --peers symbackprop,torch_eager
    python benchmarks/real_sizes.py --layers               # each convolution's kernels alone
    python benchmarks/real_sizes.py --save real-sizes-2026-12-06

The model (padding 2 on the first convolution, as LeNet-5 on MNIST):

    1 x 28 x 28 -> conv 5x5 (6, padding 2) -> relu -> max pool 2 -> 6 x 14 x 14
                -> conv 5x5 (16) -> relu -> max pool 2 -> 16 x 5 x 5
                -> flatten (400) -> linear(120) -> relu -> linear(84) -> relu -> linear(10)
                -> softmax cross-entropy

What is timed: a training step with Adam (symbackprop's `train_step`, one C
call; PyTorch's zero_grad, forward, backward and `torch.optim.Adam.step`),
and inference (symbackprop's `forward`, the loss and logits; PyTorch's
forward under no_grad). Every peer runs in this process, pinned to one CPU
with one thread (`os.sched_setaffinity`, `torch.set_num_threads(1)`,
`sbp.set_num_threads(1)`); after a warm-up, each round runs `--calls` calls
of each peer in turn, and each peer's round median is kept. Printed and
saved: the median of the round medians, and each peer's ratio to
symbackprop's, round by round (its median and range). Before timing, the
loss and every gradient are checked once against PyTorch float64 autograd
from the same parameters.

`--layers` times each convolution's three kernels (forward, the gradient
by the images, the gradient by the weights) as small models of their own:
forward() of sum(conv(X, K) * G), then value_and_grad by K (adds the
weight gradient), then by X too (adds the input gradient); the
differences are the kernels' times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
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


def torch_peers(inputs: dict, params: dict, dtype: str, compiled: bool) -> dict:
    """{peer: (train step, inference)} as calls of no arguments."""
    import torch

    out = {}
    x = torch.from_numpy(inputs["X"]).reshape(-1, 1, SIDE, SIDE)
    labels = torch.from_numpy(np.argmax(inputs["T"], axis=1))
    for peer in ("torch_eager", "torch_compile") if compiled else ("torch_eager",):
        net = torch_net(params, getattr(torch, dtype))
        adam = torch.optim.Adam(net.parameters(), lr=LR)
        forward = torch.compile(net) if peer == "torch_compile" else net

        def step(forward=forward, adam=adam):
            adam.zero_grad()
            loss = torch.nn.functional.cross_entropy(forward(x), labels)
            loss.backward()
            adam.step()
            return loss

        def infer(forward=forward):
            with torch.no_grad():
                return forward(x)

        out[peer] = (step, infer)
    return out


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


def interleave(calls: dict, rounds: int, per_round: int, warmup: int = 3) -> dict:
    """{label: (median of round medians, (ratio median, low, high) to the first label)}."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    medians: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            times = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            medians[label].append(statistics.median(times))
    base = medians[next(iter(calls))]
    out = {}
    for label, m in medians.items():
        ratios = [a / b for a, b in zip(m, base)]
        out[label] = (statistics.median(m), (statistics.median(ratios), min(ratios), max(ratios)))
    return out


def pin_one_thread() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sbp.set_num_threads(1)
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass


def run_dtype(dtype: str, peers: list[str], rounds: int, per_round: int) -> list[dict]:
    """The rows of one dtype: the training step, then inference."""
    inputs, params = make_data(dtype)
    model = lenet5()
    mod = sbp.compile(model, dtype=dtype, optimizer=sbp.Adam(lr=LR))
    sbp_params = {k: v.copy() for k, v in params.items()}
    step_calls = {"symbackprop": lambda: mod.train_step(**inputs, **sbp_params)}
    infer_calls = {"symbackprop": lambda: mod.forward(**inputs, **params)}
    wanted = [p for p in peers if p.startswith("torch")]
    if wanted:
        for peer, (step, infer) in torch_peers(inputs, params, dtype, "torch_compile" in wanted).items():
            if peer in wanted:
                step_calls[peer], infer_calls[peer] = step, infer
    rows = []
    for what, calls in (("training step (Adam)", step_calls), ("inference", infer_calls)):
        result = interleave(calls, rounds, per_round)
        row = {"label": f"LeNet-5 {dtype}, {what}", "seconds": {k: v[0] for k, v in result.items()},
               "ratios": {k: [round(r, 3) for r in v[1]] for k, v in result.items() if k != "symbackprop"}}
        rows.append(row)
        print(f"{row['label']}:")
        for label, (seconds, (ratio, low, high)) in result.items():
            print(f"  {label:14} {seconds * 1e3:8.3f} ms   ratio to symbackprop {ratio:5.2f} ({low:.2f}-{high:.2f})")
    return rows


# --- one convolution's kernels alone (--layers) ------------------------------------------


def layer_models(c_in: int, side: int, c_out: int, k: int, pad: int) -> dict:
    """sum(conv(X, K) * G) as three models: forward only, by K, by K and X."""
    n = sp.Symbol("n", integer=True, positive=True)
    x = sbp.images("X", n, c_in, side, side)
    w = sbp.conv_weight("K", c_out, c_in, k)
    y = nn.conv2d(x, w, padding=pad)
    g = sp.MatrixSymbol("G", n, y.matrix.shape[1])
    loss = nn.sum_all(sp.HadamardProduct(y.matrix, g))
    name = f"conv{c_in}x{side}to{c_out}k{k}p{pad}"
    return {"by_k": sbp.Model(name + "_k", inputs=[x.matrix, g], params=[w], loss=loss),
            "by_kx": sbp.Model(name + "_kx", inputs=[x.matrix, g], params=[w], loss=loss, grad_inputs=[x.matrix])}


def time_layers(dtype: str, rounds: int, per_round: int) -> None:
    rng = np.random.default_rng(0)
    side = SIDE
    for name, c_out, c_in, k, pad in LAYERS:
        models = layer_models(c_in, side, c_out, k, pad)
        out_side = side + 2 * pad - k + 1
        arrays = {"X": rng.random((BATCH, c_in * side * side)).astype(dtype),
                  "G": rng.standard_normal((BATCH, c_out * out_side ** 2)).astype(dtype),
                  "K": rng.standard_normal((c_out, c_in * k * k)).astype(dtype)}
        by_k = sbp.compile(models["by_k"], dtype=dtype)
        by_kx = sbp.compile(models["by_kx"], dtype=dtype)
        calls = {"forward": by_k.prepare("forward", **arrays), "by_K": by_k.prepare("value_and_grad", **arrays),
                 "by_K_X": by_kx.prepare("value_and_grad", **arrays)}
        result = interleave(calls, rounds, per_round)
        fwd, wk, wkx = (result[label][0] for label in calls)
        print(f"{name} {dtype} ({c_in}x{side}x{side} -> {c_out}, {k}x{k}, padding {pad}): forward {fwd * 1e3:.3f} ms, "
              f"weight gradient {(wk - fwd) * 1e3:.3f} ms, input gradient {(wkx - wk) * 1e3:.3f} ms")
        side = out_side // 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32,float64")
    p.add_argument("--peers", default="symbackprop,torch_eager,torch_compile")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10, help="calls of each peer per round")
    p.add_argument("--layers", action="store_true", help="time each convolution's kernels alone")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    pin_one_thread()
    dtypes = args.dtype.split(",")
    if args.layers:
        for dtype in dtypes:
            time_layers(dtype, args.rounds, args.calls)
        return 0
    peers = args.peers.split(",")
    if any(p.startswith("torch") for p in peers):
        inputs, params = make_data("float64")
        error = check(sbp.compile(lenet5()), inputs, params)
        print(f"float64 loss and gradients against PyTorch float64 autograd: largest relative error {error:.2e}")
        if error > 1e-10:
            print("they disagree: not timing", file=sys.stderr)
            return 1
    rows = [row for dtype in dtypes for row in run_dtype(dtype, peers, args.rounds, args.calls)]
    if args.save:
        from benchmarks import tables

        labels = {"symbackprop": "symbackprop", "torch_eager": "PyTorch eager", "torch_compile": "torch.compile"}
        shown = [p for p in labels if p in peers]
        data = {
            "title": "LeNet-5 on 28x28 images, batch 64: a training step with Adam, and inference",
            **tables.provenance(),
            "command": "python benchmarks/real_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "conditions": "every peer in one process pinned to one CPU, one thread; rounds of calls of each "
                          "peer in turn; median of the round medians; the ratio is the median of the per-round "
                          "ratios (peer over symbackprop) and their range",
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
