"""GradBench `llsq`: a linear least-squares objective (cmpad's llsq_obj).

Definition (evals/llsq/README.md, cpp/gradbench/evals/llsq.hpp):
    y(x) = 1/2 sum_{i<n} (s_i - sum_{j<m} x_j t_i^j)^2,  t_i = -1 + 2i/(n-1),  s_i = sign(t_i).
`primal` returns y(x), `gradient` dy/dx (m numbers).
Data (evals/llsq/run.py): np.random.seed(31337) once; for the (n, m) pairs sorted by
n*m, x = np.random.rand(m); `generate` replays the draws. Published sizes: n in
16 ... 16392 (doubling, with 8196 and 16392 as published), m = 128.

Every peer gets t and s as arrays computed once in numpy (they depend on n only)
and evaluates the polynomial as the definition writes it, sum_j x_j t_i^j: symbackprop
as a map over the points of that scalar body with x a shared row; JAX and PyTorch
as the matrix of powers t_i^j (t[:, None] ** arange(m)) times x. (Horner's rule in
the symbackprop body, 127 nested multiply-adds, stops with a RecursionError in
symbackprop's model fingerprint: the expression is walked recursively.)
"""

from __future__ import annotations

import numpy as np

from ._common import jax_module, jax_value_grad_pair, torch_module, torch_value_grad_pair

NAME = "llsq"
PRIMAL, DERIVATIVE = "primal", "gradient"
_N = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8196, 16392)
SIZES = [{"n": n, "m": 128} for n in _N]
DEFAULT = {"n": 4096, "m": 128}  # issue 15's table
SMALL = {"n": 16, "m": 128}
SCALING = [{"n": n, "m": 128} for n in (1024, 4096, 16392)]


def label(size: dict) -> str:
    return f"n={size['n']},m={size['m']}"


def work(size: dict) -> float:
    return float(size["n"] * size["m"])


def generate(size: dict) -> dict:
    n, m = size["n"], size["m"]
    rs = np.random.RandomState(31337)
    x = None
    for s in sorted(SIZES, key=lambda s: s["n"] * s["m"]):
        draw = rs.rand(s["m"])
        if (s["n"], s["m"]) == (n, m):
            x = draw
            break
    if x is None:
        x = np.random.RandomState(31337).rand(m)
    t = -1.0 + np.arange(n) * 2.0 / (n - 1)
    return {"x": x, "t": t, "s": np.sign(t)}


def reference(data: dict) -> tuple[dict, dict]:
    x, t, s = data["x"], data["t"], data["s"]
    V = t[:, None] ** np.arange(len(x))[None, :]
    r = s - V @ x
    return {"value": 0.5 * float(r @ r)}, {"x": -(V.T @ r)}


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp

    m = size["m"]
    N = sp.Symbol("N", integer=True, positive=True)
    points = sp.MatrixSymbol("ts", N, 2)  # (t_i, s_i) a row
    coeffs = sp.MatrixSymbol("x", 1, m)  # one row: shared by every point
    t, s = sp.symbols("t s", real=True)
    k = sp.symbols(f"k0:{m}", real=True)
    poly = sum(k[j] * t**j for j in range(m))
    sq = sbp.map_examples((s - poly) ** 2, [((t, s), points), (sp.Matrix(k), coeffs)])
    return sbp.Model(f"gradbench_llsq_m{m}", inputs=[points], params=[coeffs],
                     loss=sbp.reduce("sum", sq, 0) / 2)


SBP_FUNCTIONS = ("forward", "value_and_grad")


def sbp_calls(mod, data: dict):
    ts = np.ascontiguousarray(np.stack([data["t"], data["s"]], axis=1))
    x = data["x"].reshape(1, -1)
    return (lambda: {"value": mod.forward(ts=ts, x=x)["loss"]},
            lambda: {"x": mod.value_and_grad(ts=ts, x=x)[1]["x"]})


def _loss(xp):
    def loss(p, c):
        x, t = p["x"], c["t"]
        r = c["s"] - (t[:, None] ** xp.arange(x.shape[0], dtype=t.dtype)[None, :]) @ x
        return 0.5 * xp.sum(r * r)
    return loss


def jax_calls(data: dict):
    jax_module()
    import jax.numpy as jnp

    return jax_value_grad_pair(_loss(jnp), {"x": data["x"]}, {"t": data["t"], "s": data["s"]})


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()
    return torch_value_grad_pair(_loss(torch), {"x": data["x"]}, {"t": data["t"], "s": data["s"]},
                                 compiled)
