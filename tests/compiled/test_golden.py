"""Golden files: the generated code of a few small models, checked in under
tests/golden/. An intended change to the output shows in the diff under
review; rewrite them with `python -m pytest tests/compiled/test_golden.py --update-golden`."""

import difflib
from pathlib import Path

import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate

GOLDEN = Path(__file__).resolve().parents[1] / "golden"  # tests/golden/


def scalar_model():
    x, y = sp.symbols("x y")
    return sbp.Model("scalar", params=[x, y], loss=x**3 * y + sp.sin(x * y) + sp.exp(y) / x)


def logistic_model():
    n = sp.Symbol("n", integer=True, positive=True)
    X, t, w = sp.MatrixSymbol("X", n, 2), sp.MatrixSymbol("t", n, 1), sp.MatrixSymbol("w", 2, 1)
    p = nn.sigmoid(X * w)
    ones = sp.OneMatrix(n, 1)
    nll = -(sp.HadamardProduct(t, p.applyfunc(sp.log)) + sp.HadamardProduct(ones - t, (ones - p).applyfunc(sp.log)))
    return sbp.Model("logistic", inputs=[X, t], params=[w], loss=nn.mean_all(nll))


def softmax_model():
    Z, T = sp.MatrixSymbol("Z", 4, 3), sp.MatrixSymbol("T", 4, 3)
    return sbp.Model("softmax_ce", inputs=[T], params=[Z], loss=nn.softmax_cross_entropy(Z, T))


def scan_model():
    """A scan with most of its C's cases: a row state and a matrix state
    (started from a transposed matrix: copied), a sequence given transposed
    (its rows gathered at each step), checkpoints (the backward loop by
    segments) and weights' adjoints added straight into their accumulators."""
    T = sp.Symbol("T", integer=True, positive=True)
    W, Ux, b = sp.MatrixSymbol("W", 3, 3), sp.MatrixSymbol("Ux", 2, 3), sp.MatrixSymbol("b", 1, 3)
    V, h0, M = sp.MatrixSymbol("V", 3, 1), sp.MatrixSymbol("h0", 1, 3), sp.MatrixSymbol("M", 2, 2)
    XT, Z = sp.MatrixSymbol("XT", 2, T), sp.MatrixSymbol("Z", T, 1)
    h, m, x = sp.MatrixSymbol("h", 1, 3), sp.MatrixSymbol("m", 2, 2), sp.MatrixSymbol("x", 1, 2)
    h_next = (h * W + x * Ux + b).applyfunc(sp.tanh)
    Y = sbp.scan((h_next, m * sp.Rational(1, 2) + M.T), h_next * V, (h, m), x, (h0, M.T * 2), XT.T, checkpoint_every=2)
    final_h, final_m = sbp.final_state(Y)
    loss = (sp.OneMatrix(1, T) * sp.HadamardPower(Y - Z, 2) + final_h * sp.OneMatrix(3, 1)
            + sp.OneMatrix(1, 2) * final_m * sp.OneMatrix(2, 1))
    return sbp.Model("scan_rnn", inputs=[XT, Z], params=[W, Ux, b, V, h0, M], loss=loss)


MODELS = {"scalar": scalar_model, "logistic": logistic_model, "softmax_ce": softmax_model, "scan_rnn": scan_model}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generated_code_matches_golden(name, request):
    emitted, _ = generate(MODELS[name]())
    files = {f"{name}.c": emitted.source, f"{name}.h": emitted.header, f"{name}.md": emitted.derivation}
    if request.config.getoption("--update-golden"):
        GOLDEN.mkdir(exist_ok=True)
        for file, text in files.items():
            (GOLDEN / file).write_text(text)
    for file, text in files.items():
        path = GOLDEN / file
        old = path.read_text() if path.exists() else ""
        diff = "".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(path), "generated now"))
        assert not diff, f"{path} differs from what is generated now; if intended, rerun with --update-golden:\n{diff}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_golden_models_are_right(name):
    """The golden models compute correct gradients (central differences)."""
    import numpy as np
    from oracles import relative_error

    model = MODELS[name]()
    mod = sbp.compile(model)
    rng = np.random.default_rng(0)
    shapes = {leaf.name: (leaf.shape if isinstance(leaf, sp.MatrixSymbol) else (1, 1)) for leaf in model.inputs + model.params}
    data = {k: rng.uniform(0.2, 0.9, size=tuple(5 if isinstance(d, sp.Symbol) else int(d) for d in s)) for k, s in shapes.items()}
    _, grads = mod.value_and_grad(**data)
    for name_, grad in grads.items():
        numeric = np.zeros(np.shape(data[name_]))
        for index in np.ndindex(numeric.shape):
            values = []
            for sign in (1, -1):
                shifted = data[name_].copy()
                shifted[index] += sign * 1e-6
                values.append(mod.forward(**{**data, name_: shifted})["loss"])
            numeric[index] = (values[0] - values[1]) / 2e-6
        assert relative_error(np.reshape(grad, numeric.shape), numeric) < 1e-6, name_
