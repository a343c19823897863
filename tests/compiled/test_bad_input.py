"""Malformed calls: each one is either converted as runtime.py documents
(and then gives exactly the result of the well-formed call) or raises an
ArgumentError that names the argument, what was expected and what came."""

from __future__ import annotations

import array
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
T = sp.MatrixSymbol("T", n, 1)
W = sp.MatrixSymbol("W", 3, 1)
b = sp.Symbol("b")
MODEL = sbp.Model("bad_input", inputs=[X, T], params=[W, b], loss=nn.mse(X * W + b * nn.ones(n, 1), T))

RNG = np.random.default_rng(7)
GOOD = {
    "X": RNG.standard_normal((4, 3)),
    "T": RNG.standard_normal((4, 1)),
    "W": RNG.standard_normal((3, 1)),
    "b": 0.25,
}


@dataclass(frozen=True)
class Rejected:
    """An ArgumentError whose message holds every fragment."""

    fragments: tuple[str, ...]


@dataclass(frozen=True)
class Converted:
    """Accepted: the result equals the call with `canonical` in its place."""

    canonical: object


def _strided_rows():
    tall = np.zeros((8, 3))
    tall[::2] = GOOD["X"]
    return tall[::2]


def _masked():
    return np.ma.masked_array(GOOD["X"], mask=np.zeros_like(GOOD["X"], dtype=bool))


def _matrix():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.asmatrix(GOOD["X"])


def _readonly():
    x = GOOD["X"].copy()
    x.flags.writeable = False
    return x


X_ROWS = GOOD["X"][::-1].copy()
W_LIST = GOOD["W"].tolist()
W_INT = np.array([[1.0], [-2.0], [3.0]])

# (id, {argument: value} replacing GOOD's, expectation)
CASES = [
    # wrong shape and rank
    ("X-wrong-cols", {"X": np.zeros((4, 2))}, Rejected(("X", "(n, 3)", "(4, 2)"))),
    ("W-wrong-shape", {"W": np.zeros((3, 2))}, Rejected(("W", "(3, 1)", "(3, 2)"))),
    ("W-transposed", {"W": np.zeros((1, 3))}, Rejected(("W", "(3, 1)", "(1, 3)"))),
    ("X-rank-1", {"X": np.zeros(12)}, Rejected(("X", "2-D", "(n, 3)", "1-D", "(12,)"))),
    ("X-rank-3", {"X": np.zeros((1, 4, 3))}, Rejected(("X", "(n, 3)", "3-D", "(1, 4, 3)"))),
    ("T-rank-1-column", {"T": np.zeros(4)}, Rejected(("T", "(n, 1)", "(4,)"))),
    ("W-0-d-array", {"W": np.array(1.0)}, Rejected(("W", "(3, 1)", "0-D", "()"))),
    ("b-vector", {"b": np.zeros(2)}, Rejected(("b", "scalar", "(2,)"))),
    ("b-rank-3", {"b": np.zeros((1, 1, 1))}, Rejected(("b", "scalar", "(1, 1, 1)"))),
    # wrong dtype
    ("X-int64", {"X": np.ones((4, 3), dtype=np.int64)}, Rejected(("X", "float64", "int64"))),
    ("X-float32", {"X": GOOD["X"].astype(np.float32)}, Rejected(("X", "float64", "float32", "(4, 3)"))),
    ("X-complex", {"X": GOOD["X"].astype(complex)}, Rejected(("X", "float64", "complex128"))),
    ("X-bool", {"X": np.ones((4, 3), dtype=bool)}, Rejected(("X", "float64", "bool"))),
    ("X-object", {"X": GOOD["X"].astype(object)}, Rejected(("X", "float64", "object"))),
    ("X-big-endian", {"X": GOOD["X"].astype(">f8")}, Rejected(("X", "float64", ">f8"))),
    ("W-uint8", {"W": np.ones((3, 1), dtype=np.uint8)}, Rejected(("W", "float64", "uint8"))),
    ("b-float32-array", {"b": np.array(0.25, dtype=np.float32)}, Rejected(("b", "float64", "float32"))),
    ("X-masked", {"X": _masked()}, Rejected(("X", "masked"))),
    # empty and inconsistent batches
    ("zero-batch", {"X": np.zeros((0, 3)), "T": np.zeros((0, 1))}, Rejected(("X", "(n, 3)", "n >= 1", "(0, 3)"))),
    ("batch-mismatch", {"T": np.zeros((5, 1))}, Rejected(("T", "(n, 1)", "n=4", "as in X", "(5, 1)"))),
    ("X-zero-cols", {"X": np.zeros((4, 0))}, Rejected(("X", "(n, 3)", "(4, 0)"))),
    # missing and unknown arguments
    ("missing-T", {"T": None}, Rejected(("missing ['T']", "'X', 'T', 'W', 'b'"))),
    ("unknown-Z", {"Z": np.zeros((4, 3))}, Rejected(("unknown ['Z']", "'X', 'T', 'W', 'b'"))),
    ("misspelled-w", {"W": None, "w": GOOD["W"]}, Rejected(("missing ['W']", "unknown ['w']"))),
    # Python values where arrays are expected
    ("W-ragged-list", {"W": [[1.0], [2.0, 3.0], [4.0]]}, Rejected(("W", "could not be converted", "float64"))),
    ("W-list-of-str", {"W": [["a"], ["b"], ["c"]]}, Rejected(("W", "float64", "list as <U1"))),
    ("W-complex-list", {"W": [[1j], [2.0], [3.0]]}, Rejected(("W", "float64", "complex128"))),
    ("W-bool-list", {"W": [[True], [False], [True]]}, Rejected(("W", "float64", "bool"))),
    ("W-number", {"W": 1.0}, Rejected(("W", "(3, 1)", "0-D", "()"))),
    ("X-short-list", {"X": [[1.0, 2.0]]}, Rejected(("X", "(n, 3)", "(1, 2)"))),
    ("X-str", {"X": "1 2 3"}, Rejected(("X", "numpy array", "float64", "(n, 3)", "str"))),
    ("X-ellipsis", {"X": ...}, Rejected(("X", "numpy array", "ellipsis"))),
    ("X-memoryview", {"X": memoryview(GOOD["X"])}, Rejected(("X", "numpy array", "memoryview"))),
    ("W-array-module", {"W": array.array("d", [1.0, 2.0, 3.0])}, Rejected(("W", "numpy array", "array"))),
    ("b-complex", {"b": 1j}, Rejected(("b", "real number", "complex"))),
    ("b-bool", {"b": True}, Rejected(("b", "float64", "bool"))),
    ("b-huge-int", {"b": 2**2000}, Rejected(("b", "float64", "int", "object"))),
    # documented conversions
    ("X-fortran-order", {"X": np.asfortranarray(GOOD["X"])}, Converted(GOOD["X"])),
    ("X-strided-rows", {"X": _strided_rows()}, Converted(GOOD["X"])),
    ("X-reversed-view", {"X": X_ROWS[::-1]}, Converted(GOOD["X"])),
    ("X-transposed-view", {"X": GOOD["X"].T.copy().T}, Converted(GOOD["X"])),
    ("X-broadcast-view", {"X": np.broadcast_to(GOOD["X"][:1], (4, 3))}, Converted(np.repeat(GOOD["X"][:1], 4, axis=0))),
    ("X-read-only", {"X": _readonly()}, Converted(GOOD["X"])),
    ("X-matrix-subclass", {"X": _matrix()}, Converted(GOOD["X"])),
    ("W-nested-list", {"W": W_LIST}, Converted(GOOD["W"])),
    ("W-tuple", {"W": tuple(map(tuple, W_LIST))}, Converted(GOOD["W"])),
    ("W-int-list", {"W": [[1], [-2], [3]]}, Converted(W_INT)),
    ("b-int", {"b": 1}, Converted(1.0)),
    ("b-numpy-float32", {"b": np.float32(0.25)}, Converted(0.25)),
    ("b-numpy-int", {"b": np.int64(2)}, Converted(2.0)),
    ("b-0-d-array", {"b": np.array(0.25)}, Converted(0.25)),
    ("b-shape-1", {"b": np.array([0.25])}, Converted(0.25)),
    ("b-shape-1x1", {"b": np.array([[0.25]])}, Converted(0.25)),
    ("b-list", {"b": [0.25]}, Converted(0.25)),
]

REJECTED = [pytest.param(changes, expect, id=name) for name, changes, expect in CASES if isinstance(expect, Rejected)]
CONVERTED = [pytest.param(changes, expect, id=name) for name, changes, expect in CASES if isinstance(expect, Converted)]
CALLS = {
    "forward": lambda mod, args: mod.forward(**args),
    "value_and_grad": lambda mod, args: mod.value_and_grad(**args),
    "prepare": lambda mod, args: mod.prepare(**args),
}


@pytest.fixture(scope="module")
def mod():
    return sbp.compile(MODEL)


def _arguments(changes: dict) -> dict:
    args = {**GOOD, **changes}
    return {k: v for k, v in args.items() if v is not None}


def test_the_table_is_large_enough():
    assert len(REJECTED) >= 25 and len(CONVERTED) >= 10


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("changes, expect", REJECTED)
def test_rejected_with_a_message_naming_what_is_wrong(mod, changes, expect, call):
    with pytest.raises(sbp.ArgumentError) as info:
        CALLS[call](mod, _arguments(changes))
    message = str(info.value)
    for fragment in expect.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert isinstance(info.value, sbp.SymbackpropError)


@pytest.mark.parametrize("changes, expect", CONVERTED)
def test_converted_as_documented(mod, changes, expect):
    (name,) = list(changes)
    reference = {**GOOD, name: expect.canonical}
    loss, grads = mod.value_and_grad(**_arguments(changes))
    expected_loss, expected_grads = mod.value_and_grad(**reference)
    assert loss == expected_loss
    for key, grad in expected_grads.items():
        np.testing.assert_array_equal(grads[key], grad)
    outputs = mod.forward(**_arguments(changes))
    assert outputs["loss"] == expected_loss


def test_inputs_are_not_written(mod):
    args = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in GOOD.items()}
    mod.value_and_grad(**args)
    mod.forward(**args)
    for key, value in GOOD.items():
        np.testing.assert_array_equal(args[key], value)


def test_nan_passes_through(mod):
    x = GOOD["X"].copy()
    x[2, 1] = np.nan
    loss, grads = mod.value_and_grad(**{**GOOD, "X": x})
    assert math.isnan(loss)
    assert np.isnan(grads["W"]).all() and math.isnan(grads["b"])


def test_infinity_passes_through(mod):
    x = GOOD["X"].copy()
    x[0, 0] = np.inf
    loss, grads = mod.value_and_grad(**{**GOOD, "X": x})
    assert loss == math.inf
    assert not np.isfinite(grads["W"]).all()
    finite_loss, _ = mod.value_and_grad(**{**GOOD, "X": np.full((4, 3), 1e200)})
    assert finite_loss == math.inf  # overflow follows IEEE rules, no error


def test_batch_of_one_and_a_large_batch(mod):
    for rows in (1, 5000):
        data = {**GOOD, "X": np.ones((rows, 3)), "T": np.zeros((rows, 1))}
        loss, grads = mod.value_and_grad(**data)
        single = float(GOOD["W"].sum() + GOOD["b"]) ** 2
        assert loss == pytest.approx(single, rel=1e-12)
        assert grads["W"].shape == (3, 1)


def test_a_rejected_call_leaves_the_module_usable(mod):
    expected = mod.value_and_grad(**GOOD)[0]
    for _, changes, expect in CASES:
        if isinstance(expect, Rejected):
            with pytest.raises(sbp.ArgumentError):
                mod.value_and_grad(**_arguments(changes))
    assert mod.value_and_grad(**GOOD)[0] == expected


def test_float64_into_a_float32_module():
    mod32 = sbp.compile(MODEL, dtype="float32")
    with pytest.raises(sbp.ArgumentError) as info:
        mod32.value_and_grad(**GOOD)
    assert "X must have dtype float32; got float64" in str(info.value)
    loss, grads = mod32.value_and_grad(**{k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v) for k, v in GOOD.items()})
    assert grads["W"].dtype == np.float32
    assert loss == pytest.approx(_numpy_loss(), rel=1e-5)


def _numpy_loss() -> float:
    residual = GOOD["X"] @ GOOD["W"] + GOOD["b"] - GOOD["T"]
    return float(np.mean(residual**2))
