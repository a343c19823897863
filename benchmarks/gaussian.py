"""Linear algebra: a Gaussian's negative log-likelihood and its gradient by the covariance.

    taskset -c 1 python benchmarks/gaussian.py --sizes 4,16,64,256 --rounds 9 --save NAME

The model of docs/linalg.md: m = 4 n samples Y (m x n), the covariance
Sigma (n x n) the parameter, `m/2 logdet(Sigma) + 1/2 |L^-1 Y^T|^2` with L
the Cholesky factor (`sbp.cholesky`, `sbp.triangular_solve`,
`sbp.logdet`), value and gradient. Beside it: JAX jit of the same loss
(`jnp.linalg.cholesky`, `solve_triangular`, `slogdet`, `value_and_grad`),
PyTorch eager (`torch.linalg`, `autograd.grad`) and numpy by hand (the
loss by Cholesky, the gradient's closed form (m S^-1 - S^-1 Y^T Y S^-1)/2
with S^-1 from the factor). Every peer's loss and gradient is checked
against numpy's (relative error under 1e-8) before timing. One process,
one thread, CPU time; each round times every peer in turn (samples of
about 2 ms of back-to-back calls), the ratios taken round by round.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tables  # noqa: E402
from benchmarks.interleave import _load, interleaved_summary, sample_repeats  # noqa: E402


def data(n: int):
    rng = np.random.default_rng(0)
    y = rng.standard_normal((4 * n, n)) @ rng.standard_normal((n, n)) / np.sqrt(n)
    return y, np.cov(y.T) + np.eye(n)


def numpy_call(y, sigma):
    m = y.shape[0]
    c = np.linalg.cholesky(sigma)
    z = np.linalg.solve(c, y.T)  # numpy has no triangular solve; scipy's would be one
    loss = m * np.sum(np.log(np.diag(c))) + 0.5 * np.sum(z * z)
    inv = np.linalg.inv(sigma)
    w = inv @ (y.T @ y) @ inv
    return loss, (m * inv - w) / 2


def peers(n: int) -> dict:
    import sympy as sp

    import symbackprop as sbp
    from symbackprop import nn

    y, sigma = data(n)
    calls = {}
    nn_, m_ = sp.symbols("n m", integer=True, positive=True)
    Y, S = sp.MatrixSymbol("Y", m_, nn_), sp.MatrixSymbol("Sigma", nn_, nn_)
    Z = sbp.triangular_solve(sbp.cholesky(S), Y.T, lower=True)
    nll = m_ * sbp.logdet(S) / 2 + sbp.as_scalar(nn.sum_all(sp.HadamardPower(Z, 2))) / 2
    mod = sbp.compile(sbp.Model("bench_gaussian_nll", inputs=[Y], params=[S], loss=nll))
    calls["symbackprop"] = lambda: (lambda r: (r[0], r[1]["Sigma"]))(mod.value_and_grad(Y=y, Sigma=sigma))
    pre = mod.prepare(Y=y, Sigma=sigma)
    calls["symbackprop.prepared()"] = lambda: (lambda r: (r[0], r[1]["Sigma"]))(pre())
    calls["numpy_ref"] = lambda: numpy_call(y, sigma)
    try:
        import jax
        import jax.numpy as jnp
        from jax.scipy.linalg import solve_triangular

        jax.config.update("jax_enable_x64", True)

        def jloss(s, yy):
            c = jnp.linalg.cholesky((s + s.T) / 2)
            z = solve_triangular(c, yy.T, lower=True)
            return yy.shape[0] * jnp.linalg.slogdet(s)[1] / 2 + jnp.sum(z * z) / 2

        js, jy = jnp.asarray(sigma), jnp.asarray(y)
        f = jax.jit(jax.value_and_grad(jloss)).lower(js, jy).compile()
        calls["jax_jit"] = lambda: jax.block_until_ready(f(js, jy))
    except ImportError:
        pass
    try:
        import torch

        torch.set_num_threads(1)
        ts, ty = torch.from_numpy(sigma.copy()).requires_grad_(), torch.from_numpy(y)

        def tcall():
            c = torch.linalg.cholesky((ts + ts.T) / 2)
            z = torch.linalg.solve_triangular(c, ty.T, upper=False)
            loss = ty.shape[0] * torch.linalg.slogdet(ts)[1] / 2 + (z * z).sum() / 2
            (g,) = torch.autograd.grad(loss, ts)
            return loss.detach(), g

        calls["torch_eager"] = tcall
    except ImportError:
        pass
    want = numpy_call(y, sigma)
    for label, call in calls.items():
        loss, grad = call()
        err = max(abs(float(loss) - want[0]) / abs(want[0]),
                  float(np.linalg.norm(np.asarray(grad) - want[1]) / np.linalg.norm(want[1])))
        if err > 1e-8:
            raise AssertionError(f"{label} at n={n}: relative error {err:.2e}")
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,16,64,256")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--conditions", default="")
    p.add_argument("--save", default=None, metavar="NAME")
    args = p.parse_args(argv)
    load = [_load()]
    rows, columns = [], []
    for n in (int(s) for s in args.sizes.split(",")):
        calls = peers(n)
        for call in calls.values():
            call()
        summary = interleaved_summary(calls, sample_repeats(calls, 0), args.rounds, args.calls)
        columns += [label for label in summary if label not in columns]
        print(f"n={n}:")
        for label, (median, (ratio, low, high)) in summary.items():
            print(f"  {label:24} {median * 1e6:10.2f} us  ratio {ratio:.2f} ({low:.2f}-{high:.2f})", flush=True)
        rows.append({"label": f"n={n}, m={4 * n} samples, float64",
                     "seconds": {label: median for label, (median, _) in summary.items()},
                     "ratios": {label: ratio for label, (_, ratio) in summary.items() if label != "symbackprop"}})
    load.append(_load())
    if args.save:
        from benchmarks.interleave import LABELS

        conditions = [f"one process, one thread, its CPU time, {args.rounds} rounds of {args.calls} samples of each "
                      "in turn, a sample about 2 ms of back-to-back calls, median of the round medians, the ratio the "
                      "median of the per-round ratios and their range; every peer's loss and gradient checked against "
                      "numpy's first (relative error under 1e-8)"]
        conditions += [f"load average {load[0]} at the start, {load[1]} at the end"] if all(load) else []
        if hasattr(os, "sched_getaffinity"):
            conditions.append(f"run on CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))} of {os.cpu_count()}")
        conditions += [args.conditions] if args.conditions else []
        data_ = {"title": "Linear algebra: a Gaussian's negative log-likelihood (cholesky, triangular_solve, logdet) "
                          "and its gradient by the covariance", **tables.provenance(),
                 "command": "python benchmarks/gaussian.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                 "conditions": "; ".join(conditions), "source": "written by benchmarks/gaussian.py --save",
                 "row_header": "size", "baseline": "symbackprop",
                 "columns": [{"key": c, "label": LABELS.get(c, c), "ratio": c != "symbackprop"} for c in columns],
                 "rows": rows}
        print(f"wrote {tables.save(args.save, data_).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
