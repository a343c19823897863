"""loggamma, gamma and polygamma in models: likelihoods of counts and
proportions (Poisson, negative binomial, Beta, Dirichlet) compile, and their
gradients and Hessian-vector products (which need polygamma(0), (1) and (2)
in C: symbackprop_polygamma, templates/fn_polygamma.c.j2) agree with
central differences of a numpy formula written with the standard library's
math.lgamma, with PyTorch's float64 autograd where it is installed, and with
the numpy interpreter of the IR (no C). The C helper's values are checked
against mpmath (always installed with SymPy) and scipy.special (skipped
without scipy).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp
from c_driver import strict_compile_errors
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.base.functions import polygamma_scalar
from symbackprop.declare import nn
from symbackprop.diff.autodiff import jvp, vjp
from symbackprop.errors import ModelError
from symbackprop.ir.construct import const, leaf
from symbackprop.ir.interpret import bind_dims, evaluate
from symbackprop.ir.lower import lower
from symbackprop.ir.node import SCALAR
from symbackprop.pipeline import generate

N = sp.Symbol("N", integer=True, positive=True)
X = sp.MatrixSymbol("X", N, 3)  # covariates
Y = sp.MatrixSymbol("Y", N, 1)  # counts, or proportions in (0, 1)
W = sp.MatrixSymbol("W", 3, 1)  # regression weights
R = sp.MatrixSymbol("R", 1, 1)  # log size (negative binomial)
S = sp.MatrixSymbol("S", 1, 2)  # log shapes (Beta)
P = sp.MatrixSymbol("P", 1, 3)  # log concentrations (Dirichlet)
F = sp.MatrixSymbol("F", N, 3)  # rows on the simplex (Dirichlet)
x, y = sp.Matrix(sp.symbols("x0:3", real=True)), sp.Symbol("y", real=True)
lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def _rows(body, *bindings):
    return sbp.map_examples(body, list(bindings))


# --- the models and their numpy formulas ----------------------------------------


def poisson_model():
    """Poisson regression: -sum [y eta - exp(eta) - loggamma(y + 1)], eta = x.w;
    the counts are differentiated too (grad_inputs): that needs digamma."""
    eta = sum(x[k] * W[k, 0] for k in range(3))
    body = -(y * eta - sp.exp(eta) - sp.loggamma(y + 1))
    loss = nn.sum_all(_rows(body, (x, X), (sp.Matrix([y]), Y)))
    return sbp.Model("poisson_glm", inputs=[X, Y], params=[W], loss=loss, grad_inputs=[Y])


def poisson_numpy(d):
    eta = d["X"] @ d["W"]
    return float(-(d["Y"] * eta - np.exp(eta) - lgamma(d["Y"] + 1)).sum())


def negative_binomial_model():
    """NB2 regression, mean mu = exp(x.w), size r = exp(R)."""
    mu, r = sp.exp(sum(x[k] * W[k, 0] for k in range(3))), sp.exp(R[0, 0])
    log_p = (sp.loggamma(y + r) - sp.loggamma(r) - sp.loggamma(y + 1)
             + r * sp.log(r / (r + mu)) + y * sp.log(mu / (r + mu)))
    loss = nn.sum_all(_rows(-log_p, (x, X), (sp.Matrix([y]), Y)))
    return sbp.Model("negative_binomial", inputs=[X, Y], params=[W, R], loss=loss)


def negative_binomial_numpy(d):
    mu, r = np.exp(d["X"] @ d["W"]), np.exp(d["R"][0, 0])
    yv = d["Y"]
    log_p = lgamma(yv + r) - lgamma(r) - lgamma(yv + 1) + r * np.log(r / (r + mu)) + yv * np.log(mu / (r + mu))
    return float(-log_p.sum())


def beta_model():
    """Beta likelihood of proportions, shapes a = exp(S[0, 0]), b = exp(S[0, 1])."""
    a, b = sp.exp(S[0, 0]), sp.exp(S[0, 1])
    log_p = sp.loggamma(a + b) - sp.loggamma(a) - sp.loggamma(b) + (a - 1) * sp.log(y) + (b - 1) * sp.log(1 - y)
    loss = nn.sum_all(_rows(-log_p, (sp.Matrix([y]), Y)))
    return sbp.Model("beta_likelihood", inputs=[Y], params=[S], loss=loss)


def beta_numpy(d):
    a, b = np.exp(d["S"][0, 0]), np.exp(d["S"][0, 1])
    yv = d["Y"]
    return float(-(lgamma(a + b) - lgamma(a) - lgamma(b) + (a - 1) * np.log(yv) + (b - 1) * np.log(1 - yv)).sum())


def dirichlet_model():
    """Dirichlet likelihood of rows on the simplex, alpha = exp(P)."""
    alpha = [sp.exp(P[0, k]) for k in range(3)]
    log_p = (sp.loggamma(sum(alpha)) - sum(sp.loggamma(a) for a in alpha)
             + sum((a - 1) * sp.log(f) for a, f in zip(alpha, x, strict=True)))
    loss = nn.sum_all(_rows(-log_p, (x, F)))
    return sbp.Model("dirichlet_likelihood", inputs=[F], params=[P], loss=loss)


def dirichlet_numpy(d):
    alpha = np.exp(d["P"][0])
    log_p = lgamma(alpha.sum()) - lgamma(alpha).sum() + ((alpha - 1) * np.log(d["F"])).sum(axis=1)
    return float(-log_p.sum())


def gamma_model():
    """gamma and polygamma written by hand, entrywise on a parameter matrix
    of positive and of negative non-integer entries (the reflection formula)."""
    A = sp.MatrixSymbol("A", 2, 3)
    loss = nn.sum_all(A.applyfunc(lambda t: sp.gamma(t) / 8 + sp.digamma(t) + sp.polygamma(2, t) / 16))
    return sbp.Model("gamma_family", params=[A], loss=loss)


def gamma_numpy(d):
    a = d["A"]
    gamma = np.vectorize(math.gamma, otypes=[np.float64])
    digamma = np.vectorize(lambda t: polygamma_scalar(0, t), otypes=[np.float64])
    tetragamma = np.vectorize(lambda t: polygamma_scalar(2, t), otypes=[np.float64])
    return float((gamma(a) / 8 + digamma(a) + tetragamma(a) / 16).sum())


def _draw(name, rng):
    rows = 7
    if name == "gamma_family":
        return {"A": np.array([[0.7, 1.3, 4.2], [-0.35, -1.6, -2.7]]) + rng.uniform(-0.05, 0.05, (2, 3))}
    d = {"X": rng.normal(0, 0.5, (rows, 3)), "W": rng.normal(0, 0.5, (3, 1)), "R": rng.normal(0.3, 0.4, (1, 1)),
         "S": rng.normal(0.3, 0.4, (1, 2)), "P": rng.normal(0.3, 0.4, (1, 3))}
    if name in ("poisson_glm", "negative_binomial"):
        d["Y"] = rng.poisson(2.0, (rows, 1)).astype(np.float64) + rng.uniform(0.1, 0.9, (rows, 1)) * (name == "poisson_glm")
    elif name == "beta_likelihood":
        d["Y"] = rng.uniform(0.05, 0.95, (rows, 1))
    else:
        d["F"] = rng.dirichlet([2.0, 3.0, 4.0], rows)
    model = MODELS[name][0]()
    keep = {v.name for v in (*model.inputs, *model.params)}
    return {k: v for k, v in d.items() if k in keep}


MODELS = {
    "poisson_glm": (poisson_model, poisson_numpy),
    "negative_binomial": (negative_binomial_model, negative_binomial_numpy),
    "beta_likelihood": (beta_model, beta_numpy),
    "dirichlet_likelihood": (dirichlet_model, dirichlet_numpy),
    "gamma_family": (gamma_model, gamma_numpy),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def compiled(request):
    name = request.param
    model = MODELS[name][0]()
    return name, model, sbp.compile(model, functions=("forward", "value_and_grad", "hvp"))


def _differentiated(model):
    return [v.name for v in model.differentiated]


# --- compiled: values, gradients, Hessian-vector products ---------------------


def test_value_and_gradient_match_the_numpy_formula(compiled):
    name, model, mod = compiled
    reference = MODELS[name][1]
    d = _draw(name, np.random.default_rng(0))
    loss, grads = mod.value_and_grad(**d)
    assert loss == pytest.approx(reference(d), rel=1e-12)
    for key in _differentiated(model):
        expected = central_differences(reference, d, key)
        assert relative_error(grads[key], expected) < 1e-7, key


def test_hessian_vector_products_match_differences_of_gradients(compiled):
    name, model, mod = compiled
    d = _draw(name, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    keys = [v.name for v in model.params]
    v = {key: rng.standard_normal(d[key].shape) for key in keys}
    hvp = mod.hvp(v, **d)
    h = 1e-5
    plus = mod.value_and_grad(**{**d, **{k: d[k] + h * v[k] for k in keys}})[1]
    minus = mod.value_and_grad(**{**d, **{k: d[k] - h * v[k] for k in keys}})[1]
    for key in keys:
        assert relative_error(hvp[key], (plus[key] - minus[key]) / (2 * h)) < 1e-6, key


def _torch_loss(name, t):
    import torch

    if name == "poisson_glm":
        eta = t["X"] @ t["W"]
        return -(t["Y"] * eta - torch.exp(eta) - torch.lgamma(t["Y"] + 1)).sum()
    if name == "negative_binomial":
        mu, r, yv = torch.exp(t["X"] @ t["W"]), torch.exp(t["R"][0, 0]), t["Y"]
        return -(torch.lgamma(yv + r) - torch.lgamma(r) - torch.lgamma(yv + 1)
                 + r * torch.log(r / (r + mu)) + yv * torch.log(mu / (r + mu))).sum()
    if name == "beta_likelihood":
        a, b, yv = torch.exp(t["S"][0, 0]), torch.exp(t["S"][0, 1]), t["Y"]
        return -(torch.lgamma(a + b) - torch.lgamma(a) - torch.lgamma(b) + (a - 1) * torch.log(yv)
                 + (b - 1) * torch.log(1 - yv)).sum()
    if name == "dirichlet_likelihood":
        alpha = torch.exp(t["P"][0])
        return -(torch.lgamma(alpha.sum()) - torch.lgamma(alpha).sum() + ((alpha - 1) * torch.log(t["F"])).sum(dim=1)).sum()
    a = t["A"]
    return (torch.exp(torch.lgamma(a)) * torch.sign(_gamma_sign(a)) / 8 + torch.special.digamma(a)
            + torch.special.polygamma(2, a) / 16).sum()


def _gamma_sign(a):
    """The sign of gamma(a): (-1)^ceil(-a) for negative a, + for positive."""
    import torch

    return torch.where(a > 0, torch.ones_like(a), (-1.0) ** torch.ceil(-a))


def test_gradients_and_hvp_match_torch_float64(compiled):
    torch = pytest.importorskip("torch")
    name, model, mod = compiled
    d = _draw(name, np.random.default_rng(3))
    keys = _differentiated(model)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in keys) for k, v in d.items()}
    loss = _torch_loss(name, t)
    grads = torch.autograd.grad(loss, [t[k] for k in keys], create_graph=True)
    value, compiled_grads = mod.value_and_grad(**d)
    assert value == pytest.approx(loss.item(), rel=1e-12)
    # torch's trigamma (polygamma(1)) is within about 5e-10 of mpmath (ours
    # and scipy's within 4e-16): where it enters, the tolerance is wider
    wide = 1e-8
    for key, g in zip(keys, grads, strict=True):
        rtol = wide if name == "gamma_family" else 1e-11
        np.testing.assert_allclose(compiled_grads[key], g.detach().numpy(), rtol=rtol, atol=1e-12, err_msg=key)
    params = [v.name for v in model.params]
    rng = np.random.default_rng(4)
    v = {k: rng.standard_normal(d[k].shape) for k in params}
    dot = sum((g * torch.tensor(v[k])).sum() for k, g in zip(keys, grads, strict=True) if k in params)
    hv = torch.autograd.grad(dot, [t[k] for k in params])
    ours = mod.hvp(v, **d)
    for key, h in zip(params, hv, strict=True):
        np.testing.assert_allclose(ours[key], h.numpy(), rtol=wide, atol=1e-11, err_msg=key)


def test_float32_modules_call_the_float_helper():
    model = gamma_model()
    d = _draw("gamma_family", np.random.default_rng(5))
    single = sbp.compile(model, dtype="float32")
    double = sbp.compile(model)
    loss32, grads32 = single.value_and_grad(**{k: v.astype(np.float32) for k, v in d.items()})
    loss64, grads64 = double.value_and_grad(**d)
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    assert relative_error(grads32["A"], grads64["A"]) < 1e-4


# --- the C-free layer: the interpreter on the same models ----------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_interpreter_gradients_match_central_differences(name):
    model = MODELS[name][0]()
    lowered = lower(model)
    d = _draw(name, np.random.default_rng(6))
    dims = bind_dims(lowered.leaves, d)

    def loss(arrays):
        return evaluate([lowered.loss], arrays, dims)[0].item()

    assert loss(d) == pytest.approx(MODELS[name][1](d), rel=1e-12)
    keys = _differentiated(model)
    grads = evaluate(vjp([(lowered.loss, const(1, SCALAR))], [lowered.leaves[k] for k in keys])[0], d, dims)
    for key, grad in zip(keys, grads, strict=True):
        assert relative_error(grad, central_differences(loss, d, key)) < 1e-7, key
    rng = np.random.default_rng(7)
    tangents = {lowered.leaves[k]: leaf(f"t_{k}", lowered.leaves[k].shape, "input") for k in keys}
    directions = {f"t_{k}": rng.standard_normal(np.shape(d[k])) for k in keys}
    (tangent,) = jvp([lowered.loss], tangents)
    value = evaluate([tangent], {**d, **directions}, dims)[0].item()
    h = 1e-6
    moved = [loss({**d, **{k: d[k] + s * h * directions[f"t_{k}"] for k in keys}}) for s in (1, -1)]
    assert value == pytest.approx((moved[0] - moved[1]) / (2 * h), rel=1e-6)


# --- the C helper's values --------------------------------------------------------

ORDERS = (0, 1, 2, 3)


def _table_module():
    T = sp.MatrixSymbol("T", N, 1)
    outputs = {f"psi{n}": T.applyfunc(lambda t, n=n: sp.polygamma(n, t)) for n in ORDERS}
    outputs["lgamma"], outputs["tgamma"] = T.applyfunc(sp.loggamma), T.applyfunc(sp.gamma)
    return sbp.compile(sbp.Model("polygamma_table", inputs=[T], outputs=outputs), functions=("forward",))


@pytest.fixture(scope="module")
def table():
    return _table_module()


def _points(count):
    """x in [1e-3, 1e6] (and around the positive root of digamma), and
    negative non-integers down to -1e4."""
    rng = np.random.default_rng(8)
    positive = np.concatenate([np.geomspace(1e-3, 1e6, count), rng.uniform(1e-3, 30.0, count),
                               1.4616321449683622 + np.linspace(-0.1, 0.1, 41)])
    negative = -np.concatenate([np.geomspace(1e-3, 1e4, count), rng.uniform(0.0, 40.0, count)])
    return positive, negative[negative != np.round(negative)]


def _relative(got, want):
    return np.abs(got - want) / np.abs(want)


def test_polygamma_in_c_against_mpmath(table):
    """Relative error: 2e-14 for x in [1e-3, 1e6]; 2e-15 for n >= 1 at
    negative non-integers, and for digamma there 1e-14 of max(1, |psi|)
    (its roots there leave only absolute accuracy: near them, scipy too)."""
    positive, negative = _points(100)
    for xs, where in ((positive, "x > 0"), (negative, "x < 0")):
        out = table.forward(T=xs.reshape(-1, 1))
        for n in ORDERS:
            got = out[f"psi{n}"].ravel()
            want = np.array([polygamma_scalar(n, v) for v in xs])
            scale = np.maximum(np.abs(want), 1.0) if n == 0 and where == "x < 0" else np.abs(want)
            error = np.abs(got - want) / scale
            assert error.max() < (2e-14 if n == 0 else 4e-15), (n, where, xs[error.argmax()])


def test_polygamma_in_c_against_scipy(table):
    special = pytest.importorskip("scipy.special")
    positive, negative = _points(2000)
    out = table.forward(T=positive.reshape(-1, 1))
    for n in ORDERS:
        want = special.psi(positive) if n == 0 else special.polygamma(n, positive)
        assert _relative(out[f"psi{n}"].ravel(), want).max() < 2e-14, n
    wide = np.geomspace(1e-3, 150.0, 200)  # tgamma overflows beyond 171
    out = table.forward(T=wide.reshape(-1, 1))
    assert _relative(out["lgamma"].ravel(), special.gammaln(wide)).max() < 1e-13
    assert _relative(out["tgamma"].ravel(), special.gamma(wide)).max() < 1e-13
    out = table.forward(T=negative.reshape(-1, 1))
    for n in (1, 2, 3):
        assert _relative(out[f"psi{n}"].ravel(), special.polygamma(n, negative)).max() < 2e-13, n


def test_polygamma_at_poles_and_special_values(table):
    xs = np.array([0.0, -0.0, -1.0, -7.0, np.inf, -np.inf, np.nan])
    out = table.forward(T=xs.reshape(-1, 1))
    inf, nan = np.inf, np.nan
    expected = {
        0: [-inf, inf, nan, nan, inf, nan, nan],
        1: [inf, inf, inf, inf, 0.0, nan, nan],
        2: [-inf, inf, nan, nan, 0.0, nan, nan],
        3: [inf, inf, inf, inf, 0.0, nan, nan],
    }
    for n, want in expected.items():
        np.testing.assert_array_equal(out[f"psi{n}"].ravel(), np.array(want), err_msg=f"polygamma({n}, x)")
        interpreted = [polygamma_scalar(n, v) for v in xs]
        np.testing.assert_array_equal(np.array(interpreted), np.array(want), err_msg=f"interpreter, n = {n}")


# --- the C text -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_helper_is_emitted_once_and_compiles_without_warnings(dtype, tmp_path):
    emitted, _ = generate(dirichlet_model(), dtype=dtype, functions=("forward", "value_and_grad", "hvp"))
    suffix = "f" if dtype == "float32" else ""
    assert emitted.source.count("static double symbackprop_polygamma(int n, double x)") == 1
    assert f"symbackprop_polygamma{suffix}(0, " in emitted.source and f"symbackprop_polygamma{suffix}(1, " in emitted.source
    assert "the n-th derivative of digamma" in emitted.source  # the helper says what it computes
    errors = strict_compile_errors(emitted, tmp_path, dtype)
    assert errors == "", errors


def test_modules_without_polygamma_have_no_helper():
    model = poisson_model()  # without grad_inputs: loggamma(y + 1) is a constant
    emitted, _ = generate(sbp.Model("no_digamma", inputs=[X, Y], params=[W], loss=model.loss))
    assert "lgamma(" in emitted.source and "symbackprop_polygamma" not in emitted.source


def test_a_polygamma_order_that_is_not_a_literal_integer_is_a_model_error():
    order, value = sp.symbols("order value", real=True)
    out = _rows(sp.polygamma(order, value), (sp.Matrix([order, value]), sp.MatrixSymbol("A", N, 2)))
    model = sbp.Model("symbolic_order", inputs=[sp.MatrixSymbol("A", N, 2)], outputs={"out": out})
    with pytest.raises(ModelError, match="polygamma's order must be a literal integer"):
        generate(model, functions=("forward",))


def test_a_user_name_equal_to_the_helper_is_renamed_in_the_c():
    clash = sp.MatrixSymbol("symbackprop_polygamma", 2, 2)
    model = sbp.Model("name_clash", params=[clash], loss=nn.sum_all(clash.applyfunc(sp.loggamma)))
    mod = sbp.compile(model)
    value = np.array([[0.5, 1.5], [2.5, 3.5]])
    _, grads = mod.value_and_grad(symbackprop_polygamma=value)
    digamma = np.vectorize(lambda t: polygamma_scalar(0, t), otypes=[np.float64])
    np.testing.assert_allclose(grads["symbackprop_polygamma"], digamma(value), rtol=1e-14)
