"""The generated C checks what it relies on (every dimension at least 1,
every Index against every array it gathers from) at its entry, before it
writes anything: called directly (cffi, and a plain C driver built with
AddressSanitizer and UndefinedBehaviorSanitizer), a failing call returns
its documented status and leaves every output, every array it updates in
place and its workspace as they were; a failing train_epoch trains nothing."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, unwrapped, write_runtime_header
from test_memory_safety import SANITIZE, SANITIZER_ENV, _sanitizer_works

import symbackprop as sbp
from symbackprop.base.abi import SIZE_DOES_NOT_FIT, STATUS_TEXT
from symbackprop.declare import nn
from symbackprop.emit.describe import NULL_POINTER, SHAPE_STATUSES
from symbackprop.pipeline import generate
from symbackprop.run.optim import SGD, Adam

N, C, K, T, V = sp.symbols("N C K T V", integer=True, positive=True)
SENTINEL = 7.25  # what every written buffer holds before a call that must fail
a = sp.Matrix(sp.symbols("a0:2", real=True))
q, x0, x1 = sp.symbols("q x0 x1", real=True)


def two_gathers_model():
    """One Index into two arrays of different rows (P: C, Q: K), read by a
    per-example map of an output (Y) that must be computed first, and a
    reduction over each row."""
    X, W = sp.MatrixSymbol("X", N, 2), sp.MatrixSymbol("W", 2, 2)
    P, Q = sp.MatrixSymbol("P", C, 2), sp.MatrixSymbol("Q", K, 1)
    idx = sbp.Index("idx", N)
    Y = (X * W).applyfunc(sp.tanh)
    body = sp.Matrix([sp.sin(a[0] * x0) + a[1] * q, sp.exp(a[1]) - x1 * q])
    R = sbp.map_examples(body, [(a, sbp.gather(P, idx)), (q, sbp.gather(Q, idx)), (sp.Matrix([x0, x1]), Y)])
    loss = nn.sum_all(sbp.reduce("logsumexp", R, 1)) + nn.sum_all(sp.HadamardPower(R, 2))
    return sbp.Model("two_gathers", inputs=[X, idx], params=[W, P, Q], loss=loss, outputs={"Y": Y, "R": R})


def two_gathers_numpy(d):
    A, Qg, Y = d["P"][d["idx"]], d["Q"][d["idx"]][:, 0], np.tanh(d["X"] @ d["W"])
    R = np.stack([np.sin(A[:, 0] * Y[:, 0]) + A[:, 1] * Qg, np.exp(A[:, 1]) - Y[:, 1] * Qg], axis=1)
    lse = np.log(np.exp(R).sum(axis=1))
    return lse.sum() + (R**2).sum(), Y, R


def trained_model():
    """A data Index (one row number per example, sliced with the examples)
    and a fixed one (`sel`, passed whole to every step)."""
    X, P, B = sp.MatrixSymbol("X", N, 2), sp.MatrixSymbol("P", 4, 2), sp.MatrixSymbol("B", 3, 1)
    idx, sel = sbp.Index("idx", N), sbp.Index("sel", 2)
    R = sbp.map_examples(sp.Matrix([a[0] * x0 + sp.tanh(a[1]) * x1]), [(a, sbp.gather(P, idx)), (sp.Matrix([x0, x1]), X)])
    loss = nn.sum_all(sp.HadamardPower(R, 2)) + nn.sum_all(sp.HadamardPower(sbp.gather(B, sel), 2))
    return sbp.Model("trained", inputs=[X, idx, sel], params=[P, B], loss=loss)


def sliced_gather_model():
    """An Index into a data input: train_epoch slices the array it gathers
    from, so the C checks its row numbers against the smallest minibatch."""
    X, W = sp.MatrixSymbol("X", N, 2), sp.MatrixSymbol("W", 2, 1)
    sel = sbp.Index("sel", 2)
    return sbp.Model("sliced", inputs=[X, sel], params=[W], loss=nn.sum_all(sp.HadamardPower(sbp.gather(X, sel) * W, 2)))


def embed_rnn_model():
    """Rows of an embedding gathered by token, then a scan over them."""
    E, W, U = sp.MatrixSymbol("E", V, 2), sp.MatrixSymbol("W", 2, 2), sp.MatrixSymbol("U", 2, 2)
    h, x, h0 = sp.MatrixSymbol("h", 1, 2), sp.MatrixSymbol("x", 1, 2), sp.MatrixSymbol("h0", 1, 2)
    tok = sbp.Index("tok", T)
    new = (h * W + x * U).applyfunc(sp.tanh)
    Y = sbp.scan(new, new * sp.OneMatrix(2, 1), h, x, h0, sbp.gather(E, tok))
    loss = sp.OneMatrix(1, T) * sp.HadamardPower(Y, 2)
    return sbp.Model("embed_rnn", inputs=[tok], params=[E, W, U, h0], loss=loss, outputs={"Y": Y})


def embed_rnn_numpy(d):
    h, ys = d["h0"], []
    for t in d["tok"]:
        h = np.tanh(h @ d["W"] + d["E"][t:t + 1] @ d["U"])
        ys.append(h.sum())
    ys = np.array(ys).reshape(-1, 1)
    return float((ys**2).sum()), ys


@pytest.fixture(scope="module")
def two_gathers():
    return sbp.compile(two_gathers_model(), functions=("forward", "value_and_grad", "vjp"))  # GATHER_FUNCTIONS


@pytest.fixture(scope="module")
def embed_rnn():
    return sbp.compile(embed_rnn_model())


def two_gathers_data(rows=7):
    rng = np.random.default_rng(3)
    return {"X": rng.standard_normal((rows, 2)), "idx": rng.integers(0, 2, rows), "W": rng.standard_normal((2, 2)),
            "P": rng.standard_normal((4, 2)), "Q": rng.standard_normal((2, 1))}


def embed_data(steps=6):
    rng = np.random.default_rng(5)
    return {"tok": rng.integers(0, 5, steps), "E": rng.standard_normal((5, 2)), "W": rng.standard_normal((2, 2)) / 2,
            "U": rng.standard_normal((2, 2)) / 2, "h0": rng.standard_normal((1, 2))}


# --- calling a generated function directly --------------------------------------
# Arguments are laid out from the ABI codegen emitted (emitted.module), not
# through the runtime's binder: only the cffi library comes from the module.


class Direct:
    """One generated C function called through cffi with every Python check
    bypassed: inputs from `given` (0.1 for the ones not given: optimizer
    hyperparameters and state), outputs and workspace filled with SENTINEL."""

    def __init__(self, mod, model, functions, cname, sizes, given):
        emitted, _ = generate(model, functions=functions, optimizer=getattr(mod, "optimizer", None))
        self.cfn = next(f for f in emitted.module.functions if f.name == cname)
        self.epoch = emitted.module.epoch
        kind = cname[len(emitted.prefix) + 1:]
        fn = mod.function("vjp", kind[4:]) if kind.startswith("vjp_") else mod.function(kind)
        self.lib, self.ffi = fn.lib, fn.ffi
        self.sizes = {p.cname: sizes[p.name] for p in self.cfn.params if p.role == "dim"}
        self.dims = list(self.sizes.values())
        self.arrays = {}
        for p in self.cfn.params:
            if p.role in ("input", "inout"):
                index = p.decl.startswith("const int64_t *")
                value, shape = np.asarray(given.get(p.name, 0.1)), self.shape(p)
                value = value.reshape(shape) if value.size == np.prod(shape) else np.broadcast_to(value, shape)
                self.arrays[p.cname] = np.array(value, dtype=np.int64 if index else float)

    def shape(self, p):
        return tuple(int(eval(d, {}, dict(self.sizes))) for d in p.shape)

    def __call__(self, dims=None):
        buf = self.ffi.from_buffer
        outputs = [np.full(self.shape(p), SENTINEL) for p in self.cfn.params if p.role == "output"]
        work = np.full(max(getattr(self.lib, self.cfn.name + "_work_len")(*self.dims), 1), SENTINEL)
        before = {k: v.copy() for k, v in self.arrays.items()}
        args = [buf(self.arrays[p.cname]) for p in self.cfn.params if p.role in ("input", "inout")]
        status = getattr(self.lib, self.cfn.name)(*(self.dims if dims is None else dims), *args,
                                                   *[buf(o) for o in outputs], buf(work))
        self.outputs = outputs
        self.unchanged = all(np.array_equal(before[k], v) for k, v in self.arrays.items()) and \
            all((o == SENTINEL).all() for o in outputs) and (work == SENTINEL).all()
        return status

    def epoch_call(self, rows, batch, order=None, dims=None):
        """<prefix>_train_epoch on the arrays (laid out with `rows` examples)."""
        e, buf = self.epoch, self.ffi.from_buffer
        losses = np.full(-(-rows // batch), SENTINEL)
        work = np.full(max(getattr(self.lib, e.name + "_work_len")(rows, batch), 1), SENTINEL)
        before = {k: v.copy() for k, v in self.arrays.items()}
        order_arg = self.ffi.NULL if order is None else buf(np.ascontiguousarray(order, dtype=np.int64))
        args = [buf(self.arrays[p.cname]) for p in self.cfn.params if p.role in ("input", "inout")]
        status = getattr(self.lib, e.name)(*((rows, batch) if dims is None else dims), order_arg, *args, buf(losses),
                                          buf(work))
        self.unchanged = all(np.array_equal(before[k], v) for k, v in self.arrays.items()) and \
            (losses == SENTINEL).all() and (work == SENTINEL).all()
        return status


GATHER_FUNCTIONS = ("forward", "value_and_grad", "vjp")


@pytest.mark.parametrize("kind", ["forward", "value_and_grad", "vjp_R"])
@pytest.mark.parametrize("bad, where", [(2, 0), (2, -1), (4, 3), (-1, 0), (2**62, -1)])
def test_a_bad_index_returns_2_and_writes_nothing(two_gathers, kind, bad, where):
    """2 is a row of P (4 rows) but not of Q (2 rows): refused all the same."""
    d = two_gathers_data()
    call = Direct(two_gathers, two_gathers_model(), GATHER_FUNCTIONS, f"two_gathers_{kind}", {"N": 7, "C": 4, "K": 2},
                  {**d, "seed_R": np.ones((7, 2))})
    assert call() == 0 and not call.unchanged
    if kind == "forward":  # the oracle for the valid call: numpy
        loss, Y, R = two_gathers_numpy(d)
        assert call.outputs[0][0, 0] == pytest.approx(loss, rel=1e-12)
        np.testing.assert_allclose(call.outputs[1], Y, rtol=1e-13)
        np.testing.assert_allclose(call.outputs[2], R, rtol=1e-13)
    call.arrays["idx"][where] = bad
    assert call() == 2
    assert call.unchanged


@pytest.mark.parametrize("kind", ["forward", "value_and_grad"])
@pytest.mark.parametrize("position", [0, 5])
def test_a_bad_token_before_a_scan_writes_nothing(embed_rnn, kind, position):
    e = embed_data()
    call = Direct(embed_rnn, embed_rnn_model(), ("forward", "value_and_grad"), f"embed_rnn_{kind}", {"T": 6, "V": 5}, e)
    assert call() == 0
    if kind == "forward":
        loss, ys = embed_rnn_numpy(e)
        assert call.outputs[0][0, 0] == pytest.approx(loss, rel=1e-12)
        np.testing.assert_allclose(call.outputs[1], ys, rtol=1e-12)
    call.arrays["tok"][position] = 5  # E has 5 rows
    assert call() == 2 and call.unchanged


@pytest.mark.parametrize("value", [0, -1, -(2**40)])
def test_a_dimension_below_1_returns_1_and_writes_nothing(two_gathers, embed_rnn, value):
    cases = [(two_gathers, two_gathers_model(), GATHER_FUNCTIONS, {"N": 7, "C": 4, "K": 2}, two_gathers_data()),
             (embed_rnn, embed_rnn_model(), ("forward", "value_and_grad"), {"T": 6, "V": 5}, embed_data())]
    for mod, model, functions, sizes, data in cases:
        for kind in ("forward", "value_and_grad"):
            call = Direct(mod, model, functions, f"{model.name}_{kind}", sizes, data)
            for k in range(len(call.dims)):
                dims = list(call.dims)
                dims[k] = value
                assert call(dims) == 1, (kind, k)
                assert call.unchanged, (kind, k)
                assert getattr(call.lib, call.cfn.name + "_work_len")(*dims) == 0  # not a size from negative products


# --- training ------------------------------------------------------------------

TRAIN_FUNCTIONS = ("forward", "value_and_grad", "train_step")


def trained_data(rows=10):
    rng = np.random.default_rng(8)
    return {"X": rng.standard_normal((rows, 2)), "idx": rng.integers(0, 4, rows), "sel": np.array([2, 0]),
            "P": rng.standard_normal((4, 2)), "B": rng.standard_normal((3, 1)), "lr": 0.05}


@pytest.fixture(scope="module")
def trained():
    return sbp.compile(trained_model(), functions=TRAIN_FUNCTIONS, optimizer=Adam(lr=0.05))


def train_call(mod, rows=10):
    return Direct(mod, trained_model(), TRAIN_FUNCTIONS, "trained_train_step", {"N": rows}, trained_data(rows))


@pytest.mark.parametrize("name, bad", [("idx", 4), ("idx", -1), ("sel", 3)])
def test_train_step_with_a_bad_index_trains_nothing(trained, name, bad):
    call = train_call(trained)
    assert call() == 0 and not call.unchanged  # a step changes the parameters
    call = train_call(trained)
    call.arrays[name][-1] = bad
    assert call() == 2
    assert call.unchanged, "a parameter, the optimizer state, the loss or the workspace changed"


@pytest.mark.parametrize("position", [0, 4, 9])
@pytest.mark.parametrize("ordered", [False, True])
def test_train_epoch_with_one_bad_row_anywhere_trains_nothing(trained, position, ordered):
    """Row 9 is in the last of four minibatches: three steps would have run."""
    call = train_call(trained)
    order = np.random.default_rng(1).permutation(10) if ordered else None
    assert call.epoch_call(10, 3, order) == 0 and not call.unchanged
    call = train_call(trained)
    call.arrays["idx"][position] = 4
    assert call.epoch_call(10, 3, order) == 2 and call.unchanged


def test_train_epoch_with_a_bad_fixed_index_order_or_dimension_trains_nothing(trained):
    call = train_call(trained)
    call.arrays["sel"][1] = 3
    assert call.epoch_call(10, 3) == 2 and call.unchanged
    call = train_call(trained)
    for order in (np.r_[np.arange(9), 10], np.r_[-1, np.arange(1, 10)]):
        assert call.epoch_call(10, 3, order) == 2 and call.unchanged
    for dims in ((0, 3), (10, 0), (-5, 3), (10, -1)):
        assert call.epoch_call(10, 3, dims=dims) == 1 and call.unchanged


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_train_epoch_with_index_data_equals_its_steps(ordered, dtype):
    """The oracle: train_step on each minibatch in turn, bit for bit (float32:
    the gathered rows of the Index take two workspace entries each)."""
    d = trained_data()
    params = {"P": d.pop("P").astype(dtype), "B": d.pop("B").astype(dtype)}
    del d["lr"]
    d["X"] = d["X"].astype(dtype)
    order = np.random.default_rng(2).permutation(10) if ordered else np.arange(10)
    mod = sbp.compile(trained_model(), dtype=dtype, optimizer=Adam(lr=0.05))
    epoch_params = {k: v.copy() for k, v in params.items()}
    losses = mod.train_epoch(3, order if ordered else None, **d, **epoch_params)
    steps = sbp.compile(trained_model(), dtype=dtype, optimizer=Adam(lr=0.05))
    step_params = {k: v.copy() for k, v in params.items()}
    expected = [steps.train_step(X=d["X"][order[s:s + 3]], idx=d["idx"][order[s:s + 3]], sel=d["sel"], **step_params)
                for s in range(0, 10, 3)]
    np.testing.assert_array_equal(losses, expected)
    for k in params:
        np.testing.assert_array_equal(epoch_params[k], step_params[k])
        assert not np.array_equal(epoch_params[k], params[k])


def test_an_index_alone_is_sliced_as_data():
    """Tokens are the only data: minibatches [0, 1], [4, 4], [2] of sum(E[tok]**2)
    under SGD(lr=0.1) scale a row chosen k times in one step by 1 - 0.2k."""
    E, tok = sp.MatrixSymbol("E", 5, 2), sbp.Index("tok", T)
    model = sbp.Model("tokens", inputs=[tok], params=[E], loss=nn.sum_all(sp.HadamardPower(sbp.gather(E, tok), 2)))
    mod = sbp.compile(model, optimizer=SGD(lr=0.1))
    E_value = np.ones((5, 2))
    losses = mod.train_epoch(2, None, tok=np.array([0, 1, 4, 4, 2]), E=E_value)
    np.testing.assert_array_equal(losses, [4.0, 4.0, 2.0])
    np.testing.assert_allclose(E_value[:, 0], [0.8, 0.8, 0.8, 1.0, 0.6], rtol=1e-15)
    with pytest.raises(sbp.ArgumentError, match="tok"):
        mod.train_epoch(2, None, tok=np.array([0, 1, 5, 4, 2]), E=E_value)
    np.testing.assert_allclose(E_value[:, 0], [0.8, 0.8, 0.8, 1.0, 0.6], rtol=1e-15)


def anchors_model():
    """An Index of a length of its own (M), passed whole to every step."""
    M = sp.Symbol("M", integer=True, positive=True)
    X, P, W = sp.MatrixSymbol("X", N, 2), sp.MatrixSymbol("P", 4, 2), sp.MatrixSymbol("W", 2, 1)
    sel = sbp.Index("sel", M)
    loss = nn.sum_all(sp.HadamardPower(X * W, 2)) + nn.sum_all(sp.HadamardPower(sbp.gather(P, sel), 2))
    return sbp.Model("anchors", inputs=[X, sel], params=[P, W], loss=loss)


def test_an_index_of_its_own_length_is_passed_whole():
    """`sel` has a dimension of its own (M): not a batch dimension, so the
    epoch slices X only and checks every row of sel once, before the first step."""
    model = anchors_model()
    emitted, _ = generate(model, functions=("forward", "train_step"), optimizer=SGD(lr=0.1))
    assert [d.cname for d in emitted.module.epoch.data] == ["X"]
    assert emitted.module.epoch.checks == (("sel", "M", ("4",)),)
    mod = sbp.compile(model, functions=("forward", "train_step"), optimizer=SGD(lr=0.1))
    rng = np.random.default_rng(6)
    data = {"X": rng.standard_normal((5, 2)), "sel": np.array([3, 0, 3])}
    by_epoch = {"P": rng.standard_normal((4, 2)), "W": rng.standard_normal((2, 1))}
    by_steps = {k: v.copy() for k, v in by_epoch.items()}
    losses = mod.train_epoch(2, None, **data, **by_epoch)
    expected = [mod.train_step(X=data["X"][s:s + 2], sel=data["sel"], **by_steps) for s in range(0, 5, 2)]
    np.testing.assert_array_equal(losses, expected)
    for k in by_epoch:
        np.testing.assert_array_equal(by_epoch[k], by_steps[k])


def test_an_index_into_sliced_data_is_checked_against_the_smallest_minibatch():
    """10 rows in minibatches of 4 leave 2 rows for the last: a row number 2
    fits the first two minibatches only, so the epoch refuses it up front."""
    mod = sbp.compile(sliced_gather_model(), functions=("forward", "train_step"), optimizer=SGD(lr=0.1))
    rng = np.random.default_rng(4)
    data = {"X": rng.standard_normal((10, 2)), "sel": np.array([1, 0]), "W": rng.standard_normal((2, 1))}
    call = Direct(mod, sliced_gather_model(), ("forward", "train_step"), "sliced_train_step", {"N": 10}, data)
    assert call.epoch_call(10, 4) == 0 and not call.unchanged
    call = Direct(mod, sliced_gather_model(), ("forward", "train_step"), "sliced_train_step", {"N": 10}, data)
    call.arrays["sel"][0] = 2
    assert call.epoch_call(10, 4) == 2 and call.unchanged
    assert call.epoch_call(10, 5) == 0  # minibatches of 5 rows: 2 fits every one


# --- the header ------------------------------------------------------------------


STATUS_LINE = re.compile(r"^ \* Returns (\d): ")


def documented_statuses(header: str) -> dict[str, set[int]]:
    statuses, seen = {}, set()
    for line in header.splitlines():
        if line.startswith("/*"):
            seen = set()
        match = STATUS_LINE.match(line)
        if match:
            seen.add(int(match.group(1)))
        prototype = re.match(r"^int (\w+)\((.*)\);$", line)
        if prototype:
            statuses[prototype.group(1)] = seen
    return statuses


def fixed_model():
    w, x = sp.MatrixSymbol("w", 1, 3), sp.MatrixSymbol("x", 3, 1)
    return sbp.Model("fixed", inputs=[x], params=[w], loss=nn.sum_all(nn.tanh(w * x)))


@pytest.mark.parametrize("model", [two_gathers_model, trained_model, embed_rnn_model, fixed_model])
def test_the_header_lists_every_status_of_each_function(model):
    """0 always; 1 and 6 (a size over the limit) where there are dimensions;
    2 where an Index is read (and always for train_epoch, which takes a row
    order). The top of the
    header lists every status (STATUS_TEXT); the self-describing shape
    functions return only 0, 1 and 3."""
    functions = ("forward", "value_and_grad", "train_step")
    emitted, _ = generate(model(), functions=functions, optimizer=SGD(lr=0.1))
    header = unwrapped(emitted.header)
    documented = documented_statuses(header)
    computing = {name for name in re.findall(r"^size_t (\w+)_work_len\(", header, re.M)
                 if not name.endswith("_call")}  # F_call: the header's top says what it returns
    prototypes = [(name, params) for name, params in re.findall(r"^int (\w+)\((.*)\);$", header, re.M)
                  if name in computing]
    assert {name for name, _ in prototypes} == computing and computing <= set(documented)
    for name, params in prototypes:
        expected = {0}
        if "int64_t " in params.replace("const int64_t *", ""):
            expected |= {1, SIZE_DOES_NOT_FIT}
        if "const int64_t *" in params:  # an Index, or train_epoch's order
            expected.add(2)
        assert documented[name] == expected, name
    assert set(re.findall(r"Returns (\d+)", emitted.header)) <= {"0", "1", "2", str(SIZE_DOES_NOT_FIT)}
    listed = re.findall(r"^ \*   (\d+): (.*)$", emitted.header, re.M)
    assert {int(code): text for code, text in listed} == STATUS_TEXT
    computing_text, _, describing_text = emitted.source.partition("/* --- what the functions take")
    assert describing_text
    assert set(re.findall(r"return (\d+);", computing_text)) <= {"0", "1", "2", str(SIZE_DOES_NOT_FIT)}  # no other
    shape_bodies = re.findall(r"^int \w+_shape_(?:in|out)\(.*?^}", describing_text, re.M | re.S)
    returned = {int(s) for body in shape_bodies for s in re.findall(r"return (\d+);", body)}
    assert shape_bodies and {0, 3} <= returned <= set(SHAPE_STATUSES)
    call_bodies = re.findall(r"^int \w+_call\(.*?^}", describing_text, re.M | re.S)
    assert len(call_bodies) == len(computing)  # one array-form call a function: 4, or what the function returns
    assert {int(s) for body in call_bodies for s in re.findall(r"return (\d+);", body)} == {NULL_POINTER}


# --- sanitizers: a plain C driver ------------------------------------------------


def _shape_size(shape) -> str:
    return " * ".join(f"(size_t)({d})" for d in shape) or "1"


def _index_bound(checks, cname) -> str | None:
    bounds = [b for index, _, bs in checks if index == cname for b in bs]
    if not bounds:
        return None
    text = bounds[0]
    for b in bounds[1:]:
        text = f"({text} < {b} ? {text} : {b})"
    return text


def _arrays(params, checks, roles=("input", "inout", "output")):
    """Declarations of exact-size arrays for `params`, and what to free."""
    lines, names = [], []
    for salt, p in enumerate(params):
        if p.role not in roles:
            continue
        size = _shape_size(p.shape)
        names.append(p.cname)
        if p.decl.startswith("const int64_t *"):
            bound = _index_bound(checks, p.cname)
            lines.append(f"int64_t *{p.cname} = rows_of({size}, {bound or 1});")
        else:
            lines.append(f"real *{p.cname} = values({size}, {salt if p.role != 'output' else -1});")
        lines.append(f"const size_t n_{p.cname} = {size}; (void)n_{p.cname};")
    return lines, names


def _snapshot(names, writable):
    lines = [f"real *s_{n} = malloc(n_{n} * sizeof(real) + 1); memcpy(s_{n}, {n}, n_{n} * sizeof(real));"
             for n in names if n in writable]
    same = " && ".join(f"!memcmp(s_{n}, {n}, n_{n} * sizeof(real))" for n in names if n in writable) or "1"
    return lines, same


def _failing_calls(name, args, dims, index_params, checks, same, code):
    """Calls that must fail: each bad row number (each Index, first and last
    row, past the smallest bound, negative, huge) and each dimension below 1;
    again with NULL for every array the checks do not read (the workspace
    stays: a wrapper points into it once the dimensions are checked)."""
    lines = []
    nulls = [a if a in index_params or a in dims or a in ("order", "work") else "NULL" for a in args]
    for index in index_params:
        bound = _index_bound(checks, index)
        for at in ("0", f"n_{index} - 1"):
            for bad in (bound, "-1", "INT64_MAX"):
                lines += [f"{{ const int64_t keep = {index}[{at}]; {index}[{at}] = {bad};",
                          f"  if ({name}({', '.join(args)}) != 2 || !({same})) return {code};",
                          f"  if ({name}({', '.join(nulls)}) != 2) return {code + 1};",
                          f"  {index}[{at}] = keep; }}"]
    for d in dims:
        for value in ("0", "-1"):
            changed = [value if a == d else a for a in args]
            lines.append(f"if ({name}({', '.join(changed)}) != 1 || !({same})) return {code + 2};")
            lines.append(f"if ({name}({', '.join(value if a == d else ('NULL' if a not in dims else a) for a in args)}) != 1) "
                         f"return {code + 3};")
    return lines


def function_block(fn, sizes, code):
    """Valid call, then every failing one, for a public function."""
    dims = [p.cname for p in fn.params if p.role == "dim"]
    lines = [f"const int64_t {p.cname} = {sizes[p.name]};" for p in fn.params if p.role == "dim"]
    arrays, names = _arrays(fn.params, fn.checks)
    lines += arrays
    lines.append(f"real *work = values({fn.name}_work_len({', '.join(dims) or ''}), -1);")
    lines.append(f"const size_t n_work = {fn.name}_work_len({', '.join(dims) or ''});")
    args = [p.cname for p in fn.params]
    lines.append(f"if ({fn.name}({', '.join(args)}) != 0) return {code};")
    writable = {p.cname for p in fn.params if p.role in ("inout", "output")} | {"work"}
    snap, same = _snapshot(names + ["work"], writable)
    lines += snap
    index_params = [index for index, _, _ in fn.checks]  # an Index a function never reads (vjp of Y) is not checked
    lines += _failing_calls(fn.name, args, dims, index_params, fn.checks, same, code + 1)
    lines += [f"free({n});" for n in names + ["work"]] + [f"free(s_{n});" for n in names + ["work"] if n in writable]
    return ["{", *("    " + line for line in lines), "}"]


def epoch_block(e, step, sizes, rows, batch, code):
    """train_epoch: valid calls (in order, and with a row order), then failing ones."""
    lines = [f"const int64_t {e.rows} = {rows};", f"const int64_t {e.batch} = {batch};",
             f"const int64_t {e.size} = {e.rows};",
             f"const int64_t {e.last} = {e.rows} - ({e.rows} - 1) / {e.batch} * {e.batch};"]
    lines += [f"const int64_t {p.cname} = {sizes[p.name]};" for p in step.params if p.role == "dim" and p.cname != e.size]
    params = [p for p in step.params if p.role in ("input", "inout")]
    arrays, names = _arrays(params, e.checks)
    lines += arrays
    lines.append(f"real *losses = values({-(-rows // batch)}, -1); const size_t n_losses = {-(-rows // batch)};")
    lines.append(f"int64_t *order = rows_of({e.rows}, 1); for (int64_t k = 0; k < {e.rows}; ++k) order[k] = {e.rows} - 1 - k;")
    lines.append(f"real *work = values({e.name}_work_len({e.dim_args}), -1);")
    lines.append(f"const size_t n_work = {e.name}_work_len({e.dim_args});")
    lines.append(f"(void){e.last}; (void){e.size};")
    args = [e.rows, e.batch, *e.dims, "order", *(p.cname for p in params), "losses", "work"]
    lines.append(f"if ({e.name}({', '.join(['NULL' if a == 'order' else a for a in args])}) != 0) return {code};")
    lines.append(f"if ({e.name}({', '.join(args)}) != 0) return {code};")
    writable = {p.cname for p in params if p.role == "inout"} | {"losses", "work"}
    snap, same = _snapshot(names + ["losses", "work"], writable)
    lines += snap
    index_params = [index for index, _, _ in e.checks]
    lines += _failing_calls(e.name, args, [e.rows, e.batch, *e.dims], index_params, e.checks, same, code + 1)
    for bad in (e.rows, "-1"):
        lines += [f"{{ const int64_t keep = order[{e.rows} - 1]; order[{e.rows} - 1] = {bad};",
                  f"  if ({e.name}({', '.join(args)}) != 2 || !({same})) return {code + 5};",
                  f"  order[{e.rows} - 1] = keep; }}"]
    lines += [f"free({n});" for n in names + ["losses", "order", "work"]]
    lines += [f"free(s_{n});" for n in names + ["losses", "work"] if n in writable]
    return ["{", *("    " + line for line in lines), "}"]


DRIVER_HEAD = """#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "{header}"

typedef {real} real;

static real *values(size_t count, int salt) {{
    real *a = malloc(count ? count * sizeof(real) : 1);
    for (size_t k = 0; k < count; ++k) a[k] = salt < 0 ? (real)7.25 : (real)(sin((double)k + salt) * 0.5);
    return a;
}}

static int64_t *rows_of(size_t count, int64_t bound) {{
    int64_t *a = malloc(count ? count * sizeof(int64_t) : 1);
    for (size_t k = 0; k < count; ++k) a[k] = (int64_t)(k % (size_t)bound);
    return a;
}}

int main(void) {{
"""


def driver(emitted, sizes, epoch=None):
    lines = [DRIVER_HEAD.format(header=f"{emitted.prefix}.h", real=emitted.module.real_c)]
    for number, fn in enumerate(emitted.module.functions):
        lines += ["    " + line for line in function_block(fn, sizes, 10 * (number + 1))]
    if emitted.module.epoch is not None and epoch is not None:
        step = next(f for f in emitted.module.functions if f.name.endswith("_train_step"))
        for rows, batch in epoch:
            lines += ["    " + line for line in epoch_block(emitted.module.epoch, step, sizes, rows, batch, 200)]
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def sanitizer(tmp_path_factory):
    if not _sanitizer_works(tmp_path_factory.mktemp("probe")):
        pytest.skip("no working -fsanitize=address,undefined runtime for cc")


SANITIZED = {  # model, functions, dimensions, dtype, train_epoch's (rows, batch) to try
    "two_gathers": (two_gathers_model, ("forward", "value_and_grad", "vjp"), {"N": 5, "C": 4, "K": 2}, "float64", None),
    "trained": (trained_model, TRAIN_FUNCTIONS, {"N": 7}, "float64", [(7, 3), (7, 7), (7, 10), (1, 1)]),
    "trained_float32": (trained_model, TRAIN_FUNCTIONS, {"N": 7}, "float32", [(7, 3), (7, 2), (1, 1)]),
    "sliced": (sliced_gather_model, ("forward", "train_step"), {"N": 6}, "float64", [(6, 4), (6, 2)]),
    "embed_rnn": (embed_rnn_model, ("forward", "value_and_grad"), {"T": 4, "V": 3}, "float32", None),
    "anchors": (anchors_model, ("forward", "train_step"), {"N": 5, "M": 3}, "float64", [(5, 2), (5, 5)]),
}


@pytest.mark.parametrize("name", sorted(SANITIZED))
def test_valid_and_failing_calls_are_clean_under_sanitizers(name, sanitizer, tmp_path):
    """Exact-size arrays; every failing call must return its status, leave
    every written buffer as it was, and read nothing but the indices (the
    same calls with NULL for every other array)."""
    model, functions, sizes, dtype, epochs = SANITIZED[name]
    emitted, _ = generate(model(), dtype=dtype, functions=functions, optimizer=SGD(lr=0.1))
    (tmp_path / f"{emitted.prefix}.c").write_text(emitted.source)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    (tmp_path / "driver.c").write_text(driver(emitted, sizes, epochs))
    exe = tmp_path / "driver"
    built = subprocess.run(["cc", *SANITIZE, *STRICT_FLAGS[1:], f"-I{tmp_path}", str(tmp_path / f"{emitted.prefix}.c"),
                            str(tmp_path / "driver.c"), "-o", str(exe), "-lm"], capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, env={**os.environ, **SANITIZER_ENV}, timeout=300,
                         check=False)
    assert run.returncode == 0, f"driver exit {run.returncode}:\n{run.stderr[-4000:]}"
    assert "runtime error" not in run.stderr and "Sanitizer" not in run.stderr, run.stderr[-4000:]


# --- gathers the entry checks cannot cover -----------------------------------------


def test_a_scan_step_cannot_gather():
    """The premise of checking at entry only: a step has no Index of its own."""
    P, h, x = sp.MatrixSymbol("P", K, 2), sp.MatrixSymbol("h", 1, 2), sp.MatrixSymbol("x", 1, 2)
    X, h0, idx = sp.MatrixSymbol("X", T, 2), sp.MatrixSymbol("h0", 1, 2), sbp.Index("idx", 1)
    final = sbp.scan((h + x + sbp.gather(P, idx)).applyfunc(sp.tanh), None, h, x, h0, X)
    model = sbp.Model("step_gather", inputs=[X, idx], params=[P, h0], loss=final * sp.OneMatrix(2, 1))
    with pytest.raises(sbp.ModelError, match="Index idx"):
        generate(model)


def test_a_gather_nested_in_a_kernel_schedule_is_refused():
    """Should a nested step ever gather, its rows would go unchecked: codegen refuses."""
    from types import SimpleNamespace

    from symbackprop.base.cnames import CNamer
    from symbackprop.emit.cfunction import entry_checks
    from symbackprop.emit.codegen import FLOAT64, FunctionEmitter
    from symbackprop.ops.emap_kernel import EmapKernel
    from symbackprop.schedule.scheduler import FunctionSchedule

    gather = EmapKernel((N,), (), (), (), (), (("idx", N, C),), ())
    step = FunctionSchedule("step", (), (gather,), (), sp.Integer(0))
    outer = FunctionSchedule("f", (), (SimpleNamespace(loops=(SimpleNamespace(schedule=step),)),), (), sp.Integer(0))
    emitter = FunctionEmitter(CNamer(frozenset({"m"})), {N: "N", C: "C"}, FLOAT64)
    assert entry_checks(step, emitter) == (("idx", "N", ("C",)),)
    with pytest.raises(AssertionError, match="nested step"):
        entry_checks(outer, emitter)
