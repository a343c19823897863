"""The C hot path of ordinary calls (symbackprop/_fastcall.c): the same
results as the Python path, bit for bit; anything it does not expect goes
to the Python path, which converts or explains."""

import sys
import threading

import numpy as np
import pytest
from conftest import ROOT, example_names, load_example

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
        _same_shaped(fn.answer(dict(data)), fn.returned(_python_path(fn, data)))


def _same_shaped(a, b):
    """The same dicts and tuples of the same floats and arrays, bit for bit."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        _same(list(a.values()), list(b.values()))
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_shaped(x, y)
    else:
        _same([a], [b])


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
    ((1, 1, 1, 8, ((0, 1, 12, False),), ()), ValueError),
    ((1, 1, 1, 8, ((-3, 1, 12, False),), ()), ValueError),
    ((1, 1, 1, 8, ((1, 1, 12, False),), (), ("a", "b")), ValueError),  # one name per input
    (("a",), TypeError),
    ((1, 1, 1, 8, (), ((2, 1, 12, True),), ()), ValueError),  # a scalar output is 1 x 1
    ((1, 1, 1, 8, (), ((1, 1, 12, True),), (), 1), ValueError),  # no output 1
    ((1, 1, 1, 8, (), ((1, 1, 12, True),), (), [0]), ValueError),  # a list is no layout
    ((1, 1, 1, 8, (), ((1, 1, 12, True),), (), {"a": "0"}), ValueError),
    ((1, 1, 1, 8, (), ((1, 1, 12, True),), (), ({"a": 0}, -1)), ValueError),
    ((1, 1, 1, 8, (), ((1, 1, 12, True),), (), 0, "not callable"), TypeError),
])
def test_a_caller_checks_its_construction(args, error):
    module = fastcall.extension()
    if error is None:
        with pytest.raises(TypeError, match="uninitialized"):
            module.Caller.__new__(module.Caller)([])
        return
    with pytest.raises(error):
        module.Caller(*args)


@pytest.fixture(scope="module", params=["float64", "float32"])
def square(request):
    """GradBench's hello: the square of a scalar, and its derivative."""
    import sympy as sp

    x = sp.Symbol("x")
    return sbp.compile(sbp.Model(f"fast_square_{request.param}", params=[x], loss=x**2), dtype=request.param)


@pytest.mark.parametrize("given", [float, np.array, lambda v: np.full((1, 1), v)])
@pytest.mark.parametrize("value", [3.0, -0.5, 0.0, 1e30])
def test_a_scalar_model_returns_floats_in_one_c_call(square, monkeypatch, given, value):
    dtype = square.dtype
    x = given(value) if given is float else given(value).astype(dtype)
    monkeypatch.setattr(type(square.function("forward")), "call", lambda *_: pytest.fail("the Python path ran"))
    out = square.forward(x=x)
    loss, grads = square.value_and_grad(x=x)
    rounded = float(dtype.type(value))  # (1e30 squared overflows float32: inf)
    # closed forms: x^2 and 2x, each in the module's precision (inf where float32 overflows)
    with np.errstate(over="ignore"):
        assert out == {"loss": float(dtype.type(rounded * rounded))} and loss == out["loss"]
        assert grads == {"x": float(dtype.type(2 * rounded))}
    assert type(loss) is float and type(grads["x"]) is float


@pytest.mark.parametrize("bad, message", [
    (np.ones((2, 1)), r"x is a scalar.*got shape \(2, 1\)"),
    (np.ones((1, 1), np.int32), "x must have dtype .*; got int32"),
    ("3", "x must be a real number .* got str"),
    (None, "x must be a real number .* got NoneType"),
])
def test_a_scalar_models_bad_argument_is_named_by_the_fallback(square, bad, message):
    if isinstance(bad, np.ndarray) and bad.dtype.kind == "f":
        bad = bad.astype(square.dtype)  # only the shape is wrong
    for call in (square.forward, square.value_and_grad):
        with pytest.raises(ArgumentError, match=message):
            call(x=bad)
    with pytest.raises(ArgumentError, match="y"):
        square.forward(x=1.0, y=2.0)
    with pytest.raises(ArgumentError, match="x"):
        square.value_and_grad()


def test_a_mapping_of_another_type_goes_to_the_fallback(square):
    """Function.answer given an OrderedDict (or a list): the Python path, the same answer."""
    from collections import OrderedDict

    fn = square.function("value_and_grad")
    assert fn.answer(OrderedDict(x=3.0)) == fn.answer({"x": 3.0}) == (9.0, {"x": 6.0})
    with pytest.raises(ArgumentError, match="x"):
        fn.answer(OrderedDict(y=3.0))


def test_a_module_and_its_callers_are_collected():
    """A Caller's fallback is its Function's method: a cycle the collector breaks."""
    import gc
    import weakref

    import sympy as sp

    x = sp.Symbol("x")
    mod = sbp.compile(sbp.Model("fast_square_collected", params=[x], loss=x**2))
    assert mod.value_and_grad(x=2.0) == (4.0, {"x": 4.0})
    gone = weakref.ref(mod.function("value_and_grad"))
    del mod
    gc.collect()
    assert gone() is None


@pytest.fixture(scope="module", params=["float64", "float32"])
def scalars(request):
    """A model with two scalar params: numbers for them take the C path."""
    import sympy as sp

    x = sp.MatrixSymbol("x", 3, 1)
    a, b = sp.symbols("a b")
    model = sbp.Model(f"fast_scalars_{request.param}", inputs=[x], params=[a, b],
                      loss=sbp.as_scalar(sp.OneMatrix(1, 3) * x) * a + b**2)
    return sbp.compile(model, dtype=request.param), np.dtype(request.param)


@pytest.mark.parametrize("a, b", [(1.5, 2), (np.float64(-0.25), 3.0), (2**40 + 1, 1e-3), (0.1, -7)])
def test_numbers_for_scalars_take_the_c_path_with_the_binders_conversion(scalars, monkeypatch, a, b):
    mod, dtype = scalars
    x = np.array([[1.0], [2.0], [4.0]], dtype=dtype)
    as_arrays = mod.value_and_grad(x=x, a=np.full((1, 1), a, dtype), b=np.full((1, 1), b, dtype))
    fn = mod.function("value_and_grad")
    monkeypatch.setattr(type(fn), "bind", lambda *_: pytest.fail("the Python path ran"))
    loss, grads = mod.value_and_grad(x=x, a=a, b=b)
    assert loss == as_arrays[0]
    for name in ("a", "b"):
        np.testing.assert_array_equal(grads[name], as_arrays[1][name])
    # closed forms: d/da = sum(x), d/db = 2b (in the module's precision)
    assert grads["a"] == pytest.approx(7.0, rel=1e-6)
    assert grads["b"] == pytest.approx(2 * float(dtype.type(b)), rel=1e-6)


def test_zero_d_arrays_for_scalars_take_the_c_path(scalars, monkeypatch):
    mod, dtype = scalars
    x = np.array([[1.0], [2.0], [4.0]], dtype=dtype)
    fn = mod.function("value_and_grad")
    as_python = _python_path(fn, {"x": x, "a": np.full((1, 1), 0.5, dtype), "b": np.full((1, 1), -3.0, dtype)})
    monkeypatch.setattr(type(fn), "bind", lambda *_: pytest.fail("the Python path ran"))
    loss, grads = mod.value_and_grad(x=x, a=np.array(0.5, dtype), b=np.array(-3.0, dtype))
    assert loss == as_python[0] and loss == pytest.approx(0.5 * 7 + 9, rel=1e-6)  # closed form: a sum(x) + b^2
    np.testing.assert_array_equal(grads["b"], np.full((1, 1), -6.0, dtype))
    np.testing.assert_array_equal(grads["a"], np.full((1, 1), 7.0, dtype))


def test_zero_d_arrays_the_c_path_declines_go_to_the_binder(scalars):
    mod, dtype = scalars
    fn = mod.function("value_and_grad")
    x = np.ones((3, 1), dtype=dtype)
    other = np.array(2.0, np.float32 if dtype == np.float64 else np.float64)
    assert fn.fast({"x": x, "a": other, "b": 1.0}) is None  # another dtype: the binder says so
    with pytest.raises(ArgumentError, match="a"):
        mod.value_and_grad(x=x, a=other, b=1.0)


@pytest.mark.parametrize("value", [True, 2**64, 1e300, "1.0", None])
def test_numbers_the_c_path_declines_go_to_the_binder(scalars, value):
    mod, dtype = scalars
    fn = mod.function("value_and_grad")
    x = np.ones((3, 1), dtype=dtype)
    taken = fn.fast({"x": x, "a": value, "b": 1.0}) is not None
    assert taken == (type(value) is float and dtype == np.float64)  # float32 would overflow: numpy warns
    try:
        expected = fn.bind({"x": x, "a": value, "b": 1.0})
    except ArgumentError:
        with pytest.raises(ArgumentError, match="a"):
            mod.value_and_grad(x=x, a=value, b=1.0)
    else:
        assert mod.value_and_grad(x=x, a=value, b=1.0)[0] == fn.call(dict(zip(fn.input_names, expected[0])))[0]


def test_an_empty_cache_builds_the_hot_path_beside_the_first_model(tmp_path):
    """build_beside starts the extension's build in a thread where the cache
    has none, leaves a whole entry that extension() then loads, and starts
    nothing once the entry is there (a fresh process: extension() is
    memoized in this one)."""
    import os
    import subprocess

    script = (
        "from symbackprop.run import fastcall\n"
        "thread = fastcall.build_beside()\n"
        "assert thread is not None\n"
        "thread.join()\n"
        "source, final, built = fastcall._entry()\n"
        "assert built.is_file(), built\n"
        "assert fastcall.build_beside() is None\n"
        "assert fastcall.extension() is not None\n"
    )
    env = {**os.environ, "SYMBACKPROP_CACHE_DIR": str(tmp_path), fastcall.FROM_CACHE_ENV: "1"}  # not the installed copy
    env.pop("SYMBACKPROP_NO_FASTCALL", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _setup_py():
    """setup.py as a module (its setup() runs only as a script)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("symbackprop_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_extension_is_built_as_the_cache_builds_it():
    """setup.py compiles the same source with the same flags, and carries
    the digest the runtime compares."""
    setup = _setup_py()
    assert ROOT / setup.SOURCE == fastcall.SOURCE
    assert setup.NAME == fastcall.INSTALLED
    assert tuple(setup.FLAGS) == fastcall.FLAGS
    assert setup.source_digest(fastcall.SOURCE) == fastcall.source_digest()
    (extension,) = setup.extensions()
    assert extension.name == fastcall.INSTALLED and extension.optional
    assert ("SYMBACKPROP_FASTCALL_SOURCE", f'"{fastcall.source_digest()}"') in extension.define_macros


class _Stale:
    SOURCE_DIGEST = "0" * 64  # built from another _fastcall.c


@pytest.mark.parametrize("present", [None, _Stale, ImportError])
def test_a_missing_stale_or_broken_installed_extension_falls_back_to_the_cache(present, monkeypatch, tmp_path):
    """No installed extension, one built from another source (an editable
    install's copy after _fastcall.c changed), one that does not import:
    the cache's copy, built on first use, and build_beside builds it."""
    import importlib

    real = importlib.import_module

    def fake(name, *args):
        if name != fastcall.INSTALLED:
            return real(name, *args)
        if present is None:
            raise ModuleNotFoundError(name)
        if present is ImportError:
            raise ImportError("numpy.core.multiarray failed to import")
        return present

    monkeypatch.setattr(importlib, "import_module", fake)
    monkeypatch.setenv("SYMBACKPROP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(fastcall.FROM_CACHE_ENV, raising=False)
    fastcall.installed.cache_clear()
    fastcall.extension.cache_clear()
    try:
        assert fastcall.installed() is None
        thread = fastcall.build_beside()
        assert thread is not None
        thread.join()
        module = fastcall.extension()
        assert module is not None and module is not present
        assert getattr(module, "SOURCE_DIGEST", None) is None  # the cache's build carries none
        assert any(tmp_path.rglob(f"fastcall-*/{fastcall.NAME}*"))
    finally:
        fastcall.installed.cache_clear()
        fastcall.extension.cache_clear()


def test_the_installed_extension_is_taken_where_it_matches():
    """Where the package's own copy is there and current (an install, or
    `python setup.py build_ext --inplace`), calls use it and nothing is
    built into the cache; a copy built from another _fastcall.c (an
    editable install after a pull) is not used; with no copy, none is."""
    import importlib.util

    fastcall.installed.cache_clear()
    fastcall.extension.cache_clear()
    try:
        spec = importlib.util.find_spec(fastcall.INSTALLED)
        module = fastcall.installed()
        current = spec is not None and \
            getattr(importlib.import_module(fastcall.INSTALLED), "SOURCE_DIGEST", None) == fastcall.source_digest()
        if not current:
            assert module is None
        else:
            assert module is not None
            assert fastcall.build_beside() is None
            assert fastcall.extension() is module
    finally:
        fastcall.installed.cache_clear()
        fastcall.extension.cache_clear()
