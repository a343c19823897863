"""GradBench `particle`: the control that steers a charged particle to the origin.

Definition (evals/particle/README.md; the algorithm of GradBench's tools, e.g.
tools/futhark/particle.fut): two unit charges at (10, 10 - w) and (10, 0)
make the potential p(x; w) = sum 1 / |x - c|; the particle starts at x = (0, 8)
with velocity (0.75, 0) and moves by Euler steps of dt = 0.1 with
acceleration -grad_x p, while the next position's y is > 0: x' = x + dt v,
v' = v - dt grad_x p(x). At the last x above the axis, t_f = -x_1 / v_1 and
naive_euler(w) = (x_0 + t_f v_0)^2. The output is the argmin over w of
naive_euler by `multivariate_argmin` from w0 (saddle.py's docstring has the
algorithm). The eval's expected output (python/gradbench/gradbench/evals/
particle/run.py) is 0.2071918746486116 from w0 = 0, for each of the four
variants (ff, fr, rf, rr: which AD mode the argmin and the Euler loop use).

The symbackprop model: the Euler loop is one `sbp.fixed_point` with tol=0
whose state is (x, v) and whose step takes the move when x_1 + dt v_1 > 0
and otherwise returns the state unchanged, so the loop stops on the first
unchanged state (one step more than the moves; 352 moves from w = 0). Its
acceleration is `sbp.grad(p(x), x)` inside the step. The argmin is saddle's
`_argmin_loop` (a fixed point whose step holds the Euler loop and
`sbp.grad` of naive_euler through it). Reverse mode at both levels ("rr").

Which derivative is exact: the Euler loop is differentiated by
diff="unrolled", the derivative of the steps that ran (the stopping test
and the branch are piecewise constant in w): exact for the computed
function. diff="implicit" would be wrong, not only slow: at the last state
the step is the identity, which does not read w, so the implicit function
theorem gives d naive_euler / dw through x* = 0 (and its adjoint iteration,
with d step / d state = I there, never converges). `derivative` is
d naive_euler / dw at w0, the gradient the argmin starts with.

The numpy reference carries d/dw along the Euler steps by hand (forward
mode, grad_x p's Jacobian written out): an oracle independent of every AD
tool; `fd_error` checks the derivative against central differences.
"""

from __future__ import annotations

import numpy as np

from ._common import first_calls, jax_module, jax_pair, torch_module
from .saddle import _argmin_loop, _jax_argmin, argmin

NAME = "particle"
PRIMAL, DERIVATIVE = "primal", "gradient"
DT = 0.1
X0, V0 = (0.0, 8.0), (0.75, 0.0)
EULER_MAX_ITER = 1000  # the Euler loop's bound (GradBench's has none; 352 moves from w = 0, 359 at w*)
EXPECTED = 0.2071918746486116  # GradBench's expected output, from w0 = 0
SIZES = [{"w0": 0.0}]
DEFAULT = SMALL = SIZES[0]
SCALING: list = []


def label(size: dict) -> str:
    return f"w0={size['w0']:g}"


def work(size: dict) -> float:
    return 1.0


def generate(size: dict) -> dict:
    return {"w0": np.array([size["w0"]], dtype=np.float64)}


# --------------------------------------------------------------------------
# numpy: the primal, and d/dw carried along by hand (forward mode)


def _charges(w: float) -> tuple:
    return np.array([10.0, 10.0 - w]), np.array([10.0, 0.0])


def _accel(x: np.ndarray, dx: np.ndarray, w: float) -> tuple[np.ndarray, np.ndarray]:
    """-grad_x p(x; w) and its derivative along (dx, dw = 1): for one
    charge, -grad = d / r^3 (d = x - c) and its Jacobian I / r^3 - 3 d d^T / r^5;
    the first charge moves with w (dc/dw = (0, -1), so dd/dw = (0, 1))."""
    a, da = np.zeros(2), np.zeros(2)
    for c, dd in zip(_charges(w), (dx + np.array([0.0, 1.0]), dx)):
        d = x - c
        r = np.sqrt(d @ d)
        a += d / r**3
        da += dd / r**3 - 3 * d * (d @ dd) / r**5
    return a, da


def naive_euler(w: float) -> tuple[float, float]:
    """naive_euler(w) and its derivative with respect to w."""
    x, v, dx, dv = np.array(X0), np.array(V0), np.zeros(2), np.zeros(2)
    while x[1] + DT * v[1] > 0:
        a, da = _accel(x, dx, w)
        x, v, dx, dv = x + DT * v, v + DT * a, dx + DT * dv, dv + DT * da
    t, dt_f = -x[1] / v[1], -dx[1] / v[1] + x[1] * dv[1] / v[1] ** 2
    end, d_end = x[0] + t * v[0], dx[0] + dt_f * v[0] + t * dv[0]
    return end**2, 2 * end * d_end


def reference(data: dict) -> tuple[dict, dict]:
    w0 = data["w0"]
    w_star = argmin(lambda w: naive_euler(w[0])[0], lambda w: np.array([naive_euler(w[0])[1]]), w0)
    return {"w": w_star}, {"w": np.array([naive_euler(w0[0])[1]])}


def fd_error(data: dict, deriv: dict, eps: float = 1e-6) -> float:
    """Relative error of the derivative against central differences of the
    numpy primal (its step count is the same at w0 +- eps)."""
    w0 = data["w0"][0]
    fd = (naive_euler(w0 + eps)[0] - naive_euler(w0 - eps)[0]) / (2 * eps)
    return float(abs(np.ravel(deriv["w"])[0] - fd) / abs(fd))


# --------------------------------------------------------------------------
# symbackprop


def _naive_euler(w):
    """naive_euler of the scalar expression w: the Euler loop as a fixed
    point (tol=0: it stops on the first step that does not move)."""
    import sympy as sp

    import symbackprop as sbp

    x, v = sp.MatrixSymbol("ex", 1, 2), sp.MatrixSymbol("ev", 1, 2)
    charges = ((10, 10 - w), (10, 0))
    p = sum(1 / sp.sqrt((x[0, 0] - cx) ** 2 + (x[0, 1] - cy) ** 2) for cx, cy in charges)
    a = -sbp.grad(p, x)
    moves = sp.StrictGreaterThan(x[0, 1] + DT * v[0, 1], 0, evaluate=False)

    def pick(moved, kept):
        return sp.Piecewise((moved, moves), (kept, True))

    step = (sp.Matrix(1, 2, lambda r, c: pick(x[r, c] + DT * v[r, c], x[r, c])),
            sp.Matrix(1, 2, lambda r, c: pick(v[r, c] + DT * a[r, c], v[r, c])))
    xf, vf = sbp.fixed_point(step, (x, v), (sp.Matrix([list(X0)]), sp.Matrix([list(V0)])),
                             tol=0.0, max_iter=EULER_MAX_ITER, diff="unrolled")
    t_f = -xf[0, 1] / vf[0, 1]
    return (xf[0, 0] + t_f * vf[0, 0]) ** 2


def build_models(size: dict) -> dict:
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    w0 = sp.MatrixSymbol("w0", 1, 1)
    w_star = _argmin_loop(lambda v: _naive_euler(v[0, 0]), sp.MatrixSymbol("w", 1, 1), w0, "arg_")
    particle = sbp.Model("gradbench_particle", inputs=[w0], params=[], loss=nn.sum_all(w_star),
                         outputs={"w": w_star})
    w = sp.MatrixSymbol("w", 1, 1)
    value = sbp.Model("gradbench_particle_grad", inputs=[], params=[w], loss=_naive_euler(w[0, 0]))
    return {"particle": particle, "grad": value}


SBP_FUNCTIONS = {"particle": ("forward",), "grad": ("value_and_grad",)}  # what sbp_calls calls


def sbp_calls(mods, data: dict):
    w0 = data["w0"].reshape(1, 1)

    def primal():
        return {"w": mods["particle"].forward(w0=w0)["w"][0]}

    return primal, lambda: {"w": mods["grad"].value_and_grad(w=w0)[1]["w"][0]}


# --------------------------------------------------------------------------
# JAX: the Euler loop as a lax.while_loop; d/dw by forward mode (jax.jacfwd:
# reverse mode does not go through a while loop), grad_x p by reverse mode
# ("fr")


def _jax_naive_euler(w):
    jax = jax_module()
    import jax.numpy as jnp

    def p(x):
        return (1 / jnp.sqrt((x[0] - 10.0) ** 2 + (x[1] - (10.0 - w)) ** 2)
                + 1 / jnp.sqrt((x[0] - 10.0) ** 2 + x[1] ** 2))

    def body(s):
        x, v, _ = s
        moves = x[1] + DT * v[1] > 0
        return jnp.where(moves, x + DT * v, x), jnp.where(moves, v - DT * jax.grad(p)(x), v), moves

    init = (jnp.array(X0), jnp.array(V0), jnp.asarray(True))
    x, v, _ = jax.lax.while_loop(lambda s: s[2], body, init)
    return (x[0] - x[1] / v[1] * v[0]) ** 2


def jax_calls(data: dict):
    jax = jax_module()

    def primal(w0):
        return {"w": _jax_argmin(lambda w: _jax_naive_euler(w[0]), jax.jacfwd(lambda w: _jax_naive_euler(w[0])), w0)}

    def derivative(w0):
        return {"w": jax.jacfwd(lambda w: _jax_naive_euler(w[0]))(w0)}

    return jax_pair(primal, derivative, (data["w0"],))


# --------------------------------------------------------------------------
# PyTorch: the same loops in Python; grad_x p by torch.autograd.grad with
# create_graph (so d/dw goes through it), d/dw by reverse mode ("rr")


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()

    def naive_euler_t(w):
        track = w.requires_grad  # d/dw wanted: grad_x p keeps its graph
        x, v = torch.tensor(X0, dtype=torch.float64), torch.tensor(V0, dtype=torch.float64)
        c1 = torch.stack([torch.tensor(10.0, dtype=torch.float64), 10.0 - w])
        c2 = torch.tensor([10.0, 0.0], dtype=torch.float64)
        with torch.enable_grad():
            while x[1] + DT * v[1] > 0:
                xg = x if x.requires_grad else x.detach().requires_grad_(True)
                p = 1 / torch.linalg.vector_norm(xg - c1) + 1 / torch.linalg.vector_norm(xg - c2)
                g = torch.autograd.grad(p, xg, create_graph=track)[0]
                x, v = x + DT * v, v - DT * g
        return (x[0] - x[1] / v[1] * v[0]) ** 2

    def grad(w):
        with torch.enable_grad():
            w = w.detach().requires_grad_(True)
            return torch.autograd.grad(naive_euler_t(w[0]), w)[0]

    w0 = torch.tensor(data["w0"], dtype=torch.float64)

    def primal():  # GradBench's argmin (saddle.argmin) over torch's values and gradients
        w_star = argmin(lambda w: float(naive_euler_t(torch.from_numpy(w)[0])),
                        lambda w: grad(torch.from_numpy(w)).numpy(), w0.numpy())
        return {"w": torch.from_numpy(w_star)}

    return first_calls(primal, lambda: {"w": grad(w0)}, compiled)
