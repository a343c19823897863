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
