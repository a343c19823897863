"""What the GradBench ports share: output conversion and comparison, and
the JAX / PyTorch plumbing (jit and AOT compile, autograd, torch.compile).

Every port returns its outputs as ``{name: value}`` dicts (a float or an
array per name); ``to_numpy`` turns a peer's dict into float64 numpy, and
``max_rel_error`` compares two such dicts with the harness's relative error
(``benchmarks.measure._rel``: 2-norm of the difference over 2-norm of the
reference, per entry, the largest over the entries).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from benchmarks.measure import _rel

Outputs = dict[str, Any]


class Unsupported(Exception):
    """This peer cannot run this eval (the message says why)."""


def to_numpy(value: Any) -> Any:
    """A float64 numpy array (or a float) from numpy, JAX or torch values."""
    if isinstance(value, Mapping):
        return {k: to_numpy(v) for k, v in value.items()}
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value, dtype=np.float64)
    return float(arr) if arr.ndim == 0 else arr


def max_rel_error(got: Outputs, ref: Outputs) -> float:
    """Largest relative error over the reference's entries (inf when an
    entry is missing or has another number of elements)."""
    worst = 0.0
    for name, want in ref.items():
        if name not in got:
            return float("inf")
        g = np.ravel(np.asarray(to_numpy(got[name]), dtype=np.float64))
        w = np.ravel(np.asarray(want, dtype=np.float64))
        if g.shape != w.shape:
            return float("inf")
        worst = max(worst, _rel(g, w))
    return worst


# --------------------------------------------------------------------------
# symbackprop


def build_models(E, size) -> dict:
    """The eval module E's symbackprop models at ``size``, by name."""
    return E.build_models(size) if hasattr(E, "build_models") else {"main": E.build_model(size)}


def sbp_functions(E, key: str) -> tuple:
    """The functions to compile for E's model `key`: E.SBP_FUNCTIONS, or its
    entry for `key` where it is a dict (a port compiles only what it calls:
    each emitted function is C to generate and compile)."""
    return E.SBP_FUNCTIONS[key] if isinstance(E.SBP_FUNCTIONS, dict) else E.SBP_FUNCTIONS


def sbp_compile_models(E, models: dict) -> dict:
    """Each of E's models (build_models) compiled, by name (at once: one
    model's C compiler runs while the next one's C is generated)."""
    import symbackprop as sbp

    return sbp.compile_all(models, functions={k: sbp_functions(E, k) for k in models})


def sbp_compile(E, size):
    """The compiled module (a dict of them for evals with several models)."""
    mods = sbp_compile_models(E, build_models(E, size))
    return mods if hasattr(E, "build_models") else mods["main"]


# --------------------------------------------------------------------------
# JAX


def jax_module():
    """jax with float64 on (the ports are float64, as GradBench)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    return jax


def jax_pair(primal: Callable, derivative: Callable, args: tuple) -> tuple[Callable, Callable, dict]:
    """Ahead-of-time compile ``primal(*args)`` and ``derivative(*args)`` with
    ``jax.jit``; returns two no-argument calls (each waits for its result)
    and the compile seconds of each."""
    jax = jax_module()
    dev = tuple(jax.device_put(a) for a in args)
    t0 = time.perf_counter()
    cp = jax.jit(primal).lower(*dev).compile()
    t1 = time.perf_counter()
    cd = jax.jit(derivative).lower(*dev).compile()
    t2 = time.perf_counter()
    return ((lambda: jax.block_until_ready(cp(*dev))), (lambda: jax.block_until_ready(cd(*dev))),
            {"primal": t1 - t0, "derivative": t2 - t1})


def jax_value_grad_pair(loss: Callable, params: dict, consts: dict, primal_name: str = "value"):
    """The usual eval: a scalar ``loss(params, consts)`` and its gradient
    with respect to every entry of ``params``."""
    jax = jax_module()

    def primal(p, c):
        return {primal_name: loss(p, c)}

    def derivative(p, c):
        return jax.grad(loss)(p, c)

    return jax_pair(primal, derivative, (params, consts))


# --------------------------------------------------------------------------
# PyTorch


def torch_module():
    import torch

    torch.set_num_threads(1)
    return torch


def torch_tensors(arrays: Mapping[str, np.ndarray], grad: bool = False) -> dict:
    torch = torch_module()
    out = {}
    for k, v in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        out[k] = t.requires_grad_() if grad else t
    return out


def torch_value_grad_pair(loss: Callable, params: dict, consts: dict, compiled: bool,
                          primal_name: str = "value"):
    """Eager (or torch.compile'd) ``loss(params, consts)`` and its gradient
    by ``torch.autograd.grad``; two no-argument calls. With ``compiled``,
    the first call of each is made here (it compiles) and its seconds are
    returned."""
    torch = torch_module()
    tp, tc = torch_tensors(params, grad=True), torch_tensors(consts)
    names = list(tp)
    fn = torch.compile(loss) if compiled else loss

    def primal():
        with torch.no_grad():
            return {primal_name: fn(tp, tc)}

    def derivative():
        grads = torch.autograd.grad(fn(tp, tc), [tp[n] for n in names])
        return dict(zip(names, grads))

    return _first_calls(primal, derivative, compiled)


def _first_calls(primal, derivative, compiled: bool):
    seconds = {}
    if compiled:
        for key, call in (("primal", primal), ("derivative", derivative)):
            t0 = time.perf_counter()
            call()
            seconds[key] = time.perf_counter() - t0
    return primal, derivative, seconds


def first_calls(primal, derivative, compiled: bool):
    """(primal, derivative, {first-call seconds}) for a torch.compile'd pair."""
    return _first_calls(primal, derivative, compiled)
