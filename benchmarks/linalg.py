"""Linear algebra at real sizes: value_and_grad of det, logdet and solve of
an n x n matrix (n = 64, 128, 512), symbackprop beside JAX jit and numpy,
one thread, interleaved rounds (benchmarks/real_sizes.py's interleave).

    taskset -c 1 python benchmarks/linalg.py                       # n = 64, 128, 512, 15 rounds
    taskset -c 1 python benchmarks/linalg.py --sizes 64 --ops det --rounds 5
    taskset -c 1 python benchmarks/linalg.py --clock cpu --save linalg-2026-12-07
    taskset -c 1 python benchmarks/linalg.py --threshold          # LAPACK against the loops, small n

What is timed, float64, each peer's value and gradient from fresh arrays:
- det:    det(A), its gradient det(A) A^-T;
- logdet: log|det A|, its gradient A^-T;
- solve:  sum(X * X) / 2 with A X = b (b: n x 1), its gradients by A and b.
A = I + 0.4 R / sqrt(n) (R standard normal): det of order 1 at every n,
well conditioned. symbackprop: the plain call mod.value_and_grad (LU once,
kept for the gradient: LAPACK's getrf and the BLAS's trsm above
LAPACK_MIN_SIZE). JAX: jax.jit(jax.value_and_grad(loss)), its result
blocked on. numpy: the closed forms by np.linalg (det and inv, slogdet and
inv, solve twice). Before timing, every peer's value and gradients are
checked against numpy's (relative error under 1e-8).

`--threshold` times symbackprop's det and solve value_and_grad built with
the LAPACK path from n = 1 and with it never (-DSYMBACKPROP_LAPACK_MIN), at
small n: where LAPACK starts to win is emit.codegen.LAPACK_MIN_SIZE.

Run it pinned to one CPU (taskset) with one thread: the BLAS threads are
set to one here before numpy is imported (OPENBLAS_NUM_THREADS,
MKL_NUM_THREADS), symbackprop's by sbp.set_num_threads(1), and JAX's pool
is bounded by the affinity.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before numpy loads its BLAS (imported by the tests: no side effect there)
    for _name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import sympy as sp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import symbackprop as sbp
from benchmarks.real_sizes import CLOCKS, interleave
from symbackprop import nn
from symbackprop.toolchain.builder import default_flags

OPS = ("det", "logdet", "solve")
n = sp.Symbol("n", integer=True, positive=True)
A, b = sp.MatrixSymbol("A", n, n), sp.MatrixSymbol("b", n, 1)


def model(op: str) -> sbp.Model:
    if op == "det":
        return sbp.Model("bench_det", params=[A], loss=sbp.det(A))
    if op == "logdet":
        return sbp.Model("bench_logdet", params=[A], loss=sbp.logdet(A))
    x = sbp.solve(A, b)
    return sbp.Model("bench_solve", params=[A, b], loss=nn.sum_all(sp.HadamardPower(x, 2)) / 2)


def data(op: str, size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed + size)
    arrays = {"A": np.eye(size) + 0.4 * rng.standard_normal((size, size)) / np.sqrt(size)}
    if op == "solve":
        arrays["b"] = rng.standard_normal((size, 1))
    return arrays


def numpy_peer(op: str) -> Callable[..., tuple[float, dict]]:
    """The value and gradients by np.linalg's closed forms."""

    def det(A):
        d = np.linalg.det(A)
        return d, {"A": d * np.linalg.inv(A).T}

    def logdet(A):
        return np.linalg.slogdet(A)[1], {"A": np.linalg.inv(A).T}

    def solve(A, b):
        x = np.linalg.solve(A, b)
        grad_b = np.linalg.solve(A.T, x)
        return float((x * x).sum()) / 2, {"A": -grad_b @ x.T, "b": grad_b}

    return {"det": det, "logdet": logdet, "solve": solve}[op]


def jax_peer(op: str) -> Callable[..., tuple[float, dict]]:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    losses = {"det": lambda w: jnp.linalg.det(w["A"]), "logdet": lambda w: jnp.linalg.slogdet(w["A"])[1],
              "solve": lambda w: jnp.sum(jnp.linalg.solve(w["A"], w["b"]) ** 2) / 2}
    step = jax.jit(jax.value_and_grad(losses[op]))

    def call(**arrays):
        value, grads = step({k: jnp.asarray(v) for k, v in arrays.items()})
        return float(jax.block_until_ready(value)), {k: np.asarray(v) for k, v in grads.items()}

    return call


def check(calls: dict, arrays: dict) -> dict[str, float]:
    """Each peer's largest relative error against numpy's (value and gradients)."""
    value, grads = calls["numpy"](**arrays)
    errors = {}
    for peer, call in calls.items():
        got, got_grads = call(**arrays)
        error = abs(got - value) / max(abs(value), 1e-300)
        for name, grad in grads.items():
            error = max(error, float(np.abs(got_grads[name] - grad).max() / np.abs(grad).max()))
        errors[peer] = error
    return errors


def peers(op: str, wanted: list[str]) -> dict:
    """{peer: call(**arrays) -> (value, grads)}, symbackprop first (the ratios' baseline)."""
    mod = sbp.compile(model(op))
    calls = {"symbackprop": lambda **arrays: mod.value_and_grad(**arrays), "numpy": numpy_peer(op)}
    if "jax_jit" in wanted:
        calls["jax_jit"] = jax_peer(op)
    return {k: v for k, v in calls.items() if k in wanted or k == "numpy"}


def run(ops: list[str], sizes: list[int], wanted: list[str], rounds: int, per_round: int, clock: str) -> list[dict]:
    rows = []
    for op in ops:
        calls = peers(op, wanted)
        for size in sizes:
            arrays = data(op, size)
            errors = check(calls, arrays)
            print(f"{op} n={size}: largest relative error against numpy: "
                  + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()))
            if max(errors.values()) > 1e-8:
                raise SystemExit(f"{op} n={size}: the peers disagree, not timing")
            timed = {peer: (lambda call=call, arrays=arrays: call(**arrays)) for peer, call in calls.items()
                     if peer in wanted}
            result = interleave(timed, rounds, per_round, clock=clock)
            row = {"label": f"{op}, n = {size}", "seconds": {k: v[0] for k, v in result.items()},
                   "ratios": {k: [round(r, 3) for r in v[1]] for k, v in result.items() if k != "symbackprop"}}
            rows.append(row)
            print("  " + ", ".join(f"{k} {v[0] * 1e6:.1f} us (ratio {v[1][0]:.2f}, {v[1][1]:.2f}-{v[1][2]:.2f})"
                                   for k, v in result.items()))
    return rows


def threshold(sizes: list[int], rounds: int, per_round: int, clock: str) -> None:
    """symbackprop's det and solve with LAPACK from n = 1 against the loops alone."""
    for op in ("det", "solve"):
        lapack = sbp.compile(model(op), options=sbp.BuildOptions(flags=(*default_flags(), "-DSYMBACKPROP_LAPACK_MIN=1")))
        loops = sbp.compile(model(op), options=sbp.BuildOptions(flags=(*default_flags(),
                                                                       "-DSYMBACKPROP_LAPACK_MIN=1000000000")))
        for size in sizes:
            arrays = data(op, size)
            timed = {label: (lambda mod=mod, arrays=arrays: mod.value_and_grad(**arrays))
                     for label, mod in (("loops", loops), ("lapack", lapack))}
            result = interleave(timed, rounds, per_round, clock=clock)
            print(f"{op} n={size:4}: loops {result['loops'][0] * 1e6:8.2f} us, LAPACK {result['lapack'][0] * 1e6:8.2f} us"
                  f" (LAPACK / loops {result['lapack'][1][0]:.2f}, {result['lapack'][1][1]:.2f}-"
                  f"{result['lapack'][1][2]:.2f})")


def save(name: str, rows: list[dict], wanted: list[str], clock: str, argv: list[str], load: str) -> None:
    from benchmarks import tables

    labels = {"symbackprop": "symbackprop", "jax_jit": "JAX jit", "numpy": "numpy"}
    data = {
        "title": "det, logdet and solve of an n x n matrix, value and gradient, float64",
        **tables.provenance(),
        "command": "taskset -c 1 python benchmarks/linalg.py " + " ".join(_without_load(argv)),
        "conditions": ("one process pinned to one CPU (taskset -c 1), one thread; "
                       + ("the process's CPU time; " if clock == "cpu" else "")
                       + "rounds of calls of each peer in turn; median of the round medians; the ratio is the median "
                         "of the per-round ratios (peer over symbackprop) and their range; every peer's value and "
                         "gradients checked against numpy's (relative error under 1e-8) before timing; "
                       + load),
        "source": "benchmarks/linalg.py",
        "row_header": "value_and_grad",
        "baseline": "symbackprop",
        "columns": [{"key": k, "label": labels[k], "ratio": k != "symbackprop"} for k in labels if k in wanted],
        "rows": rows,
    }
    print(f"wrote {tables.save(name, data)}")


def _without_load(argv: list[str]) -> list[str]:
    """The command's arguments, --load's text shown as TEXT (it is in the conditions)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--load":
            arg = "TEXT"
        out.append("--load=TEXT" if arg.startswith("--load=") else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default="64,128,512")
    p.add_argument("--peers", default="symbackprop,jax_jit,numpy")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10, help="calls of each peer per round")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--threshold", action="store_true", help="LAPACK against the loops at small n")
    p.add_argument("--load", default="", help="the machine's load, said in the saved file's conditions")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    sbp.set_num_threads(1)
    if args.threshold:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes != "64,128,512" else [4, 8, 12, 16, 24, 32, 48]
        threshold(sizes, args.rounds, args.calls, args.clock)
        return 0
    wanted = args.peers.split(",")
    rows = run(args.ops.split(","), [int(s) for s in args.sizes.split(",")], wanted, args.rounds, args.calls, args.clock)
    if args.save:
        save(args.save, rows, wanted, args.clock, argv if argv is not None else sys.argv[1:], args.load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
