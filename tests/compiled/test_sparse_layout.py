"""sparse_layout: the compiled per-example Jacobian's values, placed by the
layout, equal the whole Jacobian by dense central differences."""

import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.errors import ArgumentError, ModelError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _dense(vals, rows, cols, shape):
    J = np.zeros(shape)
    np.add.at(J, (rows, cols), vals)  # repeated pairs add, as COO does
    return J


def _central(f, flat, eps=1e-6):
    cols = []
    for k in range(flat.size):
        up, down = flat.copy(), flat.copy()
        up[k] += eps
        down[k] -= eps
        cols.append((f(up) - f(down)) / (2 * eps))
    return np.stack(cols, axis=1)


def test_bundle_adjustment_jacobian_matches_dense_differences():
    from benchmarks.gradbench import ba

    rng = np.random.default_rng(5)
    n, m, p = 3, 4, 9
    cams = np.concatenate([0.2 * rng.standard_normal((n, 3)), rng.standard_normal((n, 3)), 400 + rng.random((n, 1)),
                           rng.standard_normal((n, 2)), 1e-3 * rng.standard_normal((n, 2))], axis=1)
    data = {"cams": cams, "X": rng.standard_normal((m, 3)) + [0, 0, 10], "w": 1 + 0.1 * rng.standard_normal(p),
            "feats": rng.standard_normal((p, 2)), "cam": rng.integers(0, n, p), "pt": rng.integers(0, m, p)}
    residual, c, X, w = ba._declare()
    mod = sbp.compile(ba.build_models({})["derivative"], functions=("forward",))
    arrays = ba._arrays(data)
    vals = mod.forward(**arrays)["J"].ravel()
    rows, cols, shape = sbp.sparse_layout(residual, c, X, w).coo(arrays)
    assert shape == (2 * p, 11 * n + 3 * m + p) and len(rows) == len(cols) == vals.size == 30 * p

    def flat_residual(z):
        C, P, W = z[:11 * n].reshape(n, 11), z[11 * n:11 * n + 3 * m].reshape(m, 3), z[11 * n + 3 * m:]
        return ba.residual_rows(C[data["cam"]], P[data["pt"]], W, data["feats"]).ravel()

    want = _central(flat_residual, np.concatenate([cams.ravel(), data["X"].ravel(), data["w"]]))
    got = _dense(vals, rows, cols, shape)
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
    assert np.count_nonzero(want) <= vals.size  # the pattern holds every nonzero
    indptr, indices, _ = sbp.sparse_layout(residual, c, X, w).csr(arrays)
    np.testing.assert_array_equal(indices, cols)
    np.testing.assert_array_equal(np.repeat(np.arange(shape[0]), np.diff(indptr)), rows)


def test_shared_own_and_twice_gathered_rows():
    N, K = sp.symbols("N K", integer=True, positive=True)
    A, B, s = sp.MatrixSymbol("A", K, 2), sp.MatrixSymbol("B", N, 1), sp.MatrixSymbol("s", 1, 2)
    i, j = sbp.Index("i", N), sbp.Index("j", N)
    a, a2, b, t = sp.symbols("a0:2"), sp.symbols("e0:2"), sp.Symbol("b"), sp.symbols("t0:2")
    body = sp.Matrix([a[0] * a2[1] + sp.sin(b) * t[0], a[1] ** 2 * t[1] - a2[0] * b])
    f = sbp.map_examples(body, [(a, sbp.gather(A, i)), (a2, sbp.gather(A, j)), (b, B), (t, s)])
    model = sbp.Model("sparse_layout_mix", inputs=[i, j], params=[A, B, s], outputs={"J": f.jacobian(a, a2, b, t)})
    mod = sbp.compile(model, functions=("forward",))
    rng = np.random.default_rng(2)
    arrays = {"A": rng.standard_normal((3, 2)), "B": rng.standard_normal((5, 1)), "s": rng.standard_normal((1, 2)),
              "i": np.array([0, 2, 1, 2, 0]), "j": np.array([2, 2, 0, 1, 0])}
    layout = sbp.sparse_layout(f, a, a2, b, t)
    assert layout.arrays == ("A", "B", "s")
    rows, cols, shape = layout.coo(arrays)

    def flat(z):
        A_, B_, s_ = z[:6].reshape(3, 2), z[6:11].reshape(5, 1), z[11:].reshape(1, 2)
        x, y, u = A_[arrays["i"]], A_[arrays["j"]], B_[:, 0]
        return np.stack([x[:, 0] * y[:, 1] + np.sin(u) * s_[0, 0], x[:, 1] ** 2 * s_[0, 1] - y[:, 0] * u], 1).ravel()

    want = _central(flat, np.concatenate([arrays[k].ravel() for k in ("A", "B", "s")]))
    got = _dense(mod.forward(**arrays)["J"].ravel(), rows, cols, shape)
    np.testing.assert_allclose(got, want, atol=1e-8)


def test_what_a_layout_refuses():
    N = sp.Symbol("N", integer=True, positive=True)
    A, i = sp.MatrixSymbol("A", N, 1), sbp.Index("i", N)
    x, y = sp.Symbol("x"), sp.Symbol("y")
    f = sbp.map_examples(x * y, [(x, sbp.gather(A, i)), (y, 2 * A)])
    with pytest.raises(ModelError, match="not a key"):
        sbp.sparse_layout(f, sp.Symbol("z"))
    with pytest.raises(ModelError, match="entries of arrays"):
        sbp.sparse_layout(f, y)
    layout = sbp.sparse_layout(f, x)
    with pytest.raises(ArgumentError, match="outside"):
        layout.coo({"A": np.ones((2, 1)), "i": np.array([0, 2])})
    with pytest.raises(ArgumentError, match="'i'"):
        layout.coo({"A": np.ones((2, 1))})
