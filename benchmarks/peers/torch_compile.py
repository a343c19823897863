"""PyTorch with torch.compile (inductor, default mode) on the forward loss;
AOTAutograd compiles the backward, run by torch.autograd.grad.

Compile time "cold" is the first call with an empty inductor cache (run.py
gives each peer process a fresh TORCHINDUCTOR_CACHE_DIR); "cached" is the
first call again after torch._dynamo.reset(), served from that disk cache.
"""

from __future__ import annotations

import functools

import torch

from ._common import Variant, mlp_loss, timed
from ._torch import OPS, VERSION, step_call  # noqa: F401 (VERSION is reported)


def _compiled_call(workload, inputs, params):
    torch._dynamo.reset()
    loss_fn = torch.compile(functools.partial(mlp_loss, workload, OPS))
    call = step_call(loss_fn, inputs, params)
    _, seconds = timed(call)  # the first call compiles forward and backward
    return call, seconds


def setup(workload, dtype, inputs, params):
    _, cold = _compiled_call(workload, inputs, params)
    call, cached = _compiled_call(workload, inputs, params)
    return [Variant("torch_compile", call, compile_cold_s=cold, compile_cached_s=cached)]
