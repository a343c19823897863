"""A sum of matrix products of one shape that only the sum reads (an
input's gradient where it feeds several products, as attention's Q, K and
V; a weight used twice; a recurrent cell's x W + h U + b) adds its products
up in one buffer, the first written and the others added to it
(schedule.fusion.ProductSum): no buffer for each product and no loop that
adds them. Loss and gradients against PyTorch autograd in float64, with
BLAS and with the plain loops, at odd sizes and a batch of one; the C has
the products added in place and no summing pass."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp
from oracles import assert_matches_autograd

import symbackprop as sbp
from symbackprop import nn
from symbackprop.toolchain.builder import BuildOptions

torch = pytest.importorskip("torch")

m = sp.Symbol("m", integer=True, positive=True)
D_IN, D, H = 5, 7, 3  # odd sizes


def _compiled(model, blas):
    return sbp.compile(model, options=BuildOptions(blas=blas))


def _comments(source: str) -> list[str]:
    """The one-line equations of the kernels' comments ('lhs = rhs', 'lhs += rhs')."""
    return re.findall(r"/\* (\w+ \+?= .*?) \*/", source)


def _shared_input_model(rows):
    """X = tanh(Z W0) feeds three products (attention's Q, K and V): the
    adjoint of X is the sum of three products, which only the loop of
    tanh's derivative reads."""
    Z = sp.MatrixSymbol("Z", rows, D_IN)
    W0 = sp.MatrixSymbol("W0", D_IN, D)
    wq, wk, wv = (sp.MatrixSymbol(w, D, H) for w in ("Wq", "Wk", "Wv"))
    X = nn.tanh(Z * W0)
    loss = nn.sum_all(sp.HadamardProduct((X * wq).applyfunc(sp.sin), nn.tanh(X * wk), X * wv))
    return sbp.Model("shared_input", inputs=[Z], params=[W0, wq, wk, wv], loss=loss)


def _shared_input_reference(t):
    X = torch.tanh(t["Z"] @ t["W0"])
    return (torch.sin(X @ t["Wq"]) * torch.tanh(X @ t["Wk"]) * (X @ t["Wv"])).sum()


def _shared_input_arrays(rng, rows):
    return {"Z": rng.normal(size=(rows, D_IN)), "W0": rng.normal(size=(D_IN, D)) / 2,
            **{w: rng.normal(size=(D, H)) for w in ("Wq", "Wk", "Wv")}}


@pytest.mark.parametrize("blas", [True, False])
def test_an_inputs_gradient_adds_its_three_products_in_one_buffer(blas):
    model = _shared_input_model(m)
    mod = _compiled(model, blas)
    rng = np.random.default_rng(0)
    for rows in (1, 5, 37):
        assert_matches_autograd(mod, model, _shared_input_reference, _shared_input_arrays(rng, rows))
    equations = _comments(mod.source)
    firsts = [e for e in equations if e.endswith(", the first of 3 products added up here")]
    assert len(firsts) == 1, equations
    total = firsts[0].split(" = ")[0]
    added = [e for e in equations if e.startswith(f"{total} += ")]
    assert len(added) == 2 and all(" @ " in e for e in added), equations
    assert len(re.findall(rf"_matmul_add\([^;]*, {total}\);", mod.source)) == 2
    # no loop adds three stored values, and the product's readers read the sum's buffer
    assert not [e for e in equations if re.fullmatch(r"\w+ = \w+ \+ \w+ \+ \w+", e)], equations
    assert [e for e in equations if re.fullmatch(rf"\w+ = .*\b{total}\b.*", e) and "@" not in e], equations


def test_a_fixed_size_sum_adds_its_products_in_the_inline_loops():
    """Products too small for the helper are loops: the later ones add into
    the first's entries without zeroing them."""
    model = _shared_input_model(3)
    mod = sbp.compile(model)
    assert_matches_autograd(mod, model, _shared_input_reference, _shared_input_arrays(np.random.default_rng(1), 3))
    assert "_matmul_add(" not in mod.source and "_matmul(" not in mod.source  # all inline
    assert len([e for e in _comments(mod.source) if " += " in e and " @ " in e]) == 2


@pytest.mark.parametrize("blas", [True, False])
def test_a_weight_used_twice_adds_its_gradients_products_into_the_output(blas):
    X, T = sp.MatrixSymbol("X", m, D), sp.MatrixSymbol("T", m, D)
    W = sp.MatrixSymbol("W", D, D)
    model = sbp.Model("tied", inputs=[X, T], params=[W], loss=nn.mse(nn.tanh(nn.tanh(X * W) * W), T))
    mod = _compiled(model, blas)
    rng = np.random.default_rng(2)
    for rows in (1, 9):
        arrays = {"X": rng.normal(size=(rows, D)), "T": rng.normal(size=(rows, D)), "W": rng.normal(size=(D, D)) / 2}
        assert_matches_autograd(
            mod, model, lambda t: ((torch.tanh(torch.tanh(t["X"] @ t["W"]) @ t["W"]) - t["T"]) ** 2).mean(), arrays)
    # grad_W = X^T @ g + H^T @ g', straight into the output: no buffer for either product, no copy
    assert re.search(r"_matmul\([^;]*, grad_W\);", mod.source)
    assert re.search(r"_matmul_add\([^;]*, grad_W\);", mod.source)
    assert not [e for e in _comments(mod.source) if e.startswith("grad_W = ") and "@" not in e]


@pytest.mark.parametrize("blas", [True, False])
def test_a_sum_with_other_terms_reads_its_products_once(blas):
    """tanh(x A + y B + b): the bias is added by the loop that reads the products' one buffer."""
    X, Y, T = sp.MatrixSymbol("X", m, D_IN), sp.MatrixSymbol("Y", m, D), sp.MatrixSymbol("T", m, H)
    A, B, b = sp.MatrixSymbol("A", D_IN, H), sp.MatrixSymbol("B", D, H), sp.MatrixSymbol("b", 1, H)
    model = sbp.Model("cell", inputs=[X, Y, T], params=[A, B, b], loss=nn.mse(nn.tanh(X * A + nn.linear(Y, B, b)), T))
    mod = _compiled(model, blas)
    rng = np.random.default_rng(3)
    for rows in (1, 11):
        arrays = {"X": rng.normal(size=(rows, D_IN)), "Y": rng.normal(size=(rows, D)), "T": rng.normal(size=(rows, H)),
                  "A": rng.normal(size=(D_IN, H)), "B": rng.normal(size=(D, H)), "b": rng.normal(size=(1, H))}
        assert_matches_autograd(
            mod, model, lambda t: ((torch.tanh(t["X"] @ t["A"] + t["Y"] @ t["B"] + t["b"]) - t["T"]) ** 2).mean(), arrays)
    equations = _comments(mod.source)
    first = next(e for e in equations if e.endswith(", the first of 2 products added up here"))
    total = first.split(" = ")[0]
    assert any(e.startswith(f"{total} += ") for e in equations), equations
    arguments = {a for e in equations for a in re.findall(r"tanh\(([^()]*)\)", e)}
    assert arguments == {f"b + {total}"}, equations


def test_a_loss_that_is_a_sum_of_products_is_added_up_in_the_output():
    """A 1 x 1 loss u v + u W v: both products go into `loss` itself (the
    second added), in value_and_grad and in the forward-only call."""
    u, v, W = sp.MatrixSymbol("u", 1, D), sp.MatrixSymbol("v", D, 1), sp.MatrixSymbol("W", D, D)
    model = sbp.Model("bilinear", inputs=[u, v], params=[W], loss=u * v + u * W * v)
    mod = sbp.compile(model)
    rng = np.random.default_rng(4)
    arrays = {"u": rng.normal(size=(1, D)), "v": rng.normal(size=(D, 1)), "W": rng.normal(size=(D, D))}
    assert_matches_autograd(mod, model, lambda t: (t["u"] @ t["v"] + t["u"] @ t["W"] @ t["v"]).sum(), arrays)
    assert mod.forward(**arrays)["loss"] == pytest.approx(mod.value_and_grad(**arrays)[0], rel=1e-15)
    equations = _comments(mod.source)
    assert [e for e in equations if e.startswith("loss += ") and " @ " in e], equations
    assert not [e for e in equations if re.fullmatch(r"loss = \w+ \+ \w+", e)], equations
