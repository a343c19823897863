"""Inputs, params and outputs named as C keywords, libm functions, the C
library's macros, the runtime's helpers and the generated code's own names,
through every function a module has (forward, value_and_grad, vjp, jvp,
hvp, train_step), against closed forms; outputs whose functions' C names
would meet those another function derives (o and o_call: nm_vjp_o_call);
and the seed of a scalar output in every form numpy users pass one.

The C named a vjp function by sanitizing its name once more (vjp_exp_
became vjp_exp) while the runtime looked up the name as planned: the vjp
of an output named exp, int, main, work, ... raised AttributeError."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.base.cnames import DERIVED, function_base

X = np.array([[1.0], [2.0], [-3.0]])
W = np.array([[0.5], [-1.0], [2.0]])
SEED = np.array([[1.0], [-2.0], [0.5]])
TANGENT = np.array([[0.3], [0.1], [-1.0]])
LR = 0.1

# (input, param, output): each name in each role across the rotations below
GROUPS = [
    ("exp", "log", "sqrt"), ("int", "double", "return"), ("floor", "pow", "fabs"), ("main", "malloc", "NULL"),
    ("work", "status", "i"), ("x0", "acc", "dims"), ("EDOM", "INT_MAX", "Py_None"),
    ("symbackprop_f64_matmul", "expf", "errno"), ("nm_forward", "nm_value_and_grad", "nm_vjp_o"),
    ("grad_W", "seed_o", "tangent_W"), ("lgamma", "tgamma", "index"), ("NM_H", "NM_REAL", "size_t"),
]
FAST = GROUPS[:2]


def _rotations(groups):
    for group in groups:
        for r in range(3):
            yield group[r:] + group[:r]


def _check_every_function(nx: str, nw: str, no: str) -> None:
    x, w = sp.MatrixSymbol(nx, 3, 1), sp.MatrixSymbol(nw, 3, 1)
    p = sp.HadamardProduct(w, x)
    model = sbp.Model("nm", inputs=[x], params=[w], loss=nn.sum_all(sp.HadamardProduct(p, p)) / 2, outputs={no: p})
    mod = sbp.compile(model, optimizer=sbp.SGD(lr=LR))
    args = {nx: X, nw: W}
    out = mod.forward(**args)
    np.testing.assert_allclose(out[no], W * X)
    assert out["loss"] == pytest.approx(0.5 * np.sum((W * X) ** 2))
    _, grads = mod.value_and_grad(**args)
    np.testing.assert_allclose(grads[nw], W * X**2)
    np.testing.assert_allclose(mod.vjp(no, SEED, **args)[nw], SEED * X)
    tangents = mod.jvp({nw: TANGENT}, **args)
    np.testing.assert_allclose(tangents[no], TANGENT * X)
    assert tangents["loss"] == pytest.approx(np.sum(W * X**2 * TANGENT))
    np.testing.assert_allclose(mod.hvp({nw: TANGENT}, **args)[nw], X**2 * TANGENT)
    stepped = W.copy()
    mod.train_step(**{nx: X, nw: stepped})
    np.testing.assert_allclose(stepped, W - LR * W * X**2)


@pytest.mark.parametrize("names", list(_rotations(FAST)), ids="-".join)
def test_reserved_names_through_every_function(names):
    _check_every_function(*names)


@pytest.mark.slow
@pytest.mark.parametrize("names", list(_rotations(GROUPS[len(FAST):])), ids="-".join)
def test_more_reserved_names_through_every_function(names):
    _check_every_function(*names)


# outputs whose vjp functions' C names meet: o's derived nm_vjp_o_call and
# o_call's function; two names equal in their first 44 characters; two that
# sanitize alike
OUTPUTS = ["o", "o_call", "o_work_len", "o_shape_in", "o_call_fn", "o_n", "a b", "a_b", "x" * 60, "x" * 59 + "y",
           "exp", "exp_"]


def test_outputs_whose_function_names_meet():
    x, w = sp.MatrixSymbol("x", 3, 1), sp.MatrixSymbol("W", 3, 1)
    p = sp.HadamardProduct(w, x)
    outputs = {name: (k + 1) * p for k, name in enumerate(OUTPUTS)}
    mod = sbp.compile(sbp.Model("nm2", inputs=[x], params=[w], loss=nn.sum_all(p), outputs=outputs),
                      functions=("forward", "vjp"))
    names = [f.c_name for f in mod.spec.functions]
    assert len(set(names)) == len(names)
    for k, name in enumerate(OUTPUTS):
        np.testing.assert_allclose(mod.vjp(name, SEED, x=X, W=W)["W"], (k + 1) * SEED * X, err_msg=name)


@pytest.mark.parametrize("name", ["vjp_o_call", "vjp_o_work_len", "vjp_exp_", "vjp_" + "y" * 80, "vjp_o"])
def test_function_base_never_ends_as_a_derived_name(name):
    base = function_base(name)
    assert function_base(base) == base  # used as it stands: sanitizing it again changes nothing
    assert not any(base.endswith("_" + suffix) for suffix in DERIVED)


# --- the seed of an output of shape (1, 1) ---------------------------------------

A = sp.Symbol("a")
SCALAR_SEEDS = {"float": 2.0, "int": 2, "np.float64": np.float64(2.0), "np.float32": np.float32(2.0),
                "0-d": "0d", "(1,)": (1,), "(1, 1)": (1, 1), "list": [2.0], "nested list": [[2.0]]}
BAD_SEEDS = {"(1, 1, 1)": (1, 1, 1), "(2,)": (2,), "(1, 2)": (1, 2), "(2, 1)": (2, 1), "str": "2", "bool": True}


@pytest.fixture(scope="module", params=["float64", "float32"])
def scalar_outputs(request):
    dt = request.param
    x, w = sp.MatrixSymbol("x", 3, 1), sp.MatrixSymbol("W", 3, 1)
    n = sp.Symbol("n", integer=True, positive=True)
    V = sp.MatrixSymbol("V", n, 1)
    outputs = {"dot": (w.T * x) * A, "expr": A * A, "gram": (V.T * V) * A}  # (1, 1) matrices and a scalar
    mod = sbp.compile(sbp.Model(f"seeds_{dt}", inputs=[x, V], params=[w, A], loss=nn.sum_all(w), outputs=outputs),
                      dtype=dt, functions=("forward", "vjp"))
    args = {"x": X.astype(dt), "V": np.ones((2, 1), dt), "W": W.astype(dt), "a": 1.5}
    # d/da of seed * output at a = 1.5, seed 2: w.x = -6.5, 2a = 3, V.V = 2
    return mod, args, dt, {"dot": 2 * float((W.T @ X)[0, 0]), "expr": 2 * 3.0, "gram": 2 * 2.0}


def _seed(form, dt):
    if isinstance(form, tuple):
        return np.full(form, 2.0, dtype=dt)
    return np.array(2.0, dtype=dt) if form == "0d" else form


@pytest.mark.parametrize("form", list(SCALAR_SEEDS))
@pytest.mark.parametrize("output", ["dot", "expr", "gram"])
def test_scalar_seed_forms(scalar_outputs, output, form):
    mod, args, dt, want = scalar_outputs
    got = mod.vjp(output, _seed(SCALAR_SEEDS[form], dt), **args)["a"]
    assert float(np.ravel(got)[0]) == pytest.approx(want[output], rel=1e-6)
    assert float(np.ravel(mod.vjp(output, None, **args)["a"])[0]) == pytest.approx(want[output] / 2, rel=1e-6)


@pytest.mark.parametrize("form", list(BAD_SEEDS))
@pytest.mark.parametrize("output", ["dot", "expr", "gram"])
def test_bad_scalar_seeds_name_the_output(scalar_outputs, output, form):
    mod, args, dt, _ = scalar_outputs
    with pytest.raises(sbp.ArgumentError, match=rf"seed for '{output}'.*(\(1, 1\)|real number)"):
        mod.vjp(output, _seed(BAD_SEEDS[form], dt), **args)
