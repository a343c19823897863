"""PyTorch eager mode: the workload's loss, then torch.autograd.grad.

W6J (a forward workload) is torch.func.vmap(torch.func.jacrev(...)); W9
has a second variant, ``torch_eager.nn_lstm``, through torch.nn.LSTM.
"""

from __future__ import annotations

from ._common import Variant
from ._torch import VERSION, call_for, loss_function, lstm_loss_nn  # noqa: F401 (VERSION is reported)


def setup(workload, dtype, inputs, params):
    variants = [Variant("torch_eager", call_for(workload, loss_function(workload), inputs, params))]
    if workload.name == "W9":
        variants.append(Variant("torch_eager.nn_lstm", call_for(workload, lstm_loss_nn, inputs, params),
                                notes=["torch.nn.LSTM (ATen's fused LSTM) with the example's weights"]))
    return variants
