"""PyTorch eager mode: the generic MLP loss, then torch.autograd.grad."""

from __future__ import annotations

import functools

from ._common import Variant, mlp_loss
from ._torch import OPS, VERSION, step_call  # noqa: F401 (VERSION is reported)


def setup(workload, dtype, inputs, params):
    loss_fn = functools.partial(mlp_loss, workload, OPS)
    return [Variant("torch_eager", step_call(loss_fn, inputs, params))]
