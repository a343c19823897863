"""A function holding a long loop-free body is SYMBACKPROP_STRAIGHT (GCC
optimizes it for size: its register assignment for speed and its vectorizer
of basic blocks were most of a determinant's compile), a short one is not; the attribute is defined for
every compiler and the module builds and computes the same with it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package

import symbackprop as sbp
from benchmarks.gradbench import det
from symbackprop.build.builder import BuildOptions
from symbackprop.pipeline import generate


def _marked(source: str) -> list[str]:
    return re.findall(r"SYMBACKPROP_STRAIGHT (?:static )?\w+ (\w+)\(", source)


def test_long_straight_body_is_marked_and_short_is_not():
    long_c = generate(det.build_model({"ell": 7}), functions=det.SBP_FUNCTIONS)[0].source
    short_c = generate(det.build_model({"ell": 4}), functions=det.SBP_FUNCTIONS)[0].source
    assert len(_marked(long_c)) == 1
    assert _marked(short_c) == []


@pytest.mark.default_flags  # the attribute is there for GCC's -O3 passes
def test_marked_module_builds_and_matches_numpy(tmp_path):
    size = {"ell": 7}
    mod = sbp.compile(det.build_model(size), functions=det.SBP_FUNCTIONS,
                      options=BuildOptions(cache_dir=tmp_path))
    assert "SYMBACKPROP_STRAIGHT" in mod.emitted.source
    A = det.generate(size)["A"]
    value, grads = mod.value_and_grad(A=A)
    assert np.isclose(value, np.linalg.det(A), rtol=1e-10)
    assert np.allclose(grads["A"], np.linalg.det(A) * np.linalg.inv(A).T, rtol=1e-9)
