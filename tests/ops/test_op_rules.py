"""Every op's derivative rules, checked without C (in the manner of JAX's
lax_autodiff_test): a table of small models, one or more per op, lowered to
the IR; the VJP and JVP graphs that autodiff builds are evaluated by the
numpy interpreter (symbackprop.ir.interpret) and compared with central finite
differences of the interpreted loss. Each model's interpreted loss is first
compared with a numpy formula written independently of the IR.

A few models are also compiled, to check that the C computes what the
interpreter does (the interpreter is then an oracle for the emitted code).
The loop ops (scan, fixed_point), which the interpreter does not run, have
compiled cases. The table is read against the registry
(symbackprop.base.registry.records()): an op registered without a case for
its VJP, JVP or evaluator fails test_every_registered_op_has_a_case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.base import registry
from symbackprop.declare import nn
from symbackprop.declare.pick import pick
from symbackprop.diff.autodiff import jvp, vjp
from symbackprop.errors import ModelError
from symbackprop.ir import node as node_module
from symbackprop.ir.construct import const, leaf, map_, matmul, reduce_sum
from symbackprop.ir.interpret import bind_dims, evaluate
from symbackprop.ir.lower import lower
from symbackprop.ir.node import SCALAR, Node, placeholder, topological_order
from symbackprop.loops.reshape import reshape

n, k = sp.symbols("n k", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
W = sp.MatrixSymbol("W", 3, 2)
V = sp.MatrixSymbol("V", 2, 3)
B = sp.MatrixSymbol("B", 1, 2)
C = sp.MatrixSymbol("C", k, 3)
Z = sp.MatrixSymbol("Z", 3, k)  # k = 4 columns: pick reads the one an Index names
a = sp.Symbol("a", real=True)
idx = sbp.Index("idx", n)
IMG = sbp.images("IMG", n, 2, 5, 4)  # n x 40: 2 channels of 5 x 4
KER, KB = sbp.conv_weight("KER", 3, 2, 3), sp.MatrixSymbol("KB", 1, 3)
KRECT = sbp.conv_weight("KRECT", 3, 2, 3, 2)  # a 3 x 2 kernel
GAMMA, BETA = sp.MatrixSymbol("GAMMA", 1, 2), sp.MatrixSymbol("BETA", 1, 2)
SQ, SK, SV = (sbp.sequences(name, n, 3, 4) for name in ("SQ", "SK", "SV"))  # n = 5 rows: sequences of 3, then 2
LNG, LNB = sp.MatrixSymbol("LNG", 1, 3), sp.MatrixSymbol("LNB", 1, 3)
S4 = sp.MatrixSymbol("S4", 4, 4)
T5 = sp.MatrixSymbol("T5", 3, 5)  # disjoint column blocks 0:2 and 3:5: one slice_scatter of both adjoints


@dataclass(frozen=True)
class Case:
    """A model (or a graph of IR nodes, for an op no SymPy expression lowers
    to by itself), the numpy formula of its loss, and how to draw its arrays."""

    name: str
    model: Callable[[], dict] | None  # _model(...): the loss, params and inputs of a Model named after the case
    reference: Callable[[dict], float]
    positive: bool = False  # draw strictly positive floats (logs, square roots)
    graph: Callable[[], tuple[Node, dict[str, Node]]] | None = None  # (loss node, leaves by name), without a Model
    rtol: float = 1e-12  # of the reference: looser where it is itself a finite difference
    unsupported: str | None = None  # the ModelError its VJP and JVP raise, where an op documents that limit

    def build(self) -> sbp.Model:
        """The case's Model, named after the case (each compiled module its own name)."""
        assert self.model is not None, f"{self.name} is a graph of IR nodes, not a model"
        return sbp.Model(f"op_{self.name}", **self.model())

    def lowered(self):
        """The lowered loss and leaves (the IR the interpreter and autodiff read)."""
        if self.graph is not None:
            loss, leaves = self.graph()
            return SimpleNamespace(loss=loss, leaves=leaves)
        return lower(self.build())


def _sum(m):
    return nn.sum_all(m)


def _lse(z, axis):
    top = z.max(axis=axis, keepdims=True)
    return top + np.log(np.exp(z - top).sum(axis=axis, keepdims=True))


def _model(loss, params=(W,), inputs=(X,)):
    return {"loss": loss, "params": list(params), "inputs": list(inputs)}


CASES = [
    Case("map_tanh", lambda: _model(_sum((X * W).applyfunc(sp.tanh))), lambda d: np.tanh(d["X"] @ d["W"]).sum()),
    Case("map_exp_sin", lambda: _model(_sum((X * W).applyfunc(lambda t: sp.exp(sp.sin(t)) * t))),
         lambda d: (np.exp(np.sin(d["X"] @ d["W"])) * (d["X"] @ d["W"])).sum()),
    Case("map_log_sqrt", lambda: _model(_sum(X.applyfunc(lambda t: sp.log(t) + sp.sqrt(t)) * W), params=(W, X), inputs=()),
         lambda d: ((np.log(d["X"]) + np.sqrt(d["X"])) @ d["W"]).sum(), positive=True),
    Case("map_power", lambda: _model(_sum(sp.HadamardPower(X * W, 3))), lambda d: ((d["X"] @ d["W"]) ** 3).sum()),
    Case("broadcast_row", lambda: _model(_sum((X * W + nn.ones(n, 1) * B).applyfunc(sp.tanh)), params=(W, B)),
         lambda d: np.tanh(d["X"] @ d["W"] + d["B"]).sum()),
    Case("scalar_param", lambda: _model(_sum((a * X * W).applyfunc(sp.sin)), params=(W, a)),
         lambda d: np.sin(d["a"] * (d["X"] @ d["W"])).sum()),
    Case("matmul_chain", lambda: _model(_sum((X * W * V).applyfunc(sp.sin)), params=(W, V)),
         lambda d: np.sin(d["X"] @ d["W"] @ d["V"]).sum()),
    Case("transpose", lambda: _model(_sum((W.T * X.T).applyfunc(sp.cos)), params=(W, X), inputs=()),
         lambda d: np.cos(d["W"].T @ d["X"].T).sum()),
    Case("sum_axis0", lambda: _model(_sum(sbp.reduce("sum", (X * W).applyfunc(sp.tanh), 0).applyfunc(sp.exp))),
         lambda d: np.exp(np.tanh(d["X"] @ d["W"]).sum(axis=0)).sum()),
    Case("sum_axis1", lambda: _model(_sum(sbp.reduce("sum", (X * W).applyfunc(sp.tanh), 1).applyfunc(sp.exp))),
         lambda d: np.exp(np.tanh(d["X"] @ d["W"]).sum(axis=1)).sum()),
    Case("mean", lambda: _model(_sum(sbp.reduce("mean", (X * W).applyfunc(sp.sin), 0).applyfunc(sp.exp))),
         lambda d: np.exp(np.sin(d["X"] @ d["W"]).mean(axis=0)).sum()),
    Case("logsumexp_axis1", lambda: _model(_sum(sbp.reduce("logsumexp", X * W, 1))),
         lambda d: _lse(d["X"] @ d["W"], 1).sum()),
    Case("logsumexp_axis0", lambda: _model(_sum(sbp.reduce("logsumexp", X * W, 0).applyfunc(sp.sin))),
         lambda d: np.sin(_lse(d["X"] @ d["W"], 0)).sum()),
    Case("max_axis1", lambda: _model(_sum(sbp.reduce("max", X * W, 1).applyfunc(sp.sin))),
         lambda d: np.sin((d["X"] @ d["W"]).max(axis=1)).sum()),
    Case("min_axis0", lambda: _model(_sum(sbp.reduce("min", X * W, 0).applyfunc(sp.exp))),
         lambda d: np.exp((d["X"] @ d["W"]).min(axis=0)).sum()),
    Case("prod_axis0", lambda: _model(_sum(sbp.reduce("prod", (X * W).applyfunc(sp.sin), 0))),
         lambda d: np.sin(d["X"] @ d["W"]).prod(axis=0).sum()),
    Case("cumsum_axis1", lambda: _model(_sum(sbp.cumsum(X * W, 1).applyfunc(sp.sin))),
         lambda d: np.sin(np.cumsum(d["X"] @ d["W"], axis=1)).sum()),
    Case("det", lambda: _model(sbp.det(X.T * X + W * V), params=(W, V)),
         lambda d: np.linalg.det(d["X"].T @ d["X"] + d["W"] @ d["V"])),
    Case("logdet", lambda: _model(sbp.logdet(X.T * X), params=(X,), inputs=()),
         lambda d: np.linalg.slogdet(d["X"].T @ d["X"])[1]),
    Case("solve", lambda: _model(_sum(sbp.solve(X.T * X, W).applyfunc(sp.sin)), params=(W, X), inputs=()),
         lambda d: np.sin(np.linalg.solve(d["X"].T @ d["X"], d["W"])).sum()),
    Case("cholesky", lambda: _model(_sum(sbp.cholesky(X.T * X).applyfunc(sp.sin)), params=(X,), inputs=()),
         lambda d: np.sin(np.linalg.cholesky(d["X"].T @ d["X"])).sum()),
    Case("triangular_solve", lambda: _model(_sum(sbp.triangular_solve(X.T * X, W, lower=False, transpose=True)),
                                            params=(W, X), inputs=()),
         lambda d: np.linalg.solve(np.triu(d["X"].T @ d["X"]).T, d["W"]).sum()),
    Case("shift_down_fill", lambda: _model(_sum(sp.HadamardProduct(sbp.shift(X * W, 1, 0, fill=1.5), X * W)
                                                    .applyfunc(sp.sin))),
         lambda d: np.sin(np.vstack([np.full((1, 2), 1.5), (d["X"] @ d["W"])[:-1]]) * (d["X"] @ d["W"])).sum()),
    Case("shift_left_axis1", lambda: _model(_sum(sbp.shift(X * W, -1, 1).applyfunc(sp.exp))),
         lambda d: np.exp(np.hstack([(d["X"] @ d["W"])[:, 1:], np.zeros((len(d["X"]), 1))])).sum()),
    Case("element", lambda: _model(sp.sin((X * W)[0, 1]) * sp.cos((X * W)[1, 0])),
         lambda d: np.sin((d["X"] @ d["W"])[0, 1]) * np.cos((d["X"] @ d["W"])[1, 0])),
    Case("pack", lambda: _model(_sum(sp.Matrix([[sp.sin(W[0, 0]), W[1, 1] ** 2]]) * V),
                                params=(W, V), inputs=()),
         lambda d: (np.array([[np.sin(d["W"][0, 0]), d["W"][1, 1] ** 2]]) @ d["V"]).sum()),
    Case("softmax_axis1", lambda: _model(_sum(nn.softmax(X * W).applyfunc(sp.sin))),
         lambda d: np.sin(np.exp(d["X"] @ d["W"] - _lse(d["X"] @ d["W"], 1))).sum()),
    Case("log_softmax_axis0", lambda: _model(_sum(nn.log_softmax(X * W, 0).applyfunc(sp.sin))),
         lambda d: np.sin(d["X"] @ d["W"] - _lse(d["X"] @ d["W"], 0)).sum()),
    Case("softmax_ce", lambda: _model(nn.softmax_cross_entropy(X * W, sp.MatrixSymbol("Y", n, 2)),
                                      inputs=(X, sp.MatrixSymbol("Y", n, 2))),
         lambda d: ((_lse(d["X"] @ d["W"], 1) * d["Y"].sum(axis=1, keepdims=True)).sum()  # PyTorch's: -sum(Y * log_softmax)
                    - (d["Y"] * (d["X"] @ d["W"])).sum()) / d["X"].shape[0]),
    Case("emap_rows", lambda: _model(_sum(_row_map()), params=(W,), inputs=(X,)),
         lambda d: np.sum(np.sin(d["X"][:, 0] * d["W"][0, 0]) * d["X"][:, 2] + d["X"][:, 1] ** 2 * d["W"][2, 1])),
    Case("emap_gather", lambda: _model(_sum(_gather_map()), params=(C,), inputs=(X, idx)),
         lambda d: np.sum(np.sqrt(((d["X"] - d["C"][d["idx"][:, 0]]) ** 2).sum(axis=1) + 1))),
    Case("emap_pairs", lambda: _model(_sum(_pair_map()), params=(C,), inputs=(X,)),
         lambda d: np.sum(np.exp(-((d["X"][:, None, :] - d["C"][None, :, :]) ** 2).sum(axis=2)))),
    # an extreme of a map over pairs: its derivative at each row's extreme pair, read through an index
    Case("min_pairs_axis1", lambda: _model(_sum(sbp.reduce("min", _pair_map(), 1).applyfunc(sp.sin)), params=(C,), inputs=(X,)),
         lambda d: np.sin(np.exp(-((d["X"][:, None, :] - d["C"][None, :, :]) ** 2).sum(axis=2)).min(axis=1)).sum()),
    Case("max_pairs_axis0", lambda: _model(_sum(sbp.reduce("max", _pair_map(), 0).applyfunc(sp.exp)), params=(C,), inputs=(X,)),
         lambda d: np.exp(np.exp(-((d["X"][:, None, :] - d["C"][None, :, :]) ** 2).sum(axis=2)).max(axis=0)).sum()),
    Case("emap_shared_row", lambda: _model(_sum(_shared_map()), params=(B,), inputs=(X,)),
         lambda d: np.sum(np.tanh(d["X"][:, 0] * d["B"][0, 0] + d["B"][0, 1]) ** 2)),
    Case("conv2d_stride2_pad1", lambda: _model(_sum(nn.conv2d(IMG, KER, KB, stride=2, padding=1).matrix.applyfunc(sp.sin)),
                                               params=(IMG, KER, KB), inputs=()),
         lambda d: np.sin(_np_conv(d["IMG"], d["KER"], d["KB"], 2, 1)).sum()),
    Case("max_pool2d", lambda: _model(_sum(nn.max_pool2d(IMG, 2, 1).matrix.applyfunc(sp.sin)), params=(IMG,), inputs=()),
         lambda d: np.sin(_np_pool(d["IMG"], 2, 1, np.max)).sum()),
    Case("avg_pool2d", lambda: _model(_sum(nn.avg_pool2d(IMG, 3, 2).matrix.applyfunc(sp.exp)), params=(IMG,), inputs=()),
         lambda d: np.exp(_np_pool(d["IMG"], 3, 2, np.mean)).sum()),
    Case("conv2d_rect", lambda: _model(_sum(nn.conv2d(IMG, KRECT, KB, stride=(2, 1), padding=(1, 2), kernel_size=(3, 2),
                                                      dilation=(1, 2)).matrix.applyfunc(sp.sin)),
                                       params=(IMG, KRECT, KB), inputs=()),
         lambda d: np.sin(np.einsum("ncyxuv,ocuv->noyx", _np_windows(d["IMG"], (3, 2), (2, 1), (1, 2), (1, 2)),
                                    d["KRECT"].reshape(3, 2, 3, 2)) + d["KB"].reshape(1, 3, 1, 1)).sum()),
    Case("max_pool2d_padded", lambda: _model(_sum(nn.max_pool2d(IMG, (3, 2), (2, 1), 1).matrix.applyfunc(sp.sin)),
                                             params=(IMG,), inputs=()),
         lambda d: np.sin(_np_windows(d["IMG"], (3, 2), (2, 1), (1, 1), fill=-np.inf).max(axis=(4, 5))).sum()),
    Case("avg_pool2d_padded", lambda: _model(_sum(nn.avg_pool2d(IMG, (2, 3), (1, 2), 1).matrix.applyfunc(sp.exp)),
                                             params=(IMG,), inputs=()),
         lambda d: np.exp(_np_windows(d["IMG"], (2, 3), (1, 2), (1, 1)).mean(axis=(4, 5))).sum()),
    Case("batch_norm", lambda: _model(_sum(nn.batch_norm(IMG, GAMMA, BETA).matrix.applyfunc(sp.sin)),
                                      params=(IMG, GAMMA, BETA), inputs=()),
         lambda d: np.sin(_np_batch_norm(d["IMG"], d["GAMMA"], d["BETA"])).sum()),
    Case("causal_attention", lambda: _model(_sum(nn.causal_attention(SQ, SK, SV, 2).matrix.applyfunc(sp.sin)),
                                            params=(SQ.matrix, SK.matrix, SV.matrix), inputs=()),
         lambda d: np.sin(_np_attention(d["SQ"], d["SK"], d["SV"], 3, 2)).sum()),
    Case("attention", lambda: _model(_sum(nn.attention(SQ, SK, SV, 2).matrix.applyfunc(sp.sin)),
                                     params=(SQ.matrix, SK.matrix, SV.matrix), inputs=()),
         lambda d: np.sin(_np_attention(d["SQ"], d["SK"], d["SV"], 3, 2, causal=False)).sum()),
    Case("layer_norm", lambda: _model(_sum(nn.layer_norm(X, LNG, LNB).applyfunc(sp.sin)), params=(X, LNG, LNB),
                                      inputs=()),
         lambda d: np.sin((d["X"] - d["X"].mean(1, keepdims=True)) / np.sqrt(d["X"].var(1, keepdims=True) + 1e-5)
                          * d["LNG"] + d["LNB"]).sum()),
]


CASES += [
    Case("pick", lambda: _model(_sum(pick(X * Z, idx).applyfunc(sp.sin)), params=(Z,), inputs=(X, idx)),
         lambda d: np.sin((d["X"] @ d["Z"])[np.arange(len(d["X"])), d["idx"][:, 0]]).sum()),
    # place is pick's gradient: here it is in the loss, so its own rules are checked too
    Case("place", lambda: _model(_sum(sbp.grad(_sum(pick(X * Z, idx).applyfunc(sp.sin)), Z).applyfunc(sp.sin)),
                                 params=(Z,), inputs=(X, idx)),
         lambda d: np.sin(d["X"].T @ _np_place(np.cos((d["X"] @ d["Z"])[np.arange(len(d["X"])), d["idx"][:, 0]]),
                                               d["idx"][:, 0], 4)).sum()),
    # the JVP of an extreme: the mean of the tangent over its ties
    Case("extreme_mean", lambda: _model(_sum(sbp.jvp(sbp.reduce("min", X * W, 0), W, V.T).applyfunc(sp.sin)), params=(W, V)),
         lambda d: np.sin((d["X"] @ d["V"].T)[(d["X"] @ d["W"]).argmin(axis=0), [0, 1]]).sum()),
    Case("jvp_tanh", lambda: _model(_sum(sbp.jvp((X * W).applyfunc(sp.tanh), W, V.T).applyfunc(sp.sin)), params=(W, V)),
         lambda d: np.sin((1 - np.tanh(d["X"] @ d["W"]) ** 2) * (d["X"] @ d["V"].T)).sum()),
    Case("reshape", None, lambda d: np.sin(np.sin(d["R"]).reshape(2, 6) @ d["Q"]).sum(), graph=lambda: _reshape_graph()),
    # an input's columns, a param's first rows, an intermediate's middle rows, steps, a transpose's last rows
    Case("slice", lambda: _model(_sum((X[:, 1:3] * W[0:2, :]).applyfunc(sp.sin)) + _sum((W * V)[1:3, 0:2].applyfunc(sp.cos))
                                 + _sum((S4[0:4:2, 1:3] * S4.T[2:4, :]).applyfunc(sp.sin)), params=(W, V, X, S4), inputs=()),
         lambda d: (np.sin(d["X"][:, 1:3] @ d["W"][0:2]).sum() + np.cos((d["W"] @ d["V"])[1:3, 0:2]).sum()
                    + np.sin(d["S4"][0:4:2, 1:3] @ d["S4"].T[2:4]).sum())),
    Case("slices_disjoint", lambda: _model(_sum((X * T5[:, 0:2]).applyfunc(sp.sin)) + _sum((X * T5[:, 3:5]).applyfunc(sp.cos)),
                                           params=(T5,)),
         lambda d: np.sin(d["X"] @ d["T5"][:, 0:2]).sum() + np.cos(d["X"] @ d["T5"][:, 3:5]).sum()),
]


def _second_order(name, inner_name, wrt, unsupported=None):
    """sum(sin(grad(inner loss, p))) over the params p in `wrt`: the ops of
    the inner case's VJP (conv2d_input_grad, max_unpool2d, ...) are in this
    loss, so their own VJP and JVP rules are checked. The reference is the
    central difference of the inner case's numpy formula."""
    inner = next(c for c in CASES if c.name == inner_name)

    def model():
        spec = inner.model()
        leaves = {str(getattr(s, "matrix", s)): getattr(s, "matrix", s) for s in [*spec["params"], *spec["inputs"]]}
        return dict(spec, loss=sp.Add(*[_sum(sbp.grad(spec["loss"], leaves[w]).applyfunc(sp.sin)) for w in wrt]))

    def reference(d):
        return sum(np.sin(_central_gradient(inner.reference, d, w)).sum() for w in wrt)

    return Case(name, model, reference, inner.positive, rtol=1e-7, unsupported=unsupported)


def _central_gradient(f, arrays, name, step=1e-5):
    grad = np.zeros_like(arrays[name])
    for index in np.ndindex(*grad.shape):
        for sign in (1, -1):
            moved = dict(arrays, **{name: arrays[name].copy()})
            moved[name][index] += sign * step
            grad[index] += sign * f(moved) / (2 * step)
    return grad


def _np_place(values, columns, width):
    out = np.zeros((len(values), width))
    out[np.arange(len(values)), columns] = values
    return out


def _reshape_graph():
    """reshape is a view that only batched scans build (loops/reshape.py):
    sum(sin(reshape(sin(R), 2 x 6) Q)) in IR nodes, with no scan around it."""
    r, q = leaf("R", (4, 3), "param"), leaf("Q", (6, 2), "param")
    rows = reshape(map_(sp.sin(placeholder(0)), [r]), (2, 6))
    product = map_(sp.sin(placeholder(0)), [matmul(rows, q)])
    return reduce_sum(reduce_sum(product, 0), 1), {"R": r, "Q": q}


CASES += [
    # prod's derivative, the product of the others, has no derivative of its own: the rules say so by name
    _second_order("prod_others", "prod_axis0", ["W"], unsupported=r"second derivatives through sbp.reduce\('prod'"),
    _second_order("band", "logdet", ["X"]),
    _second_order("conv2d_grads", "conv2d_stride2_pad1", ["IMG", "KER"]),
    _second_order("max_unpool2d", "max_pool2d", ["IMG"]),
    _second_order("avg_unpool2d", "avg_pool2d", ["IMG"]),
    _second_order("conv2d_rect_grads", "conv2d_rect", ["IMG", "KRECT"]),
    _second_order("max_unpool2d_padded", "max_pool2d_padded", ["IMG"]),
    _second_order("avg_unpool2d_padded", "avg_pool2d_padded", ["IMG"]),
    _second_order("attention_grads", "causal_attention", ["SK"]),
    _second_order("attention_grads_all_keys", "attention", ["SQ", "SV"]),
    _second_order("normalize_rows_vjp", "layer_norm", ["X"]),
    _second_order("slice_scatter", "slice", ["W", "S4"]),
    _second_order("slice_scatter_merged", "slices_disjoint", ["T5"]),
    _second_order("extreme_spread", "max_axis1", ["W"]),
    _second_order("extreme_ties_pairs", "min_pairs_axis1", ["C", "X"]),
    _second_order("extreme_ties_pairs_axis0", "max_pairs_axis0", ["C"]),
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


def _np_windows(x, kernel, stride, pad, dilation=(1, 1), fill=0.0):
    """IMG's windows, n x C x Ho x Wo x kh x kw, of the image padded by `fill`
    (zeros for a convolution and a mean, -inf for PyTorch's max pool)."""
    x = np.pad(x.reshape(-1, 2, 5, 4), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])), constant_values=fill)
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    ho, wo = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1, (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = np.empty((x.shape[0], 2, ho, wo, kh, kw))
    for u, v in np.ndindex(kh, kw):
        out[..., u, v] = x[:, :, u * dh:u * dh + sh * (ho - 1) + 1:sh, v * dw:v * dw + sw * (wo - 1) + 1:sw]
    return out


def _np_batch_norm(x, gamma, beta, eps=1e-5):
    x = x.reshape(-1, 2, 5, 4)
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma.reshape(1, 2, 1, 1) + beta.reshape(1, 2, 1, 1)


def _np_attention(q, k, v, length, heads, causal=True):
    """Causal attention by its definition: each sequence of `length` rows
    (the last shorter), each head's columns, keys s <= t only (every key
    of the sequence where not causal)."""
    out = np.zeros_like(q)
    dh = q.shape[1] // heads
    for first in range(0, q.shape[0], length):
        for t in range(first, min(first + length, q.shape[0])):
            for h in range(heads):
                cols = slice(h * dh, (h + 1) * dh)
                end = t + 1 if causal else min(first + length, q.shape[0])
                scores = np.array([q[t, cols] @ k[s, cols] / np.sqrt(dh) for s in range(first, end)])
                weights = np.exp(scores - scores.max())
                out[t, cols] = (weights / weights.sum()) @ v[first:end, cols]
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
    lowered = case.lowered()
    arrays = _draw(lowered, np.random.default_rng(1), case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    assert _loss(lowered, arrays, dims) == pytest.approx(case.reference(arrays), rel=case.rtol, abs=case.rtol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_vjp_matches_central_differences(case):
    lowered = case.lowered()
    arrays = _draw(lowered, np.random.default_rng(2), case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    targets = _differentiable(lowered)
    if case.unsupported:
        with pytest.raises(ModelError, match=case.unsupported):
            vjp([(lowered.loss, const(1, SCALAR))], [node for _, node in targets])
        return
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
    lowered = case.lowered()
    rng = np.random.default_rng(3)
    arrays = _draw(lowered, rng, case.positive)
    dims = bind_dims(lowered.leaves, arrays)
    targets = _differentiable(lowered)
    tangents = {node: leaf(f"t_{name}", node.shape, "input") for name, node in targets}
    directions = {f"t_{name}": rng.standard_normal(arrays[name].shape) for name, _ in targets}
    if case.unsupported:
        with pytest.raises(ModelError, match=case.unsupported):
            jvp([lowered.loss], tangents)
        return
    (tangent,) = jvp([lowered.loss], tangents)
    value = evaluate([tangent], {**arrays, **directions}, dims)[0].item()
    step = 1e-6

    def moved(sign):
        return {**arrays, **{name: arrays[name] + sign * step * directions[f"t_{name}"] for name, _ in targets}}

    numeric = (_loss(lowered, moved(1), dims) - _loss(lowered, moved(-1), dims)) / (2 * step)
    assert value == pytest.approx(numeric, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name", ["map_exp_sin", "logsumexp_axis0", "softmax_axis1", "log_softmax_axis0",
                                  "emap_gather", "emap_pairs", "min_pairs_axis1", "max_pairs_axis0",
                                  "extreme_ties_pairs", "prod_axis0", "cumsum_axis1",
                                  "shift_down_fill", "shift_left_axis1",
                                  "conv2d_stride2_pad1", "max_pool2d", "avg_pool2d", "batch_norm",
                                  "conv2d_rect", "max_pool2d_padded", "avg_pool2d_padded",
                                  "causal_attention", "attention", "layer_norm", "slice", "slice_scatter"])
def test_compiled_module_agrees_with_the_interpreter(name):
    case = next(c for c in CASES if c.name == name)
    model = case.build()
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
    model = sbp.Model("op_stable", **_model(_sum((X * W).applyfunc(lambda t: nn.sigmoid(t) + nn.softplus(-t)))))
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


# --- the loop ops, which the interpreter does not run: compiled ---------------
# scan (its parts, its backward pass scan_vjp and the scan_seed nodes that
# seed it) and fixed_point have no numpy evaluator (the interpreter raises
# NotImplementedError), so their cases are compiled: the loss against a numpy
# loop, the gradient, the JVP and the Hessian-vector product (forward over
# the VJP graph: the JVP rules of scan_vjp and scan_seed's reader) against
# central differences.

T = sp.Symbol("T", integer=True, positive=True)
SH, SD = 2, 2
SW, SU, SB = sp.MatrixSymbol("SW", SH, SH), sp.MatrixSymbol("SU", SD, SH), sp.MatrixSymbol("SB", 1, SH)
SVO, SH0 = sp.MatrixSymbol("SVO", SH, 1), sp.MatrixSymbol("SH0", 1, SH)
SX = sp.MatrixSymbol("SX", T, SD)
_h, _x = sp.MatrixSymbol("h", 1, SH), sp.MatrixSymbol("x", 1, SD)
FW, FU, FB = sp.MatrixSymbol("FW", 3, 3), sp.MatrixSymbol("FU", 3, 2), sp.MatrixSymbol("FB", 3, 1)
FX, _z = sp.MatrixSymbol("FX", 2, 1), sp.MatrixSymbol("z", 3, 1)


def _rnn_loss():
    """A tanh RNN: sum of its outputs squared plus its final state's entries."""
    new = (_h * SW + _x * SU + SB).applyfunc(sp.tanh)
    out = sbp.scan(new, new * SVO, _h, _x, SH0, SX)  # T x 1
    return nn.sum_all(sp.HadamardPower(out, 2)) + sbp.final_state(out) * sp.OneMatrix(SH, 1)


def _np_rnn(d):
    state, loss = d["SH0"], 0.0
    for row in d["SX"]:
        state = np.tanh(state @ d["SW"] + row[None, :] @ d["SU"] + d["SB"])
        loss += (state @ d["SVO"]).item() ** 2
    return loss + state.sum()


def _deq_loss():
    """z = tanh(FW z + FU FX + FB) by its fixed point, then sum(z^2) / 2."""
    z_star = sbp.fixed_point((FW * _z + FU * FX + FB).applyfunc(sp.tanh), _z, sp.ZeroMatrix(3, 1), tol=1e-14, max_iter=300)
    return nn.sum_all(sp.HadamardPower(z_star, 2)) / 2


def _np_deq(d):
    z = np.zeros((3, 1))
    for _ in range(300):
        z = np.tanh(d["FW"] @ z + d["FU"] @ d["FX"] + d["FB"])
    return (z**2).sum() / 2


def _rnn_data(rng):
    return {"SW": rng.uniform(-0.6, 0.6, (SH, SH)), "SU": rng.uniform(-1, 1, (SD, SH)), "SB": rng.uniform(-1, 1, (1, SH)),
            "SVO": rng.uniform(-1, 1, (SH, 1)), "SH0": rng.uniform(-1, 1, (1, SH)), "SX": rng.uniform(-1, 1, (4, SD))}


def _deq_data(rng):
    w = rng.standard_normal((3, 3))
    return {"FW": 0.4 * w / np.linalg.norm(w, 2), "FU": rng.uniform(-1, 1, (3, 2)), "FB": rng.uniform(-0.5, 0.5, (3, 1)),
            "FX": rng.uniform(-1, 1, (2, 1))}


@dataclass(frozen=True)
class LoopCase:
    """A compiled case: a model, the numpy loop of its loss, and its arrays."""

    name: str
    model: Callable[[], dict]
    reference: Callable[[dict], float]
    data: Callable[[np.random.Generator], dict]
    rtol: float = 1e-11  # of the reference: looser where it is itself a finite difference

    def build(self) -> sbp.Model:
        return sbp.Model(f"op_{self.name}", **self.model())


def _grad_of_rnn(d):
    """sum(sin(d loss / d SW)) by central differences of the numpy loop."""
    return np.sin(_central_gradient(_np_rnn, d, "SW")).sum()


LOOP_CASES = [
    LoopCase("scan", lambda: _model(_rnn_loss(), params=(SW, SU, SB, SVO, SH0, SX), inputs=()), _np_rnn, _rnn_data),
    # the backward pass in the loss: scan_vjp and scan_seed are in the forward graph, so they are differentiated
    LoopCase("scan_vjp", lambda: _model(_sum(sbp.grad(_rnn_loss(), SW).applyfunc(sp.sin)), params=(SW, SU, SB, SVO, SH0, SX),
                                        inputs=()), _grad_of_rnn, _rnn_data, rtol=1e-7),
    LoopCase("fixed_point", lambda: _model(_deq_loss(), params=(FW, FU, FB, FX), inputs=()), _np_deq, _deq_data),
]


@pytest.fixture(scope="module", params=LOOP_CASES, ids=[c.name for c in LOOP_CASES])
def loop_case(request):
    return request.param, sbp.compile(request.param.build())


def _compiled_loss(module, arrays):
    return module.value_and_grad(**arrays)[0]


def test_loop_loss_and_gradient_match_numpy_and_central_differences(loop_case):
    case, module = loop_case
    arrays = case.data(np.random.default_rng(5))
    loss, grads = module.value_and_grad(**arrays)
    assert loss == pytest.approx(case.reference(arrays), rel=case.rtol, abs=case.rtol)
    for name, grad in grads.items():
        numeric = _central_gradient(lambda d: _compiled_loss(module, d), arrays, name, step=1e-6)
        np.testing.assert_allclose(np.reshape(grad, numeric.shape), numeric, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{case.name}: d loss / d {name}")


def test_loop_jvp_and_hvp_match_central_differences(loop_case):
    case, module = loop_case
    rng = np.random.default_rng(6)
    arrays = case.data(rng)
    directions = {name: rng.standard_normal(np.shape(value)) for name, value in arrays.items()}
    step = 1e-6

    def moved(sign):
        return {name: value + sign * step * directions[name] for name, value in arrays.items()}

    tangent = module.jvp(directions, **arrays)["loss"]
    numeric = (_compiled_loss(module, moved(1)) - _compiled_loss(module, moved(-1))) / (2 * step)
    assert float(np.ravel(tangent)[0]) == pytest.approx(numeric, rel=1e-6, abs=1e-7)
    products = module.hvp(directions, **arrays)
    plus, minus = module.value_and_grad(**moved(1))[1], module.value_and_grad(**moved(-1))[1]
    for name, product in products.items():
        np.testing.assert_allclose(np.ravel(product), np.ravel((plus[name] - minus[name]) / (2 * step)), rtol=1e-5,
                                   atol=1e-6, err_msg=f"{case.name}: Hessian times the direction, row {name}")


# --- every registered op has a case --------------------------------------------

# records with no rule the table runs (no VJP, JVP, evaluator or lowering):
# kernels the emitter makes inside a loop's step. Each names a loop case and
# a line of its template that the case's C must hold.
KERNEL_ONLY = {"scan_add_product": ("scan", "+= acc *")}
# ops that a loop's VJP builds and its own rule consumes at once: never in a
# graph, so their VJP and JVP rules only say so. Each names a loop case.
TRANSIENT = {"scan_seed": "scan"}


def _ops(roots) -> set[str]:
    return {node.op for node in topological_order(list(roots))}


def _classes(expr) -> set[type]:
    return {type(e) for e in sp.preorder_traversal(expr)}


@functools.cache
def _covered() -> dict[str, set]:
    """What the tests above run, by rule: the ops the interpreter evaluates
    (forward and VJP graphs), the ops whose VJP and JVP rules are applied
    (forward graphs; a loop case's VJP graph too, which its hvp runs forward
    mode over), and the SymPy classes the cases' losses lower from."""
    covered: dict[str, set] = {"evaluate": set(), "vjp": set(), "jvp": set(), "lowering": set()}
    for case in [*CASES, *LOOP_CASES]:
        lowered = case.lowered() if isinstance(case, Case) else lower(case.build())
        forward = _ops([lowered.loss])
        covered["vjp"] |= forward
        covered["jvp"] |= forward
        if case.model is not None:
            covered["lowering"] |= _classes(case.model()["loss"])
        if isinstance(case, Case) and case.unsupported:
            continue
        grads, _ = vjp([(lowered.loss, const(1, SCALAR))], [node for _, node in _differentiable(lowered)])
        covered["evaluate" if isinstance(case, Case) else "jvp"] |= _ops(grads)
        if isinstance(case, Case):
            covered["evaluate"] |= forward
    return covered


def _missing_cases(records) -> list[str]:
    covered, missing = _covered(), []
    for record in records:
        if record.name in KERNEL_ONLY or record.name in TRANSIENT:
            continue
        missing += [f"{record.name}: {rule}" for rule in ("vjp", "jvp", "evaluate")
                    if getattr(record, rule) is not None and record.name not in covered[rule]]
        if not any(getattr(record, rule) is not None for rule in ("vjp", "jvp", "evaluate")):
            if not record.lowering:
                missing.append(f"{record.name}: no rule to check (add it to KERNEL_ONLY with a case)")
            elif not any(cls in covered["lowering"] for cls, _ in record.lowering):
                missing.append(f"{record.name}: lowering")
    return missing


def test_every_registered_op_has_a_case():
    """Driven by the registry: an op registered without a case here, for its
    VJP, its JVP, its interpreter or (an op that is only lowered: grad, jvp)
    its lowering, fails with its name and the rule."""
    records = registry.records()
    assert _missing_cases(records) == []
    names = [c.name for c in [*CASES, *LOOP_CASES]]
    assert len(set(names)) == len(names)  # a case's id names its model (op_<id>): one module each
    assert len(records) >= 49  # the registry is read, not an empty list


def test_an_op_without_a_case_is_named():
    """The check above can fail: an op it has never seen, with every rule."""
    rule = registry.record("map")
    fake = registry.OpRecord("no_such_op", vjp=rule.vjp, jvp=rule.jvp, evaluate=rule.evaluate)
    assert _missing_cases([fake]) == ["no_such_op: vjp", "no_such_op: jvp", "no_such_op: evaluate"]
    assert _missing_cases([registry.OpRecord("bare_op")]) == ["bare_op: no rule to check (add it to KERNEL_ONLY with a case)"]


@pytest.mark.parametrize("op", sorted(KERNEL_ONLY))
def test_kernel_only_ops_are_in_a_compiled_case(op):
    case_name, line = KERNEL_ONLY[op]
    case = next(c for c in LOOP_CASES if c.name == case_name)
    assert line in sbp.compile(case.build()).source


@pytest.mark.parametrize("op", sorted(TRANSIENT))
def test_transient_ops_are_built_and_consumed_by_a_loop_vjp(op):
    case = next(c for c in LOOP_CASES if c.name == TRANSIENT[op])
    lowered = lower(case.build())
    built, original = [], node_module._node

    def spy(name, *args):
        built.append(name)
        return original(name, *args)

    with mock.patch.object(node_module, "_node", spy):
        grads, _ = vjp([(lowered.loss, const(1, SCALAR))], [node for _, node in _differentiable(lowered)])
    assert op in built and op not in _ops(grads)
    node = node_module.op_node(op, (lowered.loss,), SCALAR, ("final", 0))
    with pytest.raises(AssertionError, match="never differentiated"):
        registry.rule(op, "vjp")(node, lowered.loss, [True])
    with pytest.raises(AssertionError, match="never differentiated"):
        registry.rule(op, "jvp")(node, [lowered.loss])
