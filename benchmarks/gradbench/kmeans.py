"""GradBench `kmeans`: the k-means cost and its Newton direction.

Definition (evals/kmeans/README.md, cpp/gradbench/evals/kmeans.hpp):
    cost(C) = sum_i min_j ||P_i - C_j||^2   (squared Euclidean distance)
`cost` returns it; `dir` returns J / H: the gradient with respect to the
centroids C divided entrywise by the Hessian's diagonal (the Hessian is
diagonal: 2 x the number of points nearest to each centroid).
Data (evals/kmeans/run.py): points = np.random.rand(n, d), centroids = the last k
points (so every centroid has a point). GradBench does not seed this draw; the port
seeds it with np.random.RandomState(31337). Published sizes: k in (10, 100, 1000),
n in (1000, 10000, 100000), d in (8, 16).

Every peer gets the Hessian's diagonal as a Hessian-vector product with a vector of
ones (exact here, since the Hessian is diagonal): symbackprop `value_grad_and_hvp` (the
gradient and the product from one C call); JAX `jvp` of `grad`; PyTorch double backward. The frameworks compute the
distances as ||P||^2 - 2 P C^T + ||C||^2 (one matrix product); symbackprop maps the
difference form over every (point, centroid) pair.
"""

from __future__ import annotations

import numpy as np

from ._common import first_calls, jax_module, jax_pair, torch_module, torch_tensors

NAME = "kmeans"
PRIMAL, DERIVATIVE = "cost", "dir"
SIZES = [{"k": k, "n": n, "d": d} for k in (10, 100, 1000) for n in (1000, 10000, 100000) for d in (8, 16)]
DEFAULT = {"k": 100, "n": 1000, "d": 16}  # issue 15's table
SMALL = {"k": 10, "n": 1000, "d": 8}
SCALING = [{"k": 100, "n": n, "d": 16} for n in (1000, 10000, 100000)]


def label(size: dict) -> str:
    return f"k={size['k']},n={size['n']},d={size['d']}"


def work(size: dict) -> float:
    return float(size["k"] * size["n"] * size["d"])


def generate(size: dict) -> dict:
    points = np.random.RandomState(31337).rand(size["n"], size["d"])
    return {"points": points, "centroids": points[-size["k"]:].copy()}


def reference(data: dict) -> tuple[dict, dict]:
    P, C = data["points"], data["centroids"]
    near, best = [], []
    for start in range(0, len(P), 2000):  # the difference form, in blocks of points
        dist = ((P[start:start + 2000, None, :] - C[None, :, :]) ** 2).sum(-1)
        near.append(dist.argmin(1))
        best.append(dist.min(1))
    near = np.concatenate(near)
    cost = float(np.concatenate(best).sum())
    count = np.bincount(near, minlength=len(C)).astype(float)
    grad = 2.0 * (count[:, None] * C - np.stack([P[near == j].sum(0) for j in range(len(C))]))
    hess = 2.0 * np.repeat(count[:, None], C.shape[1], axis=1)
    return {"value": cost}, {"dir": grad / hess}


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    d = size["d"]
    N, K = sp.symbols("N K", integer=True, positive=True)
    P = sp.MatrixSymbol("points", N, d)
    C = sp.MatrixSymbol("centroids", K, d)
    p = sp.Matrix(sp.symbols(f"p0:{d}", real=True))
    c = sp.Matrix(sp.symbols(f"c0:{d}", real=True))
    dist = sbp.map_examples(sum((p[i] - c[i]) ** 2 for i in range(d)), [(p, P), (c, C)])  # N x K
    return sbp.Model(f"gradbench_kmeans_d{d}", inputs=[P], params=[C],
                     loss=nn.sum_all(sbp.reduce("min", dist, 1)))


SBP_FUNCTIONS = ("forward", "hvp")


def sbp_calls(mod, data: dict):
    P, C = data["points"], data["centroids"]
    ones = np.ones_like(C)

    def direction():
        _, g, h = mod.value_grad_and_hvp({"centroids": ones}, points=P, centroids=C)
        return {"dir": g["centroids"] / h["centroids"]}

    return (lambda: {"value": mod.forward(points=P, centroids=C)["loss"]}), direction


def _cost(xp, amin):
    def cost(C, P):
        d2 = (P * P).sum(1)[:, None] - 2.0 * (P @ C.T) + (C * C).sum(1)[None, :]
        return amin(d2, 1).sum()
    return cost


def jax_calls(data: dict):
    jax = jax_module()
    import jax.numpy as jnp

    cost = _cost(jnp, lambda a, ax: jnp.min(a, axis=ax))

    def primal(C, P):
        return {"value": cost(C, P)}

    def derivative(C, P):
        g = jax.grad(cost)
        grad, hess = jax.jvp(lambda c: g(c, P), (C,), (jnp.ones_like(C),))
        return {"dir": grad / hess}

    return jax_pair(primal, derivative, (data["centroids"], data["points"]))


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()
    t = torch_tensors({"C": data["centroids"]}, grad=True)
    P = torch_tensors({"P": data["points"]})["P"]
    C = t["C"]
    cost = _cost(torch, torch.amin)
    fn = torch.compile(cost) if compiled else cost

    def primal():
        with torch.no_grad():
            return {"value": fn(C, P)}

    def derivative():
        (g,) = torch.autograd.grad(fn(C, P), [C], create_graph=True)
        (h,) = torch.autograd.grad(g, [C], grad_outputs=torch.ones_like(C))
        return {"dir": g.detach() / h}

    return first_calls(primal, derivative, compiled)
