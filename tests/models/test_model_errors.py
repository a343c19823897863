"""Models that cannot be compiled raise ModelError naming the offending
subexpression, before any C is written."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn

a, x, y = sp.symbols("a x y")
n, m = sp.symbols("n m", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
Q = sp.MatrixSymbol("Q", m, 2)
W = sp.MatrixSymbol("W", 3, 2)
S = sp.MatrixSymbol("S", 3, 3)
Z = sp.MatrixSymbol("Z", n, 3)
Z2 = sp.MatrixSymbol("Z", 2 * n, 2)  # a dimension that is an expression
f = sp.Function("f")
ones = nn.ones


def scalar_model(loss, **extra):
    return sbp.Model("m", inputs=[x], params=[a], loss=loss, **extra)


def matrix_model(loss, inputs=(X,), params=(W,), **extra):
    return sbp.Model("m", inputs=list(inputs), params=list(params), loss=loss, **extra)


# (id, a function building and compiling the model, fragments of the message)
CASES = [
    # unsupported SymPy nodes
    ("Inverse", lambda: matrix_model(a * nn.sum_all(sp.Inverse(S)), inputs=[S], params=[a]),
     ("unsupported matrix operation Inverse", "S**(-1)")),
    ("MatPow", lambda: matrix_model(a * nn.sum_all(S ** sp.Rational(1, 2)), inputs=[S], params=[a]), ("MatPow", "S**(1/2)")),
    ("MatPow-negative", lambda: matrix_model(a * nn.sum_all(S**-2), inputs=[S], params=[a]), ("MatPow", "S**(-2)")),
    ("Identity", lambda: matrix_model(nn.sum_all(S + sp.Identity(3)), inputs=[], params=[S]), ("Identity",)),
    ("Trace", lambda: matrix_model(a * sp.Trace(S), inputs=[S], params=[a]), ("unsupported scalar operation Trace", "Trace(S)")),
    ("Determinant", lambda: matrix_model(a * sp.Determinant(S), inputs=[S], params=[a]), ("Determinant", "Determinant(S)")),
    ("Integral", lambda: scalar_model(sp.Integral(a * y, (y, 0, x))),
     ("unsupported scalar operation Integral", "Integral(a*y, (y, 0, x))")),
    ("Sum", lambda: scalar_model(sp.Sum(a * y, (y, 1, 3))), ("Sum", "Sum(a*y, (y, 1, 3))")),
    ("Derivative", lambda: scalar_model(sp.Derivative(sp.exp(a * x), x, evaluate=False)),
     ("Derivative", "Derivative(exp(a*x), x)")),
    ("imaginary-unit", lambda: scalar_model(sp.I * a), ("I is not a real number", "I*a")),
    ("complex-infinity", lambda: scalar_model(a / sp.S(0)), ("zoo is not a real number",)),
    ("matrix-in-scalar", lambda: matrix_model(a * sp.exp(X[0, 0]) + sp.exp(X), params=[a]), ("matrix X used inside the scalar",)),
    ("symbolic-index", lambda: matrix_model(W[n, 0]), ("only constant indices", "W[n, 0]")),
    # functions without a derivative
    ("undefined-function", lambda: scalar_model(f(a * x)), ("f is an undefined function",)),
    ("undefined-elementwise", lambda: matrix_model(nn.sum_all((X * W).applyfunc(f))), ("f is an undefined function",)),
    ("frac", lambda: scalar_model(sp.frac(a * x)), ("no derivative known", "frac(a*x)")),
    ("Mod-elementwise", lambda: matrix_model(nn.sum_all((X * W).applyfunc(lambda v: sp.Mod(v, 2)))),
     ("no derivative known", "Mod(")),
    ("Mod", lambda: scalar_model(sp.Mod(a, x)), ("no derivative known", "Mod(a, x)")),
    ("undefined-in-output", lambda: scalar_model(a * x, outputs={"o": f(x)}), ("f is an undefined function",)),
    # non-scalar losses
    ("matrix-loss", lambda: matrix_model(X * W), ("loss must be a scalar", "(n, 2)", "X*W")),
    ("relational-loss", lambda: scalar_model(sp.Gt(a, x)), ("loss must be a scalar", "a > x")),
    ("column-loss", lambda: matrix_model(nn.row_sums(X * W)), ("loss must be a scalar", "(n, 1)")),
    # shape mismatches SymPy cannot see (symbolic dimensions)
    ("matmul-mismatch", lambda: matrix_model(nn.sum_all(X.T * Q), inputs=[X, Q]), ("matrix product", "(m, 2)", "X.T*Q")),
    ("add-mismatch", lambda: matrix_model(nn.sum_all(X * W + Q), inputs=[X, Q]), ("(m, 2)", "Q + X*W")),
    ("hadamard-mismatch", lambda: matrix_model(nn.sum_all(sp.HadamardProduct(X * W, Q)), inputs=[X, Q]),
     ("cannot broadcast", "HadamardProduct(X*W, Q)")),
    ("fixed-vs-symbolic", lambda: matrix_model(nn.sum_all(S + Z), inputs=[Z], params=[S]),
     ("need equal shapes", "(3, 3)", "(n, 3)", "S + Z")),
    # names: declared twice, never declared
    ("input-and-param", lambda: sbp.Model("m", inputs=[x], params=[x], loss=x), ("'x' is declared twice", "input", "param")),
    ("same-name-other-assumptions", lambda: sbp.Model("m", inputs=[sp.Symbol("x", real=True)], params=[x], loss=x),
     ("'x' is declared twice",)),
    ("symbol-and-matrix-same-name", lambda: sbp.Model("m", inputs=[sp.MatrixSymbol("a", 2, 2)], params=[a], loss=a),
     ("'a' is declared twice",)),
    ("undeclared-symbol", lambda: scalar_model(a * x * y), ("y is neither an input nor a param", "a*x*y")),
    ("undeclared-matrix", lambda: matrix_model(nn.sum_all(X * W) + nn.sum_all(S)), ("S is neither an input nor a param",)),
    ("undeclared-in-output", lambda: scalar_model(a * x, outputs={"o": y + 1}), ("y is neither an input nor a param", "y + 1")),
    ("undeclared-in-elementwise", lambda: matrix_model(nn.sum_all((X * W).applyfunc(lambda v: v * y))),
     ("uses undeclared", "y")),
    ("undeclared-dimension", lambda: matrix_model(nn.sum_all(ones(m, 1) * ones(1, n) * X * W)),
     ("m in", "neither an input, a param nor a dimension")),
    ("undeclared-dimension-broadcast", lambda: matrix_model(nn.sum_all(X * W), outputs={"o": ones(m, 1) * W[0:1, :]}),
     ("dimension m of", "not a dimension of any input or param")),
    ("dimension-is-input", lambda: matrix_model(nn.sum_all(X * W) * n, inputs=[X, n]), ("n is used both as a dimension",)),
    ("dimension-expression", lambda: matrix_model(nn.sum_all(Z2), inputs=[Z2], params=[]),
     ("dimension 2*n of Z",)),
    ("leaf-named-loss", lambda: sbp.Model("m", inputs=[x], params=[sp.Symbol("loss")], loss=x), ("'loss' is reserved", "param")),
    ("output-named-like-input", lambda: scalar_model(a * x, outputs={"x": 2 * x}), ("output 'x' clashes with the input",)),
    ("grad-input-not-input", lambda: scalar_model(a * x, grad_inputs=[a]), ("grad_inputs names 'a'",)),
    ("leaf-not-a-symbol", lambda: sbp.Model("m", inputs=[x], params=[a + 1], loss=x), ("must be sympy Symbols", "a + 1")),
    ("empty-model-name", lambda: sbp.Model("", inputs=[x], params=[a], loss=a * x), ("non-empty string name",)),
]


@pytest.mark.parametrize("build, fragments", [pytest.param(b, fr, id=i) for i, b, fr in CASES])
def test_model_error_names_the_subexpression(build, fragments):
    with pytest.raises(sbp.ModelError) as info:
        sbp.compile(build())
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_enough_cases():
    assert len(CASES) >= 30


def test_model_error_is_a_value_error_of_the_hierarchy():
    assert issubclass(sbp.ModelError, sbp.SymbackpropError) and issubclass(sbp.ModelError, ValueError)


def test_the_same_model_without_the_error_compiles():
    """The fixtures above are only wrong where they say: the valid twin of
    the shape-mismatch model compiles and runs."""
    mod = sbp.compile(matrix_model(nn.sum_all(X.T * sp.MatrixSymbol("P", n, 2)), inputs=[X, sp.MatrixSymbol("P", n, 2)]))
    assert mod.value_and_grad(**_ones(X=(2, 3), P=(2, 2), W=(3, 2)))[0] == 12.0


def _ones(**shapes):
    return {k: np.ones(s) for k, s in shapes.items()}


def test_outputs_none_is_no_outputs_and_a_list_is_named():
    """outputs=None declares none (as loss=None declares no loss); a list
    instead of a dict is a ModelError that says what outputs must be."""
    loss = nn.sum_all(X * W)
    assert matrix_model(loss, outputs=None).outputs == {}
    with pytest.raises(sbp.ModelError, match=r"outputs must map names to expressions \(a dict\); got a list"):
        matrix_model(loss, outputs=[X * W])
