"""Numerics at the saturation limits of both real types (issue 13): each
activation's value and derivative, through compiled float64 and float32
modules, at z from -1e4 to 1e4, +-inf and NaN, against closed forms
evaluated in mpmath (60 digits), and against PyTorch where it is installed.

NaN in gives NaN out, in the value and in the derivative (IEEE semantics;
numpy's heaviside and sign do the same). PyTorch agrees on every value, but
its derivatives at NaN are numbers for some kinks (relu 1, abs 0,
leaky_relu 0.01, elu 1): those four are one documented difference; the
other is PyTorch's float32 exact gelu at +inf (NaN; ours is inf, the limit).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import sympy as sp
from sympy.codegen.cfunctions import log1p

import symbackprop as sbp
from symbackprop.base.stable import sigmoid, softplus, stabilize
from symbackprop.declare import nn

NAN, INF = math.nan, math.inf
ZS = [-1e4, -800.0, -710.0, -89.0, -88.0, -20.0, 0.0, 20.0, 88.0, 89.0, 710.0, 800.0, 1e4, NAN, INF, -INF]
DTYPES = ["float64", "float32"]
mpmath.mp.dps = 60
M = mpmath.mpf

# closed forms: name -> (value(x), derivative(x)) at a finite mpf x
_C = M(2) / mpmath.pi
ORACLES = {
    "sigmoid": (lambda x: 1 / (1 + mpmath.exp(-x)), lambda x: mpmath.exp(-x) / (1 + mpmath.exp(-x)) ** 2),
    "softplus": (lambda x: mpmath.log1p(mpmath.exp(x)), lambda x: 1 / (1 + mpmath.exp(-x))),
    "log_sigmoid": (lambda x: -mpmath.log1p(mpmath.exp(-x)), lambda x: 1 / (1 + mpmath.exp(x))),
    "log_one_minus_sigmoid": (lambda x: -mpmath.log1p(mpmath.exp(x)), lambda x: -1 / (1 + mpmath.exp(-x))),
    "tanh": (mpmath.tanh, lambda x: mpmath.sech(x) ** 2),
    "relu": (lambda x: max(x, 0), lambda x: M(1) if x > 0 else M(0)),
    "leaky_relu": (lambda x: x if x > 0 else x / 100, lambda x: M(1) if x > 0 else M(1) / 100),
    "elu": (lambda x: x if x > 0 else mpmath.expm1(x), lambda x: M(1) if x > 0 else mpmath.exp(x)),
    "abs": (abs, lambda x: mpmath.sign(x)),
    "sigmoid_derivative": (lambda x: mpmath.exp(-x) / (1 + mpmath.exp(-x)) ** 2,
                           lambda x: mpmath.exp(-x) * (mpmath.exp(-x) - 1) / (1 + mpmath.exp(-x)) ** 3),
    "gelu": (lambda x: x / 2 * (1 + mpmath.erf(x / mpmath.sqrt(2))),
             lambda x: (1 + mpmath.erf(x / mpmath.sqrt(2))) / 2 + x * mpmath.npdf(x)),
    "gelu_tanh": (lambda x: x / 2 * (1 + mpmath.tanh(mpmath.sqrt(_C) * (x + M("0.044715") * x**3))),
             lambda x: mpmath.diff(lambda y: y / 2 * (1 + mpmath.tanh(mpmath.sqrt(_C) * (y + M("0.044715") * y**3))), x)),
}
# the limits at +inf and -inf: (value, derivative) each
LIMITS = {
    "sigmoid": ((1, 0), (0, 0)), "softplus": ((INF, 1), (0, 0)), "log_sigmoid": ((0, 0), (-INF, 1)),
    "log_one_minus_sigmoid": ((-INF, -1), (0, 0)), "tanh": ((1, 0), (-1, 0)), "relu": ((INF, 1), (0, 0)),
    "leaky_relu": ((INF, 1), (-INF, 0.01)), "elu": ((INF, 1), (-1, 0)), "abs": ((INF, 1), (INF, -1)),
    "sigmoid_derivative": ((0, 0), (0, 0)),
    "gelu": ((INF, NAN), (NAN, NAN)),  # inf*0 at both ends, as PyTorch's
    "gelu_tanh": ((INF, NAN), (NAN, NAN)),  # the tanh form: inf*0 at both ends, as PyTorch's
}


def _by_hand(fn):
    return lambda Z: Z.applyfunc(fn)


# name -> (builder of an elementwise matrix expression of Z, oracle name)
FAMILIES = {
    "sigmoid": (nn.sigmoid, "sigmoid"),
    "softplus": (nn.softplus, "softplus"),
    "log_sigmoid": (nn.log_sigmoid, "log_sigmoid"),
    "tanh": (nn.tanh, "tanh"),
    "relu": (nn.relu, "relu"),
    "leaky_relu": (nn.leaky_relu, "leaky_relu"),
    "elu": (nn.elu, "elu"),
    "gelu": (nn.gelu, "gelu"),
    "gelu_tanh": (lambda Z: nn.gelu(Z, approximate="tanh"), "gelu_tanh"),
    "abs": (_by_hand(sp.Abs), "abs"),
    # hand-written SymPy: compiled to the same stable functions
    "hand 1/(1+exp(-z))": (_by_hand(lambda v: 1 / (1 + sp.exp(-v))), "sigmoid"),
    "hand exp(z)/(1+exp(z))": (_by_hand(lambda v: sp.exp(v) / (1 + sp.exp(v))), "sigmoid"),
    "hand 1/(exp(-z)+1)": (_by_hand(lambda v: 1 / (sp.exp(-v) + 1)), "sigmoid"),
    "hand log(1+exp(z))": (_by_hand(lambda v: sp.log(1 + sp.exp(v))), "softplus"),
    "hand log(1/(1+exp(-z)))": (_by_hand(lambda v: sp.log(1 / (1 + sp.exp(-v)))), "log_sigmoid"),
    "hand -log(1+exp(-z))": (_by_hand(lambda v: -sp.log(1 + sp.exp(-v))), "log_sigmoid"),
    "hand log(1-sigmoid)": (_by_hand(lambda v: sp.log(1 - 1 / (1 + sp.exp(-v)))), "log_one_minus_sigmoid"),
    "hand exp(-z)/(1+exp(-z))**2": (_by_hand(lambda v: sp.exp(-v) / (1 + sp.exp(-v)) ** 2), "sigmoid_derivative"),
    "hand 1.0/(1.0+exp(-z))": (_by_hand(lambda v: 1.0 / (1.0 + sp.exp(-v))), "sigmoid"),
    "hand log1p(exp(z))": (_by_hand(lambda v: log1p(sp.exp(v))), "softplus"),
    "hand (e^z-e^-z)/(e^z+e^-z)": (_by_hand(lambda v: (sp.exp(v) - sp.exp(-v)) / (sp.exp(v) + sp.exp(-v))), "tanh"),
    "hand Max(z,0)": (_by_hand(lambda v: sp.Max(v, 0)), "relu"),
    "hand Piecewise leaky": (_by_hand(lambda v: sp.Piecewise((v, v > 0), (v / 100, True))), "leaky_relu"),
    # across matrix operations: log(ones - sigmoid(Z)), three maps
    "matrix log(1-sigmoid(Z))": (lambda Z: (nn.ones(*Z.shape) - nn.sigmoid(Z)).applyfunc(sp.log), "log_one_minus_sigmoid"),
    "matrix log(sigmoid(Z))": (lambda Z: nn.sigmoid(Z).applyfunc(sp.log), "log_sigmoid"),
    "matrix 1/(ones+exp(-Z))": (lambda Z: sp.HadamardPower(nn.ones(*Z.shape) + (-Z).applyfunc(sp.exp), -1), "sigmoid"),
    "matrix log(ones+exp(Z))": (lambda Z: (nn.ones(*Z.shape) + Z.applyfunc(sp.exp)).applyfunc(sp.log), "softplus"),
}


def _expected(oracle: str, z: float, dtype: str) -> tuple[float, float]:
    if math.isnan(z):
        return NAN, NAN
    if math.isinf(z):
        value, grad = LIMITS[oracle][0 if z > 0 else 1]
        return float(value), float(grad)
    value, derivative = ORACLES[oracle]
    x = M(float(np.dtype(dtype).type(z)))
    return float(value(x)), float(derivative(x))


def _close(got: float, want: float, dtype: str, atol_scale: float) -> bool:
    """Within 16 ulp, plus an absolute slack: the smallest subnormal, or for
    derivatives of saturating functions 4 eps (s*(1 - s) and 1 - tanh^2
    lose the tail to rounding, exactly as PyTorch's do)."""
    info = np.finfo(np.dtype(dtype))
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    want = float(np.dtype(dtype).type(want))  # inf where it overflows the type
    if math.isinf(want) or math.isinf(got):
        return want == got
    atol = float(info.smallest_subnormal) + atol_scale * float(info.eps)
    return abs(got - want) <= 16 * float(info.eps) * abs(want) + atol


def _compile(name: str, build, dtype: str, n: int):
    Z = sp.MatrixSymbol("Z", 1, n)
    Y = build(Z)
    model = sbp.Model(f"numerics_{abs(hash(name)) % 10**8}", params=[Z], loss=nn.sum_all(Y), outputs={"Y": Y})
    return sbp.compile(model, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saturation_limits(family, dtype):
    build, oracle = FAMILIES[family]
    zs = [z for z in ZS if not (oracle == "gelu_tanh" and abs(z) == 1e4)]  # its x**3 overflows float32 there
    mod = _compile(family, build, dtype, len(zs))
    z = np.array([zs], dtype=dtype)
    values = mod.forward(Z=z)["Y"]
    _, grads = mod.value_and_grad(Z=z)
    assert values.dtype == np.dtype(dtype) and grads["Z"].dtype == np.dtype(dtype)
    wrong = []
    saturating = 0.0 if oracle in ("relu", "leaky_relu", "abs", "elu") else 4.0
    for k, zk in enumerate(zs):
        want_value, want_grad = _expected(oracle, zk, dtype)
        got_value, got_grad = float(values[0, k]), float(grads["Z"][0, k])
        if not _close(got_value, want_value, dtype, 0.0 if oracle != "sigmoid_derivative" else 4.0):
            wrong.append(f"value at {zk}: {got_value} != {want_value}")
        if not _close(got_grad, want_grad, dtype, saturating):
            wrong.append(f"derivative at {zk}: {got_grad} != {want_grad}")
    assert not wrong, f"{family} ({dtype}): " + "; ".join(wrong)


def test_issue_examples():
    """The reported holes: sigmoid' at -710 (float64) and -89 (float32), and
    softplus(800) = inf with a NaN gradient."""
    for dtype, z in (("float64", -710.0), ("float64", -1e4), ("float32", -89.0), ("float32", -1e4)):
        mod = _compile("issue sigmoid", nn.sigmoid, dtype, 1)
        _, grads = mod.value_and_grad(Z=np.array([[z]], dtype=dtype))
        assert np.isfinite(grads["Z"]).all() and grads["Z"][0, 0] >= 0
    mod = _compile("issue softplus", nn.softplus, "float64", 1)
    value, grads = mod.value_and_grad(Z=np.array([[800.0]]))
    assert value == 800.0 and grads["Z"][0, 0] == 1.0


def test_one_batch_near_800_keeps_dW_finite():
    """A layer sigmoid(X W) with inputs near 800: dW stays finite (it was NaN
    in every entry)."""
    X, W = sp.MatrixSymbol("X", 4, 3), sp.MatrixSymbol("W", 3, 2)
    loss = nn.sum_all(nn.softplus(X * W)) + nn.sum_all(nn.sigmoid(X * W))
    for dtype in DTYPES:
        mod = sbp.compile(sbp.Model(f"numerics_layer_{dtype}", inputs=[X], params=[W], loss=loss), dtype=dtype)
        x = np.array([[800.0, -790.0, 1.0], [-800.0, 805.0, 0.5], [1.0, 2.0, 3.0], [-700.0, -720.0, 1e3]], dtype=dtype)
        w = np.array([[1.0, -1.0], [0.5, 2.0], [-0.25, 1.0]], dtype=dtype)
        value, grads = mod.value_and_grad(X=x, W=w)
        assert np.isfinite(value) and np.isfinite(grads["W"]).all(), (dtype, grads["W"])
        z = x.astype(np.float64) @ w.astype(np.float64)
        s = np.exp(-np.logaddexp(0.0, -z))  # sigmoid without overflow
        expected = x.T.astype(np.float64) @ (s + s * (1 - s))
        eps = np.finfo(np.dtype(dtype)).eps
        assert np.allclose(grads["W"], expected, rtol=64 * eps, atol=64 * eps * np.abs(x).max())


def test_nan_propagates_through_kinks():
    """Max, Min (2 and 3 arguments), Heaviside, sign, Piecewise (a
    comparison, an And): NaN in, NaN out, in the value and the derivative
    (comparisons with NaN are false, and C's fmax drops a NaN); other
    points give numbers. The cases are one module per dtype, each on
    parameters of its own (z_i, v_i): the loss is their sum, so each
    case's partials are its own, and each case's value is an output."""
    cases = {
        "max2": lambda z, v: sp.Max(z, v), "min2": lambda z, v: sp.Min(z, v),
        "max3": lambda z, v: sp.Max(z, v, 2 * z - 1), "min3": lambda z, v: sp.Min(z, v, -z),
        "heaviside": lambda z, v: sp.Heaviside(z) * v, "heaviside2": lambda z, v: sp.Heaviside(z - v) + z,
        "sign": lambda z, v: sp.sign(z) * v, "abs": lambda z, v: sp.Abs(z) * v,
        "huber-like": lambda z, v: sp.Piecewise((z**2 / 2, sp.Abs(z - v) <= 1), (sp.Abs(z) - v, True)),
        "and": lambda z, v: sp.Piecewise((z, (z > 0) & (v > 0)), (v, True)),
    }
    leaves = {name: sp.symbols(f"z{i} v{i}", real=True) for i, name in enumerate(cases)}
    values = {name: case(*leaves[name]) for name, case in cases.items()}
    outputs = {f"value{i}": values[name] for i, name in enumerate(cases)}
    for dtype in DTYPES:
        model = sbp.Model("numerics_nan_kinks", params=[s for pair in leaves.values() for s in pair],
                          loss=sp.Add(*values.values()), outputs=outputs)
        mod = sbp.compile(model, dtype=dtype)
        for zk, vk in ((NAN, 0.5), (1.5, NAN), (-2.0, 3.0)):
            point = {str(s): k for z, v in leaves.values() for s, k in ((z, zk), (v, vk))}
            loss, grads = mod.value_and_grad(**point)
            out = mod.forward(**point)
            numbers = not (math.isnan(zk) or math.isnan(vk))
            assert np.isfinite(loss) == numbers, (dtype, zk, vk, loss)
            for i, (name, (z, v)) in enumerate(leaves.items()):
                value, dz, dv = out[f"value{i}"], grads[str(z)], grads[str(v)]
                assert np.isfinite(value) == numbers, (name, dtype, zk, vk, value)
                assert np.isfinite(dz) == numbers, (name, dtype, zk, vk, dz)
                # d/dv of step(z)*v is step(z): a number even where v is NaN
                v_in_kink = name not in ("heaviside", "sign", "abs")
                assert np.isfinite(dv) == (numbers or (v_in_kink is False and not math.isnan(zk))), (
                    name, dtype, zk, vk, dv)


def test_rewrites_are_exact_and_only_exact():
    """stabilize: the value of every rewritten form equals the original
    (checked numerically at 30 points); forms that only look alike stay."""
    z, y = sp.symbols("z y", real=True)
    rewritten = [1 / (1 + sp.exp(-z)), sp.exp(z) / (1 + sp.exp(z)), sp.log(1 + sp.exp(z)), 3 / (1 + sp.exp(2 * z - y)),
                 y * sp.exp(-z) / (1 + sp.exp(-z)) ** 2, sp.log(1 / (1 + sp.exp(-z))), (1 + sp.exp(-z - y)) ** -3,
                 sp.log(1 - 1 / (1 + sp.exp(-z))), sp.exp(2 * z) / (1 + sp.exp(2 * z)) + sp.log(1 + sp.exp(y)),
                 sp.exp(z) / (1 + sp.exp(-z)), 1.0 / (1.0 + sp.exp(-z)), log1p(sp.exp(z - y)),
                 y * (sp.exp(-z) - sp.exp(z)) / (sp.exp(z) + sp.exp(-z))]
    kept = [1 / (2 + sp.exp(-z)), sp.log(2 + sp.exp(z)), sp.log(1 + 2 * sp.exp(z)), 1 / (1 - sp.exp(-z)),
            (1 + sp.exp(z)) ** 2, sp.exp(z) / (1 + sp.exp(z)) ** sp.Rational(1, 2), sp.log(1 + sp.exp(z) + y),
            1 / (1 + sp.exp(z) ** 2 + z), sp.log(sp.Float(1.5) + sp.exp(z)), log1p(2 * sp.exp(z)),
            (sp.exp(z) - sp.exp(-z)) / (sp.exp(z) + 2 * sp.exp(-z)), (sp.exp(z) + sp.exp(-z)) / (sp.exp(z) - sp.exp(-z))]
    points = [sp.Rational(k, 3) for k in range(-90, 91, 6)]
    for expr in rewritten:
        new = stabilize(expr)
        assert new != expr and new.has(sigmoid, softplus, sp.tanh), expr
        for p in points:
            at = {z: p, y: p / 3 + sp.Rational(1, 4)}
            want = expr.subs(at).evalf(40)
            assert abs(new.rewrite(sp.exp).subs(at).evalf(40) - want) <= sp.Float(10) ** -30 * (1 + abs(want)), (expr, p)
    for expr in kept:
        assert stabilize(expr) == expr, expr


def test_functions_as_sympy():
    """sigmoid and softplus behave as SymPy functions: exact values at
    constants, limits, derivatives equal to sympy.diff of the exp forms."""
    z = sp.Symbol("z", real=True)
    assert sigmoid(0) == sp.Rational(1, 2) and softplus(0) == sp.log(2)
    assert sigmoid(sp.oo) == 1 and sigmoid(-sp.oo) == 0 and softplus(-sp.oo) == 0 and softplus(sp.oo) == sp.oo
    assert sigmoid(sp.nan) is sp.nan and softplus(sp.nan) is sp.nan
    for fn in (sigmoid, softplus):
        difference = sp.diff(fn(z), z).rewrite(sp.exp) - sp.diff(fn(z).rewrite(sp.exp), z)
        assert sp.simplify(difference) == 0, fn
    assert float(sigmoid(sp.Float(-800))) == pytest.approx(math.exp(-800), rel=1e-15)
    assert float(softplus(sp.Float(800))) == 800.0


ROWS = np.array([
    [1e4, 0.0, -1e4], [-800.0, -800.0, -800.0], [800.0, 799.0, -INF], [-INF, -INF, 0.0],
    [88.0, 89.0, -89.0], [710.0, -710.0, 0.0], [1e-3, 0.0, -1e-3], [-20.0, 20.0, 0.0],
])


def _mp_softmax(row):
    top = max(row)
    weights = [mpmath.exp(M(float(x)) - M(float(top))) if not math.isinf(x) else M(0) for x in row]
    total = sum(weights)
    return [w / total for w in weights], M(float(top)) + mpmath.log(total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_helpers_at_saturation(dtype):
    """logsumexp_rows, log_softmax, softmax and softmax_cross_entropy on rows
    with entries from -1e4 to 1e4 and -inf: values and gradients against
    mpmath (the gradient of sum(lse) is softmax; of the cross entropy,
    (softmax - t) / rows)."""
    n = ROWS.shape[0]
    Z, T = sp.MatrixSymbol("Z", n, 3), sp.MatrixSymbol("T", n, 3)
    t = np.tile(np.array([[0.25, 0.5, 0.25]]), (n, 1)).astype(dtype)
    z = ROWS.astype(dtype)
    eps = float(np.finfo(np.dtype(dtype)).eps)
    lse_mod = sbp.compile(sbp.Model("numerics_lse", params=[Z], loss=nn.sum_all(nn.logsumexp_rows(Z)),
                                    outputs={"L": nn.logsumexp_rows(Z), "S": nn.softmax(Z), "P": nn.log_softmax(Z)}),
                          dtype=dtype)
    ce_mod = sbp.compile(sbp.Model("numerics_ce", inputs=[T], params=[Z], loss=nn.softmax_cross_entropy(Z, T)), dtype=dtype)
    out = lse_mod.forward(Z=z)
    _, grads = lse_mod.value_and_grad(Z=z)
    ce, ce_grads = ce_mod.value_and_grad(Z=z, T=t)
    expected_ce = M(0)
    for r, row in enumerate(z.astype(np.float64)):
        soft, lse = _mp_softmax(list(row))
        assert float(out["L"][r, 0]) == pytest.approx(float(lse), rel=16 * eps), row
        # exp(z - lse): lse's rounding (eps |lse|) becomes softmax's relative error, as in PyTorch
        tol = 16 * eps * (1 + abs(float(lse)))
        for c in range(3):
            assert abs(float(out["S"][r, c]) - float(soft[c])) <= tol * float(soft[c]) + 4 * eps, row
            assert abs(float(grads["Z"][r, c]) - float(soft[c])) <= tol * float(soft[c]) + 4 * eps, row
            want = float(M(float(row[c])) - lse)
            got = float(out["P"][r, c])
            assert got == want if math.isinf(want) else abs(got - want) <= 16 * eps * (abs(want) + abs(float(lse))), row
            want_ce = (float(soft[c]) - float(t[r, c])) / n
            assert abs(float(ce_grads["Z"][r, c]) - want_ce) <= (tol * float(soft[c]) + 4 * eps) / n, row
        if not any(math.isinf(x) for x in row):
            expected_ce += lse - sum(M(float(t[r, c])) * M(float(row[c])) for c in range(3))
    assert ce == INF  # rows with -inf logits and t > 0 there: an infinite loss, as PyTorch's
    finite = [r for r in range(n) if np.isfinite(z[r]).all()]
    Zf = z[finite]
    Zs, Ts = sp.MatrixSymbol("Z", len(finite), 3), sp.MatrixSymbol("T", len(finite), 3)
    mod = sbp.compile(sbp.Model("numerics_ce3", inputs=[Ts], params=[Zs], loss=nn.softmax_cross_entropy(Zs, Ts)), dtype=dtype)
    value, _ = mod.value_and_grad(Z=Zf, T=t[finite])
    assert float(value) == pytest.approx(float(expected_ce) / len(finite), rel=64 * eps)


TORCH_FUNCTIONS = {
    "sigmoid": lambda t, x: t.sigmoid(x), "softplus": lambda t, x: t.nn.functional.softplus(x),
    "log_sigmoid": lambda t, x: t.nn.functional.logsigmoid(x), "tanh": lambda t, x: t.tanh(x),
    "relu": lambda t, x: t.relu(x), "leaky_relu": lambda t, x: t.nn.functional.leaky_relu(x),
    "elu": lambda t, x: t.nn.functional.elu(x), "abs": lambda t, x: t.abs(x),
    "gelu": lambda t, x: t.nn.functional.gelu(x),
    "gelu_tanh": lambda t, x: t.nn.functional.gelu(x, approximate="tanh"),
}
# PyTorch's derivatives at NaN for these kinks are numbers (relu 1, abs 0, ...); ours are NaN
NAN_GRAD_DIFFERS = {"relu", "leaky_relu", "elu", "abs"}
# PyTorch's float32 exact gelu is NaN at +inf; ours is inf, the limit (and PyTorch's float64 value)
TORCH_VALUE_DIFFERS = {("gelu", "float32", INF)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(TORCH_FUNCTIONS))
def test_against_pytorch(family, dtype):
    torch = pytest.importorskip("torch")
    build, _ = FAMILIES[family]
    zs = [z for z in ZS if not (family == "gelu_tanh" and abs(z) == 1e4)]
    mod = _compile(family, build, dtype, len(zs))
    z = np.array([zs], dtype=dtype)
    values = mod.forward(Z=z)["Y"]
    _, grads = mod.value_and_grad(Z=z)
    x = torch.tensor(z, requires_grad=True)
    y = TORCH_FUNCTIONS[family](torch, x)
    y.sum().backward()
    want_values, want_grads = y.detach().numpy(), x.grad.numpy()
    eps = float(np.finfo(np.dtype(dtype)).eps)
    for k, zk in enumerate(zs):
        for got, want, what in ((values[0, k], want_values[0, k], "value"), (grads["Z"][0, k], want_grads[0, k], "grad")):
            if what == "grad" and math.isnan(zk) and family in NAN_GRAD_DIFFERS:
                assert math.isnan(got), (family, dtype)
                continue
            if what == "value" and (family, dtype, zk) in TORCH_VALUE_DIFFERS:
                assert got == INF, (family, dtype, zk)
                continue
            if math.isnan(want) or math.isinf(want):
                assert (math.isnan(got) and math.isnan(want)) or got == want, (family, dtype, zk, what, got, want)
            else:
                assert abs(got - want) <= 16 * eps * abs(want) + 4 * eps, (family, dtype, zk, what, got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_forms_compile_without_warnings(dtype, tmp_path):
    """The C of the stable functions and the NaN tests, in every kind of
    function (second derivatives too), under -Wall -Wextra -Wpedantic
    -Werror, and for float32 -Wdouble-promotion (no double literal)."""

    from c_driver import strict_compile_errors

    from symbackprop.pipeline import generate

    Z, V = sp.MatrixSymbol("Z", 2, 3), sp.MatrixSymbol("V", 2, 3)
    a, b = sp.symbols("a b", real=True)
    mixed = sp.HadamardProduct(nn.sigmoid(Z), nn.softplus(V)) + nn.relu(Z - V) + nn.leaky_relu(V) + nn.elu(Z)
    kinks = (sp.Max(a, b, 0) + sp.Min(a, b) + sp.sign(a) + sp.Heaviside(b) * a
             + sp.Piecewise((a, (a > 0) & (b < 1)), (0, True)) + sp.Max(a, 1) * sp.Min(b, -a, 2))
    loss = nn.sum_all(mixed) + nn.sum_all(nn.log_sigmoid(Z)) + kinks * sp.OneMatrix(1, 1)
    model = sbp.Model(f"numerics_strict_{dtype}", params=[Z, V, a, b], loss=loss)
    emitted, _ = generate(model, dtype=dtype, functions=("forward", "value_and_grad", "jvp", "hvp"))
    errors = strict_compile_errors(emitted, tmp_path, dtype)
    assert errors == "", errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_map_examples_bodies_are_rewritten(dtype):
    """A per-example body written by hand (logistic loss of one example)
    gets the same stable forms: a finite loss and gradient where the logit
    is -800, 800 or 1e4, equal to the closed form."""
    N = sp.Symbol("N", integer=True, positive=True)
    X, y = sp.MatrixSymbol("X", N, 2), sp.MatrixSymbol("y", N, 1)
    w = sp.MatrixSymbol("w", 1, 2)
    x, t, v = sp.Matrix(sp.symbols("x0:2", real=True)), sp.Symbol("t", real=True), sp.Matrix(sp.symbols("v0:2", real=True))
    z = x.dot(v)
    p = 1 / (1 + sp.exp(-z))
    body = -(t * sp.log(p) + (1 - t) * sp.log(1 - p))
    per_example = sbp.map_examples(body, [(x, X), (sp.Matrix([t]), y), (v, sbp.gather(w, sbp.Index("zero", N)))])
    model = sbp.Model(f"numerics_emap_{dtype}", inputs=[X, y, sbp.Index("zero", N)], params=[w],
                      loss=sbp.reduce("sum", per_example, 0))
    mod = sbp.compile(model, dtype=dtype)
    xs = np.array([[800.0, 0.0], [-800.0, 0.0], [1e4, 0.0], [3.0, -1.0]], dtype=dtype)
    ts = np.array([[0.0], [1.0], [0.5], [1.0]], dtype=dtype)
    loss, grads = mod.value_and_grad(X=xs, y=ts, zero=np.zeros(4, dtype=np.int64), w=np.array([[1.0, 0.5]], dtype=dtype))
    logits = xs.astype(np.float64) @ np.array([1.0, 0.5])
    want = float(np.sum(np.logaddexp(0.0, logits) - ts[:, 0] * logits))
    s = np.exp(-np.logaddexp(0.0, -logits))
    want_grad = (s - ts[:, 0]) @ xs.astype(np.float64)
    eps = float(np.finfo(np.dtype(dtype)).eps)
    assert np.isfinite(loss) and loss == pytest.approx(want, rel=16 * eps)
    assert np.isfinite(grads["w"]).all() and np.allclose(grads["w"][0], want_grad, rtol=16 * eps, atol=16 * eps * 1e4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_second_derivatives_at_saturation(dtype):
    """hvp of sum(softplus(Z)) + sum(sigmoid(Z)) with direction ones: the
    diagonal s(1 - s) + s(1 - s)(1 - 2s), finite wherever z is, against
    mpmath (forward over reverse through the stable functions)."""
    zs = [z for z in ZS if not math.isnan(z)]
    Z = sp.MatrixSymbol("Z", 1, len(zs))
    model = sbp.Model(f"numerics_hvp_{dtype}", params=[Z], loss=nn.sum_all(nn.softplus(Z)) + nn.sum_all(nn.sigmoid(Z)))
    mod = sbp.compile(model, dtype=dtype, functions=("value_and_grad", "hvp"))
    z = np.array([zs], dtype=dtype)
    got = mod.hvp({"Z": np.ones_like(z)}, Z=z)["Z"][0]
    eps = float(np.finfo(np.dtype(dtype)).eps)
    for k, zk in enumerate(zs):
        if math.isinf(zk):
            assert got[k] == 0, (zk, got[k])
            continue
        x = M(float(z[0, k]))
        s = 1 / (1 + mpmath.exp(-x))
        want = float(s * (1 - s) * (2 - 2 * s))
        assert abs(got[k] - want) <= 16 * eps * abs(want) + 8 * eps, (dtype, zk, got[k], want)
