"""Element-wise loops are one function per kind (emit/maps.py): an
unrolled GRU's C has a function for each kind of loop, those that repeat
called at each step; its values and gradients are those of the inline build, of numpy
(the loss) and of central differences (the gradient); a training step
whose optimizer loops repeat updates as the inline one does. The
functions' arrays are restrict: the workspace invariant that makes this
sound (no loop's buffer overlaps another of its buffers) is checked here
on the plans of several models."""

import re

import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from test_depth import check_gru_gradient, gru_data, gru_model, gru_numpy

import symbackprop as sbp
from symbackprop import pipeline
from symbackprop.emit.maps import _shape
from symbackprop.schedule.kernel import kernel_reads, kernel_writes
from symbackprop.toolchain.builder import BuildOptions

STEPS = 4


def _calls_a_loop(source: str) -> bool:
    """Whether the C calls a kind of loop's function (<prefix>_<word>_<bounds>_loop[_<hash>])."""
    return re.search(r"_loop(?:_[0-9a-f]{4})?\(", source) is not None


def _inline(monkeypatch):
    monkeypatch.setattr(pipeline, "share_maps", lambda module, claim: module)


def test_an_unrolled_gru_calls_a_function_per_kind_of_loop(monkeypatch):
    source = pipeline.generate(gru_model(STEPS), derivation=False)[0].source
    _inline(monkeypatch)
    inline = pipeline.generate(gru_model(STEPS), derivation=False)[0].source
    kinds = set(re.findall(r"^void (gru_steps\d+_\w+_loop(?:_[0-9a-f]{4})?)\($", source, re.M))
    assert 4 <= len(kinds) <= 12
    calls = {kind: len(re.findall(rf"^\s+{kind}\(\s*n,", source, re.M)) for kind in kinds}  # one argument a line where long
    assert min(calls.values()) >= 1 and sum(n >= STEPS - 1 for n in calls.values()) >= 2, calls  # some at every step
    row_loop = "for (int64_t i = 0; i < n; ++i)"
    assert inline.count(row_loop) - source.count(row_loop) == sum(calls.values()) - len(kinds)  # a call for each loop
    assert "*SYMBACKPROP_RESTRICT a0" in source and not _calls_a_loop(inline)


def test_shared_loops_compute_what_inline_ones_do(tmp_path, monkeypatch):
    data = gru_data(STEPS, rows=13)  # a vector's rows and a remainder
    shared = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "shared"))
    _inline(monkeypatch)
    inline = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "inline"))
    assert _calls_a_loop(shared.source) and not _calls_a_loop(inline.source)
    loss, grads = shared.value_and_grad(**data)
    loss_inline, grads_inline = inline.value_and_grad(**data)
    assert shared.forward(**data)["loss"] == pytest.approx(loss, rel=1e-14)
    assert loss == pytest.approx(gru_numpy(STEPS, data), rel=1e-12)
    assert loss == pytest.approx(loss_inline, rel=1e-13)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, grads_inline[name], rtol=1e-12, atol=1e-15)
    check_gru_gradient(STEPS, data, grads, ("U_r", "W_z", "b_m", "V"), seed=2)  # central differences of numpy's loss


def test_shared_loops_on_threads_compute_what_one_thread_does(tmp_path):
    """With OpenMP each kind's loop over rows runs in chunks on threads."""
    data = gru_data(STEPS, rows=70)
    serial = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "serial"))
    threaded = sbp.compile(gru_model(STEPS), options=BuildOptions(cache_dir=tmp_path / "omp", openmp=True))
    assert _calls_a_loop(threaded.source)
    loss, grads = threaded.value_and_grad(**data)
    loss_serial, grads_serial = serial.value_and_grad(**data)
    assert loss == pytest.approx(gru_numpy(STEPS, data), rel=1e-12)
    assert loss == pytest.approx(loss_serial, rel=1e-13)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, grads_serial[name], rtol=1e-12, atol=1e-15)


def test_a_training_step_with_shared_loops_updates_as_the_inline_one(tmp_path, monkeypatch):
    """train_step (a module of its own) runs the GRU's loops as calls, then
    updates the parameters in place."""
    data = gru_data(STEPS, rows=13)
    names = [p.name for p in gru_model(STEPS).params]

    def steps(options: BuildOptions) -> tuple[str, dict, list[float]]:
        optimizer = sbp.Adam(lr=0.05)
        source = pipeline.generate(gru_model(STEPS), functions=("train_step",), optimizer=optimizer,
                                   derivation=False)[0].source
        mod = sbp.compile(gru_model(STEPS), optimizer=optimizer, options=options)
        state = {name: value.copy() for name, value in data.items()}
        losses = [mod.train_step(**state) for _ in range(3)]  # in place: the parameters move on
        return source, state, losses

    source, state, losses = steps(BuildOptions(cache_dir=tmp_path / "shared"))
    _inline(monkeypatch)
    inline_source, inline_state, inline_losses = steps(BuildOptions(cache_dir=tmp_path / "inline"))
    assert _calls_a_loop(source) and not _calls_a_loop(inline_source)
    assert losses[0] == pytest.approx(gru_numpy(STEPS, data), rel=1e-12)
    np.testing.assert_allclose(losses, inline_losses, rtol=1e-12)
    assert losses[2] < losses[0]
    for name in names:
        assert not np.array_equal(state[name], data[name]), name
        np.testing.assert_allclose(state[name], inline_state[name], rtol=1e-11, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("name", ["gru", "transformer_lm", "lstm_sequence", "digits_mlp", "cnn_digits"])
def test_no_kernel_touches_two_buffers_in_the_same_memory(name):
    """What the restrict parameters rely on: in every function's plan (and
    the plan of a call that stops at the split), a kernel's workspace
    buffers are disjoint where one of them is written, at several sizes."""
    model = gru_model(STEPS) if name == "gru" else load_example(name).model
    the_plan = pipeline.plan(model)
    checked = 0
    for fn in the_plan.functions:
        schedule = fn.schedule
        plans = [(schedule.kernels, schedule.slots)]
        if schedule.split is not None:
            plans.append((schedule.kernels[:schedule.split], schedule.head_slots))
        for kernels, slots in plans:
            dims = {d for slot in slots for e in (slot.offset, *slot.shape) for d in sp.sympify(e).free_symbols}
            for size in (1, 7, 64):
                where = {slot.name: _extent(slot, dict.fromkeys(dims, size)) for slot in slots}
                for kernel in kernels:
                    written = set(kernel_writes(kernel)) & set(where)
                    touched = (written | set(kernel_reads(kernel))) & set(where)
                    for a in written:
                        for b in touched - {a}:
                            (a0, a1), (b0, b1) = where[a], where[b]
                            assert a1 <= b0 or b1 <= a0, (fn.kind, kernel, a, b, size)
                            checked += 1
    assert checked > 10


def _extent(slot, values):
    rows, cols = slot.shape
    start = int(sp.sympify(slot.offset).subs(values))
    return start, start + int((sp.sympify(rows) * sp.sympify(cols)).subs(values))


def _fields(text: str) -> dict:
    return {"loops": [("i", "n")], "hoisted": [], "parallel": True, "straight": False, "temps": [],
            "stores": [("t1[i]", text)]}


@pytest.mark.parametrize("text, shared", [
    ("exp(t0[i]) + b[0]", True),
    ("t0[i] + work[i]", False),  # the workspace itself: it holds the other buffers
    ("t0[i] + rows[i]", False),  # an Index array (int64_t)
    ("t0[i] + with_grads", False),  # a name the loop does not own
    ("t0 + i", False),  # an array not subscripted
])
def test_only_loops_naming_their_own_arrays_are_shared(text, shared):
    arrays = {"t0", "t1", "b"}
    shape = _shape(_fields(text), arrays, frozenset({"n"}))
    assert (shape is not None) is shared
    if shared:
        assert shape.arrays == ("t1", "t0", "b") and shape.written == (True, False, False) and shape.dims == ("n",)
        assert shape.fields["stores"] == [("a0[i]", "exp(a1[i]) + a2[0]")]


def test_a_split_module_compiles_its_kinds_in_several_units():
    """The functions of the kinds of loops and products are placed like the
    module's other functions (cunits): not all in unit 0."""
    emitted = pipeline.generate(gru_model(20), derivation=False)[0]
    module, source = emitted.module, emitted.source
    assert module.units > 1
    assert len({kind.unit for kind in module.maps + module.products}) > 1
    guard = re.compile(r"^#if !defined\(SYMBACKPROP_UNIT\) \|\| SYMBACKPROP_UNIT == (\d+)$", re.M)
    for kind in module.maps + module.products:
        body = re.search(rf"^void {kind.name}\((?:[^;{{]*)\)\n\{{", source, re.M)
        assert body is not None, kind.name
        unit = [int(m.group(1)) for m in guard.finditer(source, 0, body.start())][-1]  # the guard it is under
        assert unit == kind.unit, kind.name
