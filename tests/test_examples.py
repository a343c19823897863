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
    for name, grad in grads.items():
        expected = central_differences(loss, data, name) if np.size(grad) <= 64 else None
        if expected is None:
            expected, grad = _sampled_differences(loss, data, name, grad)
        assert relative_error(grad, expected) < 1e-6, name


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
