"""Every op's derivative rules, checked without C (in the manner of JAX's
lax_autodiff_test): a table of small models, one or more per op, lowered to
the IR; the VJP and JVP graphs that autodiff builds are evaluated by the
numpy interpreter (symbackprop.ir.interpret) and compared with central finite
differences of the interpreted loss. Each model's interpreted loss is first
compared with a numpy formula written independently of the IR.

A few models are also compiled, to check that the C computes what the
interpreter does (the interpreter is then an oracle for the emitted code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.diff.autodiff import jvp, vjp
from symbackprop.ir.construct import const, leaf
from symbackprop.ir.interpret import bind_dims, evaluate
from symbackprop.ir.lower import lower
from symbackprop.ir.node import SCALAR

n, k = sp.symbols("n k", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
W = sp.MatrixSymbol("W", 3, 2)
V = sp.MatrixSymbol("V", 2, 3)
B = sp.MatrixSymbol("B", 1, 2)
C = sp.MatrixSymbol("C", k, 3)
a = sp.Symbol("a", real=True)
idx = sbp.Index("idx", n)
IMG = sbp.images("IMG", n, 2, 5, 4)  # n x 40: 2 channels of 5 x 4
KER, KB = sbp.conv_weight("KER", 3, 2, 3), sp.MatrixSymbol("KB", 1, 3)
GAMMA, BETA = sp.MatrixSymbol("GAMMA", 1, 2), sp.MatrixSymbol("BETA", 1, 2)
SQ, SK, SV = (sbp.sequences(name, n, 3, 4) for name in ("SQ", "SK", "SV"))  # n = 5 rows: sequences of 3, then 2
LNG, LNB = sp.MatrixSymbol("LNG", 1, 3), sp.MatrixSymbol("LNB", 1, 3)


@dataclass(frozen=True)
class Case:
    """A model, the numpy formula of its loss, and how to draw its arrays."""

    name: str
    model: Callable[[], sbp.Model]
    reference: Callable[[dict], float]
    positive: bool = False  # draw strictly positive floats (logs, square roots)


def _sum(m):
    return nn.sum_all(m)


def _lse(z, axis):
    top = z.max(axis=axis, keepdims=True)
    return top + np.log(np.exp(z - top).sum(axis=axis, keepdims=True))


def _model(name, loss, params=(W,), inputs=(X,)):
    return sbp.Model(name, inputs=list(inputs), params=list(params), loss=loss)


CASES = [
    Case("map_tanh", lambda: _model("m1", _sum((X * W).applyfunc(sp.tanh))), lambda d: np.tanh(d["X"] @ d["W"]).sum()),
    Case("map_exp_sin", lambda: _model("m2", _sum((X * W).applyfunc(lambda t: sp.exp(sp.sin(t)) * t))),
         lambda d: (np.exp(np.sin(d["X"] @ d["W"])) * (d["X"] @ d["W"])).sum()),
    Case("map_log_sqrt", lambda: _model("m3", _sum(X.applyfunc(lambda t: sp.log(t) + sp.sqrt(t)) * W), params=(W, X), inputs=()),
         lambda d: ((np.log(d["X"]) + np.sqrt(d["X"])) @ d["W"]).sum(), positive=True),
    Case("map_power", lambda: _model("m4", _sum(sp.HadamardPower(X * W, 3))), lambda d: ((d["X"] @ d["W"]) ** 3).sum()),
    Case("broadcast_row", lambda: _model("m4b", _sum((X * W + nn.ones(n, 1) * B).applyfunc(sp.tanh)), params=(W, B)),
         lambda d: np.tanh(d["X"] @ d["W"] + d["B"]).sum()),
    Case("scalar_param", lambda: _model("m5", _sum((a * X * W).applyfunc(sp.sin)), params=(W, a)),
         lambda d: np.sin(d["a"] * (d["X"] @ d["W"])).sum()),
    Case("matmul_chain", lambda: _model("m6", _sum((X * W * V).applyfunc(sp.sin)), params=(W, V)),
         lambda d: np.sin(d["X"] @ d["W"] @ d["V"]).sum()),
    Case("transpose", lambda: _model("m7", _sum((W.T * X.T).applyfunc(sp.cos)), params=(W, X), inputs=()),
         lambda d: np.cos(d["W"].T @ d["X"].T).sum()),
    Case("sum_axis0", lambda: _model("m8", _sum(sbp.reduce("sum", (X * W).applyfunc(sp.tanh), 0).applyfunc(sp.exp))),
         lambda d: np.exp(np.tanh(d["X"] @ d["W"]).sum(axis=0)).sum()),
    Case("sum_axis1", lambda: _model("m9", _sum(sbp.reduce("sum", (X * W).applyfunc(sp.tanh), 1).applyfunc(sp.exp))),
         lambda d: np.exp(np.tanh(d["X"] @ d["W"]).sum(axis=1)).sum()),
    Case("mean", lambda: _model("m10", _sum(sbp.reduce("mean", (X * W).applyfunc(sp.sin), 0).applyfunc(sp.exp))),
         lambda d: np.exp(np.sin(d["X"] @ d["W"]).mean(axis=0)).sum()),
    Case("logsumexp_axis1", lambda: _model("m11", _sum(sbp.reduce("logsumexp", X * W, 1))),
         lambda d: _lse(d["X"] @ d["W"], 1).sum()),
    Case("logsumexp_axis0", lambda: _model("m12", _sum(sbp.reduce("logsumexp", X * W, 0).applyfunc(sp.sin))),
         lambda d: np.sin(_lse(d["X"] @ d["W"], 0)).sum()),
    Case("max_axis1", lambda: _model("m13", _sum(sbp.reduce("max", X * W, 1).applyfunc(sp.sin))),
         lambda d: np.sin((d["X"] @ d["W"]).max(axis=1)).sum()),
    Case("min_axis0", lambda: _model("m14", _sum(sbp.reduce("min", X * W, 0).applyfunc(sp.exp))),
         lambda d: np.exp((d["X"] @ d["W"]).min(axis=0)).sum()),
    Case("prod_axis0", lambda: _model("m14b", _sum(sbp.reduce("prod", (X * W).applyfunc(sp.sin), 0))),
         lambda d: np.sin(d["X"] @ d["W"]).prod(axis=0).sum()),
    Case("cumsum_axis1", lambda: _model("m14c", _sum(sbp.cumsum(X * W, 1).applyfunc(sp.sin))),
         lambda d: np.sin(np.cumsum(d["X"] @ d["W"], axis=1)).sum()),
    Case("det", lambda: _model("m22", sbp.det(X.T * X + W * V), params=(W, V)),
         lambda d: np.linalg.det(d["X"].T @ d["X"] + d["W"] @ d["V"])),
    Case("logdet", lambda: _model("m23", sbp.logdet(X.T * X), params=(X,), inputs=()),
         lambda d: np.linalg.slogdet(d["X"].T @ d["X"])[1]),
    Case("solve", lambda: _model("m24", _sum(sbp.solve(X.T * X, W).applyfunc(sp.sin)), params=(W, X), inputs=()),
         lambda d: np.sin(np.linalg.solve(d["X"].T @ d["X"], d["W"])).sum()),
    Case("cholesky", lambda: _model("m25", _sum(sbp.cholesky(X.T * X).applyfunc(sp.sin)), params=(X,), inputs=()),
         lambda d: np.sin(np.linalg.cholesky(d["X"].T @ d["X"])).sum()),
    Case("triangular_solve", lambda: _model("m26", _sum(sbp.triangular_solve(X.T * X, W, lower=False, transpose=True)),
                                            params=(W, X), inputs=()),
         lambda d: np.linalg.solve(np.triu(d["X"].T @ d["X"]).T, d["W"]).sum()),
    Case("shift_down_fill", lambda: _model("m14d", _sum(sp.HadamardProduct(sbp.shift(X * W, 1, 0, fill=1.5), X * W)
                                                    .applyfunc(sp.sin))),
         lambda d: np.sin(np.vstack([np.full((1, 2), 1.5), (d["X"] @ d["W"])[:-1]]) * (d["X"] @ d["W"])).sum()),
    Case("shift_left_axis1", lambda: _model("m14e", _sum(sbp.shift(X * W, -1, 1).applyfunc(sp.exp))),
         lambda d: np.exp(np.hstack([(d["X"] @ d["W"])[:, 1:], np.zeros((len(d["X"]), 1))])).sum()),
    Case("element", lambda: _model("m15", sp.sin((X * W)[0, 1]) * sp.cos((X * W)[1, 0])),
         lambda d: np.sin((d["X"] @ d["W"])[0, 1]) * np.cos((d["X"] @ d["W"])[1, 0])),
    Case("pack", lambda: _model("m16", _sum(sp.Matrix([[sp.sin(W[0, 0]), W[1, 1] ** 2]]) * V),
                                params=(W, V), inputs=()),
         lambda d: (np.array([[np.sin(d["W"][0, 0]), d["W"][1, 1] ** 2]]) @ d["V"]).sum()),
    Case("softmax_axis1", lambda: _model("m11s", _sum(nn.softmax(X * W).applyfunc(sp.sin))),
         lambda d: np.sin(np.exp(d["X"] @ d["W"] - _lse(d["X"] @ d["W"], 1))).sum()),
    Case("log_softmax_axis0", lambda: _model("m12s", _sum(nn.log_softmax(X * W, 0).applyfunc(sp.sin))),
         lambda d: np.sin(d["X"] @ d["W"] - _lse(d["X"] @ d["W"], 0)).sum()),
    Case("softmax_ce", lambda: _model("m17", nn.softmax_cross_entropy(X * W, sp.MatrixSymbol("Y", n, 2)),
                                      inputs=(X, sp.MatrixSymbol("Y", n, 2))),
         lambda d: ((_lse(d["X"] @ d["W"], 1) * d["Y"].sum(axis=1, keepdims=True)).sum()  # PyTorch's: -sum(Y * log_softmax)
                    - (d["Y"] * (d["X"] @ d["W"])).sum()) / d["X"].shape[0]),
    Case("emap_rows", lambda: _model("m18", _sum(_row_map()), params=(W,), inputs=(X,)),
         lambda d: np.sum(np.sin(d["X"][:, 0] * d["W"][0, 0]) * d["X"][:, 2] + d["X"][:, 1] ** 2 * d["W"][2, 1])),
    Case("emap_gather", lambda: _model("m19", _sum(_gather_map()), params=(C,), inputs=(X, idx)),
         lambda d: np.sum(np.sqrt(((d["X"] - d["C"][d["idx"][:, 0]]) ** 2).sum(axis=1) + 1))),
    Case("emap_pairs", lambda: _model("m20", _sum(_pair_map()), params=(C,), inputs=(X,)),
         lambda d: np.sum(np.exp(-((d["X"][:, None, :] - d["C"][None, :, :]) ** 2).sum(axis=2)))),
    Case("emap_shared_row", lambda: _model("m21", _sum(_shared_map()), params=(B,), inputs=(X,)),
         lambda d: np.sum(np.tanh(d["X"][:, 0] * d["B"][0, 0] + d["B"][0, 1]) ** 2)),
    Case("conv2d_stride2_pad1", lambda: _model("m22", _sum(nn.conv2d(IMG, KER, KB, stride=2, padding=1).matrix.applyfunc(sp.sin)),
                                               params=(IMG, KER, KB), inputs=()),
         lambda d: np.sin(_np_conv(d["IMG"], d["KER"], d["KB"], 2, 1)).sum()),
    Case("max_pool2d", lambda: _model("m23", _sum(nn.max_pool2d(IMG, 2, 1).matrix.applyfunc(sp.sin)), params=(IMG,), inputs=()),
         lambda d: np.sin(_np_pool(d["IMG"], 2, 1, np.max)).sum()),
    Case("avg_pool2d", lambda: _model("m24", _sum(nn.avg_pool2d(IMG, 3, 2).matrix.applyfunc(sp.exp)), params=(IMG,), inputs=()),
         lambda d: np.exp(_np_pool(d["IMG"], 3, 2, np.mean)).sum()),
    Case("batch_norm", lambda: _model("m25", _sum(nn.batch_norm(IMG, GAMMA, BETA).matrix.applyfunc(sp.sin)),
                                      params=(IMG, GAMMA, BETA), inputs=()),
         lambda d: np.sin(_np_batch_norm(d["IMG"], d["GAMMA"], d["BETA"])).sum()),
    Case("causal_attention", lambda: _model("m26", _sum(nn.causal_attention(SQ, SK, SV, 2).matrix.applyfunc(sp.sin)),
                                            params=(SQ.matrix, SK.matrix, SV.matrix), inputs=()),
         lambda d: np.sin(_np_attention(d["SQ"], d["SK"], d["SV"], 3, 2)).sum()),
    Case("layer_norm", lambda: _model("m27", _sum(nn.layer_norm(X, LNG, LNB).applyfunc(sp.sin)), params=(X, LNG, LNB),
                                      inputs=()),
         lambda d: np.sin((d["X"] - d["X"].mean(1, keepdims=True)) / np.sqrt(d["X"].var(1, keepdims=True) + 1e-5)
                          * d["LNG"] + d["LNB"]).sum()),
]


def _np_conv(x, w, b, stride, pad):
    """PyTorch's conv2d of IMG by KER, written as the definition's loops."""
    x = np.pad(x.reshape(-1, 2, 5, 4), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    w = w.reshape(3, 2, 3, 3)
    rows, cols = (x.shape[2] - 3) // stride + 1, (x.shape[3] - 3) // stride + 1
    out = np.zeros((x.shape[0], 3, rows, cols))
    for i, o, r, c in np.ndindex(*out.shape):
        out[i, o, r, c] = b[0, o] + np.sum(w[o] * x[i, :, r * stride:r * stride + 3, c * stride:c * stride + 3])
    return out


def _np_pool(x, k, stride, reduce):
    x = x.reshape(-1, 2, 5, 4)
    rows, cols = (5 - k) // stride + 1, (4 - k) // stride + 1
    out = np.zeros((x.shape[0], 2, rows, cols))
    for i, ch, r, c in np.ndindex(*out.shape):
        out[i, ch, r, c] = reduce(x[i, ch, r * stride:r * stride + k, c * stride:c * stride + k])
    return out


def _np_batch_norm(x, gamma, beta, eps=1e-5):
    x = x.reshape(-1, 2, 5, 4)
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma.reshape(1, 2, 1, 1) + beta.reshape(1, 2, 1, 1)


def _np_attention(q, k, v, length, heads):
    """Causal attention by its definition: each sequence of `length` rows
    (the last shorter), each head's columns, keys s <= t only."""
    out = np.zeros_like(q)
    dh = q.shape[1] // heads
    for first in range(0, q.shape[0], length):
        for t in range(first, min(first + length, q.shape[0])):
            for h in range(heads):
                cols = slice(h * dh, (h + 1) * dh)
                scores = np.array([q[t, cols] @ k[s, cols] / np.sqrt(dh) for s in range(first, t + 1)])
                weights = np.exp(scores - scores.max())
                out[t, cols] = (weights / weights.sum()) @ v[first:t + 1, cols]
    return out


def _row_map():
    x = sp.symbols("x0:3", real=True)
    return sbp.map_examples(sp.sin(x[0] * W[0, 0]) * x[2] + x[1] ** 2 * W[2, 1], [(sp.Matrix(x), X)])


def _gather_map():
    x, c = sp.symbols("x0:3", real=True), sp.symbols("c0:3", real=True)
    body = sp.sqrt(sum((xi - ci) ** 2 for xi, ci in zip(x, c)) + 1)
    return sbp.map_examples(body, [(sp.Matrix(x), X), (sp.Matrix(c), sbp.gather(C, idx))])


def _pair_map():
    x, c = sp.symbols("x0:3", real=True), sp.symbols("c0:3", real=True)
    return sbp.map_examples(sp.exp(-sum((xi - ci) ** 2 for xi, ci in zip(x, c))), [(sp.Matrix(x), X), (sp.Matrix(c), C)])


def _shared_map():
    x, b = sp.symbols("x0:3", real=True), sp.symbols("b0:2", real=True)
    return sbp.map_examples(sp.tanh(x[0] * b[0] + b[1]) ** 2, [(sp.Matrix(x), X), (sp.Matrix(b), B)])


def _draw(lowered, rng, positive):
    sizes = {n: 5, k: 4}
    arrays = {}
    for name, node in lowered.leaves.items():
        shape = tuple(sizes.get(d, d) for d in node.shape)
        if node.attrs[1] == "index":
            arrays[name] = rng.integers(0, sizes[k], size=(shape[0], 1))
        elif positive:
            arrays[name] = rng.uniform(0.5, 2.0, size=shape)
        else:
            arrays[name] = rng.uniform(-1.0, 1.0, size=shape)
    return arrays


def _loss(lowered, arrays, dims):
    return evaluate([lowered.loss], arrays, dims)[0].item()


def _differentiable(lowered):
    return [(name, node) for name, node in lowered.leaves.items() if node.attrs[1] != "index"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_matches_numpy(case):
    lowered = lower(case.model())
    arrays = _draw(lowered, np.random.default_rng(1), case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    assert _loss(lowered, arrays, dims) == pytest.approx(case.reference(arrays), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_vjp_matches_central_differences(case):
    lowered = lower(case.model())
    arrays = _draw(lowered, np.random.default_rng(2), case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    targets = _differentiable(lowered)
    grads, _ = vjp([(lowered.loss, const(1, SCALAR))], [node for _, node in targets])
    values = evaluate(grads, arrays, dims)
    step = 1e-6
    for (name, _node), grad in zip(targets, values):
        numeric = np.zeros_like(arrays[name])
        for index in np.ndindex(*arrays[name].shape):
            for sign in (1, -1):
                shifted = dict(arrays, **{name: arrays[name].copy()})
                shifted[name][index] += sign * step
                numeric[index] += sign * _loss(lowered, shifted, dims) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=f"{case.name}: d loss / d {name}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_jvp_matches_directional_difference(case):
    lowered = lower(case.model())
    rng = np.random.default_rng(3)
    arrays = _draw(lowered, rng, case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    targets = _differentiable(lowered)
    tangents = {node: leaf(f"t_{name}", node.shape, "input") for name, node in targets}
    directions = {f"t_{name}": rng.standard_normal(arrays[name].shape) for name, _ in targets}
    (tangent,) = jvp([lowered.loss], tangents)
    value = evaluate([tangent], {**arrays, **directions}, dims)[0].item()
    step = 1e-6

    def moved(sign):
        return {**arrays, **{name: arrays[name] + sign * step * directions[f"t_{name}"] for name, _ in targets}}

    numeric = (_loss(lowered, moved(1), dims) - _loss(lowered, moved(-1), dims)) / (2 * step)
    assert value == pytest.approx(numeric, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name", ["map_exp_sin", "logsumexp_axis0", "softmax_axis1", "log_softmax_axis0",
                                  "emap_gather", "emap_pairs", "prod_axis0", "cumsum_axis1",
                                  "shift_down_fill", "shift_left_axis1",
                                  "conv2d_stride2_pad1", "max_pool2d", "avg_pool2d", "batch_norm",
                                  "causal_attention", "layer_norm"])
def test_compiled_module_agrees_with_the_interpreter(name):
    case = next(c for c in CASES if c.name == name)
    model = case.model()
    lowered = lower(model)
    arrays = _draw(lowered, np.random.default_rng(4), case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    targets = _differentiable(lowered)
    grads, _ = vjp([(lowered.loss, const(1, SCALAR))], [node for _, node in targets])
    interpreted = evaluate([lowered.loss, *grads], arrays, dims)
    loss, compiled = sbp.compile(model, wrt=[key for key, _ in targets]).value_and_grad(**arrays)
    assert loss == pytest.approx(interpreted[0].item(), rel=1e-12)
    for (key, _), grad in zip(targets, interpreted[1:]):
        np.testing.assert_allclose(np.reshape(compiled[key], grad.shape), grad, rtol=1e-11, atol=1e-13)


def test_stable_functions_through_the_interpreter():
    """sigmoid and softplus (symbackprop.base.stable) evaluate and differentiate
    without C, at ordinary points and where exp would overflow."""
    model = _model("m_stable", _sum((X * W).applyfunc(lambda t: nn.sigmoid(t) + nn.softplus(-t))))
    lowered = lower(model)
    arrays = {"X": np.array([[1.0, -2.0, 0.5], [800.0, 0.0, 0.0], [-800.0, 0.0, 0.0]]), "W": np.eye(3)[:, :2]}
    dims = bind_dims(lowered.leaves, arrays)
    z = arrays["X"] @ arrays["W"]
    sig = 1 / (1 + np.exp(-np.clip(z, -500, 500)))
    expected = (sig + np.logaddexp(0, -z)).sum()
    assert _loss(lowered, arrays, dims) == pytest.approx(expected, rel=1e-13)
    (grad,) = evaluate(vjp([(lowered.loss, const(1, SCALAR))], [lowered.leaves["W"]])[0], arrays, dims)
    local = sig * (1 - sig) - (1 - sig)  # d/dz [sigmoid(z) + softplus(-z)]
    np.testing.assert_allclose(grad, arrays["X"].T @ local, rtol=1e-12, atol=1e-300)
    assert np.isfinite(grad).all()
