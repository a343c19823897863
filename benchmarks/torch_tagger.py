"""from_torch's LSTM tagger: the loss and every parameter's gradient, beside PyTorch eager.

    taskset -c 1 python benchmarks/torch_tagger.py --sizes 8x16x32,16x32x64 --rounds 9 --save NAME

The tagger of docs/from_torch.md: nn.Embedding(100, H/2) of token ids ->
nn.LSTM(H/2, H, bidirectional, batch_first) -> nn.Linear(2H, 5) on every
step -> cross-entropy per token, the mean over the n*L tokens, float64.
A size is n x L x H. Peers: the module sbp.from_torch made and sbp.compile
built (`value_and_grad`, and its prepared call), and the same torch
network (loss.backward() after zeroing the gradients). Every peer's loss
and gradients are checked against torch's first (relative error under
1e-10). One process, one thread, CPU time; each round times every peer in
turn (samples of about 2 ms of back-to-back calls), the ratios taken round
by round.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tables  # noqa: E402
from benchmarks.interleave import _load, interleaved_summary, sample_repeats  # noqa: E402

VOCAB, TAGS = 100, 5


def tagger(hidden: int):
    import torch

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, hidden // 2)
            self.lstm = torch.nn.LSTM(hidden // 2, hidden, batch_first=True, bidirectional=True)
            self.tag = torch.nn.Linear(2 * hidden, TAGS)

        def forward(self, tokens):
            out, _ = self.lstm(self.embed(tokens))
            return self.tag(out)

    torch.manual_seed(0)
    return Tagger().double()


def peers(batch: int, length: int, hidden: int) -> tuple[dict, float]:
    """{label: call} returning (loss, [gradients in torch's parameter order]), and the compile's seconds."""
    import torch

    import symbackprop as sbp

    torch.set_num_threads(1)
    net = tagger(hidden)
    gen = torch.Generator().manual_seed(1)
    tokens, tags = torch.randint(0, VOCAB, (batch, length), generator=gen), torch.randint(0, TAGS, (batch, length),
                                                                                         generator=gen)
    started = time.perf_counter()
    model, params = sbp.from_torch(net, tokens, loss="cross_entropy_labels", name=f"bench_tagger_{hidden}")
    mod = sbp.compile(model)
    compile_s = time.perf_counter() - started
    rows = {"X": tokens.T.reshape(-1).numpy().copy(), "T": tags.T.reshape(-1).numpy().copy(),
            "batch": np.arange(batch)}
    keys = [key for key, _ in net.named_parameters()]
    ours = {params.torch_names[name]: name for name in params}

    def in_order(loss, grads):
        return loss, [np.asarray(grads[ours[key]]).reshape(params.torch_shapes[ours[key]]) for key in keys]

    prepared = mod.prepare(**rows, **params)

    def eager():
        net.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(tokens).reshape(-1, TAGS), tags.reshape(-1))
        loss.backward()
        return loss.item(), [p.grad.numpy() for p in net.parameters()]

    calls = {"symbackprop": lambda: in_order(*mod.value_and_grad(**rows, **params)),
             "symbackprop.prepared()": lambda: in_order(*prepared()), "torch_eager": eager}
    want = eager()
    for label, call in calls.items():
        loss, grads = call()
        err = max([abs(loss - want[0]) / abs(want[0])] + [
            float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(grads, want[1])])
        if err > 1e-10:
            raise AssertionError(f"{label} at {batch}x{length}x{hidden}: relative error {err:.2e}")
    return calls, compile_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8x16x32,16x32x64", help="n x L x H, comma-separated")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--conditions", default="")
    p.add_argument("--save", default=None, metavar="NAME")
    args = p.parse_args(argv)
    os.environ["SYMBACKPROP_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_tagger_")  # every compile cold
    load = [_load()]
    rows, columns, compiles = [], [], []
    for size in args.sizes.split(","):
        batch, length, hidden = (int(s) for s in size.split("x"))
        calls, compile_s = peers(batch, length, hidden)
        compiles.append(f"{size} {compile_s:.1f} s")
        for call in calls.values():
            call()
        summary = interleaved_summary(calls, sample_repeats(calls, 0), args.rounds, args.calls)
        columns += [label for label in summary if label not in columns]
        print(f"{size} (compiled in {compile_s:.1f} s):")
        for label, (median, (ratio, low, high)) in summary.items():
            print(f"  {label:24} {median * 1e3:10.3f} ms  ratio {ratio:.2f} ({low:.2f}-{high:.2f})", flush=True)
        rows.append({"label": f"n={batch}, L={length}, H={hidden}, float64",
                     "seconds": {label: median for label, (median, _) in summary.items()},
                     "ratios": {label: ratio for label, (_, ratio) in summary.items() if label != "symbackprop"}})
    load.append(_load())
    if args.save:
        from benchmarks.interleave import LABELS

        conditions = [f"one process, one thread, its CPU time, {args.rounds} rounds of {args.calls} samples of each "
                      "in turn, a sample about 2 ms of back-to-back calls, median of the round medians, the ratio the "
                      "median of the per-round ratios and their range; every peer's loss and gradients checked "
                      "against torch's first (relative error under 1e-10)",
                      "from_torch + compile, cold (an empty module cache), wall clock: " + ", ".join(compiles)]
        conditions += [f"load average {load[0]} at the start, {load[1]} at the end"] if all(load) else []
        if hasattr(os, "sched_getaffinity"):
            conditions.append(f"run on CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} of {os.cpu_count()}")
        conditions += [args.conditions] if args.conditions else []
        data_ = {"title": "from_torch: a bidirectional LSTM tagger's loss and gradients (Embedding, LSTM, Linear on "
                          "every step, cross-entropy per token)", **tables.provenance(),
                 "command": "python benchmarks/torch_tagger.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                 "conditions": "; ".join(conditions), "source": "written by benchmarks/torch_tagger.py --save",
                 "row_header": "size", "baseline": "symbackprop",
                 "columns": [{"key": c, "label": LABELS.get(c, c), "ratio": c != "symbackprop"} for c in columns],
                 "rows": rows}
        print(f"wrote {tables.save(args.save, data_).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
