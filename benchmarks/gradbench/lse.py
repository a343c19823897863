"""GradBench `lse`: log-sum-exp of a vector and its gradient.

Definition (evals/lse/README.md): a = max(x), LSE(x) = a + log(sum(exp(x - a))).
`primal` returns LSE(x), `gradient` its gradient (softmax(x)), the same length as x.
Data (python/gradbench/gradbench/evals/lse/run.py): np.random.seed(31337) once,
then x = np.random.rand(n) for each n of the published list in order; so the x of
one n depends on the draws before it, and `generate` replays them.
"""

from __future__ import annotations

import numpy as np

from ._common import jax_module, jax_value_grad_pair, torch_module, torch_value_grad_pair

NAME = "lse"
PRIMAL, DERIVATIVE = "primal", "gradient"
SIZES = [{"n": n} for n in (2500, 5000, 10000, 20000, 40000, 80000, 160000, 320000, 640000, 1280000)]
DEFAULT = {"n": 160000}  # the largest workload in issue 15's table
SMALL = {"n": 2500}
SCALING = [{"n": n} for n in (10000, 40000, 160000, 640000)]


def label(size: dict) -> str:
    return f"n={size['n']}"


def work(size: dict) -> float:
    return float(size["n"])


def generate(size: dict) -> dict:
    rs = np.random.RandomState(31337)
    for s in SIZES:
        x = rs.rand(s["n"])
        if s["n"] == size["n"]:
            return {"x": x}
    return {"x": np.random.RandomState(31337).rand(size["n"])}


def reference(data: dict) -> tuple[dict, dict]:
    x = data["x"]
    a = x.max()
    e = np.exp(x - a)
    return {"value": a + np.log(e.sum())}, {"x": e / e.sum()}


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp

    n = sp.Symbol("n", integer=True, positive=True)
    x = sp.MatrixSymbol("x", n, 1)
    # reduce("logsumexp") subtracts the maximum first, as the eval asks
    return sbp.Model("gradbench_lse", params=[x], loss=sbp.reduce("logsumexp", x, 0))


SBP_FUNCTIONS = ("forward", "value_and_grad")


def sbp_calls(mod, data: dict):
    x = data["x"].reshape(-1, 1)
    return (lambda: {"value": mod.forward(x=x)["loss"]},
            lambda: {"x": mod.value_and_grad(x=x)[1]["x"]})


def _loss(xp, amax):
    def loss(p, c):
        x = p["x"]
        a = amax(x)
        return a + xp.log(xp.sum(xp.exp(x - a)))
    return loss


def jax_calls(data: dict):
    jax_module()
    import jax.numpy as jnp

    return jax_value_grad_pair(_loss(jnp, jnp.max), {"x": data["x"]}, {})


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()
    return torch_value_grad_pair(_loss(torch, torch.max), {"x": data["x"]}, {}, compiled)
