"""symbackprop: the workload written as a SymPy model, compiled to C.

Variants: ``symbackprop`` (``mod.value_and_grad(**arrays)``, which checks and
binds every array and allocates the gradients on each call) and, where the
module has ``prepare``, ``symbackprop.prepared`` (arrays bound and outputs
allocated once; each call only calls C: ``pre.run()``, the loss) and
``symbackprop.prepared()`` (``pre()``, the loss and the same dict of
gradients every call; not for forward workloads).

The example workloads (W5-W9) compile the model of ``examples/<name>.py``
as it is, imported from the file; W6J times ``mod.forward`` (the loss and
the ``residual`` and ``jacobian`` outputs) instead of ``value_and_grad``.

Compile time "cold" is ``sbp.compile`` with an empty cache (a fresh
SYMBACKPROP_CACHE_DIR folder for each workload and dtype, inside the one
run.py gives the peer process); "cached" is the same ``sbp.compile`` again,
served from that cache. The generated C's line count (``mod.source``, the
forward and value_and_grad functions) is reported as ``c_lines``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import sympy as sp

import symbackprop as sbp
from symbackprop.declare import nn

from .. import workloads
from ._common import Unsupported, Variant, bench_threads, cache_root, timed

VERSION = sbp.__version__
# The worker leaves BLAS's threads alone: run.py's OPENBLAS_NUM_THREADS
# holds with one thread, and with more a module built with OpenMP keeps
# OpenBLAS's pool at one thread and splits its products across OpenMP's
# (toolchain/builder.py); threadpoolctl would set that pool back to --threads.
SETS_ITS_BLAS_THREADS = True


@functools.lru_cache(maxsize=None)
def load_example(name: str):
    """``examples/<name>.py`` imported as a module."""
    path = workloads.EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(workload):
    """The workload as an ``sbp.Model``."""
    if getattr(workload, "example", None) == "lstm_lm_batched":
        batch = dict(workload.size)["batch"]  # the batch is the scan's: a model of its own
        return load_example(workload.example).lm_model(workloads.LSTM_BATCHED_HIDDEN, batch, f"lstm_lm_b{batch}")
    if workloads.is_example(workload):
        return load_example(workload.example).model
    if workload.layout == "rows":
        return _rows_model(workload)
    return _columns_model(workload)


def _rows_model(workload):
    n = sp.Symbol("n", integer=True, positive=True)
    sizes, L = workload.sizes, workload.n_layers
    X, T = sp.MatrixSymbol("X", n, sizes[0]), sp.MatrixSymbol("T", n, sizes[-1])
    act = getattr(nn, workload.activation)
    params, a = [], X
    for k in range(1, L + 1):
        W = sp.MatrixSymbol(f"W{k}", sizes[k - 1], sizes[k])
        b = sp.MatrixSymbol(f"b{k}", 1, sizes[k])
        params += [W, b]
        z = nn.linear(a, W, b)
        a = act(z) if k < L else z
    losses = {"mse": nn.mse, "softmax_ce": nn.softmax_cross_entropy}
    if workload.loss not in losses:
        raise Unsupported(f"no symbackprop loss for {workload.loss!r} in rows layout")
    loss = losses[workload.loss](a, T)
    return sbp.Model(workload.name, inputs=[X, T], params=params, loss=loss,
                     outputs={"Y": a})


def _columns_model(workload):
    sizes, L = workload.sizes, workload.n_layers
    if workload.loss != "half_sse" or sizes[-1] != 1 or workload.batch != 1:
        raise Unsupported("columns layout is written for one example and one output")
    x, t = sp.MatrixSymbol("x", sizes[0], 1), sp.MatrixSymbol("t", 1, 1)
    act = getattr(nn, workload.activation)
    params, a = [], x
    for k in range(1, L + 1):
        W = sp.MatrixSymbol(f"W{k}", sizes[k], sizes[k - 1])
        params.append(W)
        z = W * a
        a = act(z) if k < L else z
    loss = sp.HadamardPower(a - t, 2) / 2  # a 1x1 matrix: a scalar loss
    return sbp.Model(workload.name, inputs=[x, t], params=params, loss=loss,
                     outputs={"y": a})


def _compile(model, dtype):
    # with more than one thread, the batch loops run on them too (OpenMP);
    # an older symbackprop (interleave's SBP_CWD) may predate BuildOptions
    build = getattr(sbp, "BuildOptions", None)
    options = {"options": build(openmp=bench_threads() > 1)} if build else {}
    try:
        return timed(sbp.compile, model, dtype=dtype, **options)
    except sbp.SymbackpropError as exc:
        if dtype != "float64":
            raise Unsupported(f"sbp.compile(dtype={dtype!r}) failed: {exc}") from exc
        raise


def _fresh_cache(workload, dtype) -> None:
    """Point symbackprop at an empty cache folder of this workload and dtype
    (W6 and W6J compile the same model: each must start cold)."""
    folder = cache_root() / f"symbackprop_{workload.name}_{dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["SYMBACKPROP_CACHE_DIR"] = str(folder)


def setup(workload, dtype, inputs, params):
    model = build_model(workload)
    _fresh_cache(workload, dtype)
    _, cold = _compile(model, dtype)
    mod, cached = _compile(model, dtype)
    arrays = {**inputs, **params}
    lines = mod.source.count("\n")
    common = {"compile_cold_s": cold, "compile_cached_s": cached,
              "notes": [f"generated C: {lines} lines"], "extra": {"c_lines": lines}}
    outputs = getattr(workload, "outputs", ())
    if outputs:
        def call():
            result = mod.forward(**arrays)
            return result["loss"], {k: result[k] for k in outputs}
    else:
        call = lambda: mod.value_and_grad(**arrays)
    variants = [Variant("symbackprop", call, **common)]
    if hasattr(mod, "prepare"):
        variants.append(Variant("symbackprop.prepared", _prepared(mod, arrays, outputs), **common))
        if not outputs:  # the prepared call itself: (loss, grads), the same dict every call
            variants.append(Variant("symbackprop.prepared()", mod.prepare(**arrays), **common))
    return variants


def _prepared(mod, arrays, outputs=()):
    if outputs:
        call = mod.prepare("forward", **arrays)
        results = {k: call.results[k] for k in outputs}
        return lambda: (call.run(), results)
    call = mod.prepare(**arrays)
    grads = call.grads  # the same preallocated arrays after every call
    return lambda: (call.run(), grads)  # run(): the loss alone, the least a call does
