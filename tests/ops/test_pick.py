"""pick(A, idx): one entry a row at the column an Index names, and its
gradient place (ops.pick); the softmax cross-entropy against class numbers
(or one_hot rows) picks the target logit instead of summing one-hot rows.
Values, gradients and a Hessian-vector product against PyTorch autograd in
float64; bad input named."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.declare.pick import pick
from symbackprop.errors import ArgumentError, ModelError

torch = pytest.importorskip("torch")
F = torch.nn.functional

m = sp.Symbol("m", integer=True, positive=True)


def _model(name, k, n, loss_of):
    X, W, y = sp.MatrixSymbol("X", m, k), sp.MatrixSymbol("W", k, n), sbp.Index("y", m)
    return sbp.Model(name, inputs=[y], params=[X, W], loss=loss_of(X * W, y))


def _arrays(rng, rows, k, n):
    return {"X": rng.normal(size=(rows, k)), "W": rng.normal(size=(k, n)), "y": rng.integers(0, n, rows)}


def _torch(arrays):
    return ({k: torch.tensor(v, requires_grad=True) for k, v in arrays.items() if k != "y"},
            torch.tensor(arrays["y"]))


def _close(got, want):
    want = want.detach().numpy() if hasattr(want, "detach") else want
    assert np.abs(got - want).max() <= 1e-10 * max(np.abs(want).max(), 1e-300)


@pytest.mark.parametrize("rows,k,n", [(1, 3, 5), (7, 4, 9), (13, 1, 2)])
def test_pick_and_its_gradient_match_torch(rows, k, n):
    """sum(sin(pick)) * 3: pick's value and its gradient (a place) in every parameter."""
    model = _model(f"pick_{rows}_{k}_{n}", k, n, lambda z, y: nn.sum_all(pick(z, y).applyfunc(sp.sin)) * 3)
    arrays = _arrays(np.random.default_rng(rows), rows, k, n)
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    t, y = _torch(arrays)
    want = 3 * torch.sin((t["X"] @ t["W"]).gather(1, y[:, None])).sum()
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for name in ("X", "W"):
        _close(grads[name], t[name].grad)


@pytest.mark.parametrize("target", ["index", "one_hot"])
@pytest.mark.parametrize("rows,n", [(1, 4), (11, 7)])
def test_cross_entropy_of_class_numbers_picks_the_target_logit(target, rows, n):
    """nn.softmax_cross_entropy of an Index or of one_hot rows: PyTorch's
    cross_entropy, and the C picks the logit (no one-hot matrix, no product with it)."""
    k = 3
    labels = (lambda y: y) if target == "index" else (lambda y: nn.one_hot(y, n))
    model = _model(f"xent_{target}_{rows}", k, n, lambda z, y: nn.softmax_cross_entropy(z, labels(y)))
    arrays = _arrays(np.random.default_rng(10 + rows), rows, k, n)
    mod = sbp.compile(model)
    loss, grads = mod.value_and_grad(**arrays)
    t, y = _torch(arrays)
    want = F.cross_entropy(t["X"] @ t["W"], y)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for name in ("X", "W"):
        _close(grads[name], t[name].grad)
    comments = re.findall(r"/\* (\w+(?:\[[^]]*\])? = [^*]*?) \*/", mod.source)
    assert any(re.fullmatch(r"\w+\[i\] = \w+\[i, y\[i\]\]", c) for c in comments), comments
    assert "Matrix([" not in mod.source  # the identity's rows are not gathered


def test_hessian_vector_product_through_pick_and_place():
    """pick's VJP is place and place's is pick: second derivatives exist."""
    rows, k, n = 6, 3, 5
    model = _model("pick_hvp", k, n, lambda z, y: nn.softmax_cross_entropy(z.applyfunc(sp.tanh) * 2, y))
    rng = np.random.default_rng(5)
    arrays = _arrays(rng, rows, k, n)
    directions = {"X": rng.normal(size=(rows, k)), "W": rng.normal(size=(k, n))}
    loss, grads, hvp = sbp.compile(model).value_grad_and_hvp(directions, **arrays)
    t, y = _torch(arrays)
    want = F.cross_entropy(2 * torch.tanh(t["X"] @ t["W"]), y)
    first = torch.autograd.grad(want, [t["X"], t["W"]], create_graph=True)
    dot = sum((g * torch.tensor(directions[name])).sum() for g, name in zip(first, ("X", "W")))
    second = torch.autograd.grad(dot, [t["X"], t["W"]])
    assert loss == pytest.approx(want.item(), rel=1e-10)
    for name, g, h in zip(("X", "W"), first, second):
        _close(grads[name], g)
        _close(hvp[name], h)


def test_bad_pick_input_is_named():
    X, y = sp.MatrixSymbol("X", m, 3), sbp.Index("y", m)
    with pytest.raises(ModelError, match="Index"):
        pick(X, sp.MatrixSymbol("Y", m, 1))
    with pytest.raises(ModelError, match="rows"):
        pick(sp.MatrixSymbol("Z", 4, 3), sbp.Index("w", 5))
    with pytest.raises(ModelError, match="matrix"):
        pick(sp.Symbol("s"), y)


def test_a_column_number_out_of_range_is_named_at_the_call():
    model = _model("pick_range", 2, 4, lambda z, y: nn.softmax_cross_entropy(z, y))
    arrays = _arrays(np.random.default_rng(0), 5, 2, 4)
    arrays["y"][2] = 4
    with pytest.raises(ArgumentError, match="y"):
        sbp.compile(model).value_and_grad(**arrays)
