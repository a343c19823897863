"""Sums over examples of many products of two per-example values (a
Cholesky factor's gradient in a GMM) are one matrix product after the loop
(ops/emap_kernel.py OuterProductSums), not an accumulator each in the loop: checked
against closed forms in numpy, at counts of examples that are and are not
whole eights, and against central differences on GradBench's gmm port."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.ops.emap_group import OUTER_SUMS_MIN, _sides

D = 9  # 9 x 9 = 81 sums of products: over OUTER_SUMS_MIN


def _compile(name: str, x, w, term, width: int):
    """loss = sum over (example i of X, row j of W) of term(x_i, w_j)."""
    N, K = sp.symbols("N K", integer=True, positive=True)
    X = sp.MatrixSymbol("X", N, len(x))
    W = sp.MatrixSymbol("W", K, width)
    terms = sbp.map_examples(term, [(sp.Matrix(x), X), (sp.Matrix(w), W)])  # N x K
    model = sbp.Model(name, inputs=[X], params=[W], loss=sbp.reduce("sum", sbp.reduce("sum", terms, 1), 0))
    return sbp.compile(model, functions=("forward", "value_and_grad"))


@pytest.fixture(scope="module")
def whitened():
    """log(1 + |z|^2 / 2), z = M_j^T x_i (M_j: row j of W as D x D): the
    gradient of M_j[a, b] is the sum over i of x_a z_b / (1 + |z|^2 / 2),
    a GMM's shape (its centred x times its whitened z)."""
    x = sp.symbols(f"x0:{D}", real=True)
    w = sp.symbols(f"w0:{D * D}", real=True)
    z = [sum(w[a * D + b] * x[a] for a in range(D)) for b in range(D)]
    return _compile("product_sums_whitened", x, w, sp.log(1 + sum(v**2 for v in z) / 2), D * D)


@pytest.fixture(scope="module")
def shared():
    """z^2 / 2, z = sum_p w_p u_a v_b over every pair (a, b) of the first
    and last D columns: the gradient of w_p is the sum of z u_a v_b, where
    u_a v_b is a value the forward pass computed already (so 81 x 1)."""
    x = sp.symbols(f"x0:{2 * D}", real=True)
    w = sp.symbols(f"w0:{D * D}", real=True)
    z = sum(w[a * D + b] * x[a] * x[D + b] for a in range(D) for b in range(D))
    return _compile("product_sums_shared", x, w, z**2 / 2, D * D)


def _whitened_closed_form(X, W):
    M = W.reshape(len(W), D, D)  # M[j, a, b]
    Z = np.einsum("ia,jab->ijb", X, M)
    scale = 1 + 0.5 * np.sum(Z**2, axis=2)  # N x K
    return np.sum(np.log(scale)), np.einsum("ia,ijb->jab", X, Z / scale[:, :, None]).reshape(W.shape)


def _shared_closed_form(X, W):
    F = np.einsum("ia,ib->iab", X[:, :D], X[:, D:]).reshape(len(X), D * D)
    Z = F @ W.T
    return 0.5 * np.sum(Z**2), Z.T @ F


def test_the_sums_are_one_product_after_the_loop(whitened, shared):
    for mod in (whitened, shared):
        source = mod.emitted.source
        assert "left_factors" in source and "right_factors" in source
        assert "_outer_product_sums(" in source.split("right_factors", 1)[1]
    def flat(source: str) -> str:  # a long call is one argument a line (emit/wrap.py): as one line
        return re.sub(r",\n\s+", ", ", re.sub(r"\(\n\s+", "(", source))

    assert "_outer_product_sums(9, 9, N," in flat(whitened.emitted.source)  # x's by z's
    assert "_outer_product_sums(81, 1, N," in flat(shared.emitted.source)  # the forward's products by z
    # the product's 81 sums add into W's row in one loop (ADD_LOOP_MIN), and
    # X's 18 columns are copied in one
    for mod in (whitened, shared):
        assert "grad_W[81*j + k] += outer_sums[k];" in mod.emitted.source
        assert "grad_W[81*j + 1] +=" not in mod.emitted.source
    assert "X_by_column[i + N*k] = X[18*i + k];" in shared.emitted.source


T = 11  # a T x T triangle: 66 sums, over OUTER_SUMS_MIN


def _triangular_pairs() -> list[tuple[int, int]]:
    """(row, column) of a T x T lower triangle, column by column (GradBench gmm's order)."""
    return [(a, b) for b in range(T) for a in range(b, T)]


def triangular_model() -> sbp.Model:
    """log(1 + |z|^2 / 2), z = L_j^T x_i, L_j lower triangular (row j of
    a parameter named picks, the name of the C's table): its 66 sums are
    66 of the product's 121, added in from a table of where each is."""
    pairs = _triangular_pairs()
    x = sp.symbols(f"x0:{T}", real=True)
    w = sp.symbols(f"w0:{len(pairs)}", real=True)
    z = [sum(w[p] * x[a] for p, (a, b) in enumerate(pairs) if b == col) for col in range(T)]
    N, K = sp.symbols("N K", integer=True, positive=True)
    X, W = sp.MatrixSymbol("X", N, T), sp.MatrixSymbol("picks", K, len(pairs))
    terms = sbp.map_examples(sp.log(1 + sum(v**2 for v in z) / 2), [(sp.Matrix(x), X), (sp.Matrix(w), W)])
    return sbp.Model("product_sums_triangular", inputs=[X], params=[W],
                     loss=sbp.reduce("sum", sbp.reduce("sum", terms, 1), 0))


@pytest.fixture(scope="module")
def triangular():
    return sbp.compile(triangular_model(), functions=("forward", "value_and_grad"))


@pytest.mark.parametrize("n", [1, 8, 13])
def test_sums_of_a_triangle_add_in_from_a_table(triangular, n):
    """The table is the C's own (the user's `picks` renamed; the sum of
    the last entry, a square, keeps its own line), and the
    gradient is the closed form's: sum over i of x_a z_b / (1 + |z|^2 / 2)
    for each a >= b."""
    source = triangular.emitted.source
    assert re.search(r"static const int32_t picks\[6[0-9]\] = \{", source)
    assert "grad_picks[66*j + k] += outer_sums[picks[k]];" in source
    assert "*picks_," in source  # the parameter's name in the C
    rng = np.random.default_rng(n)
    X, W = rng.normal(size=(n, T)), rng.normal(size=(3, 66)) / T
    rows, cols = np.array(_triangular_pairs()).T
    L = np.zeros((3, T, T))
    L[:, rows, cols] = W
    Z = np.einsum("ia,jab->ijb", X, L)
    scale = 1 + 0.5 * np.sum(Z**2, axis=2)
    grad = np.einsum("ia,ijb->jab", X, Z / scale[:, :, None])[:, rows, cols]
    loss, got = triangular.value_and_grad(X=X, picks=W)
    np.testing.assert_allclose(float(np.ravel(loss)[0]), np.sum(np.log(scale)), rtol=1e-12)
    (got_grad,) = got.values()
    np.testing.assert_allclose(got_grad, grad, rtol=1e-11, atol=1e-12 * np.abs(grad).max())


def test_few_sums_stay_in_the_loop():
    x = sp.symbols("x0:4", real=True)
    w = sp.symbols("w0:16", real=True)
    z = [sum(w[a * 4 + b] * x[a] for a in range(4)) for b in range(4)]
    mod = _compile("product_sums_few", x, w, sp.log(1 + sum(v**2 for v in z) / 2), 16)
    assert OUTER_SUMS_MIN > 16 and "left_factors" not in mod.emitted.source


def test_the_sides_of_the_pairs():
    a, b, c, d = sp.symbols("a b c d")
    assert _sides([(a, b), (a, d), (c, b)]) == ([a, c], [b, d])
    # a square (a, a) or a triangle of pairs has no two sides: all on both
    assert _sides([(a, b), (a, a)]) == ([a, b], [a, b])
    assert _sides([(a, b), (b, c), (c, a)]) == ([a, b, c], [a, b, c])


@pytest.mark.parametrize("n", [1, 7, 8, 13])
@pytest.mark.parametrize("case", ["whitened", "shared"])
def test_the_product_sums_give_the_closed_form(request, case, n):
    mod = request.getfixturevalue(case)
    rng = np.random.default_rng(n)
    X = rng.normal(size=(n, D if case == "whitened" else 2 * D))
    W = rng.normal(size=(3, D * D)) / D
    loss, grad = (_whitened_closed_form if case == "whitened" else _shared_closed_form)(X, W)
    got_loss, got = mod.value_and_grad(X=X, W=W)
    np.testing.assert_allclose(float(np.ravel(got_loss)[0]), loss, rtol=1e-12)
    np.testing.assert_allclose(got["W"], grad, rtol=1e-11, atol=1e-12 * np.abs(grad).max())
    np.testing.assert_allclose(float(np.ravel(mod.forward(X=X, W=W)["loss"])[0]), loss, rtol=1e-12)


@pytest.mark.parametrize("n", [3, 5, 16, 19])  # fewer than eight, a whole eight or not
def test_gmm_with_a_factor_of_twelve_dimensions_matches_differences(n):
    from benchmarks.gradbench import gmm
    from benchmarks.gradbench._common import sbp_compile

    size = {"d": 12, "k": 3, "n": n}  # 66 entries below the diagonal
    mod = sbp_compile(gmm, size)
    assert "left_factors" in mod.emitted.source
    assert "rows8" in mod.emitted.source and "SYMBACKPROP_SCALAR_TAIL" not in mod.emitted.source  # whole eights
    data = gmm.generate(size)
    value, derivative = gmm.sbp_calls(mod, data)
    np.testing.assert_allclose(value()["value"], gmm.objective(data), rtol=1e-12)
    assert gmm.fd_error(data, derivative()) < 1e-7
