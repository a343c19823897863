"""The grad_fn graph shows the operations the model writes, and only those:
how a derivative is computed (a weight's gradient through X @ W is X^T @ g)
adds no node. The oracle is the model's own SymPy expression."""

import re

import pytest
import sympy as sp
from conftest import load_example

import symbackprop as sbp
from symbackprop import nn
from symbackprop.emit.graph import graph_text
from symbackprop.pipeline import plan

X, T = sp.MatrixSymbol("X", 5, 3), sp.MatrixSymbol("T", 5, 2)


def kinds(model: sbp.Model) -> set[str]:
    """The node kinds of the printed graph, "Backward" dropped."""
    text = graph_text(plan(model))
    return {re.sub(r"Backward$", "", m) for m in re.findall(r"(\w+)(?: \(.*\))?$", text, re.M)}


def explicit_transpose() -> sbp.Model:
    W = sp.MatrixSymbol("W", 2, 3)  # stored as torch.nn.Linear stores it: the model writes W^T
    return sbp.Model("wt", inputs=[X, T], params=[W], loss=nn.mse(nn.tanh(X * W.T), T))


def plain_product() -> sbp.Model:
    W = sp.MatrixSymbol("W", 3, 2)
    return sbp.Model("xw", inputs=[X, T], params=[W], loss=nn.mse(X * W, T))


def map_and_reduce() -> sbp.Model:
    n, k = sp.symbols("n k", integer=True, positive=True)
    centres, points = sp.MatrixSymbol("centres", k, 2), sp.MatrixSymbol("points", n, 2)
    of = sbp.Index("of", n)
    c, p = sp.Matrix(sp.symbols("c0:2", real=True)), sp.Matrix(sp.symbols("p0:2", real=True))
    distance = sbp.map_examples(sp.sqrt((p - c).dot(p - c)), [(c, sbp.gather(centres, of)), (p, points)])
    return sbp.Model("clusters", inputs=[points, of], params=[centres], loss=sbp.reduce("mean", distance, 0))


def row_max() -> sbp.Model:
    W = sp.MatrixSymbol("W", 3, 4)
    return sbp.Model("rowmax", inputs=[X], params=[W], loss=sbp.reduce("sum", sbp.reduce("max", X * W, 1), 0))


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: load_example("mlp").model, {"MseLoss", "MatMulWithBias", "Sigmoid", "AccumulateGrad"}),
    (plain_product, {"MseLoss", "MatMul", "AccumulateGrad"}),
    (explicit_transpose, {"MseLoss", "Tanh", "MatMul", "Transpose", "AccumulateGrad"}),
    (map_and_reduce, {"Mean", "MapExamples", "AccumulateGrad"}),
    (row_max, {"Sum", "Max", "MatMul", "AccumulateGrad"}),
], ids=["mlp", "X@W", "X@W.T", "map+mean", "sum(max(X@W))"])
def test_node_kinds_are_what_the_model_writes(make, expected):
    model = make()
    found = kinds(model)
    assert found == expected
    # a Transpose node exactly where the user's expression transposes something
    assert ("Transpose" in found) == bool(model.loss.atoms(sp.Transpose))


def test_every_differentiated_param_ends_in_its_own_leaf():
    text = graph_text(plan(load_example("mlp").model))
    for name in ("W1", "b1", "W2", "b2"):
        line = next(line for line in text.splitlines() if line.endswith(f"({name})"))
        assert line.split("── ")[-1] == f"AccumulateGrad ({name})"
