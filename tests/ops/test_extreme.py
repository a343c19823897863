"""The derivatives of max and min (ops/extreme.py), compiled: ties share
the adjoint evenly (as torch.amin and torch.amax), a NaN makes its row's
derivatives NaN, and an extreme of a map over pairs (k-means' cost) adds
the body's derivative at each row's extreme pair through an index, and
at every tied pair of a row with ties. Checked against PyTorch float64
(its gradient and its double backward) and closed forms, on data drawn
with many ties."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn

N, K = sp.symbols("N K", integer=True, positive=True)


def _torch_grad_and_hvp(loss_of, arrays: dict, directions: dict) -> tuple[dict, dict]:
    """PyTorch's gradient of loss_of(**tensors) and its Hessian times the directions (double backward)."""
    torch = pytest.importorskip("torch")
    tensors = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in arrays.items()}
    grads = torch.autograd.grad(loss_of(torch, **tensors), list(tensors.values()), create_graph=True)
    product = sum((g * torch.tensor(directions[name])).sum() for name, g in zip(tensors, grads))
    hvps = torch.autograd.grad(product, list(tensors.values()))
    return ({name: g.detach().numpy() for name, g in zip(tensors, grads)},
            {name: h.numpy() for name, h in zip(tensors, hvps)})


def _check(mod, arrays: dict, loss_of) -> None:
    rng = np.random.default_rng(5)
    directions = {name: rng.standard_normal(value.shape) for name, value in arrays.items()}
    want_grads, want_hvps = _torch_grad_and_hvp(loss_of, arrays, directions)
    _, grads, hvps = mod.value_grad_and_hvp(directions, **arrays)
    for name in arrays:
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-12, atol=1e-13, err_msg=name)
        np.testing.assert_allclose(hvps[name], want_hvps[name], rtol=1e-12, atol=1e-13, err_msg=name)


def _extreme(torch, op: str):
    return torch.amin if op == "min" else torch.amax


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("axis", [0, 1])
def test_ties_of_a_matrix_share_the_gradient_as_torch(op, axis):
    """Entries of 0, 1 and 2: most rows (columns) have ties, some of all their entries."""
    Z = sp.MatrixSymbol("Z", N, 4)
    loss = nn.sum_all(sbp.reduce(op, Z, axis).applyfunc(lambda t: sp.sin(t) * t))
    mod = sbp.compile(sbp.Model(f"ties_{op}{axis}", params=[Z], loss=loss))
    values = np.random.default_rng(axis).integers(0, 3, size=(9, 4)).astype(float)
    values[2] = 1.0  # a row of ties only
    _check(mod, {"Z": values},
           lambda torch, Z: (lambda m: (torch.sin(m) * m).sum())(_extreme(torch, op)(Z, dim=axis)))


@pytest.mark.parametrize("op", ["min", "max"])
def test_an_extreme_of_every_entry_splits_ties_at_each_level(op):
    """sbp.reduce(op, Z) is the extreme of the rows' extremes: a row's share
    is split among the rows that tie, then among that row's tied entries."""
    Z = sp.MatrixSymbol("Z", 3, 3)
    mod = sbp.compile(sbp.Model(f"whole_{op}", params=[Z], loss=sbp.reduce(op, Z)))
    values = np.array([[1.0, 1.0, 3.0], [1.0, 4.0, 2.0], [5.0, 5.0, 5.0]])
    if op == "max":
        values = -values + 6.0  # the same ties, now the largest
    _, grads = mod.value_and_grad(Z=values)
    want = np.array([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(grads["Z"], want)


def _pairs_model(name: str, op: str, axis: int, width: int = 3) -> sbp.Model:
    P, C = sp.MatrixSymbol("P", N, width), sp.MatrixSymbol("C", K, width)
    p = sp.Matrix(sp.symbols(f"p0:{width}", real=True))
    c = sp.Matrix(sp.symbols(f"c0:{width}", real=True))
    dist = sbp.map_examples(sum((p[f] - c[f]) ** 2 for f in range(width)), [(p, P), (c, C)])
    loss = nn.sum_all(sbp.reduce(op, dist, axis).applyfunc(sp.sin))
    return sbp.Model(name, params=[P, C], loss=loss)


def _pairs_loss(op: str, axis: int):
    def loss(torch, P, C):
        dist = ((P[:, None, :] - C[None, :, :]) ** 2).sum(-1)
        return torch.sin(_extreme(torch, op)(dist, dim=axis)).sum()
    return loss


@pytest.mark.parametrize("op, axis", [("min", 1), ("max", 0), ("min", 0)])
def test_an_extreme_of_pairs_with_ties_matches_torch(op, axis):
    """k-means' cost with centroids repeated (rows of three equal pairs and
    two) and a point repeated: the rows with ties take the guarded loop over
    the pairs, the others the gathered extreme pair."""
    rng = np.random.default_rng(11)
    P, C = rng.random((13, 3)), rng.random((6, 3))
    C[3] = C[1]
    C[4] = C[1]  # three equal centroids
    C[5] = C[2]  # two
    P[7] = P[0]  # two equal points (ties down the columns)
    mod = sbp.compile(_pairs_model(f"pair_ties_{op}{axis}", op, axis))
    _check(mod, {"P": P, "C": C}, _pairs_loss(op, axis))


def test_an_extreme_of_pairs_without_ties_is_the_closed_form_and_skips_the_pairs():
    """k-means: the gradient 2 (count c - sum of its points) and the
    Hessian's diagonal 2 count, from one derivative a point; the loop over
    the pairs is guarded (no row has ties, so it adds nothing)."""
    P, C = sp.MatrixSymbol("P", N, 4), sp.MatrixSymbol("C", K, 4)
    p, c = sp.Matrix(sp.symbols("p0:4", real=True)), sp.Matrix(sp.symbols("c0:4", real=True))
    dist = sbp.map_examples(sum((p[f] - c[f]) ** 2 for f in range(4)), [(p, P), (c, C)])
    model = sbp.Model("pair_closed_form", inputs=[P], params=[C], loss=nn.sum_all(sbp.reduce("min", dist, 1)))
    mod = sbp.compile(model, functions=("forward", "value_and_grad", "hvp"))
    assert "continue; /* its guard" in mod.source
    assert "*const target0 = &" in mod.source  # the scatter-add through a pointer to the row (emap_c._stores)
    rng = np.random.default_rng(3)
    points, centroids = rng.random((50, 4)), rng.random((7, 4))
    near = ((points[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)
    count = np.bincount(near, minlength=7)[:, None]
    sums = np.zeros((7, 4))
    np.add.at(sums, near, points)
    v = rng.standard_normal((7, 4))
    _, grads, hv = mod.value_grad_and_hvp({"C": v}, P=points, C=centroids)
    np.testing.assert_allclose(grads["C"], 2 * (count * centroids - sums), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(hv["C"], 2 * count * v, rtol=1e-14)


@pytest.mark.parametrize("where", ["P", "C"])
def test_a_nan_makes_every_gradient_of_its_rows_nan(where):
    """As before the index path (the mask of equal entries was NaN in a row
    with a NaN): a NaN point makes its row's extreme NaN and so every
    centroid's gradient; a NaN centroid, every row's."""
    mod = sbp.compile(_pairs_model("pair_nan", "min", 1))
    rng = np.random.default_rng(2)
    arrays = {"P": rng.random((6, 3)), "C": rng.random((4, 3))}
    arrays[where][1, 2] = np.nan
    loss, grads = mod.value_and_grad(**arrays)
    assert np.isnan(loss)
    assert np.isnan(grads["C"]).all()
    assert np.isnan(grads["P"][1]).all()
    assert np.isnan(grads["P"]).all() == (where == "C")  # a NaN point leaves the other points' gradients


def test_an_extreme_of_pairs_in_float32_matches_float64():
    """The index of each row's extreme is a float32 number there (exact
    below 2**24 columns): the gradient with ties matches float64's."""
    rng = np.random.default_rng(4)
    P, C = rng.integers(0, 4, size=(20, 3)).astype(float) / 4, rng.integers(0, 4, size=(9, 3)).astype(float) / 4
    C[5] = C[2]  # ties, exact in both precisions (quarters)
    model = _pairs_model("pair_f32", "min", 1)
    _, want = sbp.compile(model).value_and_grad(P=P, C=C)
    _, got = sbp.compile(model, dtype="float32").value_and_grad(P=P.astype(np.float32), C=C.astype(np.float32))
    for name in ("P", "C"):
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("length", [5, 70])  # the scalar helper, and the vector one (64 and more)
def test_an_extreme_is_numpys_and_nan_wherever_a_row_has_one(op, length):
    Z = sp.MatrixSymbol("Z", N, length)
    mod = sbp.compile(sbp.Model(f"extreme_{op}_{length}", params=[Z], loss=nn.sum_all(Z),
                                outputs={"m": sbp.reduce(op, Z, 1)}))
    values = np.random.default_rng(length).standard_normal((6, length))
    values[1, 0] = values[2, length // 2] = values[3, -1] = np.nan
    got = mod.forward(Z=values)["m"]
    np.testing.assert_array_equal(got, getattr(np, op)(values, axis=1, keepdims=True))
    assert np.isnan(got[1:4]).all() and not np.isnan(got[[0, 4, 5]]).any()


def _shares(dist: np.ndarray, axis: int, op: str) -> np.ndarray:
    """numpy's hit / count of each row's (axis 1) or column's extreme: ties
    share evenly; a row (column) with a NaN is NaN throughout."""
    extreme = getattr(np, op)(dist, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        hit = (dist == extreme).astype(float)
        nan = np.isnan(dist).any(axis=axis, keepdims=True)
        return np.where(nan, np.nan, hit / hit.sum(axis=axis, keepdims=True))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op, axis", [("min", 1), ("max", 0)])
@pytest.mark.parametrize("rows, length", [(77, 5), (77, 11), (9, 70), (70, 70)])
@pytest.mark.parametrize("nan", [False, True])
def test_many_short_rows_eight_at_a_time_match_numpy(dtype, op, axis, rows, length, nan):
    """Short rows (fewer than 64 entries) go eight at a time, one in each
    lane of a vector (reduce.c.j2's _rows helpers), in blocks of 64 rows:
    77 rows are a block, a second of eight and five more one at a time;
    70 entries take the helper a row. The extreme, the ties' position or
    count (through the gradient of k-means' cost, the rows with one
    extreme through the index, with ties through the guarded loop) and a
    NaN's row (column) in a lane, against numpy."""
    width = 3
    mod = sbp.compile(_pairs_model(f"rows_{op}{axis}_{rows}_{length}", op, axis, width), dtype=dtype)
    rng = np.random.default_rng(rows + length)
    n, k = (rows, length) if axis == 1 else (length, rows)
    P = rng.integers(0, 3, size=(n, width)).astype(dtype) / 2  # halves: many exact ties
    C = rng.integers(0, 3, size=(k, width)).astype(dtype) / 2
    if nan:  # one row of the distances (a point), or one column (a centroid), in a lane of the first eight
        (P if axis == 1 else C)[3, 1] = np.nan
    loss, grads = mod.value_and_grad(P=P, C=C)
    P64, C64 = P.astype(float), C.astype(float)
    diff = P64[:, None, :] - C64[None, :, :]
    dist = (diff ** 2).sum(-1)
    share = _shares(dist, axis, op)
    with np.errstate(invalid="ignore"):
        extreme = getattr(np, op)(dist, axis=axis)
        g = np.cos(extreme)
        weight = share * (g[:, None] if axis == 1 else g[None, :])  # d loss / d dist
        want_P = 2 * (weight[:, :, None] * diff).sum(1)
        want_C = -2 * (weight[:, :, None] * diff).sum(0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 1e-12, "atol": 1e-12}
    assert np.isnan(loss) == nan
    np.testing.assert_allclose(loss, np.sin(extreme).sum(), **tol)
    np.testing.assert_allclose(grads["P"], want_P, **tol)
    np.testing.assert_allclose(grads["C"], want_C, **tol)
    assert np.isnan(grads["P"]).any() == nan


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("axis", [0, 1])
def test_an_extreme_of_many_rows_is_numpys(dtype, op, axis):
    """The extreme alone (reduce.c.j2's _rows helpers): 37 rows of 20
    entries, or 20 columns of 37, eight at a time and the rest one at a
    time, with NaNs in some rows and columns (in lanes and in the rest)
    and infinities, against numpy."""
    Z = sp.MatrixSymbol("Z", N, 20)
    mod = sbp.compile(sbp.Model(f"many_{op}{axis}", params=[Z], loss=nn.sum_all(Z),
                                outputs={"m": sbp.reduce(op, Z, axis)}), dtype=dtype)
    values = np.random.default_rng(axis).standard_normal((37, 20)).astype(dtype)
    values[3, 0] = values[20, 5] = values[36, 19] = np.nan
    values[10, 1], values[11, 4] = np.inf, -np.inf
    got = mod.forward(Z=values)["m"]
    want = getattr(np, op)(values, axis=axis, keepdims=True)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(want).sum() == 3
