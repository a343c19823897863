"""The cyclic garbage collector is paused while a model compiles and
restored after (symbackprop.gcpause)."""

from __future__ import annotations

import gc

import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import pipeline
from symbackprop.gcpause import gc_paused


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_restored_after(gc_state):
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner block leaves it paused
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_after_an_exception(gc_state):
    gc.enable()
    with pytest.raises(ZeroDivisionError), gc_paused():
        _ = 1 / 0
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled(gc_state):
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def _model() -> sbp.Model:
    x = sp.MatrixSymbol("x", 2, 1)
    return sbp.Model("gc_pause_probe", params=[x], loss=x[0, 0] ** 2 * x[1, 0] + sp.sin(x[1, 0]))


def test_generate_runs_paused_and_restores(gc_state, monkeypatch):
    seen = []
    real = pipeline._generate

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_generate", spy)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        emitted, _ = pipeline.generate(_model())
        assert "gc_pause_probe" in emitted.source
        assert gc.isenabled() is enabled
    assert seen == [False, False]
