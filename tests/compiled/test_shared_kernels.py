"""Long kernels are one function per kind (emit/kernelkinds.py): a
transformer of three blocks has one function for each kind of layer norm
and attention kernel, called in every block, and no inline copy; its loss
matches the numpy oracle and its gradient central differences of it.
What stays inline (a kernel that names the workspace, a flag, or returns)
does, and the name of a kind comes from its own text."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp
from oracles import transformer_lm_loss

import symbackprop as sbp
from symbackprop import nn, pipeline
from symbackprop.emit import kernelkinds

CONTEXT, D, HEADS, VOCAB = 4, 8, 2, 7
KINDS = ("normalize_rows", "normalize_rows_vjp", "attention_scores", "causal_softmax", "attention_mix",
         "attention_mix_t", "softmax_vjp")


def _shapes(blocks: int) -> list[tuple[str, tuple[int, int]]]:
    """examples/transformer_lm.py's parameters (and names: tests/oracles.py reads them), smaller."""
    block = lambda b: [(f"g{b}a", (1, D)), (f"b{b}a", (1, D)), *((f"W{q}{b}", (D, D)) for q in "qkvo"),  # noqa: E731
                       (f"g{b}m", (1, D)), (f"b{b}m", (1, D)), (f"W{b}up", (D, 4 * D)), (f"c{b}up", (1, 4 * D)),
                       (f"W{b}down", (4 * D, D)), (f"c{b}down", (1, D))]
    return [("E", (VOCAB, D)), ("P", (CONTEXT, D)), *(s for b in range(blocks) for s in block(b)),
            ("gf", (1, D)), ("bf", (1, D)), ("Wout", (D, VOCAB))]


def transformer(blocks: int) -> sbp.Model:
    m = sp.Symbol("m", integer=True, positive=True)
    ids, positions, targets = sbp.Index("ids", m), sbp.Index("positions", m), sbp.Index("targets", m)
    p = {name: sp.MatrixSymbol(name, *shape) for name, shape in _shapes(blocks)}
    x = nn.add_positions(nn.embedding(p["E"], ids, CONTEXT), p["P"], positions)
    for b in range(blocks):
        x = x + nn.self_attention(nn.layer_norm(x, p[f"g{b}a"], p[f"b{b}a"]), *(p[f"W{q}{b}"] for q in "qkvo"), HEADS)
        up = nn.layer_norm(x, p[f"g{b}m"], p[f"b{b}m"]).map(
            lambda h, b=b: nn.gelu(nn.linear(h, p[f"W{b}up"], p[f"c{b}up"])))
        x = x + up.map(lambda h, b=b: nn.linear(h, p[f"W{b}down"], p[f"c{b}down"]))
    logits = nn.layer_norm(x, p["gf"], p["bf"]).matrix * p["Wout"]
    return sbp.Model(f"blocks{blocks}", inputs=[ids, positions, targets], params=list(p.values()),
                     loss=nn.softmax_cross_entropy(logits, nn.one_hot(targets, VOCAB)))


def _data(blocks: int, sequences: int = 3) -> dict:
    rng = np.random.default_rng(blocks)
    rows = sequences * CONTEXT
    data: dict = {"ids": rng.integers(0, VOCAB, rows), "targets": rng.integers(0, VOCAB, rows),
                  "positions": sbp.position_ids(sequences, CONTEXT)}
    for name, shape in _shapes(blocks):
        data[name] = rng.uniform(-1, 1, shape) + (1.0 if name[0] == "g" else 0.0)
    return data


def test_each_kind_of_long_kernel_is_one_function_called_in_every_block():
    source = pipeline.generate(transformer(3), derivation=False)[0].source
    for kind in KINDS:
        defined = set(re.findall(rf"^void (blocks3_{kind}_[0-9a-f]{{4}})\(", source, re.M))  # (and declared)
        assert len(defined) == 1, (kind, defined)
        calls = re.findall(rf"^\s+{defined.pop()}\(", source, re.M)
        assert len(calls) >= 3, (kind, len(calls))
    # no inline copy left: the layer norm's row loop is in its kind's function only
    assert source.count("squares_lane[l] += row[k + l]*row[k + l]") == 1


def test_three_blocks_match_numpy_and_central_differences():
    mod = sbp.compile(transformer(3))
    data = _data(3)
    loss_of = lambda d: transformer_lm_loss(d, length=CONTEXT, heads=HEADS, blocks=3)  # noqa: E731
    loss, grads = mod.value_and_grad(**data)
    assert loss == pytest.approx(loss_of(data), rel=1e-12)
    rng, step = np.random.default_rng(0), 1e-6
    for name, grad in grads.items():  # each along one random direction: a wrong entry anywhere moves it
        v = rng.standard_normal(grad.shape)
        ahead, behind = (loss_of({**data, name: data[name] + sign * step * v}) for sign in (1.0, -1.0))
        expected = (ahead - behind) / (2 * step)
        assert abs(float(np.sum(grad * v)) - expected) <= 1e-6 * max(np.linalg.norm(grad) * np.linalg.norm(v), 1e-8), name


def test_the_calls_compute_what_the_inline_kernels_computed(monkeypatch):
    data = _data(2)
    shared = sbp.compile(transformer(2)).value_and_grad(**data)
    monkeypatch.setattr(pipeline, "share_kernels", lambda module, claim: module)
    assert "attention_scores_" not in pipeline.generate(transformer(2), derivation=False)[0].source
    inline = sbp.compile(transformer(2)).value_and_grad(**data)
    assert shared[0] == pytest.approx(inline[0], rel=1e-13)
    for name, grad in shared[1].items():
        np.testing.assert_allclose(grad, inline[1][name], rtol=1e-12, atol=1e-14, err_msg=name)


_SCOPE = {"m": "int64_t ", "x": "const double *", "y": "double *", "work": "double *", "with_grads": "int "}


def _loop(body: str) -> str:
    return "for (int64_t i = 0; i < m; ++i) {\n    " + body + "\n}\n"


def test_a_kernel_that_names_its_function_s_flag_or_returns_stays_inline(monkeypatch):
    assert kernelkinds._canonical(_loop("y[i] = x[i] + x[i + 1];"), _SCOPE) is None  # short: inline
    monkeypatch.setattr(kernelkinds, "MIN_CHARS", 10)
    assert kernelkinds._canonical(_loop("y[i] = x[i] + x[i + 1];"), _SCOPE) is not None
    assert kernelkinds._canonical(_loop("if (with_grads) y[i] = x[i];"), _SCOPE) is None
    assert kernelkinds._canonical(_loop("y[i] = work[i];"), _SCOPE) is not None  # the workspace is an array
    assert kernelkinds._canonical(_loop("if (x[i] < 0) return; y[i] = x[i];"), _SCOPE) is None
    assert kernelkinds._canonical(_loop("y[i] = x[i] + a0;"), _SCOPE) is None  # a0: an array's new name


def test_a_kind_is_named_by_its_own_text(monkeypatch):
    """The arrays renamed in order of first use, the dimensions kept; the
    same text on other arrays is the same kind, other constants another."""
    monkeypatch.setattr(kernelkinds, "MIN_CHARS", 10)
    first = kernelkinds._canonical(_loop("y[i] = 2*x[i]; /* y from x */"), _SCOPE)
    scope = {**_SCOPE, "u": "const double *", "v": "double *"}
    second = kernelkinds._canonical(_loop("v[i] = 2*u[i]; /* v from u */"), scope)
    third = kernelkinds._canonical(_loop("v[i] = 3*u[i]; /* v from u */"), scope)
    assert first is not None and second is not None and third is not None
    assert first.key == second.key != third.key
    assert first.params == ("int64_t m", "double *a0", "const double *a1") and second.args == ("m", "v", "u")
    assert "a0[i] = 2*a1[i]; /* a0 from a1 */" in first.body


def test_a_map_over_examples_takes_restrict_arrays_and_other_kinds_do_not(monkeypatch):
    """The workspace gives no two buffers of one kernel the same memory, so
    an emap's arrays are restrict (GCC keeps a scatter's values in
    registers); the other kinds keep the caller's plain pointer types."""
    monkeypatch.setattr(kernelkinds, "MIN_CHARS", 10)
    restricted = kernelkinds._canonical(_loop("y[i] = 2*x[i];"), _SCOPE, restrict=True)
    assert restricted is not None
    assert restricted.params == ("int64_t m", "double *SYMBACKPROP_RESTRICT a0",
                                 "const double *SYMBACKPROP_RESTRICT a1")
    source = pipeline.generate(transformer(1), derivation=False)[0].source
    emaps = re.findall(r"^void blocks1_emap_[0-9a-f]{4}\(\n((?:    .*\n)+?)\)", source, re.M)
    pointers = [p for params in emaps for p in params.split(",") if "*" in p]
    assert pointers and all("*SYMBACKPROP_RESTRICT a" in p for p in pointers)
    norm = re.search(r"^void blocks1_normalize_rows_[0-9a-f]{4}\(([^)]*)\)", source, re.M)
    assert norm is not None and "*" in norm.group(1) and "RESTRICT" not in norm.group(1)
