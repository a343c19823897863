"""The one argument binder (symbackprop/binding.py) and the ABI spec
(symbackprop/abi.py): every entry point refuses the same bad arguments with
an ArgumentError naming the argument; crash-prone cases run in a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.base.abi import ModuleSpec
from symbackprop.declare import nn
from symbackprop.errors import ArgumentError

n, m, c = sp.symbols("n m c", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 3)
T = sp.MatrixSymbol("T", n, 1)
W = sp.MatrixSymbol("W", 3, 1)
b = sp.Symbol("b", real=True)
R = X * W + b * sp.OneMatrix(n, 1) - T

LINEAR = """
import numpy as np, sympy as sp, symbackprop as sbp
n = sp.Symbol("n", integer=True, positive=True)
X, T, W = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 1), sp.MatrixSymbol("W", 3, 1)
b = sp.Symbol("b", real=True)
R = X * W + b * sp.OneMatrix(n, 1) - T
mod = sbp.compile(sbp.Model("binder_lin", inputs=[X, T], params=[W, b], loss=R.T * R / n, outputs={"pred": X * W}),
                  optimizer=sbp.Adam(lr=0.01))
"""


def linear_model():
    return sbp.Model("binder_lin", inputs=[X, T], params=[W, b], loss=R.T * R / n, outputs={"pred": X * W})


@pytest.fixture(scope="module")
def mod():
    return sbp.compile(linear_model(), optimizer=sbp.Adam(lr=0.01))


def data(rows=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((rows, 3)), "T": rng.standard_normal((rows, 1)),
            "W": rng.standard_normal((3, 1)), "b": np.array(0.5)}


def step_arguments(mod, d):
    """Every argument of train_step, as prepare("train_step") takes them."""
    fn = mod.function("train_step")
    full = dict(d)
    hyper = mod.optimizer.hyper()
    for arg, role, key in fn.spec.extra_roles:
        shape = next(a.shape for a in fn.inputs if a.name == arg)
        full[arg] = np.full((1, 1), hyper[key]) if role == "hyper" else np.zeros(shape)
    return full


def numpy_loss(d):
    r = d["X"] @ d["W"] + float(d["b"]) - d["T"]
    return float((r**2).sum() / len(r))


# --- bad arguments, across the entry points ------------------------------------

def _empty_x(d):
    big = np.zeros((40, 3))
    return {**d, "X": big[:0]}


def _readonly_w(d):
    return {**d, "W": np.frombuffer(d["W"].tobytes()).reshape(3, 1)}


def _strided_w(d):
    return {**d, "W": np.repeat(d["W"], 2, axis=0)[::2]}


def _w_aliases_x(d):
    x = d["X"].copy()
    return {**d, "X": x, "W": x.reshape(-1)[:3].reshape(3, 1)}


CASES = [
    # (id, entry point, how the arguments are spoiled, what the message must name)
    ("empty-view-call", "value_and_grad", _empty_x, "X"),
    ("empty-T-call", "value_and_grad", lambda d: {**d, "T": d["T"][:0]}, "T"),
    ("empty-both-forward", "forward", lambda d: {**d, "X": d["X"][:0], "T": d["T"][:0]}, "X"),
    ("empty-view-prepare", "prepare", _empty_x, "X"),
    ("empty-view-step", "train_step", _empty_x, "X"),
    ("empty-both-epoch", "train_epoch", lambda d: {**d, "X": d["X"][:0], "T": d["T"][:0]}, "X"),
    ("empty-view-hessian", "hessian", _empty_x, "X"),
    ("empty-view-jacobian", "jacobian", _empty_x, "X"),
    ("rows-disagree-step", "train_step", lambda d: {**d, "T": d["T"][:5]}, "T"),
    ("readonly-prepare-step", "prepare_step", _readonly_w, "W"),
    ("readonly-step", "train_step", _readonly_w, "W"),
    ("readonly-epoch", "train_epoch", _readonly_w, "W"),
    ("strided-step", "train_step", _strided_w, "W"),
    ("float32-step", "train_step", lambda d: {**d, "W": d["W"].astype(np.float32)}, "W"),
    ("list-step", "train_step", lambda d: {**d, "W": d["W"].tolist()}, "W"),
    ("alias-param-input", "train_step", _w_aliases_x, "W"),
    ("alias-prepare-step", "prepare_step", _w_aliases_x, "W"),
    ("alias-two-params", "train_step", lambda d: {**d, "b": d["W"][0]}, "b"),
    ("string-arg", "value_and_grad", lambda d: {**d, "b": "0.5"}, "b"),
    ("scalar-2x2", "forward", lambda d: {**d, "b": np.ones((2, 2))}, "b"),
]


def _run(mod, entry, d):
    if entry == "prepare":
        return mod.prepare("value_and_grad", **d)
    if entry == "prepare_step":
        return mod.prepare("train_step", **step_arguments(mod, d))
    if entry == "train_epoch":
        return mod.train_epoch(4, **d)
    if entry == "hessian":
        return mod.hessian(**d)
    if entry == "jacobian":
        return mod.jacobian("pred", **d)
    return getattr(mod, entry)(**d)


@pytest.mark.parametrize("entry, spoil, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_is_refused_by_name(mod, entry, spoil, name):
    d = data()
    d["W"] = d["W"].copy()
    before = {k: np.array(v, copy=True) for k, v in d.items()}
    with pytest.raises(ArgumentError, match=rf"\b{name}\b"):
        _run(mod, entry, spoil(d))
    for k, v in before.items():  # a refused call changes nothing
        np.testing.assert_array_equal(d[k], v)


SEED_CASES = [
    ("loss-seed-2x2", lambda mod, d: mod.vjp("loss", np.ones((2, 2)), **d), "seed for 'loss'"),
    ("loss-seed-string", lambda mod, d: mod.vjp("loss", "one", **d), "seed for 'loss'"),
    ("loss-seed-bool", lambda mod, d: mod.vjp("loss", True, **d), "seed for 'loss'"),
    ("output-seed-shape", lambda mod, d: mod.vjp("pred", np.ones((3, 8)), **d), "seed for 'pred'"),
    ("output-seed-string", lambda mod, d: mod.vjp("pred", "x", **d), "seed for 'pred'"),
    ("output-seed-float32", lambda mod, d: mod.vjp("pred", np.ones((8, 1), np.float32), **d), "seed for 'pred'"),
    ("direction-2x2", lambda mod, d: mod.hvp({"b": np.ones((2, 2))}, **d), "direction for 'b'"),
    ("direction-shape", lambda mod, d: mod.hvp({"W": np.ones((1, 3))}, **d), "direction for 'W'"),
    ("tangent-float32", lambda mod, d: mod.jvp({"W": np.ones((3, 1), np.float32)}, **d), "tangent for 'W'"),
    ("tangent-string", lambda mod, d: mod.jvp({"b": "1"}, **d), "tangent for 'b'"),
    ("tangent-unknown", lambda mod, d: mod.jvp({"X": np.ones((8, 3))}, **d), "not differentiated"),
]


@pytest.mark.parametrize("call, words", [c[1:] for c in SEED_CASES], ids=[c[0] for c in SEED_CASES])
def test_seeds_tangents_and_directions_go_through_the_binder(mod, call, words):
    with pytest.raises(ArgumentError, match=words):
        call(mod, data())


def test_scalar_seeds_and_directions_take_numbers_like_arguments(mod):
    d = data()
    _, grads = mod.value_and_grad(**d)
    for seed in (2.0, np.float64(2.0), np.array(2.0), np.array([2.0]), np.array([[2.0]])):
        scaled = mod.vjp("loss", seed, **d)
        np.testing.assert_allclose(scaled["W"], 2 * grads["W"], rtol=1e-15)
    # H v for the scalar b, against central differences of the gradient
    h = 1e-6
    plus, minus = dict(d, b=np.array(0.5 + h)), dict(d, b=np.array(0.5 - h))
    expected = (mod.value_and_grad(**plus)[1]["W"] - mod.value_and_grad(**minus)[1]["W"]) / (2 * h)
    for direction in (1.0, np.array(1.0), np.array([[1.0]])):
        np.testing.assert_allclose(mod.hvp({"b": direction}, **d)["W"], expected, rtol=1e-6)
    tangent = mod.jvp({"b": 1.0}, **d)["loss"]
    assert tangent == pytest.approx(float(grads["b"]), rel=1e-12)


def test_a_model_without_a_loss_says_so():
    Y = sp.MatrixSymbol("Y", n, 1)
    outputs_only = sbp.compile(sbp.Model("binder_noloss", inputs=[X], params=[W], outputs={"Y": X * W}))
    d = {"X": data()["X"], "W": data()["W"]}
    for call in (lambda: outputs_only.value_and_grad(**d), lambda: outputs_only.vjp("loss", **d),
                 lambda: outputs_only.hvp({}, **d), lambda: outputs_only.prepare("value_and_grad", **d)):
        with pytest.raises(ArgumentError, match=r"no loss.*vjp\(output, seed"):
            call()
    seed = np.arange(8.0).reshape(8, 1)
    assert Y.shape == (n, 1)
    np.testing.assert_allclose(outputs_only.vjp("Y", seed, **d)["W"], d["X"].T @ seed, rtol=1e-14)


# --- train_epoch and Index --------------------------------------------------------

k = sp.Symbol("k", real=True)
A = sp.Matrix(sp.symbols("a0:3", real=True))


def test_train_epoch_refuses_an_index_into_the_sliced_data_before_running():
    idx = sbp.Index("idx", m)
    gathered = sbp.map_examples(sp.Matrix([A[0] * k]), [(A, sbp.gather(X, idx))])
    model = sbp.Model("binder_gather_data", inputs=[X, T, idx], params=[W, k],
                      loss=R.subs(b, 0).T * R.subs(b, 0) / n + nn.sum_all(gathered))
    mod = sbp.compile(model, optimizer=sbp.SGD(lr=0.1))
    d = {"X": np.ones((8, 3)), "T": np.ones((8, 1)), "idx": np.array([7, 0]), "W": np.ones((3, 1)), "k": np.array(1.0)}
    before = d["W"].copy()
    with pytest.raises(ArgumentError, match=r"idx.*dimension of its own"):
        mod.train_epoch(4, **d)
    np.testing.assert_array_equal(d["W"], before)  # nothing ran
    assert np.isfinite(mod.train_step(**d))  # a single step gathers from the whole X: fine


def test_train_epoch_with_an_index_into_a_param_is_the_sequence_of_steps():
    P = sp.MatrixSymbol("P", 5, 3)  # trained params have fixed shapes
    idx = sbp.Index("idx", m)
    gathered = sbp.map_examples(sp.Matrix([A[0] ** 2 + A[1] * A[2]]), [(A, sbp.gather(P, idx))])
    model = sbp.Model("binder_gather_param", inputs=[X, T, idx], params=[W, P], loss=(X * W - T).T * (X * W - T) / n
                      + nn.sum_all(gathered))
    rng = np.random.default_rng(3)
    base = {"X": rng.standard_normal((10, 3)), "T": rng.standard_normal((10, 1)), "idx": np.array([4, 0, 4]),
            "W": rng.standard_normal((3, 1)), "P": rng.standard_normal((5, 3))}
    epoch_mod = sbp.compile(model, optimizer=sbp.SGD(lr=0.05))
    step_mod = sbp.compile(model, optimizer=sbp.SGD(lr=0.05))
    by_epoch = {key: v.copy() for key, v in base.items()}
    losses = epoch_mod.train_epoch(4, **by_epoch)
    by_step = {key: v.copy() for key, v in base.items()}
    expected = [step_mod.train_step(**{**by_step, "X": base["X"][s:s + 4], "T": base["T"][s:s + 4]}) for s in (0, 4, 8)]
    np.testing.assert_array_equal(losses, expected)
    np.testing.assert_array_equal(by_epoch["P"], by_step["P"])
    with pytest.raises(ArgumentError, match=r"idx holds the row number 5, outside the 5 rows"):
        epoch_mod.train_epoch(4, **{**by_epoch, "idx": np.array([0, 5])})


def test_a_prepared_call_names_an_index_refilled_out_of_range():
    P = sp.MatrixSymbol("P", c, 3)
    idx = sbp.Index("idx", m)
    gathered = sbp.map_examples(sp.Matrix([A[0] * A[1]]), [(A, sbp.gather(P, idx))])
    mod = sbp.compile(sbp.Model("binder_prepared_index", inputs=[idx], params=[P], loss=nn.sum_all(gathered)))
    call = mod.prepare("value_and_grad", idx=np.array([0, 1]), P=np.ones((3, 3)))
    loss, grads = call()
    assert loss == 2.0 and set(grads) == {"P"}
    call.inputs["idx"][1, 0] = 3
    with pytest.raises(ArgumentError, match=r"status 2.*idx holds the row number 3"):
        call()


# --- the C hot path accepts a subset of what the binder accepts ----------------

VARIANTS = {
    "plain": lambda a: a,
    "empty": lambda a: a[:0],
    "strided": lambda a: np.repeat(a, 2, axis=0)[::2],
    "fortran": np.asfortranarray,
    "float32": lambda a: a.astype(np.float32),
    "1-D": lambda a: a.reshape(-1),
    "3-D": lambda a: a[None],
    "list": lambda a: a.tolist(),
    "byteswapped": lambda a: a.astype(a.dtype.newbyteorder()),
    "readonly": lambda a: np.frombuffer(a.tobytes()).reshape(a.shape),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", ["X", "T", "W"])
def test_the_c_hot_path_accepts_only_what_the_binder_accepts(mod, variant, name):
    fn = mod.function("value_and_grad")
    if fn.fast is None:
        pytest.skip("no C hot path here")
    d = data()
    d[name] = VARIANTS[variant](d[name])
    try:
        values, _dims = fn.bind(d)
    except ArgumentError:
        accepted = None
    else:
        accepted = values
    fast = fn.fast([d[k] for k in fn.input_names])
    if type(fast) is list:
        assert accepted is not None, f"C accepted {variant} {name}, which the binder refuses"
        loss = fast[0]
        assert loss == pytest.approx(numpy_loss({k: np.asarray(v, dtype=float) for k, v in d.items()}), rel=1e-12)
    else:
        assert fast is None


# --- crash-prone cases in a child process -----------------------------------------

def _child(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ), check=False)


def test_an_empty_view_next_to_four_million_rows_is_refused_on_every_path():
    run = _child(LINEAR + """
from symbackprop.errors import ArgumentError
big = np.zeros((4_000_000, 3))
d = {"X": big[:0], "T": np.ones((4_000_000, 1)), "W": np.ones((3, 1)), "b": np.array(0.5)}
calls = [lambda: mod.value_and_grad(**d), lambda: mod.forward(**d), lambda: mod.prepare("value_and_grad", **d),
         lambda: mod.train_step(**d), lambda: mod.train_epoch(1000, **d)]
for call in calls:
    try:
        call()
    except ArgumentError as exc:
        assert "X" in str(exc) and ">= 1" in str(exc), exc
    else:
        raise SystemExit("accepted an empty X")
print("refused", len(calls))
""")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused 5" in run.stdout


def test_read_only_memory_is_refused_by_prepare_and_train_step(tmp_path):
    path = tmp_path / "W.npy"
    np.save(path, np.ones((3, 1)))
    run = _child(LINEAR + f"""
from symbackprop.errors import ArgumentError
W = np.load({str(path)!r}, mmap_mode="r")
d = {{"X": np.ones((8, 3)), "T": np.ones((8, 1)), "W": W, "b": np.array(0.5)}}
fn = mod.function("train_step")
full = dict(d)
for arg, role, key in fn.spec.extra_roles:
    shape = next(a.shape for a in fn.inputs if a.name == arg)
    full[arg] = np.full((1, 1), 0.01) if role == "hyper" else np.zeros(shape)
count = 0
for call in (lambda: mod.prepare("train_step", **full), lambda: mod.train_step(**d), lambda: mod.train_epoch(4, **d)):
    try:
        call()
    except ArgumentError as exc:
        assert "W is updated in place" in str(exc) and "read-only" in str(exc), exc
        count += 1
print("refused", count)
""")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused 3" in run.stdout


def test_short_lived_threads_leave_no_scratch_behind():
    """200 threads each make a call through the C hot path (a few MB of
    scratch each); resident memory must not grow with the thread count."""
    run = _child("""
import threading, numpy as np, sympy as sp, symbackprop as sbp
from symbackprop import nn
n = sp.Symbol("n", integer=True, positive=True)
X, W = sp.MatrixSymbol("X", n, 32), sp.MatrixSymbol("W", 32, 32)
mod = sbp.compile(sbp.Model("binder_threads", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(nn.tanh(X * W) * W))))
from symbackprop.toolchain.builder import set_blas_threads
set_blas_threads(1)  # BLAS's own threads are not checked here; spinning, they took 3/4 of the CPU time
assert mod.function("value_and_grad").fast is not None
d = {"X": np.ones((2000, 32)), "W": np.full((32, 32), 0.01)}  # about 2 MB of scratch
page = 4096
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def run():
    mod.value_and_grad(**d)
for _ in range(8):  # warm up: arenas, caches
    t = threading.Thread(target=run); t.start(); t.join()
before = rss()
for _ in range(200):
    t = threading.Thread(target=run); t.start(); t.join()
print("growth_mb", (rss() - before) / 2**20)
""")
    assert run.returncode == 0, run.stderr[-3000:]
    growth = float(run.stdout.split("growth_mb")[1])
    assert growth < 64, f"{growth:.0f} MB more after 200 threads"


# --- the ABI spec -------------------------------------------------------------------

def test_the_spec_survives_json_and_rejects_anything_else(mod):
    spec = mod.spec
    text = json.dumps(spec.to_json())
    assert ModuleSpec.from_json(json.loads(text)) == spec
    good = json.loads(text)
    spoiled = [
        lambda s: s.pop("dims"),
        lambda s: s.update(extra=1),
        lambda s: s.update(dtype="float16"),
        lambda s: s.update(has_loss="yes"),
        lambda s: s["functions"][0].update(kind="evil"),
        lambda s: s["functions"][0].update(c_name="x; system()"),
        lambda s: s["functions"][0]["inputs"][0].update(shape=["n"]),
        lambda s: s["functions"][0]["inputs"][0].update(shape=[0, 3]),
        lambda s: s["functions"][0]["inputs"][0].update(scalar=1),
        lambda s: s.update(functions={}),
    ]
    for spoil in spoiled:
        bad = json.loads(text)
        spoil(bad)
        with pytest.raises(ValueError, match="ABI spec"):
            ModuleSpec.from_json(bad)
    assert ModuleSpec.from_json(good) == spec


def test_a_memo_hit_runs_from_the_spec_and_regenerates_the_plan_lazily():
    first = sbp.compile(linear_model())
    second = sbp.compile(linear_model())  # the memo: texts, the spec and the folder
    assert second._plan is None
    d = data()
    assert second.value_and_grad(**d)[0] == pytest.approx(numpy_loss(d), rel=1e-13)
    assert second.memory(n=16) == first.memory(n=16)  # the plan, generated again on first use
    assert second.spec == first.spec


def test_the_framework_bridges_go_through_the_binder(mod):
    """An empty tensor next to a full one is refused by name in the PyTorch
    and JAX bridges too (their host calls bind like any call)."""
    d = data()
    tried = 0
    try:
        import torch
    except ImportError:
        pass
    else:
        f = mod.as_torch()
        args = {k: torch.from_numpy(np.array(v)) for k, v in d.items()}
        with pytest.raises(ArgumentError, match=r"\bX\b.*>= 1"):
            f(**{**args, "X": torch.zeros((0, 3), dtype=torch.float64)})
        w = args["W"].clone().requires_grad_(True)
        f(**{**args, "W": w}).backward()
        np.testing.assert_allclose(w.grad.numpy(), mod.value_and_grad(**d)[1]["W"], rtol=1e-14)
        tried += 1
    try:
        import jax
    except ImportError:
        pass
    else:
        jax.config.update("jax_enable_x64", True)
        g = mod.as_jax()
        with pytest.raises(Exception, match=r"\bX\b.*>= 1"):  # JAX wraps errors raised in its host callbacks
            g(**{**d, "X": np.zeros((0, 3))})
        tried += 1
    if not tried:
        pytest.skip("neither PyTorch nor JAX is installed")


def test_a_memo_of_any_other_shape_is_a_miss(mod):
    from symbackprop.run.runtime import _from_memo, _memo

    good = json.loads(json.dumps(_memo(mod.emitted, mod.spec, mod.folder)))  # JSON-able, as the cache stores it
    emitted, spec, folder = _from_memo(good)
    assert (emitted.source, spec, folder) == (mod.emitted.source, mod.spec, mod.folder)
    bad = [None, 3, "x", (mod.emitted, mod.plan, mod.folder), {}, {**good, "folder": 7},
           {**good, "emitted": {**good["emitted"], "source": None}}, {**good, "spec": {"prefix": "x"}},
           {**good, "emitted": {**good["emitted"], "prefix": "other"}}, {**good, "emitted": []}]
    for memo in bad:
        assert _from_memo(memo) is None


def test_a_writable_memmap_param_is_updated_in_place(tmp_path):
    path = tmp_path / "W.npy"
    d = data()
    np.save(path, d["W"])
    w = np.load(path, mmap_mode="r+")
    expected = {**d, "W": d["W"].copy(), "b": d["b"].copy()}  # b is updated in place too
    first, second = (sbp.compile(linear_model(), optimizer=sbp.Adam(lr=0.01)) for _ in range(2))
    assert first.train_step(**{**d, "W": w}) == second.train_step(**expected)
    np.testing.assert_array_equal(np.asarray(w), expected["W"])


INDEX_CASES = [
    ("float-rows", lambda i: i.astype(float), "integer row numbers"),
    ("uint64-rows", lambda i: i.astype(np.uint64), "integer row numbers"),
    ("bool-rows", lambda i: i > 0, "integer row numbers"),
    ("two-columns", lambda i: np.stack([i, i], axis=1), r"shape \(m, 1\)"),
    ("negative-row", lambda i: np.where(i == i[0], -1, i), "row number -1"),
    ("row-past-the-end", lambda i: i + 3, "row number 5"),
    ("empty", lambda i: i[:0], "m >= 1"),
    ("string", lambda i: "0 1", "integer row numbers"),
]


@pytest.fixture(scope="module")
def gather_mod():
    P = sp.MatrixSymbol("P", c, 3)
    idx = sbp.Index("idx", m)
    gathered = sbp.map_examples(sp.Matrix([A[0] * A[1] + A[2] ** 2]), [(A, sbp.gather(P, idx))])
    return sbp.compile(sbp.Model("binder_index", inputs=[idx], params=[P], loss=nn.sum_all(gathered)),
                       functions=("forward", "value_and_grad", "jvp"))


@pytest.mark.parametrize("entry", ["forward", "value_and_grad", "prepare", "jvp"])
@pytest.mark.parametrize("spoil, words", [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES])
def test_a_bad_index_is_refused_by_name_on_every_entry_point(gather_mod, entry, spoil, words):
    d = {"idx": np.array([0, 2, 1]), "P": np.ones((3, 3))}
    assert gather_mod.forward(**d)["loss"] == 6.0
    bad = {**d, "idx": spoil(d["idx"])}
    calls = {"forward": lambda: gather_mod.forward(**bad), "value_and_grad": lambda: gather_mod.value_and_grad(**bad),
             "prepare": lambda: gather_mod.prepare("value_and_grad", **bad),
             "jvp": lambda: gather_mod.jvp({"P": np.ones((3, 3))}, **bad)}
    with pytest.raises(ArgumentError, match=rf"idx.*{words}|{words}.*idx"):
        calls[entry]()
