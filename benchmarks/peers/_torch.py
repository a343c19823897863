"""What torch_eager and torch_compile share: ops, tensors, the step."""

from __future__ import annotations

import torch

from ._common import Ops, bench_threads

torch.set_num_threads(bench_threads())

VERSION = torch.__version__
OPS = Ops(
    activations={"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu},
    logsumexp_rows=lambda z: torch.logsumexp(z, dim=1),
    sum_rows=lambda z: z.sum(dim=1),
)


def tensors(arrays: dict, requires_grad: bool = False) -> dict:
    """Tensors sharing memory with the numpy arrays."""
    return {k: torch.from_numpy(v).requires_grad_(requires_grad) for k, v in arrays.items()}


def step_call(loss_fn, inputs: dict, params: dict):
    """A no-arg value_and_grad call: forward ``loss_fn``, then autograd.grad."""
    ti, tp = tensors(inputs), tensors(params, requires_grad=True)
    leaves = list(tp.values())

    def call():
        loss = loss_fn(ti, tp)
        grads = torch.autograd.grad(loss, leaves)
        return loss.detach(), dict(zip(tp, grads))

    return call
