"""Optimizers whose update step is emitted in C beside the backward pass.

An optimizer describes its update as graph nodes, like a derivative rule:
given a parameter, its gradient, its state and the hyperparameters (all
leaves, so that they are run-time arguments), it returns the parameter's
and the state's new values. A training step writes them in place.

The updates follow PyTorch's `torch.optim.SGD` and `torch.optim.Adam`
(weight decay added to the gradient, as their `weight_decay` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, cast

import numpy as np
import sympy as sp

from symbackprop.ir.construct import leaf, map_
from symbackprop.ir.interpret import evaluate
from symbackprop.ir.node import SCALAR, Node, placeholder

a0, a1, a2, a3, a4 = (placeholder(k) for k in range(5))


@dataclass(frozen=True)
class _Step:
    """One line of an update: the value `name` is `rule` of the values that
    `reads` names (a0, a1, ... in order): the parameter ("param"), its
    gradient ("grad"), a state or hyperparameter, or an earlier step's
    result, which stands for its name from then on. A step that reads no
    per-entry value (the parameter, its gradient, its state, a step that
    reads one) is a scalar, computed once and named in the C code."""

    name: str
    rule: sp.Expr
    reads: tuple[str, ...]


_WEIGHT_DECAY = _Step("grad", a0 + a1 * a2, ("grad", "weight_decay", "param"))  # as torch.optim's weight_decay


class _Update:
    """The update, written once; each optimizer gives its differences as
    data: its per-parameter state, its steps (after _WEIGHT_DECAY) and
    those of the state every parameter shares (named as that state)."""

    per_param_state: ClassVar[tuple[str, ...]]
    steps: ClassVar[tuple[_Step, ...]]
    shared_steps: ClassVar[tuple[_Step, ...]] = ()
    shared_state: ClassVar[tuple[str, ...]]  # the names of shared_steps

    def __init_subclass__(cls) -> None:
        cls.shared_state = tuple(step.name for step in cls.shared_steps)

    def hyper(self) -> dict[str, float]:
        """The hyperparameters by name, as passed to the C training step.

        Returns:
            A new dict of the dataclass fields.
        """
        return asdict(cast(Any, self))

    def update(
        self, p: Node, g: Node, state: dict[str, Node], hyper: dict[str, Node], shared: dict[str, Node]
    ) -> dict[str, Node | dict[str, Node]]:
        """One parameter's update, as graph nodes.

        Args:
            p: the parameter.
            g: its gradient.
            state: its optimizer state by name (see per_param_state).
            hyper: the hyperparameter leaves by name.
            shared: the shared state after this step's shared_update.

        Returns:
            "param": the new parameter, "grad": the gradient with weight decay,
            and the new value of each per-parameter state by name; optionally
            "names": intermediate nodes by the name they get in the C code.
        """
        values: dict[str, Node] = {**hyper, **shared, **state, "param": p, "grad": g}
        per_entry = {"param", "grad", *state}
        names: dict[str, Node] = {}
        for step in (_WEIGHT_DECAY, *self.steps):
            entrywise = any(name in per_entry for name in step.reads)
            node = map_(step.rule, [values[name] for name in step.reads], p.shape if entrywise else None)
            if entrywise:
                per_entry.add(step.name)
            else:
                names[step.name] = node
            values[step.name] = node
        new: dict[str, Node | dict[str, Node]] = {"param": values["param"], "grad": values["grad"], "names": names}
        return new | {kind: values[kind] for kind in self.per_param_state}

    def shared_update(self, shared: dict[str, Node]) -> dict[str, Node]:
        """The update of the state shared by every parameter.

        Args:
            shared: the shared state leaves by name (see shared_state).

        Returns:
            The new value of each shared state by name.
        """
        return {step.name: map_(step.rule, [shared[name] for name in step.reads]) for step in self.shared_steps}


@dataclass(frozen=True)
class SGD(_Update):
    """p -= lr * v with v = momentum * v + (g + weight_decay * p); plain SGD
    when momentum is 0 (the velocity is then the gradient).

    Args:
        lr: the learning rate.
        momentum: the velocity's decay (0: plain SGD).
        weight_decay: the L2 penalty's coefficient, added to the gradient.
    """

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0

    per_param_state: ClassVar[tuple[str, ...]] = ("velocity",)
    steps: ClassVar[tuple[_Step, ...]] = (
        _Step("velocity", a0 * a1 + a2, ("momentum", "velocity", "grad")),
        _Step("param", a0 - a1 * a2, ("param", "lr", "velocity")),
    )


@dataclass(frozen=True)
class Adam(_Update):
    """Adam with bias correction: m, v moving averages of g and g^2;
    p -= lr * m_hat / (sqrt(v_hat) + eps); the step count is shared state.

    Args:
        lr: the learning rate.
        beta1: the decay of m, the moving average of the gradient.
        beta2: the decay of v, the moving average of its square.
        eps: added to sqrt(v_hat) in the denominator.
        weight_decay: the L2 penalty's coefficient, added to the gradient.
    """

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    per_param_state: ClassVar[tuple[str, ...]] = ("m", "v")
    steps: ClassVar[tuple[_Step, ...]] = (
        _Step("m", a0 * a1 + (1 - a0) * a2, ("beta1", "m", "grad")),
        _Step("v", a0 * a1 + (1 - a0) * a2**2, ("beta2", "v", "grad")),
        # the bias corrections (with the step count after this step) are scalars
        _Step("bias_correction1", 1 - a0**a1, ("beta1", "step")),
        _Step("bias_correction2", 1 - a0**a1, ("beta2", "step")),
        _Step("m_hat", a0 / a1, ("m", "bias_correction1")),
        _Step("v_hat", a0 / a1, ("v", "bias_correction2")),
        _Step("param", a0 - a1 * a2 / (sp.sqrt(a3) + a4), ("param", "lr", "m_hat", "v_hat", "eps")),
    )
    shared_steps: ClassVar[tuple[_Step, ...]] = (_Step("step", a0 + 1, ("step",)),)


OPTIMIZERS = (SGD, Adam)
Optimizer = SGD | Adam


class NumpyStep:
    """An optimizer's update on numpy arrays, in place: the graph its
    `update` builds (the one the C training step is emitted from),
    evaluated by the IR interpreter in float64, so that the update rules
    are written once (symbackprop.dask updates on the driver with it).

    Args:
        optimizer: an SGD or Adam.
        params: the parameters by name, updated in place.
        state: the optimizer's state by name as `mod.optimizer_state` names
            it ("velocity_W", "m_W", "v_W", "step"); missing entries start
            at zero, and every entry is updated in place.

    Raises:
        ValueError: a state array of another shape than its parameter.
    """

    def __init__(self, optimizer: Optimizer, params: Mapping[str, np.ndarray], state: dict[str, np.ndarray]) -> None:
        self.params, self.state = params, state
        self.hyper = {h: np.full(SCALAR, value, dtype=np.float64) for h, value in optimizer.hyper().items()}
        dtype = next(iter(params.values())).dtype if params else np.float64
        for key in optimizer.shared_state:
            state.setdefault(key, np.zeros(SCALAR, dtype=dtype))
        hyper = {h: leaf(f"hyper {h}", SCALAR, "hyper") for h in self.hyper}
        shared = {k: leaf(f"state {k}", SCALAR, "state") for k in optimizer.shared_state}
        new_shared = optimizer.shared_update(shared)
        shared_now = {k: new_shared.get(k, v) for k, v in shared.items()}
        # (where the array is, its key there, its new value)
        self.writes: list[tuple[Mapping[str, np.ndarray], str, Node]] = [(state, k, v) for k, v in new_shared.items()]
        for name, p in params.items():
            shape = p.shape if p.ndim == 2 else SCALAR
            keys = {kind: f"{kind}_{name}" for kind in optimizer.per_param_state}
            for key in keys.values():
                found = state.setdefault(key, np.zeros_like(p))
                if np.shape(found) != p.shape:
                    raise ValueError(f"state[{key!r}] has shape {np.shape(found)}; the parameter {name!r} has {p.shape}")
            new = optimizer.update(leaf(f"param {name}", shape, "input"), leaf(f"grad {name}", shape, "input"),
                                   {kind: leaf(f"state {key}", shape, "state") for kind, key in keys.items()},
                                   hyper, shared_now)
            self.writes += [(params, name, cast(Node, new["param"]))]
            self.writes += [(state, keys[kind], cast(Node, new[kind])) for kind in keys]

    def __call__(self, grads: Mapping[str, np.ndarray]) -> None:
        """One step: every parameter and state entry updated in place.

        Args:
            grads: the loss's gradient by parameter name.
        """
        arrays = {f"hyper {h}": value for h, value in self.hyper.items()}
        arrays |= {f"state {key}": value for key, value in self.state.items()}
        for name, p in self.params.items():
            arrays[f"param {name}"], arrays[f"grad {name}"] = p, grads[name]
        values = evaluate([node for _, _, node in self.writes], arrays, {})
        for (where, key, _), value in zip(self.writes, values):  # written after every value is computed
            where[key][...] = value.reshape(np.shape(where[key]))

