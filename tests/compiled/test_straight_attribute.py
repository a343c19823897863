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
from c_driver import unwrapped

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package

import symbackprop as sbp
from benchmarks.gradbench import det
from symbackprop.pipeline import generate
from symbackprop.toolchain.builder import BuildOptions

# a straight function's head: static or _SHARED (in units), then SYMBACKPROP_CALLED where it is a part
HEAD = r"SYMBACKPROP_STRAIGHT (?:static |\w+_SHARED )?(?:SYMBACKPROP_CALLED )?\w+ "


def _marked(source: str) -> list[str]:
    return re.findall(HEAD + r"(\w+)\(", source)


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


def _straight_bodies(source: str) -> list[list[str]]:
    """The statement lines of each SYMBACKPROP_STRAIGHT function."""
    functions = re.finditer(HEAD + r"\w+\(.*?\n\}\n", unwrapped(source), re.S)
    return [[line.strip() for line in f.group(0).splitlines() if line.strip().endswith(";")] for f in functions]


def test_a_straight_body_stores_each_value_after_the_last_temporary_it_reads():
    """Not all at the end, where every stored value (the minors, the
    gradient's entries) was live across the function (GCC's register
    allocation over hundreds of spilled values)."""
    source = generate(det.build_model({"ell": 7}), functions=det.SBP_FUNCTIONS)[0].source
    bodies = _straight_bodies(source)
    assert bodies
    stores = 0
    for body in bodies:
        last = -1  # the temporary defined last so far
        for line in body:
            defined = re.match(r"const \w+ x(\d+) = ", line)
            if defined:
                last = int(defined.group(1))
                continue
            store = re.match(r"(\w+)\[[^]]*\] = (.*);$", line)
            if store is None:
                continue
            stores += 1
            read = [int(n) for n in re.findall(r"\bx(\d+)\b", store.group(2))]
            assert max(read, default=-1) == last or (not read and last == -1), line
    assert stores > 100
