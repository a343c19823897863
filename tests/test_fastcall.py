"""The C hot path of ordinary calls (symbackprop/_fastcall.c): the same
results as the Python path, bit for bit; anything it does not expect goes
to the Python path, which converts or explains."""

import sys
import threading

import numpy as np
import pytest
from conftest import example_names, load_example

import symbackprop as sbp
from symbackprop.errors import ArgumentError
from symbackprop.run import fastcall

pytestmark = pytest.mark.skipif(fastcall.extension() is None, reason="the C hot path could not be built here")


def _python_path(fn, arrays):
    """The same call with the C hot path switched off."""
    fast, fn.fast = fn.fast, None
    try:
        return fn.call(arrays)
    finally:
        fn.fast = fast


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y)
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", example_names())
def test_every_example_gives_the_python_paths_results_exactly(name):
    example = load_example(name)
    mod = sbp.compile(example.model)
    data = example.sample_data(np.random.default_rng(0))
    for kind in ("forward", "value_and_grad"):
        fn = mod.function(kind)
        assert fn.fast is not None
        _same(fn.call(data), _python_path(fn, data))


@pytest.fixture(scope="module")
def mlp():
    example = load_example("mlp")
    return sbp.compile(example.model), example.sample_data(np.random.default_rng(1))


def test_ordinary_calls_take_the_c_path(mlp, monkeypatch):
    mod, data = mlp
    fn = mod.function("value_and_grad")
    monkeypatch.setattr(type(fn), "bind", lambda *a: pytest.fail("the Python path ran"))
    loss, grads = mod.value_and_grad(**data)
    assert isinstance(loss, float) and set(grads) == {"W1", "b1", "W2", "b2"}


@pytest.mark.parametrize("change", [
    lambda a: np.asfortranarray(a),                       # another layout
    lambda a: a[:, ::1].copy()[::1],                      # a plain copy (taken as is)
    lambda a: np.ascontiguousarray(a).astype(">f8"),       # byte-swapped
    lambda a: a.tolist(),                                  # a list
])
def test_other_arrays_give_the_same_result_or_a_clear_error(mlp, change):
    mod, data = mlp
    reference = mod.value_and_grad(**data)
    try:
        loss, grads = mod.value_and_grad(**{**data, "X": change(data["X"])})
    except ArgumentError as error:
        assert "X" in str(error)
        return
    assert loss == reference[0]
    for name in grads:
        np.testing.assert_array_equal(grads[name], reference[1][name])


def test_wrong_dtype_and_shape_are_explained(mlp):
    mod, data = mlp
    with pytest.raises(ArgumentError, match="X must have dtype float64; got float32"):
        mod.value_and_grad(**{**data, "X": data["X"].astype(np.float32)})
    with pytest.raises(ArgumentError, match="T must have shape"):
        mod.value_and_grad(**{**data, "T": data["T"][:, :1].copy()})
    with pytest.raises(ArgumentError, match="masked array"):
        mod.value_and_grad(**{**data, "X": np.ma.masked_array(data["X"])})


def test_an_index_out_of_range_is_named_on_the_c_path_too():
    example = load_example("bundle_adjustment")
    mod = sbp.compile(example.model)
    data = example.sample_data(np.random.default_rng(2))
    data["cam"] = data["cam"].astype(np.int64)  # 1-D, as a user passes it
    data["pt"] = data["pt"].astype(np.int64)
    mod.value_and_grad(**data)
    data["pt"][3] = 1000
    with pytest.raises(ArgumentError, match="pt holds the row number 1000"):
        mod.value_and_grad(**data)


def test_calls_keep_no_references_and_results_are_fresh(mlp):
    mod, data = mlp
    counts = {name: sys.getrefcount(value) for name, value in data.items()}
    first = mod.value_and_grad(**data)
    for _ in range(1000):
        mod.value_and_grad(**data)
    assert {name: sys.getrefcount(value) for name, value in data.items()} == counts
    second = mod.value_and_grad(**data)
    assert all(first[1][k] is not second[1][k] for k in first[1])
    assert sys.getrefcount(second[1]["W1"]) == 3  # the dict, the argument, getrefcount's own


def test_threads_calling_one_function_get_their_own_results(mlp):
    mod, _ = mlp
    example = load_example("mlp")
    inputs = [example.sample_data(np.random.default_rng(10 + k), batch=64 + k) for k in range(4)]
    expected = [mod.value_and_grad(**d) for d in inputs]
    failures = []

    def work(k):
        for _ in range(300):
            loss, grads = mod.value_and_grad(**inputs[k])
            if loss != expected[k][0] or any(not np.array_equal(grads[n], expected[k][1][n]) for n in grads):
                failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.parametrize("args, error", [
    ((0, 0, 1, 8, (), ()), None),
    ((1, 1, -1, 8, (), ()), ValueError),
    ((1, 1, 1, 8, ((0, 1, 12),), ()), ValueError),
    ((1, 1, 1, 8, ((-3, 1, 12),), ()), ValueError),
    (("a",), TypeError),
])
def test_a_caller_checks_its_construction(args, error):
    module = fastcall.extension()
    if error is None:
        with pytest.raises(TypeError, match="uninitialized"):
            module.Caller.__new__(module.Caller)([])
        return
    with pytest.raises(error):
        module.Caller(*args)
