"""Declaring a model costs what the model holds: symbackprop's own ops
stand as they are under SymPy's doit (which SymPy calls, deep, on every
matrix product and sum it builds), and a per-example Jacobian is derived
in one reverse sweep per output, equal to SymPy's own."""


import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from helpers import count_calls

import symbackprop as sbp
from symbackprop import nn
from symbackprop.base.exprdag import substitute
from symbackprop.declare.standing import Standing


def _residual_stack(layers: int) -> sp.MatrixExpr:
    """h <- h + layer_norm(h) W, `layers` times: each layer reads h twice."""
    n, d = sp.Symbol("n", integer=True, positive=True), 4
    h = sp.MatrixSymbol("X", n, d)
    gamma, beta, w = sp.MatrixSymbol("g", 1, d), sp.MatrixSymbol("b", 1, d), sp.MatrixSymbol("W", d, d)
    for _ in range(layers):
        h = h + nn.layer_norm(h, gamma, beta) * w
    return h


def test_a_residual_stack_declares_in_work_linear_in_its_depth():
    """Each layer reads the previous one twice (the residual and the
    normalized copy); nn.sum_all's product called SymPy's doit through the
    layer norm, which rebuilt the stack once per path: 906, 15,066 and
    241,626 doit calls at 4, 8 and 12 layers. Stopped at the layer norm,
    each layer adds the same few calls."""
    stacks = {k: _residual_stack(k) for k in (4, 8, 12)}  # (each + and * of a chain walks down it: SymPy's)
    calls = {k: count_calls(lambda k=k: nn.sum_all(stacks[k]), "doit") for k in stacks}
    assert calls[12] - calls[8] == calls[8] - calls[4], calls
    assert calls[12] < 2000, calls


def test_symbackprops_ops_stand_under_doit():
    n = sp.Symbol("n", integer=True, positive=True)
    a, m = sp.MatrixSymbol("A", n, 3), sp.MatrixSymbol("M", 3, 3)
    idx = sbp.Index("idx", n)
    x = sp.Matrix(sp.symbols("x0:3", real=True))
    ops = [sbp.gather(a, idx), sbp.map_examples(sp.exp(x[0]) * x[1] + x[2], [(x, a)]),
           nn.layer_norm(a, sp.MatrixSymbol("g", 1, 3), sp.MatrixSymbol("b", 1, 3)), sbp.det(m)]
    own = [sub for op in ops for sub in sp.preorder_traversal(op) if isinstance(sub, Standing)]
    assert {type(op).__name__ for op in own} >= {"Gather", "ExampleMap", "RowNormalize", "Det"}
    for op in own:
        assert op.doit() is op


@pytest.fixture(scope="module")
def bundle_adjustment():
    return load_example("bundle_adjustment")


def _values_at(exprs: list, point: dict) -> list[float]:
    """Each expression's value at `point`: xreplace's, each distinct
    subexpression evaluated once (exprdag.substitute, itself checked against
    xreplace in test_exprdag_substitute; xreplace took a second a point here)."""
    return [float(e) for e in substitute(exprs, point)]


def test_a_per_example_jacobian_is_sympys(bundle_adjustment):
    """jacobian(c, X, w) of bundle adjustment's residual (a Rodrigues
    rotation, whose small-angle branch is a Piecewise) against SymPy's
    Matrix.jacobian of the same body, at random points in both branches."""
    ex = bundle_adjustment
    body = sp.Matrix(ex.residual.body)
    symbols = list(ex.c) + list(ex.X) + [ex.w]
    ours = list(ex.jacobian.body)
    theirs = list(body.jacobian(sp.Matrix(symbols)))
    assert len(ours) == len(theirs) == 2 * 15
    rng = np.random.default_rng(3)
    for small_angle in (False, True):
        values = rng.standard_normal(len(symbols) + 2)
        point = dict(zip(symbols + list(ex.u), (sp.Float(v) for v in values)))
        point[ex.X[2]] += 8  # in front of the camera
        if small_angle:
            point.update({ex.c[k]: sp.Float(0) for k in range(3)})
        assert _values_at(ours, point) == pytest.approx(_values_at(theirs, point), rel=1e-12, abs=1e-12)


def _bone_chain(bones: int) -> sp.Matrix:
    """A product of `bones` explicit 4x4 transforms (a rotation about z, one
    about x, a translation along x), as GradBench's hand tracking chains
    its bones: each entry shares every entry of the transform before."""
    chain = sp.eye(4)
    for k in range(bones):
        a, b, c = sp.symbols(f"a{k} b{k} c{k}", real=True)
        rz = sp.Matrix([[sp.cos(a), -sp.sin(a), 0, 0], [sp.sin(a), sp.cos(a), 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
        rx = sp.Matrix([[1, 0, 0, 0], [0, sp.cos(b), -sp.sin(b), 0], [0, sp.sin(b), sp.cos(b), 0], [0, 0, 0, 1]])
        chain = chain * rz * rx * sp.Matrix([[1, 0, 0, c], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    return chain


def _distinct_subexpressions(matrix: sp.Matrix) -> int:
    seen: set = set()
    stack = list(matrix)
    while stack:
        expr = stack.pop()
        if expr not in seen:
            seen.add(expr)
            stack.extend(expr.args)
    return len(seen)


@pytest.mark.parametrize("build", [lambda v, m: v * m, lambda v, m: -(v * m), lambda v, m: nn.sum_all(v * m),
                                   lambda v, m: m.T * v.T], ids=["product", "negated", "sum_all", "left"])
def test_sympys_operator_on_an_explicit_chain_walks_its_dag(build):
    """X * M of a MatrixSymbol and an explicit matrix is SymPy's
    MatMul(X, M).doit(), which rebuilt each of M's entries as a tree: at
    10 bones, 147,620 calls of Add's and Mul's doit (0.9 s; minutes at 15
    bones, where the distinct subexpressions are ~1,000). Each distinct one is
    now rebuilt once, by no doit of its own (symbackprop.declare.explicit)."""
    chain = _bone_chain(10)
    v = sp.MatrixSymbol("V", sp.Symbol("n", integer=True, positive=True), 4)
    assert _distinct_subexpressions(chain) < 2000
    calls = count_calls(lambda: build(v, chain), "doit")
    assert calls < _distinct_subexpressions(chain), calls


def test_an_explicit_matrix_doit_is_sympys():
    """The DAG walk's result is SymPy's own doit's, entry for entry, also
    where an entry holds classes with a doit of their own (a Piecewise, an
    unevaluated product and derivative, which doit evaluates)."""
    from symbackprop.declare import explicit

    x, y = sp.symbols("x y", real=True)
    shared = sp.Mul(x, 2, x, evaluate=False) + sp.Derivative(sp.sin(x * y), x)
    chain = _bone_chain(3) * sp.Matrix([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, shared],
                                        [sp.Piecewise((shared, x > 0), (y, True)), 0, 0, 1]])
    matrix = sp.ImmutableMatrix(chain.applyfunc(lambda e: sp.Add(e, shared, evaluate=False)))
    ours, sympys = matrix.doit(), explicit.SYMPY_DOIT(matrix)
    assert ours == sympys
    assert ours != matrix  # the unevaluated parts were evaluated


def test_an_unrolled_gru_of_100_steps_declares_its_loss():
    """nn.gru_cell 100 times, then nn.mse: SymPy hashed the state's rebuilt
    nodes and sorted the loss's sum down all 100 steps at once, a
    RecursionError in nn.mse. The loss's value is the unrolled recurrence's
    (numpy, below); its gradient is tested at shorter lengths elsewhere."""
    n, hidden, steps = 3, 2, 100
    x, t = sp.MatrixSymbol("X", n, hidden), sp.MatrixSymbol("T", n, hidden)
    weights = [[sp.MatrixSymbol(f"{kind}{gate}", *shape) for gate in "rzh"]
               for kind, shape in (("W", (hidden, hidden)), ("U", (hidden, hidden)), ("b", (1, hidden)))]
    h = None
    for _ in range(steps):
        h = nn.gru_cell(x, h, *weights)
    loss = nn.mse(h, t)
    rng = np.random.default_rng(0)
    values = {s: rng.standard_normal(s.shape) * 0.5 for group in weights for s in group}
    values[x], values[t] = rng.standard_normal((n, hidden)), rng.standard_normal((n, hidden))
    mod = sbp.compile(sbp.Model("gru100", inputs=[x, t], params=[s for g in weights for s in g], loss=loss))
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    (Wr, Wz, Wh), (Ur, Uz, Uh), (br, bz, bh) = [[values[s] for s in g] for g in weights]
    X, state = values[x], np.zeros((n, hidden))
    for _ in range(steps):
        r, z = sig(X @ Wr + state @ Ur + br), sig(X @ Wz + state @ Uz + bz)
        state = (1 - z) * np.tanh(X @ Wh + bh + r * (state @ Uh)) + z * state
    expected = np.mean((state - values[t]) ** 2)
    got = mod.forward(**{str(s): v for s, v in values.items()})["loss"]
    assert np.isclose(got, expected, rtol=1e-12), (got, expected)


def test_a_product_with_a_transposed_chain_inverts_nothing():
    """S * (A * M).T with M an explicit transform: SymPy's MatMul
    canonicalization asked the compound factor for its inverse (to cancel
    X * X**-1), Gaussian elimination with simplify on M's symbolic entries
    (89 of 94 s declaring GradBench's hand tracking with `*`). It inverts
    nothing now, and the compiled value is numpy's product."""
    n = sp.Symbol("n", integer=True, positive=True)
    s, a = sp.MatrixSymbol("S", n, 4), sp.MatrixSymbol("A", 8, 4)
    theta = sp.MatrixSymbol("theta", 1, 2)
    chain = _bone_chain(2).subs({sp.Symbol("a0", real=True): theta[0, 0], sp.Symbol("b1", real=True): theta[0, 1]})
    chain = chain.subs({sp.Symbol(f"{k}{i}", real=True): 0.5 + i for k in "abc" for i in range(2)})
    calls = count_calls(lambda: s * (a[4:8, :] * chain).T * (a[0:4, :] * chain), "_inv_GE")
    assert calls == 0
    expr = s * (a[4:8, :] * chain).T * (a[0:4, :] * chain)
    mod = sbp.compile(sbp.Model("transposed_chain", inputs=[s, a], params=[theta], outputs={"y": expr}))
    rng = np.random.default_rng(5)
    sv, av, tv = rng.normal(size=(3, 4)), rng.normal(size=(8, 4)), rng.normal(size=(1, 2))
    m = np.array(chain.subs({theta[0, 0]: tv[0, 0], theta[0, 1]: tv[0, 1]}).evalf(), dtype=float)
    got = mod.forward(S=sv, A=av, theta=tv)["y"]
    assert np.allclose(got, sv @ (av[4:8] @ m).T @ (av[0:4] @ m), rtol=1e-13, atol=1e-13)
