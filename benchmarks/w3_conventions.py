"""W3 (X (n x 784) -> linear(256) -> tanh -> linear(10) -> softmax
cross-entropy) with its weights stored (in, out) and as torch.nn.Linear
stores them, (out, in): symbackprop (a prepared call) beside numpy and
JAX jit, one thread, one call of each peer in turn (load changes on a
shared machine hit all three alike), medians.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/w3_conventions.py float32 1,128,1024 21

Each peer's loss and grad_W1 are checked against the numpy version first.
"""

import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"

import jax
import jax.numpy as jnp
import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

jax.config.update("jax_enable_x64", True)
CONVENTIONS = ("in_out", "out_in")


def model(conv: str) -> sbp.Model:
    n = sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 784), sp.MatrixSymbol("T", n, 10)
    b1, b2 = sp.MatrixSymbol("b1", 1, 256), sp.MatrixSymbol("b2", 1, 10)
    if conv == "in_out":
        W1, W2 = sp.MatrixSymbol("W1", 784, 256), sp.MatrixSymbol("W2", 256, 10)
        w1, w2 = W1, W2
    else:
        W1, W2 = sp.MatrixSymbol("W1", 256, 784), sp.MatrixSymbol("W2", 10, 256)
        w1, w2 = W1.T, W2.T
    z = nn.linear(nn.tanh(nn.linear(X, w1, b1)), w2, b2)
    return sbp.Model(f"w3_{conv}", inputs=[X, T], params=[W1, b1, W2, b2], loss=nn.softmax_cross_entropy(z, T))


def numpy_value_and_grad(conv, X, T, W1, b1, W2, b2):
    w1, w2 = (W1, W2) if conv == "in_out" else (W1.T, W2.T)
    h = np.tanh(X @ w1 + b1)
    z = h @ w2 + b2
    top = z.max(1, keepdims=True)
    e = np.exp(z - top)
    s = e.sum(1, keepdims=True)
    loss = np.mean(top[:, 0] + np.log(s[:, 0]) - (T * z).sum(1))
    gz = (e / s - T) / X.shape[0]
    g1 = (gz @ w2.T) * (1 - h * h)
    if conv == "in_out":
        gW1, gW2 = X.T @ g1, h.T @ gz
    else:
        gW1, gW2 = g1.T @ X, gz.T @ h
    return loss, gW1, g1.sum(0, keepdims=True), gW2, gz.sum(0, keepdims=True)


def jax_loss(conv, X, T, W1, b1, W2, b2):
    w1, w2 = (W1, W2) if conv == "in_out" else (W1.T, W2.T)
    z = jnp.tanh(X @ w1 + b1) @ w2 + b2
    return jnp.mean(jax.nn.logsumexp(z, 1) - jnp.sum(T * z, 1))


def data(conv, n, dtype, rng):
    W1, W2 = rng.standard_normal((784, 256)) / 28, rng.standard_normal((256, 10)) / 16
    if conv == "out_in":
        W1, W2 = np.ascontiguousarray(W1.T), np.ascontiguousarray(W2.T)
    arrays = {"X": rng.standard_normal((n, 784)), "T": np.eye(10)[rng.integers(0, 10, n)], "W1": W1,
              "b1": 0.1 * rng.standard_normal((1, 256)), "W2": W2, "b2": 0.1 * rng.standard_normal((1, 10))}
    return {k: v.astype(dtype) for k, v in arrays.items()}


def main(dtype: str, batches: list[int], reps: int) -> None:
    mods = {c: sbp.compile(model(c), dtype=dtype) for c in CONVENTIONS}
    jitted = {c: jax.jit(jax.value_and_grad(lambda *a, c=c: jax_loss(c, *a), argnums=(2, 3, 4, 5))) for c in CONVENTIONS}
    rng = np.random.default_rng(0)
    for n in batches:
        for conv in CONVENTIONS:
            d = data(conv, n, dtype, rng)
            args = [d[k] for k in ("X", "T", "W1", "b1", "W2", "b2")]
            want = numpy_value_and_grad(conv, *args)
            loss, grads = mods[conv].value_and_grad(**d)
            jloss, jgrads = jitted[conv](*args)
            for got_loss, got_w1 in ((float(np.ravel(loss)[0]), grads["W1"]), (float(jloss), np.asarray(jgrads[0]))):
                assert np.isclose(got_loss, want[0], rtol=1e-4) and np.allclose(got_w1, want[1], rtol=1e-3, atol=1e-5)
            jargs = [jnp.asarray(a) for a in args]
            peers = {"symbackprop": mods[conv].prepare("value_and_grad", **d),
                     "numpy": lambda conv=conv, args=args: numpy_value_and_grad(conv, *args),
                     "jax": lambda conv=conv, jargs=jargs: jax.block_until_ready(jitted[conv](*jargs))}
            times = {name: [] for name in peers}
            for call in peers.values():
                call()
            for _ in range(reps):
                for name, call in peers.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            m = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            print(f"{dtype} n={n:6d} {conv}: " + "  ".join(f"{k} {v * 1e3:9.3f} ms" for k, v in m.items())
                  + f"   /numpy {m['symbackprop'] / m['numpy']:.2f}  /jax {m['symbackprop'] / m['jax']:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]))
