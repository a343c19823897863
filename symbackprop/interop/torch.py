"""A compiled module as a PyTorch autograd function and nn.Module.

    f = symbackprop.interop.torch.as_torch(mod)         # or mod.as_torch()
    loss = f(X=x, T=t, W1=w1, b1=c1, W2=w2, b2=c2)     # tensors by keyword; a 0-d tensor
    loss.backward()                                     # w1.grad, ... from the C gradient

The forward pass makes one `value_and_grad` C call (a `forward` call when
no argument needs a gradient) and keeps the gradients; backward returns
grad_output times them for each argument the module differentiates
(`mod.wrt`), None for the others. With `outputs=("Y",)` the function
returns `(loss, {"Y": tensor})` (one more C call, `forward`); gradients
flowing into an output are carried back by `mod.vjp` on backward.

Tensors must be CPU tensors of the module's dtype (float64 by default:
`torch.float64`); another dtype is an ArgumentError, as for numpy arrays.
Gradients come back on the argument's device and dtype. Higher-order
gradients (create_graph=True through the function) are not supported.

`SymbackpropModule` holds the model's parameters as `torch.nn.Parameter`s,
so that a compiled model sits in an ordinary training loop::

    net = SymbackpropModule(mod, {"W1": w1, "b1": c1, "W2": w2, "b2": c2})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = net(X=x, T=t); opt.zero_grad(); loss.backward(); opt.step()
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from symbackprop.errors import ArgumentError
from symbackprop.interop.common import Bridge, differentiable, scaled_gradients, value_and_grad_or_zero

if TYPE_CHECKING:  # only for annotations
    from symbackprop.run.module import CompiledModule


def _to_numpy(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ArgumentError(f"{name} is on {value.device}; symbackprop modules run on the CPU: pass {name}.cpu()")
        return value.detach().numpy()
    return value


class _Call:
    """What one autograd Function application needs besides the tensors."""

    def __init__(self, mod: Any, names: tuple[str, ...], outputs: tuple[str, ...]):
        self.mod, self.names, self.outputs = mod, names, outputs
        self.wrt = frozenset(differentiable(mod))


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, needs: bool, *tensors: torch.Tensor) -> Any:
        mod = call.mod
        arrays = {name: _to_numpy(name, t) for name, t in zip(call.names, tensors)}
        grads: Mapping[str, Any] = {}
        if needs:
            loss, grads = value_and_grad_or_zero(mod, arrays)
        outputs = mod.forward(**arrays) if call.outputs or not needs else {}
        if not needs:
            loss = outputs["loss"]
        if call.outputs:  # backward's vjp reads them: not views of tensors an optimizer may change
            arrays = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
        ctx.call, ctx.arrays, ctx.grads = call, arrays, grads
        ctx.likes = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in tensors]
        ctx.set_materialize_grads(False)
        like = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        dtype = like.dtype if like is not None else torch.float64
        loss_t = torch.tensor(float(loss), dtype=dtype)
        outs = [torch.as_tensor(np.asarray(outputs[o])) for o in call.outputs]
        return (loss_t, *outs) if call.outputs else loss_t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: Any, *grad_outputs: Any) -> Any:
        call = ctx.call
        if not ctx.grads:  # no argument needed a gradient
            return (None,) * (2 + len(call.names))
        seeds = {o: None if g is None else g.detach().cpu().numpy() for o, g in zip(call.outputs, grad_outputs)}
        seed = 0.0 if grad_loss is None else float(grad_loss)
        grads = scaled_gradients(call.mod, ctx.arrays, ctx.grads, seed, seeds)
        result: list[Any] = [None, None]
        for i, (name, like) in enumerate(zip(call.names, ctx.likes)):
            if name in grads and like is not None and ctx.needs_input_grad[2 + i]:
                shape, dtype, device = like
                result.append(torch.from_numpy(np.ascontiguousarray(grads[name])).reshape(shape).to(dtype=dtype, device=device))
            else:
                result.append(None)
        return tuple(result)


class TorchFunction(Bridge):
    """The compiled module as a function of tensors (see the module's
    docstring), built as a Bridge: TorchFunction(mod, outputs=())."""

    @functools.cached_property
    def _call(self) -> _Call:
        return _Call(self.mod, self.names, self.outputs)

    def __call__(self, **tensors: Any) -> Any:
        """The loss, differentiable by torch.autograd.

        Args:
            **tensors: every input and param by name: CPU tensors of the
                module's dtype, or arrays and numbers.

        Returns:
            The loss as a 0-d tensor; with outputs, ``(loss, {name: tensor})``.

        Raises:
            ArgumentError: missing or unknown arguments, a tensor not on the
                CPU, or any argument the module rejects.
        """
        missing = [n for n in self.names if n not in tensors]
        unknown = [n for n in tensors if n not in self.names]
        if missing or unknown:
            raise ArgumentError(f"missing {missing}, unknown {unknown}; expected the arguments {list(self.names)}")
        args = [tensors[n] for n in self.names]
        # value_and_grad only when autograd will want a gradient, else forward
        needs = torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for n, a in zip(self.names, args) if n in self._call.wrt)
        result = _Function.apply(self._call, needs, *args)
        if not self.outputs:
            return result
        return result[0], dict(zip(self.outputs, result[1:]))


def as_torch(mod: CompiledModule, outputs: Sequence[str] = ()) -> TorchFunction:
    """A callable taking the module's inputs and params as tensors by
    keyword and returning the loss as a 0-d tensor, differentiable by
    torch.autograd; with `outputs`, `(loss, {name: tensor})`.

    Args:
        mod: the compiled module.
        outputs: named outputs to return beside the loss.

    Returns:
        The TorchFunction.

    Raises:
        ArgumentError: an output name the model lacks; on call, missing or
            unknown arguments, or any argument the module rejects.
    """
    return TorchFunction(mod, outputs)


class SymbackpropModule(torch.nn.Module):
    """A compiled model as a torch.nn.Module: its params are Parameters
    (initialized from `params`, copied), its data inputs are the keyword
    arguments of `forward`, which returns the loss (and with `outputs`,
    `(loss, {name: tensor})`). Params the module does not differentiate are
    Parameters with requires_grad=False.

    Args:
        mod: the compiled module.
        params: the initial value of every param by name (arrays or tensors).
        outputs: named outputs `forward` returns beside the loss.

    Raises:
        ArgumentError: a param missing from `params`, an unknown name, or an
            output name the model lacks.
    """

    def __init__(self, mod: CompiledModule, params: Mapping[str, Any], outputs: Sequence[str] = ()) -> None:
        super().__init__()
        self.function = as_torch(mod, outputs)
        names = [str(p.name) for p in mod.model.params]
        missing = [n for n in names if n not in params]
        unknown = [n for n in params if n not in names]
        if missing or unknown:
            raise ArgumentError(f"initial values missing for {missing}, unknown {unknown}; the params are {names}")
        wrt = set(differentiable(mod))
        self.param_names = tuple(names)
        for name in names:
            value = torch.as_tensor(np.array(params[name], dtype=mod.dtype) if not isinstance(params[name], torch.Tensor)
                                    else params[name].detach().clone())
            self.register_parameter(name, torch.nn.Parameter(value, requires_grad=name in wrt))

    def forward(self, **inputs: Any) -> Any:
        """The loss at the current parameters.

        Args:
            **inputs: the model's data inputs by name.

        Returns:
            The loss as a 0-d tensor; with outputs, ``(loss, {name: tensor})``.

        Raises:
            ArgumentError: missing or unknown inputs, or any the module rejects.
        """
        return self.function(**inputs, **{name: getattr(self, name) for name in self.param_names})


__all__ = ["SymbackpropModule", "TorchFunction", "as_torch"]
