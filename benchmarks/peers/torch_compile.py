"""PyTorch with torch.compile (inductor, default mode) on the forward loss;
AOTAutograd compiles the backward, run by torch.autograd.grad.

Compile time "cold" is the first call with an empty inductor cache (run.py
gives each peer process a fresh TORCHINDUCTOR_CACHE_DIR); "cached" is the
first call again after torch._dynamo.reset(), served from that disk cache.
"""

from __future__ import annotations

import torch

from ._common import Unsupported, Variant, timed
from ._torch import VERSION, call_for, loss_function  # noqa: F401 (VERSION is reported)


def _compiled_call(workload, inputs, params):
    torch._dynamo.reset()
    loss_fn = torch.compile(loss_function(workload))
    call = call_for(workload, loss_fn, inputs, params)
    _, seconds = timed(call)  # the first call compiles forward and backward
    return call, seconds


def setup(workload, dtype, inputs, params):
    if workload.name == "W9":
        raise Unsupported("dynamo would unroll the Python loop over the steps (thousands) "
                          "into one graph; not attempted")
    _, cold = _compiled_call(workload, inputs, params)
    call, cached = _compiled_call(workload, inputs, params)
    return [Variant("torch_compile", call, compile_cold_s=cold, compile_cached_s=cached)]
