"""Every example: the loss matches a numpy evaluation and every gradient
matches central finite differences of that numpy evaluation."""

import numpy as np
import pytest
from conftest import example_names, load_example
from oracles import NUMPY_LOSSES, central_differences, relative_error

import symbackprop as sbp


@pytest.fixture(scope="module", params=example_names())
def example(request):
    module = load_example(request.param)
    return module, sbp.compile(module.model)


def test_every_example_has_a_numpy_oracle():
    assert set(example_names()) <= set(NUMPY_LOSSES)


def test_loss_matches_numpy(example):
    module, mod = example
    data = module.sample_data(np.random.default_rng(1))
    reference = NUMPY_LOSSES[module.model.name](data)
    assert mod.forward(**data)["loss"] == pytest.approx(reference, rel=1e-12, abs=1e-12)
    loss, _ = mod.value_and_grad(**data)
    assert loss == pytest.approx(reference, rel=1e-12, abs=1e-12)


def test_gradients_match_finite_differences(example):
    module, mod = example
    data = module.sample_data(np.random.default_rng(2))
    _, grads = mod.value_and_grad(**data)
    loss = NUMPY_LOSSES[module.model.name]
    assert set(grads) == {p.name for p in module.model.params}
    if len(grads) > MANY_PARAMS:  # a large model (transformer_lm): one random direction a parameter
        _directional_differences(loss, data, grads)
        return
    for name, grad in grads.items():
        expected = central_differences(loss, data, name) if np.size(grad) <= 64 else None
        if expected is None:
            expected, grad = _sampled_differences(loss, data, name, grad)
        assert relative_error(grad, expected) < 1e-6, name


# Past this many parameters, entry-by-entry differences take minutes of the
# numpy oracle: each parameter is checked along one random direction instead.
MANY_PARAMS = 16


def _directional_differences(loss, data, grads, step=1e-6):
    """<grad, v> against the central difference along a random unit v, per
    parameter, to 1e-6 of |grad| (a wrong entry anywhere moves it)."""
    rng = np.random.default_rng(4)
    for name, grad in grads.items():
        v = rng.standard_normal(np.shape(grad))
        v /= np.linalg.norm(v)
        ahead, behind = (loss({**data, name: data[name] + sign * step * v}) for sign in (1.0, -1.0))
        difference = (ahead - behind) / (2 * step)
        assert abs(float(np.sum(grad * v)) - difference) <= 1e-6 * max(np.linalg.norm(grad), 1e-8), name


def _sampled_differences(loss, data, name, grad, count=24, step=1e-6):
    """Central differences on `count` entries spread over a large gradient."""
    base = data[name]
    rng = np.random.default_rng(3)
    flat = rng.choice(base.size, size=min(count, base.size), replace=False)
    expected, actual = [], []
    for f in flat:
        index = np.unravel_index(f, base.shape)
        values = []
        for sign in (1.0, -1.0):
            shifted = base.copy()
            shifted[index] += sign * step
            values.append(loss({**data, name: shifted}))
        expected.append((values[0] - values[1]) / (2 * step))
        actual.append(grad[index])
    return np.array(expected), np.array(actual)


def test_blas_and_plain_loops_agree():
    """Large products call BLAS when scipy-openblas32 is installed; the plain
    C loops (the fallback, and what a C user builds by default) agree."""
    from symbackprop.emit.codegen import runtime_header
    from symbackprop.toolchain.builder import BuildOptions, find_blas

    module = load_example("mnist_mlp")
    data = module.sample_data(np.random.default_rng(4))
    plain = sbp.compile(module.model, options=BuildOptions(blas=False))
    assert "symbackprop_f64_matmul(" in plain.source  # the runtime header's helper, which may call BLAS
    assert "SYMBACKPROP_CBLAS_DGEMM(101" in runtime_header()
    loss_plain, grads_plain = plain.value_and_grad(**data)
    if find_blas() is None:
        pytest.skip("scipy-openblas32 is not installed")
    loss_blas, grads_blas = sbp.compile(module.model, options=BuildOptions(blas=True)).value_and_grad(**data)
    assert loss_blas == pytest.approx(loss_plain, rel=1e-12)
    for name in grads_plain:
        np.testing.assert_allclose(grads_blas[name], grads_plain[name], rtol=1e-9, atol=1e-13)


def test_float32_module_agrees_with_float64(example):
    module, mod64 = example
    data = module.sample_data(np.random.default_rng(6))
    mod32 = sbp.compile(module.model, dtype="float32")
    real = f"{mod32.spec.prefix.upper()}_REAL"  # the real-type macro of its text: float
    assert f"#define {real} float\n" in mod32.header and f"{real} *" in mod32.source and "double" not in mod32.source
    loss64, grads64 = mod64.value_and_grad(**data)
    as32 = {k: v if np.asarray(v).dtype.kind in "iu" else np.asarray(v, dtype=np.float32) for k, v in data.items()}
    loss32, grads32 = mod32.value_and_grad(**as32)  # Index arrays stay integers
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    for name, grad in grads64.items():
        assert np.asarray(grads32[name]).dtype == np.float32 or np.isscalar(grads32[name])
        assert relative_error(grads32[name], grad) < 1e-4, name
