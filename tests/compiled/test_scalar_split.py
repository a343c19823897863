"""A model of many scalar values (a determinant by minors): its gradient is
one pack of the matrix's entries, not a zeroed matrix per entry and their
sum (autodiff._merge_packs); a forward-only call computes no derivative
(fusion._splits_first); the long straight-line bodies are parts of their
own (cparts). Checked against numpy's determinant and its closed-form
gradient det(A) inv(A)^T."""

import sys
from pathlib import Path

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop.diff.autodiff import vjp
from symbackprop.ir.construct import const
from symbackprop.ir.interpret import evaluate
from symbackprop.ir.lower import lower
from symbackprop.ir.node import SCALAR, topological_order
from symbackprop.pipeline import plan
from symbackprop.schedule.kernel import MapKernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gradbench.det import det_by_minors


def det_model(ell: int) -> sbp.Model:
    A = sp.MatrixSymbol("A", ell, ell)
    det = det_by_minors(lambda i, j: A[i, j], ell, lambda a, b: a + b, sp.Integer(0))
    return sbp.Model(f"det_{ell}", params=[A], loss=det)


def test_the_gradient_of_many_entries_is_one_pack():
    lowered = lower(det_model(4))
    A = lowered.leaves["A"]
    (grad,), _ = vjp([(lowered.loss, const(1, SCALAR))], [A])
    assert grad.op == "pack" and len(grad.args) == 16
    assert sum(node.op == "pack" for node in topological_order([grad])) == 1
    data = np.random.default_rng(0).standard_normal((4, 4))
    (got,) = evaluate([grad], {"A": data}, {})
    np.testing.assert_allclose(got, np.linalg.det(data) * np.linalg.inv(data).T, rtol=1e-12)


def _operations(kernels) -> int:
    return sum(k.op_counts()[1] for k in kernels if isinstance(k, MapKernel) and k.before_cse is not None)


def test_a_forward_only_call_computes_no_derivative():
    """The shared function's part before its split (what a forward call
    runs) does the work of a function of the forward pass alone, not the
    gradient's besides (it did three times that)."""
    shared = plan(det_model(6), ("forward", "value_and_grad")).function("forward").schedule
    alone = plan(det_model(6), ("forward",)).function("forward").schedule
    assert shared.split is not None
    assert _operations(shared.kernels[:shared.split]) <= 1.1 * _operations(alone.kernels)
    assert _operations(shared.kernels) > 2 * _operations(alone.kernels)  # the gradient is after the split


def test_long_straight_bodies_are_parts_and_compute_the_determinant():
    mod = sbp.compile(det_model(7))
    assert "_part1(" in mod.source and "_part2(" in mod.source  # few kernels, but long ones
    A = np.random.default_rng(1).standard_normal((7, 7))
    assert np.isclose(mod.forward(A=A)["loss"], np.linalg.det(A), rtol=1e-12)
    _, grads = mod.value_and_grad(A=A)
    np.testing.assert_allclose(grads["A"], np.linalg.det(A) * np.linalg.inv(A).T, rtol=1e-10)
