"""Nothing silently wrong at the size limits (issue 44).

The generated C computes every size (an array's rows x columns, a
workspace, the minibatches of an epoch) from dimensions a C caller may pass
as large as INT64_MAX: each is checked, and a call whose sizes do not fit
returns base.abi.SIZE_DOES_NOT_FIT (its work_len 0, its shape functions that
status) instead of sizing a buffer from a value that wrapped around. The
generated C is built with the strict flags (C99, no extension) and called
through cffi in a child process, so a regression that writes out of bounds
fails the test instead of the test run. A scan's checkpoint segment is sized
by the sequence, not by the interval asked for."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, write_runtime_header

import symbackprop as sbp
from symbackprop.base.abi import SIZE_DOES_NOT_FIT, SIZE_LIMIT, STATUS_TEXT
from symbackprop.declare import nn
from symbackprop.pipeline import generate
from symbackprop.run.optim import Adam

INT64_MAX = 2**63 - 1
n, N, K = sp.symbols("n N K", integer=True, positive=True)


def mlp_model():
    X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 2)
    W1, W2 = sp.MatrixSymbol("W1", 3, 4), sp.MatrixSymbol("W2", 4, 2)
    Y = nn.tanh(X * W1) * W2
    return sbp.Model("bmlp", inputs=[X, T], params=[W1, W2], loss=nn.mse(Y, T))


def product_model():
    """Arrays of N x K entries: each dimension fits, their product may not."""
    X, W = sp.MatrixSymbol("X", N, K), sp.MatrixSymbol("W", K, 1)
    return sbp.Model("bprod", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W)))


CHILD = r"""
import json, sys
import cffi
ffi = cffi.FFI()
ffi.cdef('''
int bmlp_train_epoch_shape_out(int64_t i, const int64_t *dims, int64_t shape[2]);
int bmlp_train_epoch_shape_in(int64_t i, const int64_t *dims, int64_t shape[2]);
size_t bmlp_train_epoch_work_len(int64_t rows, int64_t batch);
int bmlp_train_epoch(int64_t rows, int64_t batch, const int64_t *order, void *X, void *T, void *W1, void *W2,
                     void *lr, void *beta1, void *beta2, void *eps, void *weight_decay, void *step, void *m_W1,
                     void *v_W1, void *m_W2, void *v_W2, void *losses, void *work);
int bmlp_forward_shape_out(int64_t i, const int64_t *dims, int64_t shape[2]);
size_t bmlp_forward_work_len(int64_t n);
int bmlp_forward(int64_t n, void *X, void *T, void *W1, void *W2, void *loss, void *work);
int bprod_forward_shape_in(int64_t i, const int64_t *dims, int64_t shape[2]);
size_t bprod_forward_work_len(int64_t N, int64_t K);
int bprod_forward(int64_t N, int64_t K, void *X, void *W, void *loss, void *work);
''')
out = {}
for name in ("bmlp", "bprod"):
    lib = ffi.dlopen(sys.argv[1] + "/lib" + name + ".so")
    shape = ffi.new("int64_t[2]")
    small, work = ffi.new("double[4096]"), ffi.new("double[4096]")
    for dims in json.loads(sys.argv[2])[name]:
        d = ffi.new("int64_t[]", dims)
        if name == "bmlp" and len(dims) == 2:
            shape[0] = shape[1] = -7
            status = lib.bmlp_train_epoch_shape_out(0, d, shape)
            losses = list(shape) if status == 0 else None
            status_in = lib.bmlp_train_epoch_shape_in(1, d, shape)
            work_len = lib.bmlp_train_epoch_work_len(*dims)
            # the arrays hold 4096 doubles: a call that fits them runs, one that does not must refuse
            call = lib.bmlp_train_epoch(dims[0], dims[1], ffi.NULL, *[small] * 15, work)
            out[f"{name} {dims}"] = [status, losses, status_in, work_len, call]
        elif name == "bmlp":
            status = lib.bmlp_forward_shape_out(0, d, shape)
            out[f"{name} {dims}"] = [status, lib.bmlp_forward_work_len(*dims),
                                     lib.bmlp_forward(dims[0], *[small] * 5, work)]
        else:
            status = lib.bprod_forward_shape_in(0, d, shape)
            out[f"{name} {dims}"] = [status, lib.bprod_forward_work_len(*dims),
                                     lib.bprod_forward(dims[0], dims[1], *[small] * 3, work)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("bounds")
    write_runtime_header(folder)
    for model, kwargs in ((mlp_model(), {"functions": ("forward", "train_step"), "optimizer": Adam(lr=0.01)}),
                          (product_model(), {"functions": ("forward",)})):
        emitted, _ = generate(model, **kwargs)
        (folder / f"{model.name}.c").write_text(emitted.source)
        (folder / f"{model.name}.h").write_text(emitted.header)
        subprocess.run([cc, *STRICT_FLAGS, "-O1", "-shared", "-fPIC", "-I", str(folder), "-o",
                        str(folder / f"lib{model.name}.so"), str(folder / f"{model.name}.c"), "-lm"], check=True)
    return folder


def call_child(folder, dims) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder), json.dumps(dims)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # a crash (a write out of bounds) fails here
    return json.loads(done.stdout)


def test_the_status_is_documented_once():
    assert SIZE_DOES_NOT_FIT in STATUS_TEXT and "does not fit" in STATUS_TEXT[SIZE_DOES_NOT_FIT]
    emitted, _ = generate(mlp_model(), functions=("forward",))
    assert f" *   {SIZE_DOES_NOT_FIT}: {STATUS_TEXT[SIZE_DOES_NOT_FIT]}" in emitted.header


def test_the_minibatch_count_never_overflows(libraries):
    """(rows + batch - 1)/batch wrapped to 0 or -1 minibatches at batch near
    INT64_MAX; (rows - 1)/batch + 1 is 1, and the epoch then runs one step
    on its 10 rows (what the arrays of 4096 entries hold)."""
    batches = [INT64_MAX, INT64_MAX - 4, 2**62, 10, 3]
    got = call_child(libraries, {"bmlp": [[10, b] for b in batches], "bprod": []})
    for b in batches:
        status, shape, status_in, work, call = got[f"bmlp [10, {b}]"]
        assert status == 0 and shape == [-(-10 // b), 1], b
        assert status_in == 0 and 0 < work < 4096 and call == 0, b


@pytest.mark.parametrize("rows", [INT64_MAX, INT64_MAX - 4, 2**62, SIZE_LIMIT])
def test_an_epoch_too_large_returns_the_status(libraries, rows):
    got = call_child(libraries, {"bmlp": [[rows, b] for b in (1, 7, INT64_MAX)], "bprod": []})
    for b in (1, 7, INT64_MAX):
        status, shape, status_in, work, call = got[f"bmlp [{rows}, {b}]"]
        assert (status, shape, status_in, work, call) == (SIZE_DOES_NOT_FIT, None, SIZE_DOES_NOT_FIT, 0,
                                                          SIZE_DOES_NOT_FIT), b


def test_a_function_too_large_returns_the_status(libraries):
    """n rows of X (3 columns) and a workspace of a few entries a row: 2^62
    rows overflow int64_t as 14*n; 2^57 fit an int64_t but not the limit."""
    big = [INT64_MAX, INT64_MAX - 4, 2**62, 2**57]
    got = call_child(libraries, {"bmlp": [[v] for v in big] + [[2]], "bprod": []})
    for v in big:
        assert got[f"bmlp [{v}]"] == [SIZE_DOES_NOT_FIT, 0, SIZE_DOES_NOT_FIT], v
    status, work, call = got["bmlp [2]"]
    assert status == 0 and 0 < work < 4096 and call == 0


def test_a_product_of_dimensions_too_large_returns_the_status(libraries):
    """N and K each fit; N*K does not (2^64 wraps to 0, 2^62 to itself)."""
    cases = [[2**32, 2**32], [2**31, 2**31], [INT64_MAX, 2], [3, INT64_MAX], [2**30, 2**30]]
    got = call_child(libraries, {"bmlp": [], "bprod": cases + [[4, 3]]})
    for dims in cases:
        assert got[f"bprod {dims}"] == [SIZE_DOES_NOT_FIT, 0, SIZE_DOES_NOT_FIT], dims
    status, work, call = got["bprod [4, 3]"]
    assert status == 0 and work < 4096 and call == 0


def test_fixed_sizes_over_the_limit_are_refused_when_generated():
    X = sp.MatrixSymbol("X", 2**30, 2**30)
    model = sbp.Model("huge", inputs=[X], params=[], loss=nn.sum_all(nn.tanh(X)))
    with pytest.raises(sbp.ModelError, match=r"over the limit of 576460752303423488"):
        generate(model, functions=("forward",))


def test_python_agrees_with_the_c(libraries):
    """The Python path sizes its buffers from the same functions: a normal
    call is unchanged (a smoke test of the checks' arithmetic)."""
    mod = sbp.compile(mlp_model(), functions=("forward",))
    rng = np.random.default_rng(0)
    X, T = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    W1, W2 = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    loss = mod.forward(X=X, T=T, W1=W1, W2=W2)["loss"]
    assert loss == pytest.approx(np.sum((np.tanh(X @ W1) @ W2 - T) ** 2) / (2 * 5), rel=1e-12)


# --- a scan's checkpoints ----------------------------------------------------------


def rnn_model(every, length=None, batch=1):
    """A tanh RNN over T steps (or `length` fixed ones) of B sequences,
    checkpointed every `every` steps."""
    T, B = sp.symbols("T B", integer=True, positive=True)
    rows = T if length is None else length
    B = B if batch == "B" else batch
    X, W, U = sp.MatrixSymbol("X", rows * (B if batch != 1 else 1), 2), sp.MatrixSymbol("W", 2, 2), \
        sp.MatrixSymbol("U", 2, 2)
    h, x = sp.MatrixSymbol("h", B, 2), sp.MatrixSymbol("x", B, 2)
    h0 = sp.MatrixSymbol("h0", B, 2)
    new = (h * W + x * U).applyfunc(sp.tanh)
    Y = sbp.scan(new, new * sp.OneMatrix(2, 1), h, x, h0, X, checkpoint_every=every, batch=B)
    loss = nn.sum_all(sp.HadamardPower(Y, 2))
    return sbp.Model(f"rnn_{len(str(every))}_{length}_{batch}", inputs=[X], params=[W, U, h0], loss=loss)


def scan_work(model, steps=None):
    """value_and_grad's work_len: what the C reports (steps: the value of T)."""
    fn = sbp.compile(model, functions=("value_and_grad",)).function("value_and_grad")
    return fn.work_len() if steps is None else fn.work_len(steps)


@pytest.mark.parametrize("every", [10**6, 2**40])
def test_a_checkpoint_segment_is_no_longer_than_the_sequence(every):
    """5 steps checkpointed every 10^6 (or 2^40: a MemoryError before) take
    the workspace of 5 steps checkpointed every 5."""
    assert scan_work(rnn_model(every, 5)) == scan_work(rnn_model(5, 5)) < 1000


def test_a_symbolic_length_sizes_the_segment_by_the_smaller():
    """T steps: min(k, T) rows a segment, an integer min in the C."""
    emitted, _ = generate(rnn_model(10**7), functions=("value_and_grad",))
    assert "fmin" not in emitted.source
    big, small = rnn_model(10**7), rnn_model(3)
    assert scan_work(big, 3) == scan_work(small, 3) < 1000
    assert scan_work(big, 50) - scan_work(big, 49) <= 20  # a few entries a step, not 10^7 a segment


def test_a_checkpointed_scan_still_computes_its_gradient():
    """A segment longer than the sequence: the gradient as without checkpoints."""
    rng = np.random.default_rng(2)
    args = {"X": rng.standard_normal((4, 2)), "W": rng.standard_normal((2, 2)) / 2,
            "U": rng.standard_normal((2, 2)) / 2, "h0": rng.standard_normal((1, 2))}
    plain = sbp.compile(rnn_model(1), functions=("value_and_grad",)).value_and_grad(**args)
    for every in (3, 10**6):
        loss, grads = sbp.compile(rnn_model(every), functions=("value_and_grad",)).value_and_grad(**args)
        assert loss == pytest.approx(plain[0], rel=1e-13)
        for k in grads:
            np.testing.assert_allclose(grads[k], plain[1][k], rtol=1e-12, atol=1e-14)


# --- models too large to compile in reasonable time ----------------------------------


def chain(links):
    """tanh(... tanh(tanh(W x + W) x + W) ...): `links` levels, each new."""
    W, x = sp.MatrixSymbol("W", 1, 1), sp.MatrixSymbol("x", 1, 1)
    e = W[0, 0] * x[0, 0]
    for _ in range(links):
        e = sp.tanh(e * x[0, 0] + W[0, 0])
    return sbp.Model(f"chain{links}", inputs=[x], params=[W], loss=e)


def test_operations_are_counted_once_each_in_linear_time():
    from symbackprop.pipeline import count_operations

    counts = [count_operations([chain(n).loss], 10**6) for n in (100, 200, 400)]
    assert counts[1] - counts[0] == (counts[2] - counts[1]) // 2 > 0  # the same few a link
    assert count_operations([chain(400).loss], 50) == 51  # stops past the limit


def test_a_model_over_the_limit_is_refused_before_it_is_lowered(monkeypatch):
    """The limit is the documented constant; the check walks the SymPy
    expression once (here stopped at 300), before any stage runs."""
    import symbackprop.pipeline as pipeline

    monkeypatch.setattr(pipeline, "MAX_OPERATIONS", 300)
    lowered = []
    monkeypatch.setattr(pipeline, "_Planner", lambda *a: lowered.append(a))
    with pytest.raises(sbp.ModelError, match=r"over 300 distinct subexpressions .*the limit of 300 .*MAX_OPERATIONS"):
        pipeline.plan(chain(400), functions=("value_and_grad",))
    assert not lowered
    monkeypatch.undo()
    assert pipeline.MAX_OPERATIONS >= 37_024  # an unrolled 1,000-step GRU (tests/compiled/test_depth.py) plans


def test_a_model_of_too_many_leaves_is_refused_at_once(monkeypatch):
    """10,000 scalar parameters (and their inputs) compiled for more than
    10 minutes without a word; over MAX_LEAVES plan refuses before any
    stage runs, naming the count and the remedy."""
    import symbackprop.pipeline as pipeline

    lowered = []
    monkeypatch.setattr(pipeline, "_Planner", lambda *a: lowered.append(a))
    ps, xs = sp.symbols("p0:5000"), sp.symbols("x0:5000")
    model = sbp.Model("many_leaves", inputs=list(xs), params=list(ps), loss=sp.Add(*[p * x for p, x in zip(ps, xs)]))
    with pytest.raises(sbp.ModelError, match=r"10000 inputs and params, over the limit of 4096 .*MAX_LEAVES.*matri"):
        pipeline.plan(model, functions=("value_and_grad",))
    assert not lowered
    assert pipeline.MAX_LEAVES > 2 * 1000 + 1  # a 1,000-layer stack (tests/compiled/test_depth.py) compiles


def test_a_100000_node_chain_is_refused_at_once(monkeypatch):
    """The chain of benchmarks/compile_scale.py at 10^5 subexpressions (it
    would compile for an hour): refused by the count, before any stage."""
    import symbackprop.pipeline as pipeline

    lowered = []
    monkeypatch.setattr(pipeline, "_Planner", lambda *a: lowered.append(a))
    x, w = sp.symbols("x w")
    e = x
    for _ in range(100_000 // 3):
        e = sp.tanh(w * e + x)
    with pytest.raises(sbp.ModelError, match=r"over 40000 distinct subexpressions .*MAX_OPERATIONS"):
        pipeline.plan(sbp.Model("chain_1e5", inputs=[x], params=[w], loss=e))
    assert not lowered


def test_a_function_of_more_arrays_than_the_fast_caller_takes_is_called_through_cffi():
    """A deep stack of 5,000 parameter matrices compiled for 9 minutes, then
    failed to load: the fast caller's ValueError 'too many arguments' (over
    4,096 arrays in and out). caller() declines such a function (None: the
    cffi path, which takes any number), before it reads the library."""
    from symbackprop.run import fastcall

    class Library:  # has the packed entry; its address is never taken
        f__packed = f_work_len__packed = None

    arrays = [(1, 1, 12, False)] * (fastcall.MAX_ARGUMENTS // 2 + 1)
    if fastcall.extension() is None:
        pytest.skip("no fast-call extension here")
    assert fastcall.caller(Library(), None, "f", 0, 8, arrays, arrays) is None
