"""GradBench `saddle`: a saddle point by nested gradient descent.

Definition (evals/saddle/README.md; the algorithm of GradBench's tools, e.g.
tools/futhark/saddle.fut and solver.fut): f(p1, p) = |p1|^2 - |p|^2 over R^2 x R^2;
from a start s, r1 = argmin_{p1} max_p f(p1, p) and then r2 = argmax_p f(r1, p),
each by `multivariate_argmin` (argmax: of -f) started at s: eta = 1e-5 and
i = 0; stop when |g(x)| <= 1e-5; every 10 accepted steps double eta; the
candidate x' = x - eta g(x); stop when |x - x'| <= 1e-5; accept x' when
f(x') < f(x) (i += 1), else halve eta (i = 0). The output is (r1, r2); the
eval's expected output (python/gradbench/gradbench/evals/saddle/run.py) is
8.246324826140356e-06 four times, for s = (1, 1).

The symbackprop model: each argmin is one `sbp.fixed_point` whose state is
(x, f(x), g(x), eta, i) and whose step is the algorithm's branches as a
Piecewise per entry; a stop returns the state unchanged, and with tol=0 the
loop stops on the first unchanged state. The first step only evaluates
f and g at s (g starts at 0, so x' = x; the loop runs one step more than
GradBench's count). The outer argmin's step holds the inner argmax (a
fixed point inside a fixed point's step: emitted inside the outer loop's
body), and the gradient g(x') of the outer objective R(q) = f(q, p*(q)) is
`sbp.grad(R(x - eta g), x)` (the candidate is an expression of the state; its
gradient with respect to x is R's gradient at x', as dx'/dx = I). Reverse
mode at both levels ("rr"); the other three variants would give the same
output and are not ported.

What is exact: the inner argmax is differentiated by diff="implicit". At
its last state the step takes the stop branch, the identity: every entry
is frozen (docs/fixed_point.md), so its adjoint is 0 (solved directly: the
state has 7 entries) and dR/dq = df/dq(q, p*), the envelope theorem at the
computed p*. Here p* does not depend on q at all (f separates; the inner
loop does not read q and is lowered once, outside the outer loop), so that
is the exact derivative of the computed R, 2q, as JAX's jacfwd through the
while loop gives; for a coupled f it would be the envelope theorem's value,
exact only where p* is an exact maximiser. `derivative` is that nested
gradient, dR/dq at q = s. The selects are `sbp.where`s (a Piecewise as it
stands: SymPy's would fold the inner loop's step into the outer one).

Where the API bends GradBench's text: |x - x'| is computed as |eta g| (SymPy
simplifies x - (x - eta g)), which differs only by rounding.
"""

from __future__ import annotations

import numpy as np

from ._common import first_calls, jax_module, jax_pair, torch_module

NAME = "saddle"
PRIMAL, DERIVATIVE = "primal", "gradient"
TOL_G = TOL_X = 1e-5
ETA0 = 1e-5
MAX_ITER = 400  # each loop's bound (GradBench's have none; 171 steps from (1, 1))
EXPECTED = 8.246324826140356e-06  # GradBench's expected output, each of the four numbers, from (1, 1)
SIZES = [{"start": (1.0, 1.0)}]
DEFAULT = SMALL = SIZES[0]
SCALING: list = []


def label(size: dict) -> str:
    return "start=" + ",".join(f"{v:g}" for v in size["start"])


def work(size: dict) -> float:
    return 1.0


def generate(size: dict) -> dict:
    return {"start": np.array(size["start"], dtype=np.float64)}


def f(p1, p):
    return (p1[0] ** 2 + p1[1] ** 2) - (p[0] ** 2 + p[1] ** 2)


# --------------------------------------------------------------------------
# numpy: GradBench's algorithm with the gradients written by hand


def argmin(fn, grad, x, sqrt=np.sqrt):
    """GradBench's multivariate_argmin; sqrt is the array library's (numpy's, torch's)."""
    fx, gx, eta, i = fn(x), grad(x), ETA0, 0
    while True:
        if sqrt(gx @ gx) <= TOL_G:
            return x
        if i == 10:
            eta, i = 2 * eta, 0
            continue
        xp = x - eta * gx
        if sqrt((x - xp) @ (x - xp)) <= TOL_X:
            return x
        fxp = fn(xp)
        if fxp < fx:
            x, fx, gx, i = xp, fxp, grad(xp), i + 1
        else:
            eta, i = eta / 2, 0


def _inner(q: np.ndarray, start: np.ndarray) -> np.ndarray:
    return argmin(lambda p: -f(q, p), lambda p: 2 * p, start)  # d(-f)/dp = 2p


def reference(data: dict) -> tuple[dict, dict]:
    s = data["start"]
    r1 = argmin(lambda q: f(q, _inner(q, s)), lambda q: 2 * q, s)  # dR/dq = 2q (p* does not depend on q)
    r2 = _inner(r1, s)
    return {"xy": np.concatenate([r1, r2])}, {"q": 2 * s}


# --------------------------------------------------------------------------
# symbackprop


def _argmin_loop(fn, x, init, prefix: str):
    """GradBench's multivariate_argmin of fn (a 1 x n expression -> a
    scalar) over the state x (1 x n), from init, as a fixed point."""
    import sympy as sp

    import symbackprop as sbp

    n = x.shape[1]
    fx, gx = sp.MatrixSymbol(f"{prefix}fx", 1, 1), sp.MatrixSymbol(f"{prefix}gx", 1, n)
    eta, i = sp.MatrixSymbol(f"{prefix}eta", 1, 1), sp.MatrixSymbol(f"{prefix}i", 1, 1)
    e, k, fv = eta[0, 0], i[0, 0], fx[0, 0]
    xp = sp.Matrix(1, n, lambda r, c: x[r, c] - e * gx[r, c])
    first = sp.Eq(k, -1, evaluate=False)  # evaluate f and g at the start (gx = 0 there: xp = x)
    stop_g = sp.LessThan(sp.sqrt(sum(gx[0, c] ** 2 for c in range(n))), TOL_G, evaluate=False)
    double = sp.Eq(k, 10, evaluate=False)
    stop_x = sp.LessThan(sp.sqrt(sum((x[0, c] - xp[0, c]) ** 2 for c in range(n))), TOL_X, evaluate=False)
    fxp = fn(xp)
    better = sp.StrictLessThan(fxp, fv, evaluate=False)
    gxp = sbp.grad(fn(xp), x)  # d fn(x - eta gx) / dx: fn's gradient at xp

    def pick(keep, doubled, moved, halved, at_first=None):
        where = sbp.where  # as it stands: SymPy's Piecewise would fold the inner loop's step into it
        rest = where(stop_g, keep, where(double, doubled, where(stop_x, keep, where(better, moved, halved))))
        return where(first, keep if at_first is None else at_first, rest)

    step = (sp.Matrix(1, n, lambda r, c: pick(x[r, c], x[r, c], xp[0, c], x[r, c])),
            sp.Matrix([[pick(fv, fv, fxp, fv, fxp)]]),
            sp.Matrix(1, n, lambda r, c: pick(gx[r, c], gx[r, c], gxp[r, c], gx[r, c], gxp[r, c])),
            sp.Matrix([[pick(e, 2 * e, e, e / 2)]]),
            sp.Matrix([[pick(k, 0, k + 1, 0, sp.Integer(0))]]))
    inits = (init, sp.ZeroMatrix(1, 1), sp.ZeroMatrix(1, n), sp.Matrix([[ETA0]]), sp.Matrix([[-1]]))
    return sbp.fixed_point(step, (x, fx, gx, eta, i), inits, tol=0.0, max_iter=MAX_ITER, diff="implicit")[0]


def _symbols():
    import sympy as sp

    def fs(p1, p):
        return (p1[0, 0] ** 2 + p1[0, 1] ** 2) - (p[0, 0] ** 2 + p[0, 1] ** 2)

    start = sp.MatrixSymbol("start", 1, 2)

    def inner_max(q, prefix):  # R(q) = f(q, argmax_p f(q, p)), the argmax from start
        p_star = _argmin_loop(lambda v: -fs(q, v), sp.MatrixSymbol(f"{prefix}p", 1, 2), start, prefix)
        return fs(q, p_star)

    return sp, fs, start, inner_max


def build_models(size: dict) -> dict:
    import symbackprop as sbp
    from symbackprop.declare import nn

    sp, fs, start, inner_max = _symbols()
    r1 = _argmin_loop(lambda v: inner_max(v, "in_"), sp.MatrixSymbol("x", 1, 2), start, "out_")
    r2 = _argmin_loop(lambda v: -fs(r1, v), sp.MatrixSymbol("y", 1, 2), start, "max_")
    saddle = sbp.Model("gradbench_saddle", inputs=[start], params=[], loss=nn.sum_all(r1), outputs={"x": r1, "y": r2})
    q = sp.MatrixSymbol("q", 1, 2)
    value = sbp.Model("gradbench_saddle_grad", inputs=[start], params=[q], loss=inner_max(q, "in_"))
    return {"saddle": saddle, "grad": value}


SBP_FUNCTIONS = {"saddle": ("forward",), "grad": ("value_and_grad",)}  # what sbp_calls calls


def sbp_calls(mods, data: dict):
    s = data["start"].reshape(1, 2)

    def primal():
        out = mods["saddle"].forward(start=s)
        return {"xy": np.concatenate([out["x"][0], out["y"][0]])}

    return primal, lambda: {"q": mods["grad"].value_and_grad(start=s, q=s)[1]["q"][0]}


# --------------------------------------------------------------------------
# JAX: the same algorithm as a lax.while_loop; the outer gradient by forward
# mode (jax.jacfwd: reverse mode does not go through a while loop), the
# inner by reverse mode ("fr")


def _jax_argmin(fn, grad, x):
    jax = jax_module()
    import jax.numpy as jnp

    def body(s):
        x, fx, gx, eta, i, _ = s
        xp = x - eta * gx
        fxp = fn(xp)
        stop = (jnp.sqrt(gx @ gx) <= TOL_G) | ((i != 10) & (jnp.sqrt((x - xp) @ (x - xp)) <= TOL_X))
        better = (i != 10) & (fxp < fx)
        gxp = grad(xp)
        moved = ~stop & better
        new_x = jnp.where(moved, xp, x)
        new_f = jnp.where(moved, fxp, fx)
        new_g = jnp.where(moved, gxp, gx)
        new_eta = jnp.where(stop | better, eta, jnp.where(i == 10, 2 * eta, eta / 2))
        new_i = jnp.where(stop, i, jnp.where(moved, i + 1, 0))
        return new_x, new_f, new_g, new_eta, new_i, ~stop

    init = (x, fn(x), grad(x), jnp.asarray(ETA0), jnp.asarray(0), jnp.asarray(True))
    return jax.lax.while_loop(lambda s: s[5], body, init)[0]


def _jax_parts():
    jax = jax_module()

    def inner(q, s):
        return _jax_argmin(lambda p: -f(q, p), jax.grad(lambda p: -f(q, p)), s)

    def big_r(q, s):
        return f(q, inner(q, s))

    def saddle(s):
        r_grad = jax.jacfwd(big_r)
        r1 = _jax_argmin(lambda q: big_r(q, s), lambda q: r_grad(q, s), s)
        import jax.numpy as jnp

        return jnp.concatenate([r1, inner(r1, s)])

    return saddle, jax.jacfwd(big_r)


def jax_calls(data: dict):
    saddle, r_grad = _jax_parts()
    return jax_pair(lambda s: {"xy": saddle(s)}, lambda s: {"q": r_grad(s, s)}, (data["start"],))


# --------------------------------------------------------------------------
# PyTorch: the same algorithm in Python, gradients by torch.autograd.grad


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()

    def t_argmin(fn, x):
        def grad(v):
            with torch.enable_grad():
                v = v.detach().requires_grad_(True)
                return torch.autograd.grad(fn(v), v)[0]

        return argmin(fn, grad, x, sqrt=torch.sqrt)

    s = torch.tensor(data["start"], dtype=torch.float64)

    def big_r(q):
        p_star = t_argmin(lambda p: -f(q.detach(), p), s).detach()
        return f(q, p_star)  # p* held fixed: the envelope theorem (p* does not depend on q here)

    def primal():
        r1 = t_argmin(big_r, s).detach()
        r2 = t_argmin(lambda p: -f(r1, p), s).detach()
        return {"xy": torch.cat([r1, r2])}

    def derivative():
        q = s.clone().requires_grad_(True)
        return {"q": torch.autograd.grad(big_r(q), q)[0]}

    return first_calls(primal, derivative, compiled)
