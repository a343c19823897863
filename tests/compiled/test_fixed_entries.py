"""Fixed entries along a dimension bound at call time: (X*W)[2, 0] of a
batch X (n x 3) needs n >= 3 and a fixed slice X[0:2, :] needs n >= 2.
Every entry point (the binder, the C hot path, prepared calls, train_step
and train_epoch, and the C functions themselves, for C callers) refuses a
call below that with an error naming the dimension, the least value and
why, and writes nothing; at or above it, values match numpy and finite
differences."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, write_runtime_header
from test_c_preconditions import SENTINEL, Direct
from test_memory_safety import SANITIZE, SANITIZER_ENV, _sanitizer_works, read_header

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ArgumentError, ModelError
from symbackprop.pipeline import generate
from symbackprop.run.optim import SGD

n = sp.Symbol("n", integer=True, positive=True)
X, W, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("W", 3, 2), sp.MatrixSymbol("T", n, 2)
FUNCTIONS = ("forward", "value_and_grad", "vjp", "jvp", "hvp", "train_step")
WHY = "n = 2, but the model reads row 2 of X: n must be at least 3"


def entry_model():
    """Rows 2 and 0 of a batch product (SymPy writes (X*W)[2, 0] as a sum over row 2 of X)."""
    Y = X * W
    loss = sp.sin(Y[2, 0]) * sp.cos(Y[0, 1]) + sbp.as_scalar(nn.sum_all(sp.HadamardPower(Y - T, 2)))
    return sbp.Model("entry", inputs=[X, T], params=[W], loss=loss, outputs={"Y": Y, "e": sp.exp(Y[2, 1])})


def entry_numpy(x, t, w):
    y = x @ w
    return np.sin(y[2, 0]) * np.cos(y[0, 1]) + ((y - t) ** 2).sum()


def data(rows, seed=0):
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((rows, 3)), "T": rng.standard_normal((rows, 2)), "W": rng.standard_normal((3, 2))}


@pytest.fixture(scope="module")
def mod():
    return sbp.compile(entry_model(), functions=FUNCTIONS, optimizer=SGD(lr=0.1))


def _calls(mod, d):
    w = {"W": np.ones((3, 2))}
    return {
        "forward": lambda: mod.forward(**d),
        "value_and_grad": lambda: mod.value_and_grad(**d),
        "vjp": lambda: mod.vjp("Y", np.ones((d["X"].shape[0], 2)), **d),
        "jvp": lambda: mod.jvp(w, **d),
        "hvp": lambda: mod.hvp(w, **d),
        "jacobian": lambda: mod.jacobian("e", **d),
        "prepare": lambda: mod.prepare("value_and_grad", **d)(),
        "train_step": lambda: mod.train_step(**{k: v.copy() for k, v in d.items()}),
        "train_epoch": lambda: mod.train_epoch(2, **{k: v.copy() for k, v in d.items()}),
    }


@pytest.mark.parametrize("entry", list(_calls(None, data(2))))
def test_every_entry_point_refuses_too_few_rows_naming_why(mod, entry):
    d = data(2)
    before = d["W"].copy()
    with pytest.raises(ArgumentError, match=WHY):
        _calls(mod, d)[entry]()
    np.testing.assert_array_equal(d["W"], before)


def test_the_fast_paths_refuse_exact_arrays_too(mod):
    d = data(2)
    for _ in range(3):  # the C hot path takes exact arrays after the first call
        with pytest.raises(ArgumentError, match=WHY):
            mod.value_and_grad(**d)
    call = mod.prepare("forward", **data(3))
    assert np.isfinite(call()["Y"]).all()


def test_enough_rows_match_numpy_and_finite_differences(mod):
    for rows in (3, 5):
        d = data(rows, seed=rows)
        loss, grads = mod.value_and_grad(**d)
        np.testing.assert_allclose(loss, entry_numpy(d["X"], d["T"], d["W"]), rtol=1e-12)
        eps, fd = 1e-6, np.zeros((3, 2))
        for i in range(3):
            for j in range(2):
                up, down = d["W"].copy(), d["W"].copy()
                up[i, j] += eps
                down[i, j] -= eps
                fd[i, j] = (entry_numpy(d["X"], d["T"], up) - entry_numpy(d["X"], d["T"], down)) / (2 * eps)
        np.testing.assert_allclose(grads["W"], fd, rtol=1e-6, atol=1e-8)
        out = mod.forward(**d)
        np.testing.assert_allclose(out["e"], np.exp((d["X"] @ d["W"])[2, 1]), rtol=1e-12)


def test_train_epoch_refuses_a_last_minibatch_too_small(mod):
    d = data(7)
    with pytest.raises(ArgumentError, match="last minibatch has n = 1 rows .* must be at least 3"):
        mod.train_epoch(3, **d)
    losses = mod.train_epoch(3, **data(6))  # minibatches of 3 rows: each has a row 2
    assert losses.shape == (2,) and np.isfinite(losses).all()


def test_the_c_functions_return_1_and_write_nothing(mod):
    model, sizes = entry_model(), {"n": 3}
    for kind in ("forward", "value_and_grad", "train_step"):
        call = Direct(mod, model, FUNCTIONS, f"entry_{kind}", sizes, data(3))
        assert call.lib.entry_forward_work_len(2) == 0 and call.lib.entry_forward_work_len(3) > 0
        assert call([2]) == 1 and call.unchanged, kind
        assert call([3]) == 0 and not (call.outputs[0] == SENTINEL).any(), kind
    call = Direct(mod, model, FUNCTIONS, "entry_train_step", sizes, data(3))
    assert call.epoch_call(7, 3) == 1 and call.unchanged  # its last minibatch: 1 row
    assert call.epoch_call(6, 3) == 0


def test_the_header_lists_the_need():
    emitted, _ = generate(entry_model(), functions=("forward",))
    assert " *   n >= 3: the model reads row 2 of X" in emitted.header


def test_a_fixed_slice_of_a_batch_is_a_need_of_every_call():
    Z = sp.MatrixSymbol("Z", n, 2)
    head = Z[0:2, :]
    loss = nn.sum_all(sp.HadamardPower(head * sp.MatrixSymbol("V", 2, 1), 2)) + nn.sum_all(Z)
    mod = sbp.compile(sbp.Model("head", inputs=[Z], params=[sp.MatrixSymbol("V", 2, 1)], loss=loss))
    z, v = np.arange(6.0).reshape(3, 2), np.array([[0.5], [-1.0]])
    loss_value, grads = mod.value_and_grad(Z=z, V=v)
    np.testing.assert_allclose(loss_value, ((z[:2] @ v) ** 2).sum() + z.sum())
    np.testing.assert_allclose(grads["V"], 2 * z[:2].T @ (z[:2] @ v))
    with pytest.raises(ArgumentError, match=r"n = 1, but the model takes rows 0:2:1 of Z: n must be at least 2"):
        mod.value_and_grad(Z=z[:1].copy(), V=v)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: X[-1, 0], "takes row -1 of X, counted from the end of n"),
    (lambda: (X * W)[-2, 1], "takes row -2 of X, counted from the end of n"),
])
def test_entries_no_call_could_make_safe_are_refused_at_declaration(make, message):
    with pytest.raises(ModelError, match=message):
        sbp.compile(sbp.Model("bad", inputs=[X], params=[W], loss=sp.sin(make())), functions=("forward",))


def test_a_negative_entry_of_a_fixed_size_counts_from_its_end():
    loss = sp.sin(W[0, -1]) * sp.cos(W[-1, 0]) + sbp.as_scalar(nn.sum_all(X * W))
    mod = sbp.compile(sbp.Model("last", inputs=[X], params=[W], loss=loss), functions=("forward",))
    x, w = data(4)["X"], data(4)["W"]
    expected = np.sin(w[0, 1]) * np.cos(w[2, 0]) + (x @ w).sum()
    np.testing.assert_allclose(mod.forward(X=x, W=w)["loss"], expected, rtol=1e-12)


@pytest.fixture(scope="module")
def sanitizer(tmp_path_factory):
    if not _sanitizer_works(tmp_path_factory.mktemp("probe")):
        pytest.skip("no working -fsanitize=address,undefined runtime for cc")


def test_a_c_caller_below_the_need_gets_1_under_sanitizers(sanitizer, tmp_path):
    """Exact-size arrays of 2 rows: every function returns 1 and reads
    nothing (AddressSanitizer would stop a read of row 2); of 3 rows, 0."""
    emitted, _ = generate(entry_model(), functions=("forward", "value_and_grad", "vjp"))
    lines = ["#include <stdlib.h>", '#include "entry.h"', "int main(void) {"]
    for fn in read_header(emitted.header):
        for rows, status in ((2, 1), (3, 0)):
            lines.append(f"    {{\n        const int64_t n = {rows};")
            call = []
            for arg in fn.args:
                if arg.kind == "dim":
                    call.append(arg.cname)
                    continue
                count = " * ".join(f"(size_t)({d})" for d in arg.shape) if arg.shape else f"{fn.name}_work_len(n) + 1"
                lines.append(f"        double *a_{arg.cname} = calloc({count}, sizeof(double));")
                call.append(f"a_{arg.cname}")
            lines.append(f"        if ({fn.name}({', '.join(call)}) != {status}) return 2;")
            lines += [f"        free(a_{a.cname});" for a in fn.args if a.kind != "dim"] + ["    }"]
    lines += ["    return 0;", "}", ""]
    (tmp_path / "entry.c").write_text(emitted.source)
    (tmp_path / "entry.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    (tmp_path / "driver.c").write_text("\n".join(lines))
    exe = tmp_path / "driver"
    built = subprocess.run(["cc", *SANITIZE, *STRICT_FLAGS[1:], f"-I{tmp_path}", str(tmp_path / "entry.c"),
                            str(tmp_path / "driver.c"), "-o", str(exe), "-lm"], capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, env={**os.environ, **SANITIZER_ENV}, timeout=120,
                         check=False)
    assert run.returncode == 0, f"driver exit {run.returncode}:\n{run.stderr[-4000:]}"
