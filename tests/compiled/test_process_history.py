"""The generated C is a function of the model alone: the same in a fresh
process as in one that declared and generated other models first (a
notebook, a build script, `symbackprop build` over several files). Users
check the C into git and review its diffs; a name or an order that followed
which activation an earlier model had made first showed as a spurious diff.

The oracle is the fresh process: each model's C is generated in a child
process of its own and in one that first generated other models sharing its
helpers, in another order; the two must be byte-identical."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp

import symbackprop  # noqa: F401  (installs the remembered sort keys)

ROOT = Path(__file__).resolve().parents[2]

# A child process: generates each model named on its command line, in order,
# and prints the last one's C. The models share nn's activations, each of
# which is one Lambda kept for the process (and its Dummy variable).
SCRIPT = r'''
import sys
import sympy as sp
import symbackprop as sbp
from symbackprop import nn
from symbackprop.pipeline import generate

n = sp.Symbol("n", integer=True, positive=True)
X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
W = sp.MatrixSymbol("W", 3, 2)


def fit(name, y):
    params = sorted((s for s in y.free_symbols if isinstance(s, sp.MatrixSymbol) and s != X), key=str)
    return sbp.Model(name, inputs=[X, T], params=params, loss=nn.mse(y, T), outputs={"y": y})


def lstm():
    W_, U_, b_ = ([sp.MatrixSymbol(f"{p}_{g}", *shape) for g in "ifgo"] for p, shape in
                  (("W", (3, 2)), ("U", (2, 2)), ("b", (1, 2))))
    h = c = None
    for x in (X, sp.MatrixSymbol("X2", n, 3)):
        h, c = nn.lstm_cell(x, h, c, W_, U_, b_)
    return sbp.Model("lstm", inputs=[X, sp.MatrixSymbol("X2", n, 3), T], params=[*W_, *U_, *b_],
                     loss=nn.shallow(nn.mse, h, T))


def gru():
    W_, U_, b_ = ([sp.MatrixSymbol(f"{p}_{g}", *shape) for g in "rzm"] for p, shape in
                  (("W", (3, 2)), ("U", (2, 2)), ("b", (1, 2))))
    return sbp.Model("gru", inputs=[X, T], params=[*W_, *U_, *b_],
                     loss=nn.mse(nn.gru_cell(X, None, W_, U_, b_), T))


MODELS = {
    "lstm": lstm,
    "gru": gru,
    # one pre-activation through three activations, a term each
    "heads": lambda: fit("heads", nn.sigmoid(X * W) * sp.MatrixSymbol("A", 2, 2)
                         + nn.tanh(X * W) * sp.MatrixSymbol("B", 2, 2) + nn.softplus(X * W) * sp.MatrixSymbol("C", 2, 2)),
    # three pre-activations, an activation each
    "branches": lambda: fit("branches", nn.sigmoid(X * sp.MatrixSymbol("A", 3, 2))
                            + nn.tanh(X * sp.MatrixSymbol("B", 3, 2)) + nn.softplus(X * W)),
    "tanh": lambda: fit("tanh", nn.tanh(X * W)),
    "softplus_then_tanh": lambda: fit("softplus_then_tanh", nn.tanh(nn.softplus(X * W))),
}
for name in sys.argv[1:]:
    emitted, _ = generate(MODELS[name]())
print(emitted.source)
'''


def c_after(*models: str) -> str:
    """The C of the last model, generated in a new process after the others."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, *models], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(("history", "model"), [
    (("tanh",), "lstm"),  # tanh's Lambda made before sigmoid's, unlike in the LSTM's own order
    (("softplus_then_tanh",), "heads"),
    (("tanh", "gru"), "branches"),
])
def test_c_does_not_depend_on_earlier_models(history, model):
    fresh = c_after(model)
    assert f"{model}_value_and_grad" in fresh
    assert c_after(*history, model) == fresh


def test_a_lambda_sorts_by_its_function_not_its_dummies():
    """Two activations' Lambdas made in either order: one order of terms."""
    X = sp.MatrixSymbol("X", 3, 2)

    def terms(first, second):
        made = {}
        for fn in (first, second):
            v = sp.Dummy("v", real=True)
            made[fn] = sp.Lambda(v, fn(v))
        from sympy.matrices.expressions.applyfunc import ElementwiseApplyFunction as Apply
        return sp.MatAdd(Apply(made[sp.tanh], X), Apply(made[sp.exp], X)).doit().args

    forward, backward = terms(sp.tanh, sp.exp), terms(sp.exp, sp.tanh)
    assert [a.function.expr.func for a in forward] == [a.function.expr.func for a in backward]
