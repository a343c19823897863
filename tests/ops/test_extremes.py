"""Softmax, log_softmax, cross-entropy (probabilities and Index labels,
along rows and down columns), log-sum-exp and masked attention at extreme
logits (0, subnormal, 3e7, 1e17, -1e9 masks, +-inf, NaN), and fractional
powers of negative numbers: values and gradients against closed forms
(numpy, max-subtracted, in float64) and against PyTorch in float64 and
float32 (NaN exactly where PyTorch's is). Few modules, many inputs each."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

n = sp.Symbol("n", integer=True, positive=True)
C = 4
Z, T, y = sp.MatrixSymbol("Z", n, C), sp.MatrixSymbol("T", n, C), sbp.Index("y", n)
Zc, Tc = sp.MatrixSymbol("Zc", C, n), sp.MatrixSymbol("Tc", C, n)
DTYPES = ["float64", "float32"]
INF, NAN = np.inf, np.nan
FINITE_ROWS = {"zero": [0, 0, 0, 0], "subnormal": [1e-310, 0, -1e-310, 0], "3e7": [3e7, 3e7, 3e7 - 2, 0],
               "1e17": [1e17, 1e17, 0, 0], "masked": [-1e9] * 4, "half_masked": [0, 0, -1e9, -1e9],
               "minus_3e7": [-3e7] * 4}
ROWS = {**FINITE_ROWS, "plus_inf": [INF, 0, 0, 0], "minus_inf": [-INF, 0, 1, 0], "all_minus_inf": [-INF] * 4,
        "nan": [NAN, 0, 0, 0]}
TARGETS = np.array([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
LABELS = np.array([0, 2])


@pytest.fixture(scope="module", params=DTYPES)
def modules(request):
    dt = request.param
    rows = sbp.Model(f"extremes_rows_{dt}", inputs=[T, y], params=[Z], loss=nn.softmax_cross_entropy(Z, T, reduction="sum"),
                     outputs={"sm": nn.softmax(Z), "lsm": nn.log_softmax(Z),
                              "cey": nn.softmax_cross_entropy(Z, y, reduction="sum"), "lse": sbp.reduce("logsumexp", Z, 1)})
    cols = sbp.Model(f"extremes_cols_{dt}", inputs=[Tc], params=[Zc],
                     loss=nn.sum_all(sp.HadamardProduct(Tc, nn.log_softmax(Zc, 0))),
                     outputs={"sm": nn.softmax(Zc, 0), "lsm": nn.log_softmax(Zc, 0)})
    return sbp.compile(rows, dtype=dt), sbp.compile(cols, dtype=dt), dt


def _arrays(name, dt):
    z = np.array([ROWS[name], [0.5, -1, 2, 0]], dtype=dt)
    seed = np.random.default_rng(len(name)).standard_normal(z.shape).astype(dt)
    return z, TARGETS.astype(dt), seed


def _ours(modules, name):
    """{what: (value, gradient)} of each function at row `name`, the gradient of sum(seed * value)."""
    rows, cols, dt = modules
    z, t, seed = _arrays(name, dt)
    args = {"Z": z, "T": t, "y": LABELS}
    out = rows.forward(**args)
    loss, grads = rows.value_and_grad(**args)
    got = {k: (out[k], rows.vjp(k, seed, **args)["Z"]) for k in ("sm", "lsm")}
    got["ce_prob"] = (loss, grads["Z"])
    got["ce_label"] = (out["cey"], rows.vjp("cey", None, **args)["Z"])
    got["lse"] = (out["lse"], rows.vjp("lse", seed[:, :1], **args)["Z"])
    cargs = {"Zc": np.ascontiguousarray(z.T), "Tc": np.ascontiguousarray(t.T)}
    outc = cols.forward(**cargs)
    for k in ("sm", "lsm"):
        got[k + "0"] = (outc[k].T, cols.vjp(k, np.ascontiguousarray(seed.T), **cargs)["Zc"].T)
    return got, z.astype(np.float64), t.astype(np.float64), seed.astype(np.float64)


def _close(got, want, dt, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64).reshape(np.shape(got))
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN at different places: {got} vs {want}"
    ok = ~np.isnan(want)
    rtol, atol = (1e-12, 1e-13) if dt == "float64" else (2e-6, 2e-6)
    np.testing.assert_allclose(got[ok], want[ok], rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("name", list(FINITE_ROWS))
def test_closed_forms(modules, name):
    """The max-subtracted definitions in float64: softmax p, log_softmax, the
    cross-entropies sum(T) lse - sum(T z) and lse - z[y], and their gradients."""
    got, z, t, seed = _ours(modules, name)
    dt = modules[2]
    top = z.max(axis=1, keepdims=True)
    e = np.exp(z - top)
    s = e.sum(axis=1, keepdims=True)
    p, log_p = e / s, (z - top) - np.log(s)
    onehot = np.eye(C)[LABELS]
    want = {"sm": (p, p * (seed - (p * seed).sum(axis=1, keepdims=True))),
            "lsm": (log_p, seed - p * seed.sum(axis=1, keepdims=True)),
            "ce_prob": (-(t * log_p).sum(), p * t.sum(axis=1, keepdims=True) - t),
            "ce_label": (-(onehot * log_p).sum(), p - onehot),
            "lse": (top + np.log(s), p * seed[:, :1])}
    want["sm0"], want["lsm0"] = want["sm"], want["lsm"]
    for what, (value, grad) in want.items():
        _close(got[what][0], value, dt, f"{name} {what} value")
        _close(got[what][1], grad, dt, f"{name} {what} gradient")
    if name == "masked":  # the reported case: PyTorch's 0.25 and log 4, not 1 and 0
        assert np.allclose(got["sm"][0][0], 0.25) and np.allclose(got["lsm"][0][0], -np.log(4), rtol=1e-6)


@pytest.mark.parametrize("name", list(ROWS))
def test_against_torch(modules, name):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    got, z, t, seed = _ours(modules, name)
    dt = modules[2]
    tdt = getattr(torch, dt)

    def run(fn, weight):
        a = torch.tensor(z, dtype=tdt, requires_grad=True)
        value = fn(a)
        (value * torch.tensor(weight, dtype=tdt)).sum().backward()
        return value.detach().numpy(), a.grad.numpy()

    want = {"sm": run(lambda a: torch.softmax(a, 1), seed), "lsm": run(lambda a: torch.log_softmax(a, 1), seed),
            "ce_prob": run(lambda a: F.cross_entropy(a, torch.tensor(t, dtype=tdt), reduction="sum"), 1.0),
            "ce_label": run(lambda a: F.cross_entropy(a, torch.tensor(LABELS), reduction="sum"), 1.0),
            "sm0": run(lambda a: torch.softmax(a.T, 0).T, seed), "lsm0": run(lambda a: torch.log_softmax(a.T, 0).T, seed)}
    lse = run(lambda a: torch.logsumexp(a, 1, keepdim=True), seed[:, :1])
    # torch.logsumexp's gradient is exp(z - lse), which loses the log of the sum as softmax did:
    # checked against the closed form in test_closed_forms where finite
    want["lse"] = lse if name not in FINITE_ROWS else (lse[0], got["lse"][1])
    for what, (value, grad) in want.items():
        _close(got[what][0], value, dt, f"{name} {what} value")
        _close(got[what][1], grad, dt, f"{name} {what} gradient")


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_attention_against_torch(dtype):
    """softmax(Q K^T + M) V with -1e9 above the diagonal and one row masked
    throughout (uniform weights, as PyTorch's), and scores near 3e7."""
    torch = pytest.importorskip("torch")
    L, d = 4, 2
    Q, K, V, M, W = (sp.MatrixSymbol(s, L, L if s == "M" else d) for s in "QKVMW")
    out = nn.softmax(Q * K.T + M) * V
    mod = sbp.compile(sbp.Model(f"extremes_attention_{dtype}", inputs=[M, W], params=[Q, K, V],
                                loss=nn.sum_all(sp.HadamardProduct(out, W))), dtype=dtype)
    rng = np.random.default_rng(3)
    mask = np.triu(np.full((L, L), -1e9), 1)
    mask[2] = -1e9
    for scale in (1.0, 3e3):
        arrays = {k: rng.standard_normal((L, d)).astype(dtype) for k in "QKVW"}
        arrays["Q"] *= np.asarray(scale, dtype)
        arrays["K"] *= np.asarray(scale, dtype)
        arrays["M"] = mask.astype(dtype)
        loss, grads = mod.value_and_grad(**arrays)
        t = {k: torch.tensor(a, requires_grad=k in "QKV") for k, a in arrays.items()}
        want = ((torch.softmax(t["Q"] @ t["K"].T + t["M"], 1) @ t["V"]) * t["W"]).sum()
        want.backward()
        rtol = 1e-10 if dtype == "float64" else 1e-4
        assert loss == pytest.approx(want.item(), rel=rtol, abs=rtol)
        for k in "QKV":
            np.testing.assert_allclose(grads[k], t[k].grad.numpy(), rtol=rtol, atol=rtol * max(1.0, scale), err_msg=k)


XS = [-8.0, -2.0, 0.0, 2.0]
POWERS = {"p1_3": sp.Rational(1, 3), "p2_3": sp.Rational(2, 3), "p4_3": sp.Rational(4, 3), "p1_2": sp.Rational(1, 2),
          "p2": sp.Integer(2)}


@pytest.fixture(scope="module", params=DTYPES)
def powers(request):
    X = sp.MatrixSymbol("X", 1, len(XS))
    outputs = {f"o_{k}": X.applyfunc(lambda v, p=p: v**p) for k, p in POWERS.items()}
    outputs["o_cbrt"] = X.applyfunc(sp.cbrt)
    mod = sbp.compile(sbp.Model(f"extremes_powers_{request.param}", params=[X], loss=nn.sum_all(X), outputs=outputs),
                      dtype=request.param)
    x = np.array([XS], dtype=request.param)
    out = mod.forward(X=x)
    return {k: (out[f"o_{k}"][0], mod.vjp(f"o_{k}", np.ones_like(x), X=x)["X"][0]) for k in [*POWERS, "cbrt"]}


@pytest.mark.parametrize("name", [*POWERS, "cbrt"])
def test_power_value_and_gradient_share_a_domain(powers, name):
    """p x**(p-1) from the same pow: both NaN for x < 0 where p is not an
    integer (cbrt is x**(1/3)), both numbers elsewhere (inf at 0 for p < 1)."""
    p = float(POWERS.get(name, sp.Rational(1, 3)))
    value, grad = powers[name]
    with np.errstate(all="ignore"):
        x = np.array(XS)
        want_value, want_grad = np.power(x, p), p * np.power(x, p - 1)
    assert np.array_equal(np.isnan(value), np.isnan(want_value)) and np.array_equal(np.isnan(grad), np.isnan(want_grad))
    assert np.array_equal(np.isnan(value), np.isnan(grad))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


@pytest.mark.parametrize("name", [*POWERS, "cbrt"])
def test_powers_against_torch(powers, name):
    torch = pytest.importorskip("torch")
    p = float(POWERS.get(name, sp.Rational(1, 3)))
    value, grad = powers[name]
    x = torch.tensor(XS, dtype=torch.float64, requires_grad=True)
    want = torch.pow(x, p)
    want.sum().backward()
    np.testing.assert_allclose(value, want.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-6)


# --- every scalar function and nn activation at the edges of its domain -------------
#
# Value and gradient (vjp with seed 1) at 0, -0, subnormals, inside and outside
# the domain, the overflow limits, +-inf and NaN, against PyTorch in float64
# (rounded to float32 for the float32 module): NaN exactly where PyTorch's is,
# infinities equal, numbers close. Below its domain a function's value is NaN
# and its gradient PyTorch's formula (log'(-1) = -1, atanh'(2) = -1/3,
# acosh'(-2) = 1/sqrt(3)). The deliberate differences, each checked against its
# own oracle:
# - NaN in at a kink (abs, relu, leaky_relu, elu): the gradient is NaN
#   (docs/compile_and_call.md); PyTorch's is 0, 1, 0.01 or 1;
# - sinh, cosh at |x| = 710 (float64): 1.1e308, finite (libm); PyTorch's
#   exp(x)/2 overflows to inf;
# - digamma and trigamma (and so loggamma's gradient): mpmath, not PyTorch,
#   whose polygamma(1, x) is good to 1e-9 and finite at the poles;
# - x**(k/2) for odd k at -inf: NaN in value and gradient (x < 0 is outside
#   the power's domain, as sqrt), where std::pow gives PyTorch +inf or +0.

FUNCTION_POINTS = {
    "float64": [0.0, -0.0, 5e-324, 1e-310, -1e-310, 1e-8, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 710.0, -710.0, 1e300,
                -1e300, INF, -INF, NAN],
    "float32": [0.0, -0.0, 1e-45, 1e-40, -1e-40, 1e-4, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 89.0, -89.0, 3e38, -3e38,
                INF, -INF, NAN],
}
KINKS = ("abs", "relu", "leaky_relu", "elu")
POLYGAMMA = {"digamma": 0, "trigamma": 1}


def _function_table():
    """name -> (symbackprop's function of a matrix, PyTorch's of a tensor)."""
    torch = pytest.importorskip("torch")
    from sympy.codegen.cfunctions import expm1, log1p

    F, half = torch.nn.functional, sp.Rational(1, 2)

    def each(f):
        return lambda X: X.applyfunc(f)

    table = {name: (each(getattr(sp, name)), getattr(torch, name)) for name in
             ("exp", "log", "sqrt", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh",
              "acosh", "atanh", "erf", "erfc")}
    table.update({
        "abs": (each(sp.Abs), torch.abs), "log1p": (each(log1p), torch.log1p), "expm1": (each(expm1), torch.expm1),
        "loggamma": (each(sp.loggamma), torch.lgamma), "digamma": (each(lambda v: sp.polygamma(0, v)), torch.digamma),
        "trigamma": (each(lambda v: sp.polygamma(1, v)), lambda t: torch.polygamma(1, t)),
        "cbrt": (each(sp.cbrt), lambda t: torch.pow(t, 1 / 3)), "pow_half": (each(lambda v: v**half), torch.sqrt),
        "pow_3_2": (each(lambda v: v ** (3 * half)), lambda t: torch.pow(t, 1.5)),
        "pow_m_half": (each(lambda v: v ** (-half)), lambda t: torch.pow(t, -0.5)),
        "pow_2": (each(lambda v: v**2), lambda t: torch.pow(t, 2)), "pow_3": (each(lambda v: v**3), lambda t: t**3),
        "recip": (each(lambda v: 1 / v), torch.reciprocal), "sigmoid": (nn.sigmoid, torch.sigmoid),
        "nn_tanh": (nn.tanh, torch.tanh), "relu": (nn.relu, torch.relu), "softplus": (nn.softplus, F.softplus),
        "log_sigmoid": (nn.log_sigmoid, F.logsigmoid), "silu": (nn.silu, F.silu),
        "leaky_relu": (nn.leaky_relu, F.leaky_relu), "elu": (nn.elu, F.elu), "gelu": (nn.gelu, F.gelu),
        "gelu_tanh": (lambda X: nn.gelu(X, "tanh"), lambda t: F.gelu(t, approximate="tanh")),
    })
    return table


# beyond their domain, at their poles and their overflow limits: run on every commit
DOMAIN_FUNCTIONS = ["log", "log1p", "sqrt", "asin", "acos", "atanh", "acosh", "loggamma", "digamma", "pow_3_2",
                    "pow_m_half", "sinh", "abs", "relu"]


def _functions_module(names, dtype, tag):
    table = _function_table()
    X = sp.MatrixSymbol("X", 1, len(FUNCTION_POINTS[dtype]))
    outputs = {f"o_{name}": table[name][0](X) for name in names}
    mod = sbp.compile(sbp.Model(f"extremes_fn_{tag}_{dtype}", params=[X], loss=nn.sum_all(X), outputs=outputs),
                      dtype=dtype, functions=("forward", "vjp"))
    x = np.array([FUNCTION_POINTS[dtype]], dtype=dtype)
    with np.errstate(all="ignore"):
        out = mod.forward(X=x)
    return {name: (out[f"o_{name}"][0], mod.vjp(f"o_{name}", np.ones_like(x), X=x)["X"][0]) for name in names}


@pytest.fixture(scope="module", params=DTYPES)
def domain_functions(request):
    return _functions_module(DOMAIN_FUNCTIONS, request.param, "domain"), request.param


@pytest.fixture(scope="module", params=DTYPES)
def all_functions(request):
    names = [n for n in _function_table() if n not in DOMAIN_FUNCTIONS]
    return _functions_module(names, request.param, "all"), request.param


def _torch(name, x, dtype):
    import torch

    t = torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True)
    y = _function_table()[name][1](t)
    y.backward(torch.ones_like(y))
    return y.detach().numpy().astype(np.float64), t.grad.numpy().astype(np.float64)


def _oracles(name, dtype):
    """[(value, gradient)] in float64 at the module's points: PyTorch's in
    float64 (or the deliberate differences' own oracles), rounded to the
    dtype, and for float32 PyTorch's in float32 too (a point passes if it
    agrees with either: float32 formulas that overflow inside, as gelu's
    tanh form at 3e38, are NaN in both; PyTorch's float32 gelu(inf) is NaN)."""
    x = np.array(FUNCTION_POINTS[dtype], dtype=dtype).astype(np.float64)
    if name in POLYGAMMA:
        from symbackprop.base.functions import polygamma_scalar

        n = POLYGAMMA[name]
        value, grad = (np.array([polygamma_scalar(k, v) for v in x]) for k in (n, n + 1))
    else:
        value, grad = _torch(name, x, "float64")
    if name == "loggamma":
        from symbackprop.base.functions import polygamma_scalar

        grad = np.array([polygamma_scalar(0, v) for v in x])
    if name in KINKS:
        grad[np.isnan(x)] = np.nan
    if name in ("sinh", "cosh"):
        with np.errstate(over="ignore"):
            value, grad = np.sinh(x), np.cosh(x)
            if name == "cosh":
                value, grad = grad, value
    if name in ("pow_3_2", "pow_m_half"):
        value[x == -INF] = grad[x == -INF] = np.nan
    with np.errstate(over="ignore"):
        found = [(value.astype(dtype).astype(np.float64), grad.astype(dtype).astype(np.float64))]
    if dtype == "float32" and name not in POLYGAMMA and name not in KINKS:
        found.append(_torch(name, x.astype(dtype), dtype))
    return found


def _same_numbers(got, wants, dtype, what):
    got = np.asarray(got, np.float64)
    x = FUNCTION_POINTS[dtype]
    rtol, atol = (1e-12, 1e-300) if dtype == "float64" else (1e-5, 1e-37)  # (float32: its x**(-2/3) at 1e-45)

    def agrees(g, w):
        if np.isnan(g) or np.isnan(w) or np.isinf(g) or np.isinf(w):
            return bool(np.isnan(g) and np.isnan(w)) or g == w
        return abs(g - w) <= rtol * abs(w) + atol

    for i, g in enumerate(got):
        assert any(agrees(g, w[i]) for w in wants), \
            f"{what} at x = {x[i]!r} ({dtype}): got {g!r}, PyTorch/oracle {[w[i] for w in wants]}"


def _check(got, name, dtype):
    oracles = _oracles(name, dtype)
    _same_numbers(got[name][0], [v for v, _ in oracles], dtype, f"{name} value")
    _same_numbers(got[name][1], [g for _, g in oracles], dtype, f"{name} gradient")


@pytest.mark.parametrize("name", DOMAIN_FUNCTIONS)
def test_functions_beyond_their_domain_against_torch(domain_functions, name):
    got, dtype = domain_functions
    _check(got, name, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "exp", "sin", "cos", "tan", "atan", "cosh", "tanh", "asinh", "erf", "erfc", "expm1", "trigamma", "cbrt",
    "pow_half", "pow_2", "pow_3", "recip", "sigmoid", "nn_tanh", "softplus", "log_sigmoid", "silu", "leaky_relu",
    "elu", "gelu", "gelu_tanh"])
def test_every_function_at_the_edges_against_torch(all_functions, name):
    got, dtype = all_functions
    _check(got, name, dtype)


def test_acosh_below_its_domain_has_torchs_gradient():
    """The regression: SymPy's derivative 1/(sqrt(x - 1) sqrt(x + 1)) was NaN
    for x <= -1 where PyTorch's 1/sqrt(x^2 - 1) is a number; above 1 both
    are the same number."""
    from symbackprop.base.functions import DERIVATIVES

    x = sp.Symbol("x")
    rule = DERIVATIVES[sp.acosh](x)
    assert float(rule.subs(x, -2)) == pytest.approx(1 / np.sqrt(3.0), rel=1e-15)
    for at in (1.5, 3, 1e6):
        assert float(rule.subs(x, at)) == pytest.approx(float(sp.acosh(x).diff(x).subs(x, at)), rel=1e-15)


def test_digamma_just_below_zero_is_infinite_not_nan():
    """psi(-e) ~ 1/e overflows to +inf for a subnormal e; the helper's
    reflection multiplied 0 by the infinite cotangent (NaN), and loggamma's
    gradient there was NaN. psi'(-e) ~ 1/e^2 overflows from e = 1e-300."""
    x = sp.MatrixSymbol("x", 1, 3)
    mod = sbp.compile(sbp.Model("extremes_digamma_below_zero", params=[x], loss=nn.sum_all(x),
                                outputs={"psi": x.applyfunc(lambda v: sp.polygamma(0, v)),
                                         "psi1": x.applyfunc(lambda v: sp.polygamma(1, v))}), functions=("forward",))
    out = mod.forward(x=np.array([[-1e-310, -5e-324, -1e-300]]))
    assert np.all(out["psi"][0, :2] == np.inf) and out["psi"][0, 2] == pytest.approx(1e300, rel=1e-12)
    assert np.all(out["psi1"] == np.inf)
