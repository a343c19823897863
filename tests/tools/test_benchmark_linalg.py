"""benchmarks/linalg.py: every peer it times computes the same value and
gradients (checked against numpy's closed forms before timing), here at
sizes on both sides of the LAPACK threshold, and a wrong peer is caught."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import linalg  # noqa: E402


@pytest.mark.parametrize("op", linalg.OPS)
def test_the_peers_agree_with_numpy(op):
    wanted = ["symbackprop", "numpy"]
    if _has_jax():
        wanted.append("jax_jit")
    calls = linalg.peers(op, wanted)
    for size in (5, 90):
        errors = linalg.check(calls, linalg.data(op, size))
        assert set(errors) == set(wanted) and max(errors.values()) < 1e-10, (op, size, errors)


def test_a_wrong_peer_is_caught():
    calls = linalg.peers("det", ["symbackprop", "numpy"])
    calls["wrong"] = lambda A: (np.linalg.det(A), {"A": np.linalg.inv(A)})  # not transposed
    assert linalg.check(calls, linalg.data("det", 6))["wrong"] > 1e-3


def _has_jax() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return False
    return True
