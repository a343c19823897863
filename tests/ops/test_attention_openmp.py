"""A transformer block built with OpenMP (BuildOptions(openmp=True)): the
attention ops run their sequences on several threads and the
large products are split in fixed blocks of rows across them, so the loss
and gradients are bit for bit the same on 1 and 2 threads, and both match
PyTorch autograd in float64. The shapes are large enough to take every
threaded path (the attention loops' and the products' run-time thresholds)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from test_attention import BUILDS, _block, _close, _torch_block
from test_conv_openmp import _gomp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.toolchain.blas import blas_threads
from symbackprop.toolchain.builder import BuildOptions

torch = pytest.importorskip("torch")

m = sp.Symbol("m", integer=True, positive=True)


def _model_and_data(vocab: int, length: int, d: int, heads: int, rows: int):
    ids, positions, targets = sbp.Index("ids", m), sbp.Index("positions", m), sp.MatrixSymbol("T", m, vocab)
    shapes = {"E": (vocab, d), "P": (length, d), "Wq": (d, d), "Wk": (d, d), "Wv": (d, d), "Wo": (d, d),
              "g1": (1, d), "b1": (1, d), "g2": (1, d), "b2": (1, d), "W1": (d, 4 * d), "c1": (1, 4 * d),
              "W2": (4 * d, d), "c2": (1, d), "H": (d, vocab)}
    p = {name: sp.MatrixSymbol(name, *shape) for name, shape in shapes.items()}
    x = nn.add_positions(nn.embedding(p["E"], ids, length), p["P"], positions)
    model = sbp.Model("threaded_block", inputs=[ids, positions, targets], params=list(p.values()),
                      loss=nn.softmax_cross_entropy(_block(x, p, heads).matrix * p["H"], targets))
    rng = np.random.default_rng(16)
    tokens = rng.integers(0, vocab, rows)
    arrays = {name: rng.standard_normal(shape) / np.sqrt(shape[0]) for name, shape in shapes.items()}
    sequences = -(-rows // length)  # the last one shorter
    arrays.update(ids=tokens, positions=sbp.position_ids(sequences, length)[:rows],
                  T=np.eye(vocab)[np.roll(tokens, -1)])
    return model, arrays, list(shapes)


@BUILDS
def test_one_and_two_threads_give_identical_gradients_that_match_torch(blas):
    """1100 positions: 68 sequences of 16 and a last one of 12, 4 heads of 8
    columns, a gelu MLP of 128: each attention op's sequences and every product
    of at least 2^20 multiply-adds take the threaded path."""
    gomp = _gomp()
    vocab, length, d, heads, rows = 7, 16, 32, 4, 1100
    model, arrays, wrt = _model_and_data(vocab, length, d, heads, rows)
    mod = sbp.compile(model, options=BuildOptions(blas=blas, openmp=True))
    assert "SYMBACKPROP_PARALLEL_EACH_IF(m >= " in mod.source
    if blas:  # the products are split across OpenMP's threads: the BLAS's own threads stay at one
        assert blas_threads() == 1
    results = {}
    try:
        for threads in (1, 2):
            gomp.omp_set_num_threads(threads)
            results[threads] = mod.value_and_grad(**arrays)
    finally:
        gomp.omp_set_num_threads(1)
    (loss1, grads1), (loss2, grads2) = results[1], results[2]
    assert loss1 == loss2
    for name in wrt:
        assert np.array_equal(grads1[name], grads2[name]), name

    tensors = {k: torch.tensor(a, requires_grad=a.dtype == np.float64) for k, a in arrays.items()}
    x = tensors["E"][tensors["ids"]] + tensors["P"][tensors["positions"]]
    logits = _torch_block(x, tensors, length, heads) @ tensors["H"]
    want = -(tensors["T"] * torch.log_softmax(logits, dim=1)).sum() / rows
    want.backward()
    assert loss2 == pytest.approx(want.item(), rel=1e-10)
    for name in wrt:
        _close(grads2[name], tensors[name].grad, f"d loss / d {name}")
