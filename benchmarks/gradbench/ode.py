"""GradBench `ode`: an ODE solved by Runge-Kutta 4 (cmpad's an_ode).

Definition (evals/ode/README.md, cpp/gradbench/evals/ode.hpp): y' = f(x, y) with
f_0 = x_0 and f_i = x_i y_{i-1} (i > 0) for a vector y of n entries, y(0) = 0,
integrated to t = 2 by s steps of the classical RK4 (h = 2 / s). `primal` returns
y(2) (n numbers), `gradient` the gradient of its last entry with respect to x.
Data (python/gradbench/gradbench/evals/ode/run.py): np.random.seed(31337) once, then
x = np.random.rand(n) for each (n, s) of n in (1000, 10000, 100000) and s in
(1, 10, 100), taken in order of n * s (ties in the order n, then s); `generate`
replays them.

The symbackprop model is one `sbp.scan` over the steps: its sequence is the
column of step sizes (s rows of h, so s is bound at call time like n), its
state y (n x 1), and the step's four stages are written out in SymPy; y_{i-1}
is `sbp.shift(y, 1, fill=1)` (f_0 = x_0 * 1). The last entry is read as the
sum of y times the unit vector (1 - shift(1, -1)): exact, as the rest are
multiplied by 0. No loop is unrolled: the C is one loop over the steps
holding one loop over the n entries (the four stages recomputed at i - 1,
..., i - 4 in it, schedule/shifted.py; the reverse sweep likewise),
whatever n and s.

For n >= 1000 most of y underflows: y_i(2) = 2^(i+1) / (i+1)! prod x_0..x_i,
so the gradient of the last entry is 0 at GradBench's sizes; the tests use
n = 12 too, where every entry is a normal number.
"""

from __future__ import annotations

import numpy as np

from ._common import jax_module, jax_pair, torch_module, torch_tensors

NAME = "ode"
PRIMAL, DERIVATIVE = "primal", "gradient"
T_FINAL = 2.0
_PUBLISHED = sorted(([n, s] for n in (1000, 10000, 100000) for s in (1, 10, 100)), key=lambda v: v[0] * v[1])
SIZES = [{"n": n, "s": s} for n, s in _PUBLISHED]
DEFAULT = {"n": 10000, "s": 100}
SMALL = {"n": 1000, "s": 10}
SCALING = [{"n": 1000, "s": 100}, {"n": 10000, "s": 10}, {"n": 10000, "s": 100}, {"n": 100000, "s": 100}]


def label(size: dict) -> str:
    return f"n={size['n']},s={size['s']}"


def work(size: dict) -> float:
    return float(size["n"] * size["s"])


def generate(size: dict) -> dict:
    rs = np.random.RandomState(31337)
    for s in SIZES:
        x = rs.rand(s["n"])
        if s == {"n": size["n"], "s": size["s"]}:
            return {"x": x, "s": size["s"]}
    return {"x": np.random.RandomState(31337).rand(size["n"]), "s": size["s"]}


# --------------------------------------------------------------------------
# numpy: the primal and its reverse-mode derivative written by hand


def _moved(y: np.ndarray) -> np.ndarray:
    """(1, y_0, ..., y_{n-2}): what f multiplies x by."""
    return np.concatenate([[1.0], y[:-1]])


def _moved_back(g: np.ndarray) -> np.ndarray:
    """The adjoint of y -> (., y_0, ..., y_{n-2}): (g_1, ..., g_{n-1}, 0)."""
    return np.concatenate([g[1:], [0.0]])


def _stages(x: np.ndarray, y: np.ndarray, h: float) -> tuple:
    """The points f is evaluated at, and the four stages."""
    k1 = x * _moved(y)
    y1 = y + h / 2 * k1
    k2 = x * _moved(y1)
    y2 = y + h / 2 * k2
    k3 = x * _moved(y2)
    y3 = y + h * k3
    k4 = x * _moved(y3)
    return (y, y1, y2, y3), (k1, k2, k3, k4)


def solve(x: np.ndarray, s: int, keep: bool = False):
    """y(2) after s RK4 steps (and the state before each step, with keep)."""
    h = T_FINAL / s
    y, states = np.zeros_like(x), []
    for _ in range(s):
        states.append(y)
        _, (k1, k2, k3, k4) = _stages(x, y, h)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return (y, states) if keep else y


def last_gradient(x: np.ndarray, s: int) -> np.ndarray:
    """d y(2)[-1] / d x, the RK4 steps' adjoints taken backwards."""
    h = T_FINAL / s
    _, states = solve(x, s, keep=True)
    gy = np.zeros_like(x)
    gy[-1] = 1.0
    gx = np.zeros_like(x)
    for y in reversed(states):
        points, _ = _stages(x, y, h)
        gk = [h / 6 * gy, h / 3 * gy, h / 3 * gy, h / 6 * gy]
        g_prev = gy.copy()  # y_{t+1} = y_t + ...: the adjoint passes through
        # stage j = 3, 2, 1, 0 evaluates f at points[j] = y + c_j h k_{j-1}
        for j, c in ((3, 1.0), (2, 0.5), (1, 0.5), (0, None)):
            gx += gk[j] * _moved(points[j])
            g_point = _moved_back(x * gk[j])
            g_prev += g_point
            if c is not None:
                gk[j - 1] = gk[j - 1] + c * h * g_point
        gy = g_prev
    return gx


def reference(data: dict) -> tuple[dict, dict]:
    x, s = data["x"], data["s"]
    return {"y": solve(x, s)}, {"x": last_gradient(x, s)}


def fd_error(data: dict, deriv: dict, eps: float = 1e-6) -> float:
    """Relative error of the directional derivative along a random direction
    (central differences of the numpy solve)."""
    x, s = data["x"], data["s"]
    v = np.random.default_rng(1).standard_normal(x.shape)
    fd = (solve(x + eps * v, s)[-1] - solve(x - eps * v, s)[-1]) / (2 * eps)
    got = float(np.dot(np.ravel(deriv["x"]), v))
    return abs(got - fd) / max(abs(fd), np.finfo(np.float64).tiny)


# --------------------------------------------------------------------------
# symbackprop


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    n, s = sp.symbols("n s", integer=True, positive=True)  # both bound at call time
    x = sp.MatrixSymbol("x", n, 1)
    steps = sp.MatrixSymbol("steps", s, 1)  # the step sizes, h each
    y, h_row = sp.MatrixSymbol("y", n, 1), sp.MatrixSymbol("h", 1, 1)
    h = sbp.as_scalar(h_row)

    def f(v):  # f_0 = x_0, f_i = x_i v_{i-1}
        return sp.HadamardProduct(x, sbp.shift(v, 1, fill=1))

    k1 = f(y)
    k2 = f(y + h / 2 * k1)
    k3 = f(y + h / 2 * k2)
    k4 = f(y + h * k3)
    y_next = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    y_final = sbp.scan(y_next, None, y, h_row, sp.ZeroMatrix(n, 1), steps)
    ones = sp.OneMatrix(n, 1)
    last = nn.sum_all(sp.HadamardProduct(y_final, ones - sbp.shift(ones, -1)))  # y_final[n - 1]
    return sbp.Model("gradbench_ode", inputs=[steps], params=[x], loss=last, outputs={"y": y_final})


SBP_FUNCTIONS = ("forward", "value_and_grad")


def sbp_calls(mod, data: dict):
    x = data["x"].reshape(-1, 1)
    steps = np.full((data["s"], 1), T_FINAL / data["s"])
    return (lambda: {"y": mod.forward(x=x, steps=steps)["y"]},
            lambda: {"x": mod.value_and_grad(x=x, steps=steps)[1]["x"]})


# --------------------------------------------------------------------------
# JAX (lax.scan over the steps, as GradBench's JAX tool) and PyTorch (a Python loop)


def _jax_solve(s: int):
    jax = jax_module()
    import jax.numpy as jnp

    h = T_FINAL / s

    def solve_x(x):
        def f(y):
            return x * jnp.concatenate([jnp.ones(1), y[:-1]])

        def step(y, _):
            k1 = f(y)
            k2 = f(y + h / 2 * k1)
            k3 = f(y + h / 2 * k2)
            k4 = f(y + h * k3)
            return y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), None

        return jax.lax.scan(step, jnp.zeros_like(x), None, length=s)[0]

    return solve_x


def jax_calls(data: dict):
    jax = jax_module()
    solve_x = _jax_solve(data["s"])
    return jax_pair(lambda x: {"y": solve_x(x)}, lambda x: {"x": jax.grad(lambda z: solve_x(z)[-1])(x)},
                    (data["x"],))


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()
    s = data["s"]
    h = T_FINAL / s
    x = torch_tensors({"x": data["x"]}, grad=True)["x"]
    one = torch.ones(1, dtype=x.dtype)

    def solve_x(x):
        def f(y):
            return x * torch.cat([one, y[:-1]])

        y = torch.zeros_like(x)
        for _ in range(s):
            k1 = f(y)
            k2 = f(y + h / 2 * k1)
            k3 = f(y + h / 2 * k2)
            k4 = f(y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y

    fn = torch.compile(solve_x) if compiled else solve_x

    def primal():
        with torch.no_grad():
            return {"y": fn(x)}

    def derivative():
        return {"x": torch.autograd.grad(fn(x)[-1], x)[0]}

    from ._common import first_calls

    return first_calls(primal, derivative, compiled)
