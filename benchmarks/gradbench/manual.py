"""GradBench's hand-written C++ (its `manual` tool) as a peer, called in-process.

The C++ is not in this repository (its licence and authorship are GradBench's):
rebuild it from gradbench/gradbench (tools/manual/, cpp/gradbench/evals/) as shared
libraries exposing C entry points, and name their folder in GB_MANUAL_DIR:

    libkmeans_manual.so  kmeans.hpp's `objective`, kmeans.cpp's `kmeans_objective_d`:
        double kmeans_cost(int n, int k, int d, const double* P, const double* C)
        void kmeans_dir(int n, int k, int d, const double* P, const double* C, double* dir)
    libht_manual.so      ht.hpp's `objective`, ht_d.hpp's `ht_objective_d`:
        void ht_set(model and data, as ht.hpp's from_json fills its structs)
        void ht_objective(const double* theta, double* err)
        void ht_jacobian(const double* theta, double* J)   (column-major, 3N x columns)
    libba_manual.so      ba.hpp's `objective`, ba.cpp's `Jacobian::compute` (ba_d.hpp):
        void ba_set(int n, int m, int p, cams, X, w, const int* obs, feats)   (as from_json fills Input)
        void ba_objective(double* reproj_err, double* w_err)
        const double* ba_jacobian(void)   (the SparseMat's vals, built afresh on each call as the C++ does)

built with g++ -O3 -march=native, without OpenMP (one thread, as every peer here).
Called through ctypes: a call costs about a microsecond more than from C++,
nothing next to these evals' milliseconds. `calls(eval, data)` returns the
(primal, derivative) pair, or raises Unsupported when the library is missing.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from ._common import Unsupported

SOURCE = ("the manual column: GradBench's hand-written C++ from gradbench/gradbench, rebuilt outside this "
          "repository (g++ -O3 -march=native, no OpenMP) and called in-process through ctypes: kmeans from "
          "cpp/gradbench/evals/kmeans.hpp and tools/manual/kmeans.cpp at 1e870182; ht from "
          "cpp/gradbench/evals/ht.hpp at 28d72eed, tools/manual/ht_d.hpp at 3eb158a3 and tools/manual/ht.cpp "
          "at ac868ffa, with cpp/adbench/shared/light_matrix.h at 3d73a76d and matrix.h at 17c5ef38; ba from "
          "cpp/gradbench/evals/ba.hpp at 3eb158a3, tools/manual/ba_d.hpp at 3d73a76d and tools/manual/ba.cpp at "
          "59916618")

_DOUBLES = ctypes.POINTER(ctypes.c_double)
_INTS = ctypes.POINTER(ctypes.c_int)


def _library(name: str) -> ctypes.CDLL:
    folder = os.environ.get("GB_MANUAL_DIR")
    path = Path(folder or ".") / f"lib{name}_manual.so"
    if not folder or not path.exists():
        raise Unsupported(f"GradBench's hand-written C++ is not built: set GB_MANUAL_DIR to a folder with {path.name}")
    return ctypes.CDLL(str(path))


def _doubles(a: np.ndarray):
    return np.ascontiguousarray(a, dtype=np.float64).ctypes.data_as(_DOUBLES)


def _ints(a: np.ndarray):
    return np.ascontiguousarray(a, dtype=np.intc).ctypes.data_as(_INTS)


def kmeans_calls(data: dict):
    lib = _library("kmeans")
    lib.kmeans_cost.restype = ctypes.c_double
    P, C = np.ascontiguousarray(data["points"]), np.ascontiguousarray(data["centroids"])
    (n, d), k = P.shape, len(C)
    dir_ = np.empty_like(C)
    p_ptr, c_ptr, d_ptr = _doubles(P), _doubles(C), _doubles(dir_)

    def cost():
        return {"value": lib.kmeans_cost(n, k, d, p_ptr, c_ptr)}

    def direction():
        lib.kmeans_dir(n, k, d, p_ptr, c_ptr, d_ptr)
        return {"dir": dir_}

    return cost, direction


def ht_calls(data: dict):
    lib = _library("ht")
    keep = {key: np.ascontiguousarray(data[key]) for key in ("base_relatives", "inverse_base_absolutes",
                                                              "base_positions", "weights", "points")}
    ints = {key: np.ascontiguousarray(data[key], dtype=np.intc) for key in ("parents", "triangles", "correspondences")}
    us = np.ascontiguousarray(data["us"]) if "us" in data else None
    n = len(data["points"])
    lib.ht_set(len(ints["parents"]), _ints(ints["parents"]), _doubles(keep["base_relatives"]),
               _doubles(keep["inverse_base_absolutes"]), len(keep["base_positions"]), _doubles(keep["base_positions"]),
               _doubles(keep["weights"]), len(ints["triangles"]), _ints(ints["triangles"]), n,
               _ints(ints["correspondences"]), _doubles(keep["points"]), None if us is None else _doubles(us))
    theta = np.ascontiguousarray(data["theta"])
    err = np.empty(3 * n)
    jac = np.empty(((2 if us is not None else 0) + len(theta), 3 * n))  # column-major: a row per column
    t_ptr, e_ptr, j_ptr = _doubles(theta), _doubles(err), _doubles(jac)

    def objective():
        lib.ht_objective(t_ptr, e_ptr)
        return {"objective": err}

    def jacobian():
        lib.ht_jacobian(t_ptr, j_ptr)
        return {"jacobian": jac.T}

    objective.keep = (keep, ints, us)  # the C++ holds copies; these stay alive with the calls anyway
    return objective, jacobian


def ba_calls(data: dict):
    lib = _library("ba")
    lib.ba_jacobian.restype = _DOUBLES
    keep = {key: np.ascontiguousarray(data[key]) for key in ("cams", "X", "w", "feats")}
    obs = np.ascontiguousarray(np.stack([data["cam"], data["pt"]], axis=1), dtype=np.intc)
    (n, m), p = (len(keep["cams"]), len(keep["X"])), len(keep["w"])
    lib.ba_set(n, m, p, _doubles(keep["cams"]), _doubles(keep["X"]), _doubles(keep["w"]), _ints(obs),
               _doubles(keep["feats"]))
    reproj_err, w_err = np.empty((p, 2)), np.empty(p)
    r_ptr, w_ptr = _doubles(reproj_err), _doubles(w_err)

    def objective():
        lib.ba_objective(r_ptr, w_ptr)
        return {"reproj_err": reproj_err, "w_err": w_err}

    def jacobian():  # 30 values per observation (its two rows of 15), then one per weight
        return {"vals": np.ctypeslib.as_array(lib.ba_jacobian(), shape=(31 * p,))}

    return objective, jacobian


CALLS = {"kmeans": kmeans_calls, "ht": ht_calls, "ba": ba_calls}


def calls(name: str, data: dict):
    if name not in CALLS:
        raise Unsupported(f"no hand-written C++ peer for {name} here")
    return CALLS[name](data)
