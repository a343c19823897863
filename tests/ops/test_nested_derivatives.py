"""sbp.grad and sbp.jvp inside a model (derivatives as model-building
operations): a gradient penalty, a physics-informed network's second
derivative and a saddle-point objective, each compiled to one C function and
checked against JAX's nested jax.grad/jax.jvp in float64 (1e-10 relative)
and against central differences of the compiled loss; then the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop import nn
from symbackprop.pipeline import generate

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

n = sp.Symbol("n", integer=True, positive=True)


pytestmark = pytest.mark.usefixtures("jax_x64")  # conftest.py


def square(m):
    return m.applyfunc(lambda v: v**2)


def check(mod, arrays: dict, jax_loss, params: tuple[str, ...]) -> None:
    """The compiled loss and gradients equal JAX's (1e-10 relative), and
    the gradients central differences of the compiled loss."""
    loss, grads = mod.value_and_grad(**arrays)
    values = {k: jnp.asarray(v) for k, v in arrays.items()}
    want_loss, want = jax.jit(jax.value_and_grad(lambda p: jax_loss({**values, **p})))({k: values[k] for k in params})
    assert loss == pytest.approx(float(want_loss), rel=1e-10)
    for name in params:
        got = np.reshape(grads[name], np.shape(arrays[name]))
        assert relative_error(got, np.asarray(want[name])) < 1e-10, name
        fd = central_differences(lambda d: mod.forward(**d)["loss"], arrays, name)
        assert relative_error(got, fd) < 1e-6, name


# --- 1. a gradient penalty: ||d D(x) / d x||^2 per row -------------------------

D_IN, D_HIDDEN = 3, 5
X = sp.MatrixSymbol("X", n, D_IN)
W1, b1, W2 = sp.MatrixSymbol("W1", D_IN, D_HIDDEN), sp.MatrixSymbol("b1", 1, D_HIDDEN), sp.MatrixSymbol("W2", D_HIDDEN, 1)
lam = sp.Symbol("lam", real=True)


def critic(x):
    return nn.linear(nn.tanh(nn.linear(x, W1, b1)), W2)


def penalty_model() -> sbp.Model:
    # rows are independent, so the gradient of the sum holds each row's input gradient
    per_row = sbp.grad(nn.sum_all(critic(X)), X)
    loss = sbp.as_scalar(nn.mean_all(critic(X))) + lam * sbp.as_scalar(nn.sum_all(square(per_row)))
    return sbp.Model("gradient_penalty", inputs=[X, lam], params=[W1, b1, W2], loss=loss)


def jax_penalty(v):
    def critic_row(x):
        return (jnp.tanh(x @ v["W1"] + v["b1"][0]) @ v["W2"])[0]

    rows = jax.vmap(jax.grad(critic_row))(v["X"])  # d D(x_row) / d x_row, row by row
    return jnp.mean(jax.vmap(critic_row)(v["X"])) + v["lam"] * jnp.sum(rows**2)


def test_a_gradient_penalty_matches_nested_jax_grad():
    rng = np.random.default_rng(1)
    arrays = {"X": rng.standard_normal((6, D_IN)), "lam": 0.7, "W1": rng.standard_normal((D_IN, D_HIDDEN)),
              "b1": rng.standard_normal((1, D_HIDDEN)), "W2": rng.standard_normal((D_HIDDEN, 1))}
    check(sbp.compile(penalty_model()), arrays, jax_penalty, ("W1", "b1", "W2"))


def test_the_penalty_is_one_function_with_one_tanh_per_hidden_entry():
    """One CSE across the levels: the forward pass's tanh serves the inner
    gradient and the outer one (their derivatives are 1 - tanh^2 of it)."""
    emitted, plan = generate(penalty_model())
    assert [f.kind for f in plan.functions] == ["forward", "value_and_grad"]
    code = [line for line in emitted.source.splitlines() if not line.lstrip().startswith(("/*", "*"))]
    assert sum(line.count("tanh(") for line in code) == 1


# --- 2. a physics-informed network: u'' + f = 0 on (0, 1), u(0) = u(1) = 0 -----

H = 6
x = sp.MatrixSymbol("x", n, 1)  # collocation points
xb = sp.MatrixSymbol("xb", 2, 1)  # the boundary
P1, c1 = sp.MatrixSymbol("P1", 1, H), sp.MatrixSymbol("c1", 1, H)
P2, c2 = sp.MatrixSymbol("P2", H, H), sp.MatrixSymbol("c2", 1, H)
P3, c3 = sp.MatrixSymbol("P3", H, 1), sp.MatrixSymbol("c3", 1, 1)
PINN_PARAMS = ("P1", "c1", "P2", "c2", "P3", "c3")


def network(points):
    return nn.linear(nn.tanh(nn.linear(nn.tanh(nn.linear(points, P1, c1)), P2, c2)), P3, c3)


def pinn_model() -> sbp.Model:
    du = sbp.grad(nn.sum_all(network(x)), x)  # u'(x_i) in row i
    d2u = sbp.grad(nn.sum_all(du), x)  # u''(x_i)
    source = x.applyfunc(lambda v: sp.pi**2 * sp.sin(sp.pi * v))  # u = sin(pi x) solves it
    loss = nn.mean_all(square(d2u + source)) + nn.mean_all(square(network(xb)))
    return sbp.Model("pinn_1d", inputs=[x, xb], params=[sp.MatrixSymbol(p, *s.shape) for p, s in
                                                         zip(PINN_PARAMS, (P1, c1, P2, c2, P3, c3))], loss=loss)


def jax_pinn(v):
    def u(point):
        hidden = jnp.tanh(jnp.tanh(point * v["P1"][0] + v["c1"][0]) @ v["P2"] + v["c2"][0])
        return (hidden @ v["P3"])[0] + v["c3"][0, 0]

    d2u = jax.vmap(jax.grad(jax.grad(u)))(v["x"][:, 0])
    residual = d2u + jnp.pi**2 * jnp.sin(jnp.pi * v["x"][:, 0])
    return jnp.mean(residual**2) + jnp.mean(jax.vmap(u)(v["xb"][:, 0]) ** 2)


def test_a_pinn_second_derivative_loss_matches_nested_jax_grad():
    rng = np.random.default_rng(2)
    shapes = {"P1": (1, H), "c1": (1, H), "P2": (H, H), "c2": (1, H), "P3": (H, 1), "c3": (1, 1)}
    arrays = {"x": rng.uniform(0, 1, (7, 1)), "xb": np.array([[0.0], [1.0]])}
    arrays.update({k: 0.8 * rng.standard_normal(s) for k, s in shapes.items()})
    check(sbp.compile(pinn_model()), arrays, jax_pinn, PINN_PARAMS)


def test_the_inner_derivatives_are_outputs_too():
    """u' and u'' as named outputs equal JAX's, at every point."""
    du = sbp.grad(nn.sum_all(network(x)), x)
    d2u = sbp.grad(nn.sum_all(du), x)
    mod = sbp.compile(sbp.Model("pinn_outputs", inputs=[x], params=[P1, c1, P2, c2, P3, c3],
                                outputs={"du": du, "d2u": d2u}), functions=("forward",))
    rng = np.random.default_rng(3)
    arrays = {"x": rng.uniform(0, 1, (5, 1))}
    arrays.update({p.name: rng.standard_normal(p.shape) for p in (P1, c1, P2, c2, P3, c3)})
    got = mod.forward(**arrays)
    v = {k: jnp.asarray(a) for k, a in arrays.items()}

    def u(point):
        hidden = jnp.tanh(jnp.tanh(point * v["P1"][0] + v["c1"][0]) @ v["P2"] + v["c2"][0])
        return (hidden @ v["P3"])[0] + v["c3"][0, 0]

    for name, fn in (("du", jax.grad(u)), ("d2u", jax.grad(jax.grad(u)))):
        want = np.asarray(jax.vmap(fn)(v["x"][:, 0]))
        assert relative_error(np.ravel(got[name]), want) < 1e-10, name


# --- 3. a saddle-point objective: f(p) + ||grad_q g(p, q)||^2 ------------------

p = sp.MatrixSymbol("p", 3, 1)
q = sp.MatrixSymbol("q", 2, 1)
A = sp.MatrixSymbol("A", 2, 3)
s = sp.Symbol("s", real=True)


def saddle_g():
    coupling = sbp.as_scalar(q.T * A * p.applyfunc(sp.tanh))
    return coupling + s * sbp.as_scalar(nn.sum_all(q.applyfunc(sp.sin))) * sbp.as_scalar(nn.sum_all(square(p)))


def jax_saddle_g(v, q_):
    return (q_ @ v["A"] @ jnp.tanh(v["p"]))[0] + v["s"] * jnp.sum(jnp.sin(q_)) * jnp.sum(v["p"] ** 2)


def test_a_saddle_objective_matches_nested_jax_grad():
    f = sbp.as_scalar(nn.sum_all(p.applyfunc(sp.cos)))
    loss = f + sbp.as_scalar(nn.sum_all(square(sbp.grad(saddle_g(), q)))) + sbp.grad(saddle_g(), s) ** 2
    mod = sbp.compile(sbp.Model("saddle", inputs=[A], params=[p, q, s], loss=loss))

    def jax_loss(v):
        grad_q = jax.grad(lambda q_: jax_saddle_g(v, q_))(v["q"][:, 0])
        grad_s = jax.grad(lambda s_: jax_saddle_g({**v, "s": s_}, v["q"][:, 0]))(v["s"])
        return jnp.sum(jnp.cos(v["p"])) + jnp.sum(grad_q**2) + grad_s**2

    rng = np.random.default_rng(4)
    arrays = {"A": rng.standard_normal((2, 3)), "p": rng.standard_normal((3, 1)), "q": rng.standard_normal((2, 1)),
              "s": 0.9}
    check(mod, arrays, jax_loss, ("p", "q", "s"))


# --- the Jacobian-vector and vector-Jacobian forms ----------------------------


def test_a_hessian_vector_product_and_a_cotangent_inside_the_loss():
    """jvp(grad(g, q), q, v) is the Hessian of g times v; grad of a matrix
    with a cotangent C is the vector-Jacobian product of C."""
    v = sp.MatrixSymbol("v", 2, 1)
    C = sp.MatrixSymbol("C", 3, 1)
    hessian_v = sbp.jvp(sbp.grad(saddle_g(), q), q, v)
    vjp_c = sbp.grad(p.applyfunc(sp.tanh) * s + A.T * q, q, cotangent=C)  # (3 x 1) weighted by C, w.r.t. q
    loss = sbp.as_scalar(nn.sum_all(square(hessian_v))) + sbp.as_scalar(nn.sum_all(vjp_c.applyfunc(sp.sin)))
    mod = sbp.compile(sbp.Model("hvp_inside", inputs=[A, v, C], params=[p, q, s], loss=loss))

    def jax_loss(val):
        def grad_g(q_):
            return jax.grad(lambda r: jax_saddle_g(val, r))(q_)

        _, hv = jax.jvp(grad_g, (val["q"][:, 0],), (val["v"][:, 0],))
        _, pullback = jax.vjp(lambda q_: jnp.tanh(val["p"][:, 0]) * val["s"] + val["A"].T @ q_, val["q"][:, 0])
        (vjp_value,) = pullback(val["C"][:, 0])
        return jnp.sum(hv**2) + jnp.sum(jnp.sin(vjp_value))

    rng = np.random.default_rng(5)
    arrays = {"A": rng.standard_normal((2, 3)), "v": rng.standard_normal((2, 1)), "C": rng.standard_normal((3, 1)),
              "p": rng.standard_normal((3, 1)), "q": rng.standard_normal((2, 1)), "s": -0.4}
    check(mod, arrays, jax_loss, ("p", "q", "s"))


def test_jvp_through_a_scan_is_differentiated_again():
    """Forward mode through a scan gives scan nodes that reverse mode
    differentiates: a directional derivative of a recurrence in the loss."""
    T = sp.Symbol("T", integer=True, positive=True)
    seq, U = sp.MatrixSymbol("seq", T, 2), sp.MatrixSymbol("U", 2, 2)
    h, row = sp.MatrixSymbol("h", 1, 2), sp.MatrixSymbol("row", 1, 2)
    Y = sbp.scan(nn.tanh(h * U + row), h * sp.ones(2, 1), h, row, sp.ZeroMatrix(1, 2), seq)
    loss = nn.sum_all(square(sbp.jvp(Y, U, sp.ones(2, 2))))
    mod = sbp.compile(sbp.Model("jvp_scan", inputs=[seq], params=[U], loss=loss))

    def jax_loss(val):
        def outputs(u):
            def step(state, r):
                new = jnp.tanh(state @ u + r)
                return new, jnp.sum(state)

            return jax.lax.scan(step, jnp.zeros(2), val["seq"])[1]

        _, tangent = jax.jvp(outputs, (val["U"],), (jnp.ones((2, 2)),))
        return jnp.sum(tangent**2)

    rng = np.random.default_rng(6)
    check(mod, {"seq": rng.standard_normal((5, 2)), "U": 0.6 * rng.standard_normal((2, 2))}, jax_loss, ("U",))


# --- refusals ---------------------------------------------------------------


def test_grad_of_a_matrix_needs_a_cotangent():
    with pytest.raises(sbp.ModelError, match="non-scalar expression needs a cotangent"):
        sbp.grad(critic(X), W1)
    with pytest.raises(sbp.ModelError, match="cotangent of grad has shape"):
        sbp.grad(critic(X), W1, cotangent=sp.ones(2, 1))
    with pytest.raises(sbp.ModelError, match="direction of jvp has shape"):
        sbp.jvp(critic(X), W1, sp.ones(2, 1))


def test_grad_is_taken_with_respect_to_an_expression_of_the_model():
    """An intermediate is a point (tests/ops/test_grad_api.py); a string,
    an Index or an undeclared symbol is not."""
    with pytest.raises(sbp.ModelError, match="respect to an input, a param or an expression"):
        sbp.grad(nn.sum_all(critic(X)), "X")
    with pytest.raises(sbp.ModelError, match="the Index"):
        sbp.grad(nn.sum_all(critic(X)), sbp.Index("rows", n))
    stranger = sp.MatrixSymbol("Z", n, D_IN)  # a MatrixSymbol, but not declared
    loss = nn.sum_all(square(sbp.grad(nn.sum_all(critic(X)), stranger)))
    with pytest.raises(sbp.ModelError, match="Z, which is not an input or param of the model"):
        sbp.compile(sbp.Model("undeclared_wrt", inputs=[X], params=[W1, b1, W2], loss=loss))


@pytest.mark.parametrize("make, names", [
    (lambda: nn.sum_all(sbp.reduce("prod", X * W1, 1)), r"sbp\.reduce\('prod'"),
], ids=["prod"])  # grad of a scan is differentiated again: tests/ops/test_scan_second_order.py
def test_an_op_that_cannot_be_differentiated_twice_is_named(make, names):
    loss = nn.sum_all(square(sbp.grad(make(), W1)))
    with pytest.raises(sbp.ModelError, match=names):
        sbp.compile(sbp.Model("twice", inputs=[X], params=[W1], loss=loss))


# --- the example: training converges, as nested torch.autograd.grad does ------


def test_the_pinn_example_trains_as_torch_and_converges_to_the_solution():
    pinn = load_example("pinn_poisson")
    rng = np.random.default_rng(0)
    data = {"x": rng.uniform(0, 1, (256, 1)), "xb": np.array([[0.0], [1.0]])}
    params = pinn.init_params(rng)
    orders = [rng.permutation(256) for _ in range(1000)]
    rates = pinn.learning_rates(1e-2, 1e-4, 1000)
    ours, _ = pinn.train_symbackprop(data, params, orders, 64, rates)
    assert pinn.max_error(ours) < 2e-3 < 0.5 < pinn.max_error(params)  # against sin(pi x)
    pytest.importorskip("torch")
    early, _ = pinn.train_symbackprop(data, params, orders[:20], 64, rates[::50])  # the rate changes every epoch
    theirs, _ = pinn.train_torch(data, params, orders[:20], 64, rates[::50])  # create_graph=True, torch.optim.Adam
    for name in params:
        assert relative_error(early[name], theirs[name]) < 1e-8, name


def test_the_hvp_of_a_loss_that_holds_a_gradient_matches_jax():
    """Forward over reverse over reverse: the module's hvp of the saddle
    loss (which holds grad_q g) against jax.jvp of jax.grad."""
    loss = sbp.as_scalar(nn.sum_all(square(sbp.grad(saddle_g(), q)))) + sbp.as_scalar(nn.sum_all(p.applyfunc(sp.cos)))
    mod = sbp.compile(sbp.Model("saddle_hvp", inputs=[A], params=[p, q, s], loss=loss), functions=("hvp",))
    rng = np.random.default_rng(7)
    arrays = {"A": rng.standard_normal((2, 3)), "p": rng.standard_normal((3, 1)), "q": rng.standard_normal((2, 1)),
              "s": 0.9}
    directions = {"p": rng.standard_normal((3, 1)), "q": rng.standard_normal((2, 1)), "s": -0.3}

    def jax_loss(v):
        grad_q = jax.grad(lambda q_: jax_saddle_g(v, q_))(v["q"][:, 0])
        return jnp.sum(grad_q**2) + jnp.sum(jnp.cos(v["p"]))

    primal = {k: jnp.asarray(arrays[k]) for k in ("p", "q", "s")}
    tangent = {k: jnp.asarray(directions[k]) for k in ("p", "q", "s")}
    _, want = jax.jit(lambda p, t: jax.jvp(jax.grad(lambda w: jax_loss({**w, "A": jnp.asarray(arrays["A"])})), (p,), (t,)))(
        primal, tangent)
    got = mod.hvp(directions, **arrays)
    for name in ("p", "q", "s"):
        assert relative_error(np.reshape(got[name], np.shape(want[name])), np.asarray(want[name])) < 1e-10, name


def test_the_entries_of_a_gradient_over_entries_are_scalars_in_one_loop():
    """The gradient of a function of a 1 x 2 matrix's entries is a sum of
    one-hot packs (reverse mode through each entry); an entry of it read
    by the loss is that entry's own arithmetic: no matrix is stored for it,
    the forward pass is one fused loop, and the values match JAX."""
    v = sp.MatrixSymbol("v", 1, 2)
    g = sbp.grad(v[0, 0] ** 2 * v[0, 1] + sp.sin(v[0, 1]) * v[0, 0], v)
    model = sbp.Model("grad_entries", inputs=[], params=[v], loss=g[0, 0] * g[0, 1] + sp.exp(g[0, 1]))
    emitted, _ = generate(model, functions=("forward",))
    forward = emitted.source.split("_forward(", 1)[1]
    assert forward.count("for (int64_t") == 0, "an entry of the gradient was stored as a matrix"

    def jax_loss(p):
        grad = jax.grad(lambda w: w[0, 0] ** 2 * w[0, 1] + jnp.sin(w[0, 1]) * w[0, 0])(p["v"])
        return grad[0, 0] * grad[0, 1] + jnp.exp(grad[0, 1])

    check(sbp.compile(model), {"v": np.array([[0.7, -1.3]])}, jax_loss, ("v",))
