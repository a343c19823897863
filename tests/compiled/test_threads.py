"""One compiled module called from several threads at once: the same
results as sequential calls, and the GIL released during the C call."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.toolchain.builder import BuildOptions

n = sp.Symbol("n", integer=True, positive=True)
X = sp.MatrixSymbol("X", n, 64)
T = sp.MatrixSymbol("T", n, 2)
W1 = sp.MatrixSymbol("W1", 64, 64)
b1 = sp.MatrixSymbol("b1", 1, 64)
W2 = sp.MatrixSymbol("W2", 64, 2)
MODEL = sbp.Model("threaded", inputs=[X, T], params=[W1, b1, W2],
                  loss=nn.mse(nn.tanh(nn.linear(X, W1, b1)) * W2, T), outputs={"H": nn.tanh(nn.linear(X, W1, b1))})


def _data(seed: int, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "X": rng.standard_normal((rows, 64)),
        "T": rng.standard_normal((rows, 2)),
        "W1": rng.standard_normal((64, 64)) / 8,
        "b1": rng.standard_normal((1, 64)) / 8,
        "W2": rng.standard_normal((64, 2)) / 8,
    }


@pytest.fixture(scope="module", params=[False, None], ids=["plain-loops", "default-blas"])
def mod(request):
    return sbp.compile(MODEL, options=BuildOptions(blas=request.param))


def _run_threads(count: int, work) -> list[BaseException]:
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def body(k: int) -> None:
        try:
            barrier.wait()
            work(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_four_threads_give_the_sequential_results(mod):
    """Different batch sizes per thread: a shared workspace sized for one
    thread's batch would corrupt another's results."""
    datasets = [_data(seed, rows) for seed, rows in enumerate((1, 37, 400, 1000))]
    expected = [(mod.value_and_grad(**d), mod.forward(**d)) for d in datasets]

    def work(k: int) -> None:
        (loss, grads), outputs = expected[k]
        for _ in range(15):
            got_loss, got_grads = mod.value_and_grad(**datasets[k])
            assert got_loss == loss
            for name, grad in grads.items():
                np.testing.assert_array_equal(got_grads[name], grad)
            np.testing.assert_array_equal(mod.forward(**datasets[k])["H"], outputs["H"])

    assert _run_threads(4, work) == []


def test_the_c_call_releases_the_gil():
    """While four threads are inside long C calls, the main thread keeps
    running Python: its longest pause is a small part of one call. Were the
    GIL held, it would pause for whole calls, every time; on a loaded
    machine (CI runs two test workers on two cores) the OS can also pause
    it, now and then, so the best of three tries counts. (Plain loops: BLAS
    threads of four calls at once would only crowd the two cores.)"""
    mod = sbp.compile(MODEL, options=BuildOptions(blas=False))
    rows = max(2000, min(400_000, int(2000 * 0.25 / _seconds_per_call(mod, _data(0, 2000)))))
    data = _data(0, rows)
    single = _seconds_per_call(mod, data)  # about a quarter of a second
    stalls = []
    for _ in range(3):
        stalls.append(_longest_pause_during_calls(mod, data))
        if stalls[-1] < 0.5 * single:
            break
    assert min(stalls) < 0.5 * single, f"the main thread stalled {stalls} s; one call takes {single:.3f} s"


def _longest_pause_during_calls(mod, data: dict) -> float:
    """The main thread's longest pause while four threads call the module."""
    done = threading.Event()
    intervals: list[tuple[float, float]] = []

    def work(k: int) -> None:
        entered = time.perf_counter()
        mod.value_and_grad(**data)
        intervals.append((entered, time.perf_counter()))

    beats = []
    runner = threading.Thread(target=lambda: (_run_threads(4, work), done.set()))
    runner.start()
    while not done.is_set():
        beats.append(time.perf_counter())
    runner.join()
    assert len(intervals) == 4
    last_entry, first_exit = max(s for s, _ in intervals), min(e for _, e in intervals)
    assert last_entry < first_exit  # the four calls were in progress together
    return float(np.diff(beats).max())


def _seconds_per_call(mod, data: dict) -> float:
    started = time.perf_counter()
    mod.value_and_grad(**data)
    return time.perf_counter() - started
