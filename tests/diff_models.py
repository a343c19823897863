"""Models and one-line edits of them, for the tests of how local a diff of
the generated C stays (test_diff_stays_local.py, test_diff_locality.py)."""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Sequence

import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import DEFAULT_FUNCTIONS, generate

N = sp.Symbol("n", integer=True, positive=True)


def mlp(widths: Sequence[int], activations: Sequence[Callable], l2: bool = False, names: Sequence[str] = ()) -> sbp.Model:
    """An MLP: layer k (1-based) maps widths[k-1] -> widths[k] through
    activations[k-1] (None: linear), its params W<k>, b<k> (or the names
    in `names`, one stem per layer); an MSE loss."""
    stems = list(names) or [str(k) for k in range(1, len(widths))]
    X, T = sp.MatrixSymbol("X", N, widths[0]), sp.MatrixSymbol("T", N, widths[-1])
    H, params = X, []
    for stem, (fan_in, fan_out), act in zip(stems, itertools.pairwise(widths), activations):
        W, b = sp.MatrixSymbol(f"W{stem}", fan_in, fan_out), sp.MatrixSymbol(f"b{stem}", 1, fan_out)
        params += [W, b]
        H = nn.linear(H, W, b)
        H = act(H) if act is not None else H
    loss = nn.mse(H, T)
    if l2:
        loss = loss + sp.Float(1e-4) * nn.l2_penalty(params[0])
    return sbp.Model("net", inputs=[X, T], params=params, loss=loss)


def ln_net(activation: Callable = nn.tanh, l2: bool = False) -> sbp.Model:
    """linear -> layer_norm -> activation -> linear, softmax cross-entropy."""
    X, T = sp.MatrixSymbol("X", N, 5), sp.MatrixSymbol("T", N, 3)
    W1, b1 = sp.MatrixSymbol("W1", 5, 8), sp.MatrixSymbol("b1", 1, 8)
    g, beta = sp.MatrixSymbol("gamma", 1, 8), sp.MatrixSymbol("beta", 1, 8)
    W2, b2 = sp.MatrixSymbol("W2", 8, 3), sp.MatrixSymbol("b2", 1, 3)
    H = activation(nn.layer_norm(nn.linear(X, W1, b1), g, beta))
    loss = nn.softmax_cross_entropy(nn.linear(H, W2, b2), T)
    if l2:
        loss = loss + sp.Float(1e-4) * nn.l2_penalty(W1)
    return sbp.Model("net", inputs=[X, T], params=[W1, b1, g, beta, W2, b2], loss=loss)


def c_text(model: sbp.Model, optimizer: bool = False) -> list[str]:
    """The generated .c and .h, as lines (with an Adam train_step where asked)."""
    extra = {"functions": (*DEFAULT_FUNCTIONS, "train_step"), "optimizer": sbp.Adam(lr=1e-3)} if optimizer else {}
    emitted = generate(model, derivation=False, **extra)[0]
    return (emitted.source + emitted.header).splitlines()


def changed_lines(old: list[str], new: list[str]) -> tuple[int, int]:
    """(lines removed + lines added, hunks) as a unified diff with 3 lines of context shows them."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    count = sum(i2 - i1 + j2 - j1 for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")
    return count, len(list(matcher.get_grouped_opcodes(3)))


S, T_, R = nn.sigmoid, nn.tanh, nn.relu

# (label, model before, model after, the stems of the edited layer's params)
EDITS: list[tuple[str, Callable[[], sbp.Model], Callable[[], sbp.Model], tuple[str, ...]]] = [
    ("3-layer MLP 5-6-6-3, layer 1 sigmoid -> relu",
     lambda: mlp([5, 6, 6, 3], [S, S, None]), lambda: mlp([5, 6, 6, 3], [R, S, None]), ("1",)),
    ("linear-layer_norm-tanh-linear, softmax CE, tanh -> relu",
     lambda: ln_net(nn.tanh), lambda: ln_net(nn.relu), ("gamma", "beta")),
    *[(f"8-layer tanh MLP width 8, layer {k} tanh -> relu",
       lambda: mlp([8] * 9, [T_] * 8),
       (lambda k=k: mlp([8] * 9, [T_] * (k - 1) + [R] + [T_] * (8 - k))), (str(k),)) for k in (2, 6, 8)],
    ("3-layer MLP, a layer added in the middle",
     lambda: mlp([5, 6, 6, 3], [S, S, None], names="123"),
     lambda: mlp([5, 6, 6, 6, 3], [S, S, S, None], names=["1", "2", "x", "3"]), ("x", "3")),
    ("3-layer MLP, layer 2's width 6 -> 7",
     lambda: mlp([5, 6, 6, 3], [S, S, None]), lambda: mlp([5, 6, 7, 3], [S, S, None]), ("2", "3")),
    ("layer-norm net, + 1e-4 * l2_penalty(W1)", lambda: ln_net(), lambda: ln_net(l2=True), ("1",)),
]
