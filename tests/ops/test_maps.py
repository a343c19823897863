"""Per-example maps with gathers, reductions over an axis: values against
numpy, gradients against central differences, closed forms and PyTorch."""

import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from oracles import bundle_adjustment_residuals, central_differences, relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ArgumentError, ModelError

N, C, K = sp.symbols("N C K", integer=True, positive=True)
P = sp.MatrixSymbol("P", C, 2)
X = sp.MatrixSymbol("X", N, 2)
idx = sbp.Index("idx", N)
a = sp.Matrix(sp.symbols("a0:2", real=True))
x = sp.Matrix(sp.symbols("x0:2", real=True))


def gathered_model():
    body = sp.Matrix([sp.sin(a[0] * x[0]) + a[1] ** 2 * x[1], sp.exp(a[1]) - x[0]])
    R = sbp.map_examples(body, [(a, sbp.gather(P, idx)), (x, X)])
    return sbp.Model("gathered", inputs=[X, idx], params=[P], loss=nn.sum_all(sp.HadamardPower(R, 2)), outputs={"R": R})


def gathered_numpy(d):
    A, Xv = d["P"][d["idx"]], d["X"]
    R = np.stack([np.sin(A[:, 0] * Xv[:, 0]) + A[:, 1] ** 2 * Xv[:, 1], np.exp(A[:, 1]) - Xv[:, 0]], axis=1)
    return float((R**2).sum()), R


@pytest.fixture(scope="module")
def gathered():
    return sbp.compile(gathered_model(), functions=("forward", "value_and_grad", "hvp"))


def gathered_data(rng, rows=9, choices=4):
    return {"X": rng.standard_normal((rows, 2)), "idx": rng.integers(0, choices, rows), "P": rng.standard_normal((choices, 2))}


def test_a_gathered_map_matches_numpy_and_finite_differences(gathered):
    d = gathered_data(np.random.default_rng(0))
    d["idx"][:3] = 1  # a row chosen several times gets every share of the gradient
    out = gathered.forward(**d)
    loss, R = gathered_numpy(d)
    assert out["loss"] == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(out["R"], R, rtol=1e-13)
    _, grads = gathered.value_and_grad(**d)
    expected = central_differences(lambda e: gathered_numpy(e)[0], d, "P")
    assert relative_error(grads["P"], expected) < 1e-7
    unused = sorted(set(range(4)) - set(d["idx"].tolist()))
    assert np.all(grads["P"][unused] == 0)


def test_hessian_vector_products_through_a_map(gathered):
    d = gathered_data(np.random.default_rng(1))
    v = np.random.default_rng(2).standard_normal(d["P"].shape)
    hvp = gathered.hvp({"P": v}, **d)["P"]
    h = 1e-5
    plus = gathered.value_and_grad(**{**d, "P": d["P"] + h * v})[1]["P"]
    minus = gathered.value_and_grad(**{**d, "P": d["P"] - h * v})[1]["P"]
    assert relative_error(hvp, (plus - minus) / (2 * h)) < 1e-6


def test_the_index_may_be_one_dimensional_or_a_column_of_any_integer_type(gathered):
    d = gathered_data(np.random.default_rng(3))
    reference = gathered.forward(**d)["loss"]
    for index in (d["idx"].reshape(-1, 1), d["idx"].astype(np.int32), d["idx"].tolist()):
        assert gathered.forward(**{**d, "idx": index})["loss"] == reference


@pytest.mark.parametrize("bad", [4, -1])
def test_an_index_outside_the_rows_is_refused_by_name(gathered, bad):
    d = gathered_data(np.random.default_rng(4))
    d["idx"][5] = bad
    with pytest.raises(ArgumentError, match=rf"idx holds the row number {bad}, outside the 4 rows \(C\)"):
        gathered.value_and_grad(**d)


def test_an_index_of_floats_is_refused(gathered):
    d = gathered_data(np.random.default_rng(5))
    with pytest.raises(ArgumentError, match="idx is an Index: an array of integer row numbers; got dtype float64"):
        gathered.forward(**{**d, "idx": d["idx"].astype(float)})


def test_the_c_checks_the_index_too(gathered):
    """A C caller gets status 2 instead of a read outside the array."""
    d = gathered_data(np.random.default_rng(6))
    fn = gathered.function("forward")
    values, dims = fn.bind(d)
    values[[s.name for s in fn.inputs].index("idx")][2, 0] = 99
    with pytest.raises(ArgumentError, match="row number outside the array it gathers from"):
        fn.invoke(dims, values, fn.allocate(dims), fn.workspace(dims))


def test_one_index_into_two_arrays_is_checked_against_both():
    """Rows 0..3 of P but only 0..1 of Q: a 3 is refused for Q, in Python
    and in the C (each gather checks against its own array)."""
    Q = sp.MatrixSymbol("Q", K, 1)
    q = sp.Symbol("q", real=True)
    R = sbp.map_examples(a[0] * q, [(a, sbp.gather(P, idx)), (q, sbp.gather(Q, idx))])
    mod = sbp.compile(sbp.Model("two_arrays", inputs=[idx], params=[P, Q], loss=nn.sum_all(R)))
    data = {"idx": np.array([0, 1, 1]), "P": np.ones((4, 2)), "Q": np.ones((2, 1))}
    assert mod.forward(**data)["loss"] == 3.0
    data["idx"] = np.array([0, 3, 1])
    with pytest.raises(ArgumentError, match=r"idx holds the row number 3, outside the 2 rows \(K\)"):
        mod.value_and_grad(**data)
    fn = mod.function("value_and_grad")
    values, dims = fn.bind({**data, "idx": np.array([0, 1, 1])})
    values[[s.name for s in fn.inputs].index("idx")][1, 0] = 3
    with pytest.raises(ArgumentError, match="row number outside the array it gathers from"):
        fn.invoke(dims, values, fn.allocate(dims), fn.workspace(dims))


def pairs_model():
    """Every (row of X, row of M) pair: the pattern of a mixture model."""
    M = sp.MatrixSymbol("M", K, 2)
    A = sp.MatrixSymbol("A", K, 1)
    mu = sp.symbols("m0:2", real=True)
    al = sp.Symbol("al", real=True)
    body = al - ((x[0] - mu[0]) ** 2 + (x[1] - mu[1]) ** 2) / 2
    L = sbp.map_examples(body, [(x, X), (mu, M), (al, A)])
    loss = (nn.sum_all(sbp.reduce("logsumexp", L, 1)) + nn.sum_all(sbp.reduce("max", L, 0))
            + nn.sum_all(sbp.reduce("min", L, 1)) / 3 + sbp.reduce("mean", L))
    return sbp.Model("pairs", inputs=[X], params=[M, A], loss=loss, outputs={"L": L})


def pairs_numpy(d):
    L = d["A"].T - ((d["X"][:, None, :] - d["M"][None]) ** 2).sum(-1) / 2
    top = L.max(1, keepdims=True)
    lse = (top[:, 0] + np.log(np.exp(L - top).sum(1))).sum()
    return float(lse + L.max(0).sum() + L.min(1).sum() / 3 + L.mean()), L


def test_a_map_over_pairs_with_reductions_over_either_axis():
    mod = sbp.compile(pairs_model())
    rng = np.random.default_rng(7)
    d = {"X": rng.standard_normal((6, 2)), "M": rng.standard_normal((3, 2)), "A": rng.standard_normal((3, 1))}
    loss, L = pairs_numpy(d)
    out = mod.forward(**d)
    assert out["loss"] == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(out["L"], L, rtol=1e-13)
    _, grads = mod.value_and_grad(**d)
    for name in ("M", "A"):
        assert relative_error(grads[name], central_differences(lambda e: pairs_numpy(e)[0], d, name)) < 1e-7


@pytest.mark.parametrize("op", ["max", "min"])
def test_ties_share_the_gradient_of_an_extreme_evenly(op):
    """The closed form d max(z)/dz for z = (1, 3, 3): (0, 1/2, 1/2) (as JAX)."""
    z = sp.MatrixSymbol("z", 1, 3)
    mod = sbp.compile(sbp.Model(f"tie_{op}", params=[z], loss=sbp.reduce(op, z, 1)))
    value = np.array([[1.0, 3.0, 3.0]]) if op == "max" else np.array([[3.0, 1.0, 1.0]])
    loss, grads = mod.value_and_grad(z=value)
    assert loss == (3.0 if op == "max" else 1.0)
    np.testing.assert_array_equal(grads["z"], [[0.0, 0.5, 0.5]])


def test_an_extreme_propagates_nan_as_numpy():
    z = sp.MatrixSymbol("z", 4, 1)
    mod = sbp.compile(sbp.Model("nan_max", params=[z], loss=sbp.reduce("max", z, 0)))
    assert np.isnan(mod.forward(z=np.array([[1.0], [np.nan], [2.0], [0.0]]))["loss"])


def test_softmax_along_either_axis_matches_numpy():
    Z = sp.MatrixSymbol("Z", N, 3)
    T = sp.MatrixSymbol("T", N, 3)
    for axis in (0, 1):
        S = nn.softmax(Z, axis=axis)
        mod = sbp.compile(sbp.Model(f"softmax{axis}", inputs=[T], params=[Z], loss=nn.sum_all(sp.HadamardProduct(S, T)),
                                    outputs={"S": S}))
        rng = np.random.default_rng(8)
        d = {"Z": 10 * rng.standard_normal((5, 3)), "T": rng.standard_normal((5, 3))}
        e = np.exp(d["Z"] - d["Z"].max(axis=axis, keepdims=True))
        np.testing.assert_allclose(mod.forward(**d)["S"], e / e.sum(axis=axis, keepdims=True), rtol=1e-13)

        def loss(v, axis=axis):
            e = np.exp(v["Z"] - v["Z"].max(axis=axis, keepdims=True))
            return float((e / e.sum(axis=axis, keepdims=True) * v["T"]).sum())

        assert relative_error(mod.value_and_grad(**d)[1]["Z"], central_differences(loss, d, "Z")) < 1e-7


def test_a_logsumexp_of_a_million_entries_is_as_much_c_as_of_ten():
    sources = {}
    for length in (10, 10**6):
        v = sp.MatrixSymbol("v", length, 1)
        mod = sbp.compile(sbp.Model("lse_fixed", params=[v], loss=sbp.reduce("logsumexp", v, 0)))
        sources[length] = mod.source
        value = 50 * np.random.default_rng(9).standard_normal((length, 1))
        loss, grads = mod.value_and_grad(v=value)
        top = value.max()
        assert loss == pytest.approx(top + np.log(np.exp(value - top).sum()), rel=1e-13)
        np.testing.assert_allclose(grads["v"], np.exp(value - loss), rtol=1e-11, atol=1e-300)
    # the same loops; the long one is also marked for threads (OpenMP), a few lines
    lines = {length: source.count("\n") for length, source in sources.items()}
    assert abs(lines[10**6] - lines[10]) <= 8, lines


def test_per_example_jacobians_match_finite_differences_of_each_residual():
    ba = load_example("bundle_adjustment")
    mod = sbp.compile(ba.model, functions=("forward",))
    d = ba.sample_data(np.random.default_rng(10))
    jac = mod.forward(**d)["jacobian"].reshape(-1, 2, 15)
    h = 1e-6
    for i in range(len(d["cam"])):
        numeric = np.zeros((2, 15))
        for col in range(15):
            shifted = []
            for sign in (1, -1):
                e = {k: np.array(v, copy=True) for k, v in d.items()}
                if col < 11:
                    e["cams"][d["cam"][i], col] += sign * h
                elif col < 14:
                    e["pts"][d["pt"][i], col - 11] += sign * h
                else:
                    e["weights"][i, 0] += sign * h
                shifted.append(bundle_adjustment_residuals(e)[i])
            numeric[:, col] = (shifted[0] - shifted[1]) / (2 * h)
        assert relative_error(jac[i], numeric) < 1e-6, i


def test_bundle_adjustment_gradient_matches_pytorch():
    torch = pytest.importorskip("torch")
    ba = load_example("bundle_adjustment")
    d = ba.sample_data(np.random.default_rng(11))
    _, grads = sbp.compile(ba.model).value_and_grad(**d)
    cams = torch.tensor(d["cams"], requires_grad=True)
    pts = torch.tensor(d["pts"], requires_grad=True)
    c, X = cams[torch.tensor(d["cam"])], pts[torch.tensor(d["pt"])]
    rot, v = c[:, 0:3], X - c[:, 3:6]
    theta = rot.norm(dim=1, keepdim=True)
    axis = rot / theta
    p = (v * torch.cos(theta) + torch.linalg.cross(axis, v) * torch.sin(theta)
         + axis * (axis * v).sum(1, keepdim=True) * (1 - torch.cos(theta)))
    p = -p[:, :2] / p[:, 2:3]
    r_sq = (p**2).sum(1, keepdim=True)
    proj = c[:, 6:7] * (1 + c[:, 9:10] * r_sq + c[:, 10:11] * r_sq**2) * p + c[:, 7:9]
    loss = ((torch.tensor(d["weights"]) * (proj - torch.tensor(d["feats"]))) ** 2).sum()
    loss.backward()
    np.testing.assert_allclose(grads["cams"], cams.grad.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(grads["pts"], pts.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_a_map_trains_with_adam():
    poly = load_example("polynomial_fit")
    mod = sbp.compile(poly.model, functions=("forward", "value_and_grad", "train_step"), optimizer=sbp.Adam(lr=0.05))
    d = poly.sample_data(np.random.default_rng(12))
    first = mod.forward(**d)["loss"]
    for _ in range(300):
        last = mod.train_step(**d)
    assert last < 0.1 * first


def test_a_gather_alone_copies_rows_and_scatters_its_gradient():
    W = sp.MatrixSymbol("W", N, 2)
    G = sbp.gather(P, idx)
    mod = sbp.compile(sbp.Model("gather_alone", inputs=[W, idx], params=[P], loss=nn.sum_all(sp.HadamardProduct(G, W)),
                                outputs={"G": G}))
    rng = np.random.default_rng(13)
    d = {"W": rng.standard_normal((7, 2)), "idx": np.array([0, 2, 2, 1, 0, 2, 2]), "P": rng.standard_normal((3, 2))}
    np.testing.assert_array_equal(mod.forward(**d)["G"], d["P"][d["idx"]])
    expected = np.zeros_like(d["P"])
    np.add.at(expected, d["idx"], d["W"])
    np.testing.assert_allclose(mod.value_and_grad(**d)[1]["P"], expected, rtol=1e-14)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: sbp.Model("m", params=[idx], loss=sp.Integer(0)), "declare it an input, not a param"),
        (lambda: sbp.Model("m", inputs=[idx], grad_inputs=[idx], loss=sp.Integer(0)), "row numbers have no gradient"),
        (lambda: sbp.compile(sbp.Model("m", inputs=[idx, X], loss=nn.sum_all(X + idx * sp.OneMatrix(1, 2)))),
         "holds row numbers: use it only to gather"),
        (lambda: sbp.map_examples(a[0], [(a, sp.MatrixSymbol("Y", N, 3))]), "has 2 symbols but its source Y has 3 columns"),
        (lambda: sbp.map_examples(a[0] + x[0], [(a[0], sp.MatrixSymbol("u", 1, 1)), (x[0], sp.MatrixSymbol("w", 1, 1))]),
         "needs a source with a row per example"),
        (lambda: sbp.map_examples(sp.Matrix([a[0], a[1]]), [(a, X), (x, sp.MatrixSymbol("M", K, 2))]),
         "needs a scalar body"),
        (lambda: sbp.map_examples(a[0], [((a[0], a[0]), X)]), "bound twice"),
        (lambda: sbp.compile(sbp.Model("m", inputs=[X], loss=nn.sum_all(sbp.map_examples(a[0] * sp.Symbol("q"), [(a, X)])))),
         "q in the map's body is neither bound by the map nor a scalar input or param"),
        (lambda: sbp.reduce("median", X, 0), "unknown reduction 'median'"),
        (lambda: sbp.reduce("max", X, 2), "reduce over axis 0"),
    ],
)
def test_bad_declarations_say_what_is_wrong(build, message):
    with pytest.raises(ModelError, match=message):
        build()


def shared_row_model():
    """A row shared by every example (a one-row source): its gradient adds up
    over the examples in the map's own loop (eight lanes, then the rest)."""
    Xs = sp.MatrixSymbol("Xs", N, 2)
    c = sp.MatrixSymbol("c", 1, 3)
    u, y = sp.symbols("u y", real=True)
    k = sp.symbols("k0:3", real=True)
    R = sbp.map_examples((k[0] + k[1] * u + k[2] * u**2 - y) ** 2, [((u, y), Xs), (k, c)])
    return sbp.Model("shared_row", inputs=[Xs], params=[c], loss=nn.sum_all(R), outputs={"R": R})


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 67])
def test_a_shared_rows_gradient_matches_the_closed_form_at_every_length(rows):
    mod = sbp.compile(shared_row_model())
    rng = np.random.default_rng(rows)
    d = {"Xs": rng.standard_normal((rows, 2)), "c": rng.standard_normal((1, 3))}
    u, y = d["Xs"][:, 0], d["Xs"][:, 1]
    r = d["c"][0, 0] + d["c"][0, 1] * u + d["c"][0, 2] * u**2 - y
    loss, grads = mod.value_and_grad(**d)
    assert loss == pytest.approx((r**2).sum(), rel=1e-13)
    np.testing.assert_allclose(grads["c"], [[(2 * r * u**p).sum() for p in range(3)]], rtol=1e-12)
    np.testing.assert_allclose(mod.forward(**d)["R"], (r**2)[:, None], rtol=1e-13)
    again = mod.value_and_grad(**d)[1]["c"]
    assert np.array_equal(again, grads["c"])  # a fixed order of additions


def test_a_map_over_pairs_adding_into_rows_of_either_source_and_a_shared_one():
    """Sums into each component's row (the component loop runs outside),
    into a shared row (all pairs), and exp of a component's parameter
    (computed once a component)."""
    Mc = sp.MatrixSymbol("Mc", K, 2)
    S = sp.MatrixSymbol("S", 1, 1)
    m, b, s = sp.symbols("m b s", real=True)
    body = sp.exp(b) * (x[0] - m) ** 2 + s * x[1] + s**2 * m
    L = sbp.map_examples(body, [(x, X), ((m, b), Mc), (s, S)])
    mod = sbp.compile(sbp.Model("pairs_shared", inputs=[X], params=[Mc, S], loss=nn.sum_all(L), outputs={"L": L}))
    rng = np.random.default_rng(3)
    d = {"X": rng.standard_normal((11, 2)), "Mc": rng.standard_normal((5, 2)), "S": rng.standard_normal((1, 1))}
    xs, m, b, s = d["X"], d["Mc"][:, 0], d["Mc"][:, 1], d["S"][0, 0]
    diff = xs[:, :1] - m[None]  # N x K
    L = np.exp(b)[None] * diff**2 + s * xs[:, 1:] + s**2 * m[None]
    loss, grads = mod.value_and_grad(**d)
    assert loss == pytest.approx(L.sum(), rel=1e-13)
    np.testing.assert_allclose(mod.forward(**d)["L"], L, rtol=1e-13)
    grad_m = (-2 * np.exp(b)[None] * diff).sum(0) + len(xs) * s**2
    grad_b = (np.exp(b)[None] * diff**2).sum(0)
    np.testing.assert_allclose(grads["Mc"], np.stack([grad_m, grad_b], 1), rtol=1e-12)
    grad_s = len(m) * xs[:, 1].sum() + 2 * s * len(xs) * m.sum()
    assert grads["S"][0, 0] == pytest.approx(grad_s, rel=1e-12)


@pytest.mark.parametrize("points, centroids", [(1, 1), (9, 13), (40, 3), (2, 17)])
def test_pair_distances_read_by_column_match_closed_forms(points, centroids):
    """k-means: the rows the inner loop reads (width 3) come from a copy by
    column (emap_kernel.ColumnCopy) and the loop carries ivdep; the cost, its
    gradient and Hessian-vector product match the closed forms (ties none:
    random data), at sizes around the vector width and of one example."""
    Pt = sp.MatrixSymbol("Pt", N, 3)
    Cm = sp.MatrixSymbol("Cm", K, 3)
    p = sp.Matrix(sp.symbols("p0:3", real=True))
    c = sp.Matrix(sp.symbols("c0:3", real=True))
    dist = sbp.map_examples(sum((p[f] - c[f]) ** 2 for f in range(3)), [(p, Pt), (c, Cm)])
    mod = sbp.compile(sbp.Model("pair_distances", inputs=[Pt], params=[Cm],
                                loss=nn.sum_all(sbp.reduce("min", dist, 1)), outputs={"dist": dist}),
                      functions=("forward", "value_and_grad", "hvp"))
    assert "Cm_by_column" in mod.source or "Pt_by_column" in mod.source
    assert "ivdep" in mod.source
    rng = np.random.default_rng(points * 100 + centroids)
    d = {"Pt": rng.random((points, 3)), "Cm": rng.random((centroids, 3))}
    D = ((d["Pt"][:, None, :] - d["Cm"][None, :, :]) ** 2).sum(-1)
    near = D.argmin(1)
    np.testing.assert_allclose(mod.forward(**d)["dist"], D, rtol=1e-14)
    count = np.bincount(near, minlength=centroids)[:, None]
    sums = np.zeros((centroids, 3))
    np.add.at(sums, near, d["Pt"])
    v = rng.standard_normal((centroids, 3))
    loss, grads, hv = mod.value_grad_and_hvp({"Cm": v}, **d)
    assert loss == pytest.approx(D.min(1).sum(), rel=1e-14)
    np.testing.assert_allclose(grads["Cm"], 2 * (count * d["Cm"] - sums), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(hv["Cm"], 2 * count * v, rtol=1e-14)
