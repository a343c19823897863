"""Differential fuzzing: hypothesis draws random well-typed models (matrix
and scalar) from the supported ops, symbackprop compiles each one, and its
loss, outputs and gradients are compared with a numpy evaluation of the
same SymPy expressions (tests/helpers.py), central finite differences of
it, and, for scalar models, sympy.diff.

A default run draws a few models of each kind with a fixed seed (the
_FEW counts, about 15 CPU s); the tests marked slow (`--runslow`, which CI
runs) draw the _MANY counts, about 230 distinct models compiled;
SYMBACKPROP_FUZZ_EXAMPLES=N runs N of each kind with fresh random draws.
A mismatch found here becomes a case in test_regressions.py.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import sympy as sp
from helpers import Evaluator, assert_gradients_match, random_data
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.toolchain.builder import BuildOptions

# draws per property: (default run, slow tier); SYMBACKPROP_FUZZ_EXAMPLES=N for N fresh ones
MATRIX_EXAMPLES, SCALAR_EXAMPLES, MAP_EXAMPLES = (20, 60), (10, 25), (6, 15)
_OVERRIDE = int(os.environ.get("SYMBACKPROP_FUZZ_EXAMPLES", "0"))
# Generated models are small and many: -O1 keeps each build near 0.2 s.
# Optimization levels are covered by the other tests; rounding is not at stake.
FUZZ_BUILD = BuildOptions(flags=("-O1", "-std=c99"), blas=False)


def _settings(examples: int) -> settings:
    return settings(
        max_examples=_OVERRIDE or examples,
        derandomize=not _OVERRIDE,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


n = sp.Symbol("n", integer=True, positive=True)
SIZES = (n, 1, 2, 3)

# elementwise functions defined everywhere, and those that need a positive argument
ANYWHERE = {
    "exp": lambda m: m.applyfunc(sp.exp),
    "sin": lambda m: m.applyfunc(sp.sin),
    "cos": lambda m: m.applyfunc(sp.cos),
    "tanh": nn.tanh,
    "abs": lambda m: m.applyfunc(sp.Abs),
    "relu": nn.relu,
    "softplus": nn.softplus,
    "sigmoid": nn.sigmoid,
}
# Not drawn for 1x1 shapes: SymPy's applyfunc(Abs) of a 1x1 product fails
# inside SymPy itself (ShapeError in Abs.eval), before symbackprop sees it.
NOT_ONE_BY_ONE = frozenset({"abs"})
POSITIVE_ONLY = {
    "log": lambda m: m.applyfunc(sp.log),
    "sqrt": lambda m: m.applyfunc(sp.sqrt),
    "reciprocal": lambda m: sp.HadamardPower(m, -1),
    "power 1.5": lambda m: sp.HadamardPower(m, sp.Rational(3, 2)),
}
COEFFICIENTS = (2, -1, sp.Rational(1, 3), sp.Float(0.75))


class MatrixModels:
    """Draws a random matrix expression of a given shape; declares the
    leaves it uses as it goes (D<k> inputs, P<k> params, s<k> scalars)."""

    def __init__(self, draw):
        self.draw = draw
        self.inputs: list = [sp.MatrixSymbol("D0", n, draw(st.sampled_from(SIZES)))]  # binds n even when unused
        self.params: list = []

    def leaf(self, shape) -> sp.MatrixSymbol:
        existing = [leaf for leaf in self.inputs + self.params
                    if isinstance(leaf, sp.MatrixSymbol) and tuple(leaf.shape) == tuple(shape)]
        if existing and self.draw(st.booleans()):
            return self.draw(st.sampled_from(existing))
        group = self.params if self.draw(st.integers(0, 2)) else self.inputs
        leaf = sp.MatrixSymbol(f"{'P' if group is self.params else 'D'}{len(self.inputs) + len(self.params)}", *shape)
        group.append(leaf)
        return leaf

    def scalar(self) -> sp.Expr:
        if self.draw(st.booleans()):
            return self.draw(st.sampled_from(COEFFICIENTS))
        sym = sp.Symbol(f"s{len(self.inputs) + len(self.params)}")
        (self.params if self.draw(st.booleans()) else self.inputs).append(sym)
        return sym

    def expr(self, shape, depth: int):
        if depth <= 0:
            return self.leaf(shape)
        rows, cols = shape
        op = self.draw(st.sampled_from(
            ["leaf", "matmul", "add", "transpose", "hadamard", "power", "apply", "positive", "scale", "broadcast"]))
        sub = depth - 1
        if op == "matmul":
            inner = self.draw(st.sampled_from(SIZES))
            return self.expr((rows, inner), sub) * self.expr((inner, cols), sub)
        if op == "add":
            return self.expr(shape, sub) + self.expr(shape, sub)
        if op == "transpose":
            return self.expr((cols, rows), sub).T
        if op == "hadamard":
            return sp.HadamardProduct(self.expr(shape, sub), self.expr(shape, sub))
        if op == "power":
            return sp.HadamardPower(self.expr(shape, sub), self.draw(st.sampled_from([2, 3])))
        if op == "apply":
            names = sorted(f for f in ANYWHERE if not (shape == (1, 1) and f in NOT_ONE_BY_ONE))
            return ANYWHERE[self.draw(st.sampled_from(names))](self.expr(shape, sub))
        if op == "positive":
            return POSITIVE_ONLY[self.draw(st.sampled_from(sorted(POSITIVE_ONLY)))](self.positive(shape, sub))
        if op == "scale":
            return self.scalar() * self.expr(shape, sub)
        if op == "broadcast":
            return nn.ones(rows, 1) * self.expr((1, cols), sub)
        return self.leaf(shape)

    def positive(self, shape, depth: int):
        """An expression whose every entry is positive (bounded away from 0)."""
        inner = self.expr(shape, depth)
        kind = self.draw(st.sampled_from(["exp", "sigmoid", "square plus one", "softplus plus one"]))
        if kind == "exp":
            return inner.applyfunc(sp.exp)
        if kind == "sigmoid":
            return nn.sigmoid(inner)
        if kind == "square plus one":
            return sp.HadamardPower(inner, 2) + nn.ones(*shape)
        return nn.softplus(inner) + nn.ones(*shape)


@st.composite
def matrix_models(draw):
    """(model, dims): loss = sum or mean of a random expression (plus
    sometimes a second term); the expression is also a named output."""
    gen = MatrixModels(draw)
    shape = (draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES)))
    body = gen.expr(shape, draw(st.integers(1, 3)))
    reduce = draw(st.sampled_from([nn.sum_all, nn.mean_all]))
    loss = reduce(body)
    if draw(st.booleans()):
        loss = loss + nn.mean_all(gen.expr((draw(st.sampled_from(SIZES)), 1), draw(st.integers(0, 2))))
    if not gen.params:
        gen.params.append(sp.Symbol("s_unused"))  # its gradient must come out as 0
    matrices = [leaf for leaf in gen.inputs if isinstance(leaf, sp.MatrixSymbol)]
    grad_inputs = [draw(st.sampled_from(matrices))] if draw(st.integers(0, 3)) == 0 else []
    model = sbp.Model("fuzz", inputs=gen.inputs, params=gen.params, loss=loss, outputs={"body": body},
                      grad_inputs=grad_inputs)
    return model, {n: draw(st.integers(1, 3))}


def _checkable(model, data, dims) -> bool:
    """Skip draws where finite differences cannot judge: a non-finite or
    huge loss, or an Abs/Max argument within reach of its kink."""
    evaluator = Evaluator(data, dims)
    loss = float(np.asarray(evaluator(model.loss)).reshape(-1)[0])
    return math.isfinite(loss) and abs(loss) < 1e6 and evaluator.kink > 1e-4


def _few_and_many(counts: tuple[int, int], body, **strategies):
    """A property as two tests: a few derandomized draws in the default
    run, more in the slow tier (`--runslow`)."""
    few, many = (_settings(count)(given(**strategies)(body)) for count in counts)
    return few, pytest.mark.slow(many)


def _matrix_models_match_finite_differences(drawn, seed):
    model, dims = drawn
    data = random_data(model, np.random.default_rng(seed), dims)
    assume(_checkable(model, data, dims))
    mod = sbp.compile(model, options=FUZZ_BUILD)
    assert_gradients_match(mod, model, data, dims)
    body = mod.forward(**data)["body"]
    np.testing.assert_allclose(body, Evaluator(data, dims)(model.outputs["body"]), rtol=1e-9, atol=1e-12)


test_matrix_models_match_finite_differences, test_matrix_models_match_finite_differences_many = _few_and_many(
    MATRIX_EXAMPLES, _matrix_models_match_finite_differences, drawn=matrix_models(), seed=st.integers(0, 2**32 - 1))


SCALAR_PARAMS = sp.symbols("a b c", real=True)
SCALAR_INPUTS = sp.symbols("x y", real=True)


@st.composite
def scalar_exprs(draw, depth: int, positive: bool = False):
    """A random real scalar expression; `positive` ones are > 0 everywhere."""
    if positive:
        inner = draw(scalar_exprs(depth))
        kind = draw(st.sampled_from(["exp", "square plus one", "sigmoid", "softplus"]))
        return {"exp": sp.exp(inner), "square plus one": inner**2 + 1,
                "sigmoid": nn.sigmoid(inner), "softplus": nn.softplus(inner) + sp.Rational(1, 10)}[kind]
    if depth <= 0:
        return draw(st.sampled_from(SCALAR_PARAMS + SCALAR_INPUTS + (sp.Integer(2), sp.Rational(-1, 2))))
    sub = depth - 1
    op = draw(st.sampled_from(["add", "mul", "pow", "div", "unary", "positive"]))
    if op == "add":
        return draw(scalar_exprs(sub)) + draw(scalar_exprs(sub))
    if op == "mul":
        return draw(scalar_exprs(sub)) * draw(scalar_exprs(sub))
    if op == "pow":
        return draw(scalar_exprs(sub)) ** draw(st.sampled_from([2, 3]))
    if op == "div":
        return draw(scalar_exprs(sub)) / draw(scalar_exprs(sub, positive=True))
    if op == "unary":
        fn = draw(st.sampled_from([sp.exp, sp.sin, sp.cos, sp.tanh, sp.Abs, nn.relu, nn.softplus, nn.sigmoid]))
        return fn(draw(scalar_exprs(sub)))
    fn = draw(st.sampled_from([sp.log, sp.sqrt, lambda v: v ** sp.Rational(-3, 2)]))
    return fn(draw(scalar_exprs(sub, positive=True)))


def _scalar_models_match_sympy_diff(loss, seed):
    params = [p for p in SCALAR_PARAMS if p in loss.free_symbols] or [SCALAR_PARAMS[0]]
    model = sbp.Model("fuzz_scalar", inputs=list(SCALAR_INPUTS), params=params, loss=loss)
    data = random_data(model, np.random.default_rng(seed), {})
    assume(_checkable(model, data, {}))
    mod = sbp.compile(model, options=FUZZ_BUILD)
    assert_gradients_match(mod, model, data, {})
    _, grads = mod.value_and_grad(**data)
    values = {s: data[s.name] for s in SCALAR_PARAMS + SCALAR_INPUTS if s.name in data}
    for p in params:
        # evalf can leave a rounding-level imaginary part (log(sigmoid(sin(2))): 3.5e-33j)
        exact = complex(sp.diff(loss, p).evalf(subs=values))
        assert abs(exact.imag) < 1e-12, (p, exact)
        assert math.isclose(grads[p.name], exact.real, rel_tol=1e-9, abs_tol=1e-9), (p, grads[p.name], exact)


test_scalar_models_match_sympy_diff, test_scalar_models_match_sympy_diff_many = _few_and_many(
    SCALAR_EXAMPLES, _scalar_models_match_sympy_diff, loss=scalar_exprs(3), seed=st.integers(0, 2**32 - 1))

ROWS, CHOICES = 7, 3


def _map_examples_match_sympy_diff_per_row(bodies, seed):
    """A random per-example body over a gathered parameter row (a, b, c) and
    a data row (x, y): values, and the gradient of the sum of the outputs
    squared, against SymPy (the body and sympy.diff evaluated row by row,
    gradients added into the gathered rows by hand)."""
    N, C = sp.symbols("N C", integer=True, positive=True)
    P, D, idx = sp.MatrixSymbol("P", C, 3), sp.MatrixSymbol("D", N, 2), sbp.Index("idx", N)
    R = sbp.map_examples(sp.Matrix(bodies), [(SCALAR_PARAMS, sbp.gather(P, idx)), (SCALAR_INPUTS, D)])
    model = sbp.Model("fuzz_map", inputs=[D, idx], params=[P], loss=nn.sum_all(sp.HadamardPower(R, 2)), outputs={"R": R})
    rng = np.random.default_rng(seed)
    data = {"P": rng.uniform(-1.5, 1.5, (CHOICES, 3)), "D": rng.uniform(-1.5, 1.5, (ROWS, 2)),
            "idx": rng.integers(0, CHOICES, ROWS)}
    symbols = SCALAR_PARAMS + SCALAR_INPUTS
    rows, grad = [], np.zeros((CHOICES, 3))
    for i in range(ROWS):
        at = dict(zip(symbols, [*data["P"][data["idx"][i]], *data["D"][i]]))
        values = [complex(body.evalf(subs=at)) for body in bodies]
        assume(all(abs(v.imag) < 1e-12 and math.isfinite(v.real) and abs(v.real) < 1e4 for v in values))
        rows.append([v.real for v in values])
        for k, p in enumerate(SCALAR_PARAMS):
            slope = sum(2 * v.real * complex(sp.diff(body, p).evalf(subs=at)).real for v, body in zip(values, bodies))
            assume(math.isfinite(slope))
            grad[data["idx"][i], k] += slope
    assume(_kink_free(bodies, data))
    mod = sbp.compile(model, options=FUZZ_BUILD)
    out = mod.forward(**data)
    np.testing.assert_allclose(out["R"], np.array(rows), rtol=1e-9, atol=1e-12)
    _, grads = mod.value_and_grad(**data)
    np.testing.assert_allclose(grads["P"], grad, rtol=1e-8, atol=1e-9)


test_map_examples_match_sympy_diff_per_row, test_map_examples_match_sympy_diff_per_row_many = _few_and_many(
    MAP_EXAMPLES, _map_examples_match_sympy_diff_per_row,
    bodies=st.lists(scalar_exprs(3), min_size=1, max_size=2), seed=st.integers(0, 2**32 - 1))


def _kink_free(bodies, data) -> bool:
    """No Abs/relu/Heaviside argument near 0 at any row: there SymPy's
    derivative and the C's choice at the kink may differ."""
    kinks = [a.args[0] for body in bodies for a in body.atoms(sp.Abs, sp.Heaviside, sp.Max, sp.Piecewise)
             if a.args and isinstance(a.args[0], sp.Expr)]
    for i in range(ROWS):
        at = dict(zip(SCALAR_PARAMS + SCALAR_INPUTS, [*data["P"][data["idx"][i]], *data["D"][i]]))
        for arg in kinks:
            value = complex(arg.evalf(subs=at))
            if abs(value) < 1e-4:
                return False
    return True
