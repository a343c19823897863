"""Training with a compiled module: the optimizer's state, fused steps,
whole epochs, and checkpoints.

A step is one C call (forward, backward, update); the parameters passed are
updated in place, so they must be writable C-contiguous arrays of the
module's dtype. The optimizer's state (momentum, Adam's moments, the step
count) lives in arrays held here, which `save` and `load` write to and read
from an .npz file together with the parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .errors import ArgumentError


class Trainer:
    """The training state of one compiled module and one optimizer."""

    def __init__(self, module: Any, function: Any):
        self.module = module
        self.function = function
        roles = function.plan.extra_roles
        shapes = {spec.name: spec.shape for spec in function.inputs}
        self.hyperparameters: dict[str, float] = dict(module.optimizer.hyper())
        self._hyper_arrays = {key: np.zeros((1, 1), dtype=module.dtype) for arg, role, key in roles if role == "hyper"}
        self._hyper_args = {arg: key for arg, role, key in roles if role == "hyper"}
        self._state_shapes = {arg: shapes[arg] for arg, role, _ in roles if role == "state"}
        self.state: dict[str, np.ndarray] = {}
        self._params = [name for name in function.plan.inplace if name in module.plan.lowered.leaves]

    def _ensure_state(self, arrays: Mapping[str, Any]) -> None:
        """Zero state arrays, sized from the parameters, on the first step."""
        if self.state:
            return
        for arg, shape in self._state_shapes.items():
            concrete = tuple(int(d) if not hasattr(d, "free_symbols") or d.is_Integer else None for d in shape)
            if None in concrete:
                raise ArgumentError(f"optimizer state {arg} has a symbolic shape {shape}; parameters must have fixed shapes")
            self.state[arg] = np.zeros(concrete, dtype=self.module.dtype)

    def _arguments(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        self._ensure_state(arrays)
        for name in self._params:
            _check_writable(name, arrays.get(name), self.module.dtype)
        for key, array in self._hyper_arrays.items():
            array[0, 0] = self.hyperparameters[key]
        hyper = {arg: self._hyper_arrays[key] for arg, key in self._hyper_args.items()}
        return {**arrays, **self.state, **hyper}

    def step(self, **arrays: Any) -> float:
        """One training step; returns the loss before the update."""
        return self.function.call(self._arguments(arrays))[0]

    def save(self, path: str | Path, params: Mapping[str, np.ndarray]) -> None:
        """Write the parameters, the optimizer state and hyperparameters to .npz."""
        contents = {f"param/{k}": np.asarray(v) for k, v in params.items()}
        contents.update({f"state/{k}": v for k, v in self.state.items()})
        contents.update({f"hyper/{k}": np.float64(v) for k, v in self.hyperparameters.items()})
        np.savez(path, **contents)

    def load(self, path: str | Path) -> dict[str, np.ndarray]:
        """Restore the optimizer state and hyperparameters from .npz; returns
        the saved parameters (fresh writable arrays)."""
        with np.load(path) as data:
            params = {k.split("/", 1)[1]: np.array(data[k], dtype=self.module.dtype) for k in data.files if k.startswith("param/")}
            self.state = {k.split("/", 1)[1]: np.array(data[k], dtype=self.module.dtype) for k in data.files if k.startswith("state/")}
            self.hyperparameters.update({k.split("/", 1)[1]: float(data[k]) for k in data.files if k.startswith("hyper/")})
        missing = set(self._state_shapes) - set(self.state)
        if missing:
            raise ArgumentError(f"{path} lacks the optimizer state {sorted(missing)}")
        return params


def _check_writable(name: str, value: Any, dtype: np.dtype) -> None:
    if value is None:
        return  # missing: the call names it
    if not (isinstance(value, np.ndarray) and value.dtype == dtype and value.flags.c_contiguous and value.flags.writeable):
        got = f"{type(value).__name__}" + (f" of dtype {value.dtype}" if isinstance(value, np.ndarray) else "")
        raise ArgumentError(
            f"{name} is updated in place by train_step: pass a writable C-contiguous numpy array of dtype {dtype}; got {got}"
        )
