"""GradBench `det`: the determinant by expansion by minors (cmpad's det_by_minor).

Definition (evals/det/README.md, cpp/gradbench/evals/det.hpp): det(A) of an ell x ell
matrix, expanded along the first row of each minor, recursively; `primal` returns
det(A), `gradient` d det / dA (row-major, ell^2 numbers).
Data (evals/det/run.py): np.random.seed(31337) once, then A = np.random.rand(ell*ell)
for each ell of the published list (5 ... 11) in order; `generate` replays them.

Every peer builds the same expression: the minor of rows r.. and a set of columns is
one shared node (memoised on (r, columns)), so the graph has about ell 2^(ell-1)
multiply-adds instead of the recursion's ell! (symbackprop would share them anyway:
SymPy hash-conses equal subexpressions and the compiler CSEs them). The reference is
numpy's det(A) and its gradient det(A) inv(A)^T; fd_error checks a
gradient against central differences of numpy's det.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._common import jax_module, jax_value_grad_pair, torch_module, torch_value_grad_pair

NAME = "det"
PRIMAL, DERIVATIVE = "primal", "gradient"
SIZES = [{"ell": e} for e in (5, 6, 7, 8, 9, 10, 11)]
DEFAULT = {"ell": 5}  # issue 15's table (ell=7 did not compile in 125 s)
SMALL = {"ell": 5}
SCALING = [{"ell": e} for e in (5, 6, 7)]


def label(size: dict) -> str:
    return f"ell={size['ell']}"


def work(size: dict) -> float:
    e = size["ell"]
    return float(e * 2 ** (e - 1))


def generate(size: dict) -> dict:
    rs = np.random.RandomState(31337)
    for s in SIZES:
        A = rs.rand(s["ell"] * s["ell"])
        if s["ell"] == size["ell"]:
            return {"A": A.reshape(s["ell"], s["ell"])}
    return {"A": np.random.RandomState(31337).rand(size["ell"], size["ell"])}


def reference(data: dict) -> tuple[dict, dict]:
    A = data["A"]
    d = float(np.linalg.det(A))
    return {"value": d}, {"A": d * np.linalg.inv(A).T}


def fd_error(data: dict, deriv: dict, eps: float = 1e-6) -> float:
    """Relative error of the directional derivative along a random direction
    (central differences of numpy's determinant)."""
    A = data["A"]
    v = np.random.default_rng(1).standard_normal(A.shape)
    fd = (np.linalg.det(A + eps * v) - np.linalg.det(A - eps * v)) / (2 * eps)
    got = float(np.sum(np.asarray(deriv["A"]).reshape(A.shape) * v))
    return abs(got - fd) / max(abs(fd), 1e-300)


def det_by_minors(entry, ell: int, add, zero):
    """The expansion by minors with each minor built once; ``entry(i, j)``
    gives A[i, j]."""

    @lru_cache(maxsize=None)
    def minor(row: int, cols: tuple):
        if len(cols) == 1:
            return entry(row, cols[0])
        total = zero
        for k, col in enumerate(cols):
            term = entry(row, col) * minor(row + 1, cols[:k] + cols[k + 1:])
            total = add(total, term if k % 2 == 0 else -term)
        return total

    return minor(0, tuple(range(ell)))


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp

    ell = size["ell"]
    A = sp.MatrixSymbol("A", ell, ell)
    det = det_by_minors(lambda i, j: A[i, j], ell, lambda a, b: a + b, sp.Integer(0))
    return sbp.Model(f"gradbench_det_{ell}", params=[A], loss=det)


SBP_FUNCTIONS = ("forward", "value_and_grad")


def sbp_calls(mod, data: dict):
    A = data["A"]
    return (lambda: {"value": mod.forward(A=A)["loss"]},
            lambda: {"A": mod.value_and_grad(A=A)[1]["A"]})


def _loss(p, c):
    A = p["A"]
    return det_by_minors(lambda i, j: A[i, j], A.shape[0], lambda a, b: a + b, 0.0)


def jax_calls(data: dict):
    jax_module()
    return jax_value_grad_pair(_loss, {"A": data["A"]}, {})


def torch_calls(data: dict, compiled: bool):
    torch_module()
    return torch_value_grad_pair(_loss, {"A": data["A"]}, {}, compiled)
