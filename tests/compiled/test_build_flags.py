"""$SYMBACKPROP_CFLAGS: the flags of BuildOptions() where none are given
(the suite builds at -O1 through it, tests/conftest.py). A module built
under it is never loaded by a call at the production flags (cache key and
model memo), and a test marked default_flags builds at DEFAULT_FLAGS."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from conftest import TEST_FLAGS

import symbackprop as sbp
from symbackprop.errors import BuildError
from symbackprop.toolchain.builder import CACHE_ENV, DEFAULT_FLAGS, FLAGS_ENV, BuildOptions


def test_the_environment_sets_the_default_flags_only(monkeypatch):
    monkeypatch.setenv(FLAGS_ENV, "-O1  -DNAME='a b' -std=c99")
    assert BuildOptions().flags == ("-O1", "-DNAME=a b", "-std=c99")  # split as a shell would
    assert BuildOptions(flags=("-O2",)).flags == ("-O2",)  # flags given win
    monkeypatch.setenv(FLAGS_ENV, " ")
    assert BuildOptions().flags == DEFAULT_FLAGS  # blank: unset
    monkeypatch.delenv(FLAGS_ENV)
    assert BuildOptions().flags == DEFAULT_FLAGS
    monkeypatch.setenv(FLAGS_ENV, "-O1 '-std=c99")
    with pytest.raises(BuildError, match=FLAGS_ENV):
        BuildOptions()


def test_a_module_built_under_other_flags_is_not_loaded_at_the_default_ones(monkeypatch, tmp_path):
    """The same model and cache: the -O1 build's memo and entry are not the
    production call's (each build's log names its own level)."""
    a, x = sp.symbols("a x")
    model = sbp.Model("flags_probe", inputs=[x], params=[a], loss=sp.exp(a * x) * x)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(FLAGS_ENV, "-O1 -std=c99")
    cheap = sbp.compile(model)
    monkeypatch.delenv(FLAGS_ENV)
    production = sbp.compile(model)
    assert cheap.folder != production.folder
    assert " -O1 -std=c99 " in (cheap.folder / "build.log").read_text()
    assert f" {' '.join(DEFAULT_FLAGS)} " in (production.folder / "build.log").read_text()
    data = {"x": np.array(0.7), "a": np.array(1.3)}
    for mod in (cheap, production):  # exp(a x) x: its value and derivative x^2 exp(a x), to rounding
        value, grads = mod.value_and_grad(**data)
        assert np.isclose(value, np.exp(0.91) * 0.7, rtol=1e-13)
        assert np.isclose(grads["a"], 0.49 * np.exp(0.91), rtol=1e-13)


def test_unmarked_tests_build_at_the_suites_flags(request):
    if request.config.getoption("--production-flags"):
        pytest.skip("--production-flags: every test builds at DEFAULT_FLAGS")
    assert BuildOptions().flags == tuple(TEST_FLAGS.split())


@pytest.mark.default_flags
def test_marked_tests_build_at_the_default_flags():
    assert BuildOptions().flags == DEFAULT_FLAGS
