"""A small change to a model gives a small, local diff of the generated C."""

import difflib
import re

import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate


def two_layer(activation=nn.sigmoid, hidden=4, out_activation=None):
    n = sp.Symbol("n", integer=True, positive=True)
    X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
    W1, b1 = sp.MatrixSymbol("W1", 3, hidden), sp.MatrixSymbol("b1", 1, hidden)
    W2, b2 = sp.MatrixSymbol("W2", hidden, 2), sp.MatrixSymbol("b2", 1, 2)
    Y = nn.linear(activation(nn.linear(X, W1, b1)), W2, b2)
    if out_activation is not None:
        Y = out_activation(Y)
    return sbp.Model("net", inputs=[X, T], params=[W1, b1, W2, b2], loss=nn.mse(Y, T))


def hunks(before: sbp.Model, after: sbp.Model) -> list[list[str]]:
    old = generate(before)[0].source.splitlines()
    new = generate(after)[0].source.splitlines()
    groups = difflib.SequenceMatcher(None, old, new).get_grouped_opcodes(3)  # hunks as in a unified diff
    return [[line for tag, i1, i2, j1, j2 in group if tag != "equal" for line in old[i1:i2] + new[j1:j2]]
            for group in groups]


def test_changing_one_activation_changes_only_its_blocks():
    """sigmoid -> tanh in the first layer: its forward block (in forward and
    in value_and_grad), its backward block, the workspace size (tanh's
    derivative is computed from its value, so no buffer holds it), and the
    functions of its loops' kinds (emit/maps.py: the sigmoid loops were
    this layer's only ones)."""
    changed = hunks(two_layer(nn.sigmoid), two_layer(nn.tanh))
    assert 2 <= len(changed) <= 6, changed
    layer = ("_W1", "return (size_t)")  # the layer's names (made from its weight W1), the work length
    kind = re.compile(r"void net_(grad_)?(sigmoid|tanh)_nx4_loop\(")  # the layer's kinds of loop, by what they compute

    def of_a_kind(line: str) -> bool:  # a line of a kind's body: it names no array but its parameters a0, a1, ...
        return re.search(r"\ba\d+\[", line) is not None and re.search(r"\b(?!a\d+\[)[A-Za-z_]\w*\[", line) is None

    for hunk in changed:
        assert all(any(word in line for word in layer) or re.match(r"\s*const \w+ x", line) or not line.strip(" {}")
                   or kind.match(line) or of_a_kind(line) or line.strip().startswith("(1.0 + exp(")
                   for line in hunk), hunk


def test_changing_a_fixed_dimension_changes_only_constants():
    old = generate(two_layer(hidden=4))[0].source.splitlines()
    new = generate(two_layer(hidden=5))[0].source.splitlines()
    opcodes = [op for op in difflib.SequenceMatcher(None, old, new).get_opcodes() if op[0] != "equal"]
    assert opcodes and all(tag == "replace" and i2 - i1 == j2 - j1 for tag, i1, i2, j1, j2 in opcodes), opcodes
    digits = re.compile(r"\d+")
    for _, i1, i2, j1, j2 in opcodes:
        for before, after in zip(old[i1:i2], new[j1:j2]):
            assert digits.sub("#", before) == digits.sub("#", after), (before, after)


def test_adding_an_output_activation_leaves_the_first_layer_alone():
    before, after = two_layer(), two_layer(out_activation=nn.tanh)
    changed = [line for hunk in hunks(before, after) for line in hunk]
    assert not any("X @ W1" in line or "sigmoid_W1[" in line for line in changed)
