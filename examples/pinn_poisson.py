"""A physics-informed network for the 1-D Poisson equation

    u''(x) = -pi^2 sin(pi x) on (0, 1),  u(0) = u(1) = 0,

whose solution is u(x) = sin(pi x). u is a tanh MLP of x (1 -> H -> H -> 1)
applied to a batch of collocation points x (n x 1, n symbolic); u'' is
sbp.grad of sbp.grad of it with respect to x, inside the loss, so the
gradient with respect to the weights is a third derivative of the network,
derived at compile time and emitted as one C function.

    python examples/pinn_poisson.py [--epochs 1000] [--points 256] [--batch-size 64] [--lr 0.01] [--lr-end 1e-4]

trains it with Adam through train_epoch (one C call an epoch; the learning
rate falls geometrically from --lr to --lr-end over the epochs: at a
constant rate the error does not settle, it swings between 1e-3 and 5e-2
from epoch 300 on), prints the
largest error against sin(pi x) and the median time per epoch, and, where
PyTorch and JAX are installed, the same training written with nested
torch.autograd.grad(create_graph=True) and with jax.grad of jax.grad
(jitted), from the same initialization and row orders.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

H = 16
n = sp.Symbol("n", integer=True, positive=True)
x = sp.MatrixSymbol("x", n, 1)  # collocation points
xb = sp.MatrixSymbol("xb", 2, 1)  # the boundary points 0 and 1
W1, b1 = sp.MatrixSymbol("W1", 1, H), sp.MatrixSymbol("b1", 1, H)
W2, b2 = sp.MatrixSymbol("W2", H, H), sp.MatrixSymbol("b2", 1, H)
W3, b3 = sp.MatrixSymbol("W3", H, 1), sp.MatrixSymbol("b3", 1, 1)
PARAMS = (W1, b1, W2, b2, W3, b3)


def u(points: sp.MatrixExpr) -> sp.MatrixExpr:
    return nn.linear(nn.tanh(nn.linear(nn.tanh(nn.linear(points, W1, b1)), W2, b2)), W3, b3)


def square(m: sp.MatrixExpr) -> sp.MatrixExpr:
    return m.applyfunc(lambda v: v**2)


du = sbp.grad(nn.sum_all(u(x)), x)  # rows are independent: row i is u'(x_i)
d2u = sbp.grad(nn.sum_all(du), x)  # u''(x_i)
source = x.applyfunc(lambda v: sp.pi**2 * sp.sin(sp.pi * v))
loss = nn.mean_all(square(d2u + source)) + nn.mean_all(square(u(xb)))

model = sbp.Model("pinn_poisson", inputs=[x, xb], params=list(PARAMS), loss=loss, outputs={"u": u(x)},
                  names={"du": du, "d2u": d2u})  # what the C calls them


def init_params(rng: np.random.Generator) -> dict:
    """Glorot-like weights, zero biases."""
    return {"W1": rng.standard_normal((1, H)), "b1": np.zeros((1, H)),
            "W2": rng.standard_normal((H, H)) / np.sqrt(H), "b2": np.zeros((1, H)),
            "W3": rng.standard_normal((H, 1)) / np.sqrt(H), "b3": np.zeros((1, 1))}


def sample_data(rng: np.random.Generator, batch: int = 8) -> dict:
    """Points, the boundary and parameters (random biases: every term is exercised)."""
    params = init_params(rng)
    params.update({k: 0.3 * rng.standard_normal(v.shape) for k, v in params.items() if k.startswith("b")})
    return {"x": rng.uniform(0, 1, (batch, 1)), "xb": np.array([[0.0], [1.0]]), **params}


# --- training, and the same in PyTorch and JAX ----------------------------------


def learning_rates(lr: float, lr_end: float, epochs: int) -> list[float]:
    """Each epoch's learning rate: from lr to lr_end, geometrically."""
    return [lr * (lr_end / lr) ** (epoch / max(epochs - 1, 1)) for epoch in range(epochs)]


def train_symbackprop(data: dict, params: dict, orders: list, batch_size: int,
                      rates: Sequence[float]) -> tuple[dict, list]:
    mod = sbp.compile(model, functions=("forward", "train_step"), optimizer=sbp.Adam(lr=rates[0]))
    params = {k: v.copy() for k, v in params.items()}
    times = []
    for order, rate in zip(orders, rates):
        start = time.perf_counter()
        mod.trainer.hyperparameters["lr"] = rate  # a value the C step reads at each call
        mod.train_epoch(batch_size, order, **data, **params)
        times.append(time.perf_counter() - start)
    return params, times


def train_torch(data: dict, params: dict, orders: list, batch_size: int,
                rates: Sequence[float]) -> tuple[dict, list] | None:
    try:
        import torch
    except ImportError:
        return None
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.Adam(list(p.values()), lr=rates[0])
    xs, xb_ = torch.tensor(data["x"]), torch.tensor(data["xb"])

    def net(z):
        return torch.tanh(torch.tanh(z @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]) @ p["W3"] + p["b3"]

    times = []
    for order, rate in zip(orders, rates):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = rate
        for first in range(0, len(order), batch_size):
            z = xs[order[first:first + batch_size]].clone().requires_grad_(True)
            (du_,) = torch.autograd.grad(net(z).sum(), z, create_graph=True)
            (d2u_,) = torch.autograd.grad(du_.sum(), z, create_graph=True)
            value = ((d2u_ + np.pi**2 * torch.sin(np.pi * z)) ** 2).mean() + (net(xb_) ** 2).mean()
            opt.zero_grad()
            value.backward()
            opt.step()
        times.append(time.perf_counter() - start)
    return {k: v.detach().numpy() for k, v in p.items()}, times


def train_jax(data: dict, params: dict, orders: list, batch_size: int,
              rates: Sequence[float]) -> tuple[dict, list] | None:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    jax.config.update("jax_enable_x64", True)

    def u_one(p, z):
        hidden = jnp.tanh(jnp.tanh(z * p["W1"][0] + p["b1"][0]) @ p["W2"] + p["b2"][0])
        return (hidden @ p["W3"])[0] + p["b3"][0, 0]

    def loss_(p, z):
        d2u_ = jax.vmap(jax.grad(jax.grad(u_one, argnums=1), argnums=1), (None, 0))(p, z[:, 0])
        boundary = jax.vmap(u_one, (None, 0))(p, jnp.array([0.0, 1.0]))
        return jnp.mean((d2u_ + jnp.pi**2 * jnp.sin(jnp.pi * z[:, 0])) ** 2) + jnp.mean(boundary**2)

    @jax.jit
    def step(p, m, v, t, z, lr):  # Adam, as torch.optim.Adam and sbp.Adam (betas 0.9, 0.999, eps 1e-8)
        g = jax.grad(loss_)(p, z)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        scale = lr * jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        p = jax.tree.map(lambda w, a, b: w - scale * a / (jnp.sqrt(b) + 1e-8 * jnp.sqrt(1 - 0.999**t)), p, m, v)
        return p, m, v

    p = {k: jnp.asarray(v) for k, v in params.items()}
    m = jax.tree.map(jnp.zeros_like, p)
    v = jax.tree.map(jnp.zeros_like, p)
    xs, t, times = jnp.asarray(data["x"]), 0, []
    for order, rate in zip(orders, rates):
        start = time.perf_counter()
        for first in range(0, len(order), batch_size):
            t += 1
            p, m, v = step(p, m, v, t, xs[order[first:first + batch_size]], rate)
        jax.block_until_ready(p)
        times.append(time.perf_counter() - start)
    return {k: np.asarray(a) for k, a in p.items()}, times


def max_error(params: dict) -> float:
    """The largest |u(x) - sin(pi x)| on a fine grid."""
    grid = np.linspace(0, 1, 201)[:, None]
    mod = sbp.compile(model, functions=("forward",))
    return float(np.abs(mod.forward(x=grid, xb=np.array([[0.0], [1.0]]), **params)["u"] - np.sin(np.pi * grid)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--points", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2, help="the first epoch's learning rate")
    parser.add_argument("--lr-end", type=float, default=1e-4, help="the last epoch's")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = {"x": rng.uniform(0, 1, (args.points, 1)), "xb": np.array([[0.0], [1.0]])}
    params = init_params(rng)
    orders = [rng.permutation(args.points) for _ in range(args.epochs)]
    rates = learning_rates(args.lr, args.lr_end, args.epochs)
    print(f"u'' = -pi^2 sin(pi x), u(0) = u(1) = 0: {args.points} points, batches of {args.batch_size}, "
          f"{args.epochs} epochs of Adam (lr {args.lr} -> {args.lr_end})")
    print(f"{'':12s} {'max |u - sin(pi x)|':>20s} {'ms / epoch':>12s}")
    print(f"{'initial':12s} {max_error(params):20.2e}")
    for name, trainer in (("symbackprop", train_symbackprop), ("PyTorch", train_torch), ("JAX (jit)", train_jax)):
        result = trainer(data, params, orders, args.batch_size, rates)
        if result is None:
            print(f"{name:12s} (not installed)")
            continue
        trained, times = result
        print(f"{name:12s} {max_error(trained):20.2e} {1e3 * np.median(times[1:] or times):12.3f}")


if __name__ == "__main__":
    main()
