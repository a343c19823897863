"""A sum down each column of an elementwise loop's value runs in that loop
(schedule/fusion.py, MapGroup.sums): a batch norm's statistics and the
gradients of its scale and shift, at rows of SUMS_MIN_COLUMNS entries or
more. Checked here: the loop does it (no sum_columns call, the value summed
alone has no buffer, the workspace is smaller than without it), the
results equal a numpy forward and backward pass written by hand, at row
counts and widths around the loop's column blocks, and a build with
OpenMP gives the same bits on one thread and on two."""

import re

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn, pipeline
from symbackprop.schedule import fusion
from symbackprop.toolchain.builder import BuildOptions

n = sp.Symbol("n", integer=True, positive=True)


def _model(cols: int) -> sbp.Model:
    """loss = sum_j w_j * sum_i tanh(X_ij + b_j)^2: a column sum of a loop's square, in the forward
    pass; the gradient by b a column sum of 2 w h (1 - h^2), in the backward pass."""
    x, b, w = sp.MatrixSymbol("X", n, cols), sp.MatrixSymbol("b", 1, cols), sp.MatrixSymbol("w", 1, cols)
    h = nn.tanh(x + sp.OneMatrix(n, 1) * b)
    squares = sp.HadamardProduct(h, h)
    total = sbp.reduce("sum", squares, 0)
    return sbp.Model(f"colsum_loop_{cols}", inputs=[x], params=[b, w], loss=nn.sum_all(sp.HadamardProduct(total, w)))


def _numpy(x: np.ndarray, b: np.ndarray, w: np.ndarray) -> tuple[float, dict]:
    h = np.tanh(x + b)
    loss = float(((h * h).sum(axis=0, keepdims=True) * w).sum())
    grad_b = (2 * w * h * (1 - h * h)).sum(axis=0, keepdims=True)
    return loss, {"b": grad_b, "w": (h * h).sum(axis=0, keepdims=True)}


def _data(rows: int, cols: int, dtype: str) -> dict:
    rng = np.random.default_rng(rows * 7 + cols)
    return {"X": rng.standard_normal((rows, cols)).astype(dtype), "b": rng.standard_normal((1, cols)).astype(dtype),
            "w": rng.standard_normal((1, cols)).astype(dtype)}


def test_the_sums_run_in_the_loops_that_compute_what_they_add():
    source = pipeline.generate(_model(fusion.SUMS_MIN_COLUMNS), derivation=False)[0].source
    assert "grad_b = sum of " in source and "grad_w = sum of " in source  # the loop's comments
    calls = [line for line in source.splitlines() if "_sum_columns(" in line]
    assert not calls, calls
    assert len(re.findall(r"\w+\[j\] \+= ", source)) == 2  # both sums added into their columns in one loop


def test_the_value_only_summed_has_no_buffer(monkeypatch):
    cols = fusion.SUMS_MIN_COLUMNS
    model = _model(cols)

    def work() -> sp.Expr:
        return next(fn.schedule.work_size for fn in pipeline.plan(model).functions if fn.kind == "value_and_grad")

    fused = work()
    monkeypatch.setattr(fusion, "SUMS_MIN_COLUMNS", 10**9)
    apart = work()
    saved = sp.expand(apart - fused)
    assert sp.degree(saved, n) == 1 and saved.subs(n, 1) >= 2 * cols, (fused, apart)  # h^2 and grad_b's summand


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("rows, cols", [(1, 4096), (3, 4100), (33, 5000), (70, 4096)])
def test_results_equal_numpy_by_hand(tmp_path, dtype, rows, cols):
    d = _data(rows, cols, dtype)
    mod = sbp.compile(_model(cols), dtype=dtype, options=BuildOptions(cache_dir=tmp_path))
    loss, grads = mod.value_and_grad(**d)
    up = {k: v.astype("float64") for k, v in d.items()}
    expected_loss, expected = _numpy(up["X"], up["b"], up["w"])
    rtol = 1e-12 if dtype == "float64" else 1e-4
    assert loss == pytest.approx(expected_loss, rel=rtol, abs=rtol * cols)
    for name, g in expected.items():
        np.testing.assert_allclose(grads[name], g, rtol=rtol * 10, atol=rtol * rows, err_msg=name)


def test_an_openmp_build_gives_the_same_bits_on_one_and_two_threads(tmp_path):
    d = _data(37, 4100, "float64")
    mod = sbp.compile(_model(4100), options=BuildOptions(cache_dir=tmp_path, openmp=True))
    before = sbp.get_num_threads()
    try:
        sbp.set_num_threads(1)
        one = mod.value_and_grad(**d)
        sbp.set_num_threads(2)
        two = mod.value_and_grad(**d)
    finally:
        sbp.set_num_threads(before)
    assert one[0] == two[0]
    for name in one[1]:
        np.testing.assert_array_equal(one[1][name], two[1][name])
