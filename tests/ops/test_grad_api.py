"""sbp.grad and sbp.jvp at an intermediate expression (WGAN-GP's gradient
penalty at the interpolate xhat = eps x + (1 - eps) y) and of a function of
the point, against PyTorch's nested autograd in float64 (1e-10 relative);
grad and jvp inside a map's body by the body's own symbols, against closed
forms; a 1x1 sympy.Matrix as the loss."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from oracles import relative_error

import symbackprop as sbp
from symbackprop import nn
from symbackprop.pipeline import generate

n = sp.Symbol("n", integer=True, positive=True)
D_IN, H = 3, 5
x, y = sp.MatrixSymbol("x", n, D_IN), sp.MatrixSymbol("y", n, D_IN)
eps = sp.MatrixSymbol("eps", n, 1)
W1, b1, W2 = sp.MatrixSymbol("W1", D_IN, H), sp.MatrixSymbol("b1", 1, H), sp.MatrixSymbol("W2", H, 1)
LAM = 10.0


def critic(v):
    return nn.linear(nn.tanh(nn.linear(v, W1, b1)), W2)


def interpolate():
    wide = sp.OneMatrix(1, D_IN)
    return sp.HadamardProduct(eps * wide, x) + sp.HadamardProduct((sp.OneMatrix(n, 1) - eps) * wide, y)


def penalty(g):
    """mean over rows of (||g_row|| - 1)^2"""
    return nn.mean_all(nn.row_sums(g.applyfunc(lambda v: v**2)).applyfunc(lambda s: (sp.sqrt(s) - 1) ** 2))


def wgan_gp(g) -> sbp.Model:
    loss = nn.mean_all(critic(y)) - nn.mean_all(critic(x)) + LAM * penalty(g)
    return sbp.Model("wgan_gp", inputs=[x, y, eps], params=[W1, b1, W2], grad_inputs=[x], loss=loss,
                     outputs={"penalty": penalty(g)})


def arrays(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((6, D_IN)), "y": rng.standard_normal((6, D_IN)), "eps": rng.uniform(size=(6, 1)),
            "W1": rng.standard_normal((D_IN, H)), "b1": rng.standard_normal((1, H)), "W2": rng.standard_normal((H, 1))}


def torch_wgan_gp(data: dict):
    torch = pytest.importorskip("torch")
    t = {k: torch.tensor(a, dtype=torch.float64, requires_grad=k in ("W1", "b1", "W2", "x")) for k, a in data.items()}

    def d(v):
        return torch.tanh(v @ t["W1"] + t["b1"]) @ t["W2"]

    xhat = t["eps"] * t["x"] + (1 - t["eps"]) * t["y"]
    (g,) = torch.autograd.grad(d(xhat).sum(), xhat, create_graph=True)
    pen = ((g.pow(2).sum(dim=1).sqrt() - 1) ** 2).mean()
    loss = d(t["y"]).mean() - d(t["x"]).mean() + LAM * pen
    loss.backward()
    return loss.item(), pen.item(), {k: t[k].grad.numpy() for k in ("W1", "b1", "W2", "x")}


@pytest.mark.parametrize("form", ["expression", "function"])
def test_the_wgan_gp_penalty_at_the_interpolate_matches_torch(form):
    """grad(D(xhat), xhat), written with xhat itself or as a function of the
    point: the penalty, the loss and every gradient (the data x's too:
    past the point its derivative is the interpolate's) equal PyTorch's."""
    xhat = interpolate()
    g = (sbp.grad(nn.sum_all(critic(xhat)), xhat) if form == "expression"
         else sbp.grad(lambda v: nn.sum_all(critic(v)), xhat))
    mod = sbp.compile(wgan_gp(g))
    data = arrays()
    loss, grads = mod.value_and_grad(**data)
    want_loss, want_pen, want = torch_wgan_gp(data)
    assert loss == pytest.approx(want_loss, rel=1e-10)
    assert mod.forward(**data)["penalty"] == pytest.approx(want_pen, rel=1e-10)
    for name, expected in want.items():
        assert relative_error(grads[name], expected) < 1e-10, name


def test_the_critic_at_the_point_is_computed_once_for_the_loss_and_the_penalty():
    """D(xhat) in the loss and the gradient at xhat read one forward pass
    (the point's own symbol is replaced by its value once differentiated):
    one tanh in the C, as the plain gradient penalty's."""
    xhat = interpolate()
    g = sbp.grad(nn.sum_all(critic(xhat)), xhat)
    emitted, _ = generate(sbp.Model("once", inputs=[x, y, eps], params=[W1, b1, W2],
                                    loss=nn.mean_all(critic(xhat)) + penalty(g)))
    code = [line for line in emitted.source.splitlines() if not line.lstrip().startswith(("/*", "*"))]
    assert sum(line.count("tanh(") for line in code) == 1


def test_a_function_of_a_leaf_moves_only_its_argument():
    """grad(lambda q: f(q, p(x)), x): p(x) stays fixed, as jax.grad of f in
    its first argument at x (closed form: d/dq sum(q * tanh(x)^2) = tanh(x)^2)."""
    f = sbp.grad(lambda q: nn.sum_all(sp.HadamardProduct(q, x.applyfunc(lambda v: sp.tanh(v) ** 2))), x)
    total = sbp.grad(nn.sum_all(sp.HadamardProduct(x, x.applyfunc(lambda v: sp.tanh(v) ** 2))), x)
    mod = sbp.compile(sbp.Model("of_leaf", inputs=[x], outputs={"f": f, "total": total}), functions=("forward",))
    data = {"x": np.random.default_rng(1).standard_normal((4, D_IN))}
    out = mod.forward(**data)
    t = np.tanh(data["x"])
    assert relative_error(out["f"], t**2) < 1e-14
    assert relative_error(out["total"], t**2 + 2 * data["x"] * t * (1 - t**2)) < 1e-14


def test_grad_at_a_hidden_layer_matches_torch():
    """A hidden activation h as the point: the layer above it shares nn's
    tanh (and its bound variable) with h, and reads W1 only through h."""
    torch = pytest.importorskip("torch")
    hidden = nn.tanh(nn.linear(x, W1, b1))
    g = sbp.grad(nn.sum_all(nn.tanh(hidden * W2)), hidden)
    mod = sbp.compile(sbp.Model("at_hidden", inputs=[x], params=[W1, b1, W2],
                                loss=nn.sum_all(g.applyfunc(lambda s: s**2))))
    data = {k: arrays(4)[k] for k in ("x", "W1", "b1", "W2")}
    t = {k: torch.tensor(a, dtype=torch.float64, requires_grad=k != "x") for k, a in data.items()}
    h = torch.tanh(t["x"] @ t["W1"] + t["b1"])
    (want_g,) = torch.autograd.grad(torch.tanh(h @ t["W2"]).sum(), h, create_graph=True)
    want = (want_g**2).sum()
    want.backward()
    loss, grads = mod.value_and_grad(**data)
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for name in ("W1", "b1", "W2"):
        assert relative_error(grads[name], t[name].grad.numpy()) < 1e-10, name


def test_jvp_at_the_interpolate_matches_torch_forward_mode():
    torch = pytest.importorskip("torch")
    from torch.func import jvp

    direction = sp.MatrixSymbol("direction", n, D_IN)
    tangent = sbp.jvp(lambda v: critic(v), interpolate(), direction)
    mod = sbp.compile(sbp.Model("jvp_at", inputs=[x, y, eps, direction], params=[W1, b1, W2],
                                outputs={"t": tangent}), functions=("forward",))
    data = {**arrays(2), "direction": np.random.default_rng(3).standard_normal((6, D_IN))}
    t = {k: torch.tensor(a, dtype=torch.float64) for k, a in data.items()}
    xhat = t["eps"] * t["x"] + (1 - t["eps"]) * t["y"]
    _, want = jvp(lambda v: torch.tanh(v @ t["W1"] + t["b1"]) @ t["W2"], (xhat,), (t["direction"],))
    assert relative_error(mod.forward(**data)["t"], want.numpy()) < 1e-10


def test_a_point_grad_cannot_see_is_refused_with_what_to_write():
    xhat = interpolate()
    z = sp.MatrixSymbol("z", n, D_IN)
    with pytest.raises(sbp.ModelError, match=r"does not hold as written.*lambda v"):
        sbp.grad(nn.sum_all(xhat + z), xhat)  # SymPy merges the sums
    with pytest.raises(sbp.ModelError, match=r"also reads x other than through it.*lambda v"):
        sbp.grad(nn.sum_all(critic(xhat)) + nn.sum_all(critic(x)), xhat)
    with pytest.raises(sbp.ModelError, match="the Index"):
        sbp.grad(nn.sum_all(critic(x)), sbp.Index("rows", n))
    with pytest.raises(sbp.ModelError, match="an input, a param or an expression"):
        sbp.grad(nn.sum_all(critic(x)), "x")


# --- inside a map's body --------------------------------------------------------

N = sp.Symbol("N", integer=True, positive=True)
X = sp.MatrixSymbol("X", N, 1)
w = sp.Symbol("w", real=True)
v = sp.Symbol("v", real=True)
VALUES = np.array([[0.3], [-1.2], [2.0]])


def map_loss(body):
    mod = sbp.compile(sbp.Model("in_body", inputs=[X], params=[w], loss=nn.sum_all(sbp.map_examples(body, [(v, X)]))))
    return mod.value_and_grad(X=VALUES, w=0.7)


def test_grad_and_jvp_by_a_body_symbol_inside_a_map():
    """d/dv sin(wv)^2 = w sin(2wv); d/dw of it = v sin(2wv); jvp by w along
    3: 3 v sin(2wv); summed over examples, and their gradients by w."""
    value, grads = map_loss(sbp.grad(sp.sin(w * v) ** 2, v) + sbp.grad(sp.sin(w * v) ** 2, w)
                            + sbp.jvp(sp.sin(w * v) ** 2, w, 3))
    s, c, k = np.sin(2 * 0.7 * VALUES), np.cos(2 * 0.7 * VALUES), 0.7
    assert value == pytest.approx(float(np.sum(k * s + 4 * VALUES * s)), rel=1e-13)
    want = np.sum(s + 2 * k * VALUES * c + 4 * 2 * VALUES**2 * c)
    assert grads["w"] == pytest.approx(float(want), rel=1e-13)


def test_a_second_grad_a_point_and_a_seed_inside_a_map_and_one_of_a_matrix_is_named():
    value, _ = map_loss(sbp.grad(sbp.grad(sp.sin(w * v) ** 2, v), v))  # 2 w^2 cos(2wv)
    assert value == pytest.approx(float(np.sum(2 * 0.49 * np.cos(1.4 * VALUES))), rel=1e-13)
    value, _ = map_loss(sbp.grad(lambda u: sp.sin(u) ** 2, w * v) + sbp.grad(w**2, w, cotangent=v))
    assert value == pytest.approx(float(np.sum(np.sin(1.4 * VALUES) + 1.4 * VALUES)), rel=1e-13)  # sin(2u), 2w v
    M = sp.MatrixSymbol("M", 2, 1)
    with pytest.raises(sbp.ModelError, match="inside a map's body, grad takes a scalar expression"):
        sbp.map_examples(sbp.grad(v * M[0, 0], M)[0, 0], [(v, X)])


# --- a 1x1 Matrix as the loss ------------------------------------------------------


def test_a_1x1_matrix_loss_is_its_entry():
    a, b = sp.symbols("a b", real=True)
    mod = sbp.compile(sbp.Model("matrix_loss", params=[a, b], loss=sp.Matrix([[a**2 * sp.sin(b)]]),
                                outputs={"m": sp.Matrix([[a, b]])}))
    value, grads = mod.value_and_grad(a=1.5, b=0.4)
    assert value == pytest.approx(2.25 * np.sin(0.4), rel=1e-14)
    assert grads["a"] == pytest.approx(3 * np.sin(0.4), rel=1e-14)
    assert grads["b"] == pytest.approx(2.25 * np.cos(0.4), rel=1e-14)
    assert np.array_equal(mod.forward(a=1.5, b=0.4)["m"], [[1.5, 0.4]])
