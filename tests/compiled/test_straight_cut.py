"""A long loop-free kernel is cut into pieces where few values are live
(schedule/straight.py): the pieces, run one after the other over one
memory, store what the whole kernel stores; each cut hands over the fewest
values its window allows (counted here from the sets of values each side
reads and defines); the module computes the same bits as the uncut one,
and the determinant numpy computes."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package

import symbackprop as sbp
from benchmarks.gradbench import det
from symbackprop.ir.node import SCALAR
from symbackprop.pipeline import generate
from symbackprop.schedule import straight
from symbackprop.schedule.kernel import Equation, MapKernel, View
from symbackprop.schedule.straight import cut_straight
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions


def _whole(buffer: str) -> View:
    return View(buffer, sp.Integer(0), sp.Integer(0), sp.Integer(0))


def _random_kernel(seed: int, temps: int = 120, inputs: int = 6, reach: int = 30) -> MapKernel:
    """Temporaries each a sum or product of two earlier values (most of them
    recent, as in a determinant's levels), some stored as they are, some
    stored in a sum."""
    rng = random.Random(seed)
    loads = tuple((sp.Symbol(f"_load{k}", real=True), _whole(f"in{k}")) for k in range(inputs))
    values = [sym for sym, _ in loads]
    body = []
    for k in range(temps):
        a, b = (values[max(0, len(values) - 1 - rng.randrange(reach))] for _ in range(2))
        expr = a + b + 1 if rng.random() < 0.5 else a * b - 1
        sym = sp.Symbol(f"x{k}", real=True)
        body.append((sym, expr))
        values.append(sym)
    stores = []
    for k, (sym, _) in enumerate(body):
        if rng.random() < 0.3:
            stores.append((f"out{k}", sym))
        elif rng.random() < 0.1:
            stores.append((f"sum{k}", sym + body[rng.randrange(k + 1)][0]))
    stores.append(("first", loads[0][0] * 2))  # reads no temporary: stored in the first piece
    equations = tuple(Equation(out, str(expr), "") for out, expr in stores)
    return MapKernel(SCALAR, loads, tuple(body), tuple(stores), equations, before_cse=(loads[0][0],))


def _run(kernels: list[MapKernel], memory: dict) -> dict:
    """Each kernel in turn: its loads read the memory, its stores write it."""
    memory = dict(memory)
    for kernel in kernels:
        env = {sym: memory[view.buffer] for sym, view in kernel.loads}  # a KeyError: read before written
        for sym, expr in kernel.temps:
            env[sym] = expr.xreplace(env)
        for out, expr in kernel.stores:
            memory[out] = expr.xreplace(env)
    return memory


def _claimer():
    claimed: list[str] = []

    def claim(base: str) -> str:
        claimed.append(base)
        return base

    return claim, claimed


@pytest.mark.parametrize("seed", range(6))
def test_the_pieces_store_what_the_whole_kernel_stores(seed, monkeypatch):
    monkeypatch.setattr(straight, "CUT_STATEMENTS", 50)
    kernel = _random_kernel(seed)
    claim, claimed = _claimer()
    pieces = cut_straight(kernel, claim)
    assert len(pieces) == math.ceil((len(kernel.temps) + len(kernel.stores)) / 50)
    memory = {f"in{k}": sp.Integer(k + 2) for k in range(6)}
    whole = _run([kernel], memory)
    cut = _run(pieces, memory)
    assert {k: cut[k] for k in whole} == whole
    assert set(cut) - set(whole) == set(claimed)  # only the handed-over values besides
    assert [t for p in pieces for t in p.temps] == list(kernel.temps)  # the same values, in the same order
    assert all(straight._symbols(e) == e.free_symbols for _, e in kernel.temps + kernel.stores)
    assert sorted(e.lhs for p in pieces for e in p.equations) == sorted(e.lhs for e in kernel.equations)
    assert [p.before_cse for p in pieces] == [kernel.before_cse] + [()] * (len(pieces) - 1)  # counted once


def _handed_at(kernel: MapKernel, c: int) -> tuple[int, int]:
    """(statements before, values handed over) for a cut before temporary c,
    each store after the last temporary it reads: the values defined before
    the cut and read after it, less those stored as they are before it."""
    temps, stores = list(kernel.temps), list(kernel.stores)
    defined = {sym for sym, _ in temps[:c]}
    early = [(out, e) for out, e in stores if (e.free_symbols & {s for s, _ in temps[c:]}) == set()]
    late = [(out, e) for out, e in stores if (out, e) not in early]
    read = set().union(*(e.free_symbols for _, e in temps[c:] + late))
    stored = {e for _, e in early if e in defined}
    return c + len(early), len((defined & read) - stored)


@pytest.mark.parametrize("seed", range(6))
def test_each_cut_hands_over_the_fewest_values_of_its_window(seed, monkeypatch):
    kernel = _random_kernel(seed, temps=150)
    count = len(kernel.temps) + len(kernel.stores)
    monkeypatch.setattr(straight, "CUT_STATEMENTS", count - 1)  # two pieces
    pieces = cut_straight(kernel, _claimer()[0])
    assert len(pieces) == 2
    share = count / 2
    window = {c: _handed_at(kernel, c)[1] for c in range(1, len(kernel.temps))
              if abs(_handed_at(kernel, c)[0] - share) <= straight.CUT_WINDOW * share}
    cut = len(pieces[0].temps)
    assert window[cut] == min(window.values())
    handed = [out for out, _ in pieces[0].stores if out.endswith("_kept")]
    assert len(handed) == window[cut]


def test_a_short_or_looped_kernel_is_left_whole():
    kernel = _random_kernel(0, temps=40)
    assert cut_straight(kernel, _claimer()[0]) == [kernel]
    looped = MapKernel((sp.Symbol("n"), 1), kernel.loads, kernel.temps * 20, kernel.stores, ())
    assert cut_straight(looped, _claimer()[0]) == [looped]


def test_det_ell_9_adjoints_are_handed_over_at_one_level_of_minors(monkeypatch):
    """Written out (not from a table, as by default: test_table_kernels), the
    forward minors are all stored (nothing to hand over); the adjoints cut
    where one level of them, C(9, 4) = 126, is live: four straight-line
    functions, each a part, in four units."""
    monkeypatch.setattr(straight, "TABLE_MIN_STATEMENTS", 10**9)
    source = generate(det.build_model({"ell": 9}), functions=det.SBP_FUNCTIONS)[0].source
    assert source.count("_kept[0] = ") == math.comb(9, 4)
    assert source.count("SYMBACKPROP_STRAIGHT GRADBENCH_DET_9_SHARED void") == 4
    assert "SYMBACKPROP_UNIT == 3" in source


@pytest.mark.default_flags
def test_a_cut_module_computes_what_the_whole_computes(tmp_path, monkeypatch):
    """To the last bits: with FMA contraction, a product handed over is
    rounded before the sum that reads it (the whole kernel may fuse them)."""
    size = {"ell": 7}
    A = det.generate(size)["A"]
    monkeypatch.setattr(straight, "CUT_STATEMENTS", 10**9)
    whole = sbp.compile(det.build_model(size), functions=det.SBP_FUNCTIONS,
                        options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path / "whole"))
    monkeypatch.setattr(straight, "CUT_STATEMENTS", 120)
    cut = sbp.compile(det.build_model(size), functions=det.SBP_FUNCTIONS,
                      options=BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path / "cut"))
    assert "_kept[0] = " in cut.emitted.source and "_kept" not in whole.emitted.source
    value, grads = cut.value_and_grad(A=A)
    assert np.isclose(value, np.linalg.det(A), rtol=1e-10)
    assert np.allclose(grads["A"], np.linalg.det(A) * np.linalg.inv(A).T, rtol=1e-9)
    expected_value, expected = whole.value_and_grad(A=A)
    assert np.isclose(value, expected_value, rtol=1e-14, atol=0)
    assert np.allclose(grads["A"], expected["A"], rtol=1e-13, atol=1e-17)
    assert np.isclose(cut.forward(A=A)["loss"], whole.forward(A=A)["loss"], rtol=1e-14, atol=0)
