"""Hand-written numpy backprop: the reference every peer is checked against.

The MLP workloads (W1-W4) are here; the example workloads (W5-W9) are in
``_numpy_examples.py``.

BLAS threads are limited by run.py (environment of the worker process) and,
when threadpoolctl is installed, by the worker itself.
"""

from __future__ import annotations

import numpy as np

from .. import workloads
from . import _numpy_examples
from ._common import Unsupported, Variant

VERSION = np.__version__


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


# activation(z) and its derivative expressed through (z, a=activation(z))
_ACTIVATIONS = {
    "sigmoid": (_sigmoid, lambda z, a: a * (1.0 - a)),
    "tanh": (np.tanh, lambda z, a: 1.0 - a * a),
    "relu": (lambda z: np.maximum(z, 0.0), lambda z, a: (z > 0).astype(z.dtype)),
}


def value_and_grad(workload, inputs: dict, params: dict):
    """``(loss, {param: grad})`` by explicit forward and backward passes
    (for a forward workload such as W6J: ``(loss, {output: array})``)."""
    if workloads.is_example(workload):
        return _numpy_examples.FUNCTIONS[workload.name](inputs, params)
    rows = workload.layout == "rows"
    x_name, t_name = workload.input_names
    act, dact = _ACTIVATIONS[workload.activation]
    L = workload.n_layers

    acts, pre = [inputs[x_name]], []  # acts[k] = A_k, pre[k-1] = Z_k
    for k in range(1, L + 1):
        w = params[f"W{k}"]
        z = acts[-1] @ w if rows else w @ acts[-1]
        if workload.has_bias:
            z = z + params[f"b{k}"]
        pre.append(z)
        acts.append(act(z) if k < L else z)

    loss, dz = _loss_and_grad(workload.loss, acts[-1], inputs[t_name])

    grads = {}
    for k in range(L, 0, -1):
        a_prev, w = acts[k - 1], params[f"W{k}"]
        grads[f"W{k}"] = a_prev.T @ dz if rows else dz @ a_prev.T
        if workload.has_bias:
            grads[f"b{k}"] = dz.sum(axis=0, keepdims=True)
        if k > 1:
            da = dz @ w.T if rows else w.T @ dz
            dz = da * dact(pre[k - 2], acts[k - 1])
    return loss, {name: grads[name] for name in workload.param_names}


def _loss_and_grad(kind: str, y, t):
    """Scalar loss and its gradient with respect to the output ``y``."""
    d = y - t
    if kind == "mse":
        return float(np.mean(d * d)), (2.0 / d.size) * d
    if kind == "half_sse":
        return float(0.5 * np.sum(d * d)), d
    if kind == "softmax_ce":
        m = y.max(axis=1, keepdims=True)
        e = np.exp(y - m)
        s = e.sum(axis=1, keepdims=True)
        lse = np.log(s) + m
        n = y.shape[0]
        loss = float(np.mean(lse[:, 0] - np.sum(t * y, axis=1)))
        return loss, (e / s - t) / n
    raise ValueError(f"unknown loss {kind!r}")


# Written with no numpy backward: their reference is PyTorch autograd in float64.
TORCH_REFERENCED = ("transformer_lm", "lstm_lm_batched")


def reference(workload, inputs: dict, params: dict):
    """The reference result, always computed in float64 from the given data."""
    up = lambda d: {k: np.asarray(v, dtype=np.float64) if v.dtype.kind == "f" else v
                    for k, v in d.items()}
    if getattr(workload, "example", None) in TORCH_REFERENCED:
        from ._torch import reference_float64  # torch is needed to check these

        return reference_float64(workload, up(inputs), up(params))
    return value_and_grad(workload, up(inputs), up(params))


def setup(workload, dtype, inputs, params):
    if getattr(workload, "example", None) in TORCH_REFERENCED:
        raise Unsupported("no hand-written numpy backward (the reference is torch float64 autograd)")
    return [Variant("numpy_ref", lambda: value_and_grad(workload, inputs, params))]
