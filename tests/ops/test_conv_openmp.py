"""Convolutional layers built with OpenMP (BuildOptions(openmp=True)): the
batch loops of the convolutions, pools and channel ops run on several
threads, and the gradients are bit for bit the same on 1 and 2 threads
(a weight gradient adds fixed blocks of examples in a fixed order), and
match PyTorch autograd in float64."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from test_conv import _check, _lenet_block

from symbackprop.toolchain.builder import BuildOptions

torch = pytest.importorskip("torch")


def _gomp():
    """libgomp, which the OpenMP build links (GCC); its omp_set_num_threads
    sets the thread count of the next parallel loops this thread starts."""
    name = ctypes.util.find_library("gomp")
    if name is None:
        pytest.skip("libgomp (GCC's OpenMP runtime) is not installed")
    return ctypes.CDLL(name)


@pytest.mark.parametrize("batch", (3, 37))
def test_one_and_two_threads_give_identical_gradients(batch):
    """The LeNet block of test_conv (two convolutions, stride 1 and 2 with
    padding, a max and an average pool, batch norm) at an odd batch, fewer
    and more examples than blocks: against torch float64, then the same
    call on 1 and 2 threads gives the same bits."""
    gomp = _gomp()
    model, reference, shapes = _lenet_block()
    mod, arrays = _check(model, reference, shapes, batch, wrt=["w1", "b1", "w2", "gamma", "beta", "v", "c"],
                         options=BuildOptions(openmp=True))
    assert "SYMBACKPROP_PARALLEL_BLOCKS" in mod.source and "SYMBACKPROP_PARALLEL_FOR" in mod.source
    results = {}
    try:
        for threads in (1, 2):
            gomp.omp_set_num_threads(threads)
            assert gomp.omp_get_max_threads() == threads
            results[threads] = mod.value_and_grad(**arrays)
    finally:
        gomp.omp_set_num_threads(1)
    (loss1, grads1), (loss2, grads2) = results[1], results[2]
    assert loss1 == loss2
    for name in grads1:
        assert np.array_equal(grads1[name], grads2[name]), name


_WAIT_POLICY_SCRIPT = """
import os, sys, sympy as sp, symbackprop as sbp
from symbackprop import nn
from symbackprop.toolchain.builder import BuildOptions
x = sp.MatrixSymbol("x", sp.Symbol("n", integer=True, positive=True), 3)
model = sbp.Model(sys.argv[1], inputs=[x], params=[], grad_inputs=[x], loss=nn.sum_all(x.applyfunc(sp.sin)))
sbp.compile(model, options=BuildOptions(openmp=sys.argv[1] == "with_omp"))
print(os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize(("name", "preset", "want"), [("with_omp", None, "None"), ("with_omp", "passive", "passive"),
                                                      ("without_omp", None, "None")])
def test_loading_a_module_leaves_the_openmp_wait_policy_to_the_user(name, preset, want, tmp_path):
    """Loading a module, built with OpenMP or not, leaves OMP_WAIT_POLICY as
    the user set it, or unset: libgomp's default short spin keeps its
    parallel loops cheap now that OpenBLAS runs on one thread beside it (a
    passive default had made W11's two-thread step 62 ms against 38 ms)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["SYMBACKPROP_CACHE_DIR"] = str(tmp_path)
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    out = subprocess.run([sys.executable, "-c", _WAIT_POLICY_SCRIPT, name], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == want
