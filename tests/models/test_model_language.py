"""Scalars and 1x1 matrices mix in a loss (sbp.as_scalar, or OneMatrix(1, 1)),
SymPy's expanded m[0, 0] is refused when the model is declared, and every
ModelError stays short: the expression abbreviated, its shape, the fix."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import sympy as sp
from oracles import central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.messages import LIMIT, short

n = sp.Symbol("n", integer=True, positive=True)
X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
W, b = sp.MatrixSymbol("W", 3, 2), sp.MatrixSymbol("b", 1, 2)
S, Q = sp.MatrixSymbol("S", 3, 3), sp.MatrixSymbol("Q", 4, 2)
V = sp.MatrixSymbol("V", 12, 12)
lam, y, z = sp.symbols("lam y z")
f = sp.Function("f")

LOGITS = nn.linear(X, W, b)
CE = nn.softmax_cross_entropy(LOGITS, T)
MSE = nn.mse(X * W, T)
PENALTY = lam * (W[0, 0] ** 2 + W[1, 1] ** 2)
# 144 entries: about 2 KB printed, the size of the messages the issue reports
BIG = sp.Add(*[sp.sin(V[i, j]) * V[j, i] for i in range(12) for j in range(12)])


# --- numpy oracles -----------------------------------------------------------

def _ce(d):
    z = d["X"] @ d["W"] + d["b"]
    zmax = z.max(axis=1, keepdims=True)
    lse = (zmax + np.log(np.exp(z - zmax).sum(axis=1, keepdims=True)))[:, 0]
    return float(np.mean(lse - (d["T"] * z).sum(axis=1)))


def _mse(d):
    return float(np.mean((d["X"] @ d["W"] - d["T"]) ** 2))


def _penalty(d):
    return float(d["lam"] * (d["W"][0, 0] ** 2 + d["W"][1, 1] ** 2))


def _data(rng, with_b=True):
    d = {"X": rng.standard_normal((6, 3)), "T": np.eye(2)[rng.integers(0, 2, 6)],
         "W": rng.standard_normal((3, 2)), "lam": 0.7}
    if with_b:
        d["b"] = 0.3 * rng.standard_normal((1, 2))
    return d


# (id, loss, params, numpy oracle of the loss)
ACCEPTED = [
    ("entry-plus-scalar", sbp.as_scalar(CE) + PENALTY, [W, b, lam], lambda d: _ce(d) + _penalty(d)),
    ("function-of-entry", sp.exp(sbp.as_scalar(MSE)) * 2 + lam ** 2, [W, lam],
     lambda d: 2 * np.exp(_mse(d)) + d["lam"] ** 2),
    ("product-of-entries", sbp.as_scalar(MSE) * sbp.as_scalar(nn.l2_penalty(W)) * lam, [W, lam],
     lambda d: _mse(d) * float((d["W"] ** 2).sum()) * d["lam"]),
    ("matrix-plus-onematrix", CE + PENALTY * sp.OneMatrix(1, 1), [W, b, lam], lambda d: _ce(d) + _penalty(d)),
    # an entry times a matrix (SymPy calls doit on it): the MSE of every row shifted by the MSE
    ("entry-times-matrix", nn.mean_all((X * W - T) - lam * sbp.as_scalar(MSE) * nn.ones(n, 2)), [W, lam],
     lambda d: float(np.mean(d["X"] @ d["W"] - d["T"])) - d["lam"] * _mse(d)),
]


@pytest.mark.parametrize("loss, params, oracle", [pytest.param(lo, p, o, id=i) for i, lo, p, o in ACCEPTED])
def test_mixed_losses_match_numpy_and_finite_differences(loss, params, oracle):
    model = sbp.Model("mixed", inputs=[X, T], params=params, loss=loss, outputs={"entry": sbp.as_scalar(MSE)})
    mod = sbp.compile(model)
    data = _data(np.random.default_rng(3), with_b=b in params)
    value, grads = mod.value_and_grad(**data)
    assert abs(value - oracle(data)) <= 1e-12 * max(1.0, abs(oracle(data)))
    assert abs(float(np.asarray(mod.forward(**data)["entry"])) - _mse(data)) < 1e-12
    for name in grads:
        numeric = central_differences(oracle, data, name)
        assert relative_error(np.reshape(grads[name], np.shape(numeric)), numeric) < 1e-6, name


def test_an_entry_stays_an_entry_when_it_scales_a_matrix():
    """scalar * matrix runs doit, which writes MatrixElement's entry of a
    product out term by term; as_scalar's entry stays one (one node to
    lower and differentiate, not the product written out)."""
    row = sp.MatrixSymbol("r", 1, 3)
    entry = sbp.as_scalar(nn.sum_all(row.applyfunc(sp.exp)))
    scaled = (sp.log(entry + 2) * nn.ones(1, 3)).doit()
    assert entry in scaled.atoms(type(entry))
    assert not any(isinstance(a, sp.exp) and a.args[0] == row[0, 0] for a in sp.preorder_traversal(scaled))


def test_as_scalar_of_an_explicit_matrix_and_of_a_scalar():
    x, a = sp.symbols("x a")
    assert sbp.as_scalar(sp.Matrix([[a * x]])) == a * x
    assert sbp.as_scalar(a * x) == a * x and sbp.as_scalar(2.5) == sp.Float(2.5)
    model = sbp.Model("explicit", inputs=[x], params=[a], loss=sbp.as_scalar(sp.Matrix([[sp.sin(a * x)]])) + a)
    value, grads = sbp.compile(model).value_and_grad(x=0.4, a=1.3)
    assert abs(value - (np.sin(0.52) + 1.3)) < 1e-14
    assert abs(float(grads["a"]) - (0.4 * np.cos(0.52) + 1)) < 1e-12


def test_a_number_is_a_loss():
    assert sbp.Model("const", params=[lam], loss=3).loss == 3


# --- refused forms: short messages that say what to write instead ----------

def _model(loss, **extra):
    return sbp.Model("m", inputs=[X, T, V, S, Q], params=[W, b, lam], loss=loss, **extra)


# (id, a function that raises ModelError, fragments of the message)
REFUSED = [
    ("expanded-entry", lambda: _model(CE[0, 0] + PENALTY), ("Sum(", "as_scalar(m)", "OneMatrix(1, 1)")),
    # (not of X * W's MSE: SymPy took 5.6 s to expand that entry before the refusal)
    ("expanded-entry-mse", lambda: _model(nn.mse(X[:, :2], T)[0, 0] * lam), ("Sum(", "as_scalar(m)")),
    ("expanded-entry-in-output", lambda: _model(PENALTY, outputs={"ce": CE[0, 0]}), ("the output 'ce'", "as_scalar")),
    ("matrix-loss", lambda: _model(BIG * (X * W)), ("must be a scalar or a 1x1 matrix", "(n, 2)", "nn.sum_all", " ... ")),
    ("relation-loss", lambda: _model(sp.Gt(BIG, lam)), ("must be a scalar", " ... ")),
    ("as-scalar-of-a-column", lambda: sbp.as_scalar(BIG * nn.row_sums(X * W)), ("as_scalar needs a 1x1", "(n, 1)", " ... ")),
    ("as-scalar-of-a-string", lambda: sbp.as_scalar("W"), ("as_scalar takes",)),
    ("undeclared-symbol", lambda: _model(BIG + y), ("y is neither an input nor a param", " ... ")),
    ("imaginary", lambda: _model(sp.I * BIG), ("I is not a real number", " ... ")),
    ("integral", lambda: _model(sp.Integral(BIG * z, (z, 0, 1))), ("unsupported scalar operation Integral", " ... ")),
    ("matrix-in-scalar", lambda: _model(BIG + sp.exp(X)), ("matrix X used inside the scalar", "(n, 3)", "as_scalar", " ... ")),
    ("no-derivative", lambda: _model(sp.frac(BIG * lam)), ("no derivative known", " ... ")),
    ("undefined-function", lambda: _model(f(BIG) + lam), ("f is an undefined function",)),
    ("sum-shapes", lambda: _model(nn.sum_all(BIG * (X * W) + Q)), ("need equal shapes", "(4, 2)", " ... ")),
    ("reduce-of-a-scalar", lambda: _model(nn.sum_all(sbp.reduce("sum", BIG, 0))), ("reduces a matrix",)),
]


@pytest.mark.parametrize("build, fragments", [pytest.param(b_, fr, id=i) for i, b_, fr in REFUSED])
def test_refusals_are_short_and_say_what_to_write(build, fragments):
    with pytest.raises(sbp.ModelError) as info:
        sbp.compile(build())
    message = str(info.value)
    assert len(message) < 600, (len(message), message)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_enough_refusals():
    assert len(REFUSED) >= 8 and len(ACCEPTED) >= 3


def test_short_cuts_the_middle_and_keeps_short_text_whole():
    text = short(BIG)
    assert len(str(BIG)) > 1500 and len(text) <= LIMIT and " ... " in text
    assert text.startswith(str(BIG)[:100]) and text.endswith(str(BIG)[-50:])
    assert short("a*x +\n  b") == "a*x + b"


def test_a_long_model_error_is_capped_and_survives_pickling():
    error = sbp.ModelError("x" * 5000 + " write y instead")
    assert len(str(error)) < 600 and str(error).endswith("write y instead")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is sbp.ModelError and str(again) == str(error)
