"""The four benchmark workloads, described once and shared by every peer.

Each workload is a small multi-layer perceptron described by its layer
sizes, its hidden activation, its loss and its layout:

* ``rows`` layout (W1, W3, W4): a batch ``X`` of shape ``(n, in)``, weights
  ``W_k`` of shape ``(in, out)`` and biases ``b_k`` of shape ``(1, out)``;
  layer ``k`` computes ``A_{k-1} @ W_k + b_k``.
* ``columns`` layout (W2): one example ``x`` of shape ``(in, 1)``, weights
  ``W_k`` of shape ``(out, in)`` and no biases; layer ``k`` computes
  ``W_k @ A_{k-1}``.

The hidden activation is applied after every layer except the last one.
Data is generated deterministically (``numpy.random.default_rng(0)``) in
float64 and then cast, so the float32 data is the rounded float64 data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    batch: int
    sizes: tuple[int, ...]  # (in, hidden..., out)
    activation: str  # 'sigmoid' | 'tanh' | 'relu'
    loss: str  # 'mse' | 'softmax_ce' | 'half_sse'
    layout: str = "rows"  # 'rows' | 'columns'

    @property
    def n_layers(self) -> int:
        return len(self.sizes) - 1

    @property
    def has_bias(self) -> bool:
        return self.layout == "rows"

    @property
    def input_names(self) -> tuple[str, str]:
        return ("X", "T") if self.layout == "rows" else ("x", "t")

    @property
    def param_names(self) -> tuple[str, ...]:
        names = []
        for k in range(1, self.n_layers + 1):
            names.append(f"W{k}")
            if self.has_bias:
                names.append(f"b{k}")
        return tuple(names)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Shape of every input and parameter, by name."""
        n, sizes = self.batch, self.sizes
        x_name, t_name = self.input_names
        if self.layout == "rows":
            shapes = {x_name: (n, sizes[0]), t_name: (n, sizes[-1])}
        else:
            shapes = {x_name: (sizes[0], n), t_name: (sizes[-1], n)}
        for k in range(1, self.n_layers + 1):
            fan_in, fan_out = sizes[k - 1], sizes[k]
            if self.layout == "rows":
                shapes[f"W{k}"] = (fan_in, fan_out)
                shapes[f"b{k}"] = (1, fan_out)
            else:
                shapes[f"W{k}"] = (fan_out, fan_in)
        return shapes

    @property
    def flops(self) -> int:
        """Approximate floating-point operations of one value_and_grad step.

        Counts the matrix products only: 2*n*in*out for the forward product,
        the same for the weight gradient, and the same again for the input
        gradient of every layer but the first (whose input needs none).
        """
        total = 0
        for k in range(1, self.n_layers + 1):
            mac = self.batch * self.sizes[k - 1] * self.sizes[k]
            total += (4 if k == 1 else 6) * mac
        return total

    def make_data(self, dtype: str = "float64") -> tuple[dict, dict]:
        """Deterministic ``(inputs, params)``, two dicts of C-contiguous arrays."""
        rng = np.random.default_rng(0)
        shapes = self.shapes()
        x_name, t_name = self.input_names
        inputs = {x_name: rng.standard_normal(shapes[x_name])}
        inputs[t_name] = self._targets(rng, shapes[t_name])
        params = {}
        for k in range(1, self.n_layers + 1):
            fan_in = self.sizes[k - 1]
            params[f"W{k}"] = rng.standard_normal(shapes[f"W{k}"]) / np.sqrt(fan_in)
            if self.has_bias:
                params[f"b{k}"] = 0.1 * rng.standard_normal(shapes[f"b{k}"])
        cast = lambda d: {k: np.ascontiguousarray(v, dtype=dtype) for k, v in d.items()}
        return cast(inputs), cast(params)

    def _targets(self, rng, shape):
        if self.loss == "softmax_ce":
            labels = rng.integers(0, shape[1], size=shape[0])
            return np.eye(shape[1])[labels]
        return rng.standard_normal(shape)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "W1",
            "batch X(2x3) -> linear(4) -> sigmoid -> linear(2) -> MSE vs T(2x2)",
            batch=2, sizes=(3, 4, 2), activation="sigmoid", loss="mse",
        ),
        Workload(
            "W2",
            "column vector x(2x1) -> relu(W1@x) -> W2@h -> 0.5*(y-t)^2, no biases",
            batch=1, sizes=(2, 2, 1), activation="relu", loss="half_sse",
            layout="columns",
        ),
        Workload(
            "W3",
            "X(128x784) -> linear(256) -> tanh -> linear(10) -> softmax cross-entropy",
            batch=128, sizes=(784, 256, 10), activation="tanh", loss="softmax_ce",
        ),
        Workload(
            "W4",
            "X(32x64) -> 8 x [linear(64) -> tanh] -> linear(1) -> MSE vs T(32x1)",
            batch=32, sizes=(64,) * 9 + (1,), activation="tanh", loss="mse",
        ),
    ]
}

# A tiny model, not one of the benchmarks, that each worker sets up once
# before the real ones so that one-time framework initialisation (imports,
# compiler start-up) is not charged to the first workload's compile time.
WARMUP = Workload("warmup", "one-off framework warm-up, never reported",
                  batch=3, sizes=(2, 3, 1), activation="tanh", loss="mse")


def get(names: str | list[str] | None = None) -> list[Workload]:
    """Workloads by name (comma-separated string or list); all when None."""
    if names is None:
        return list(WORKLOADS.values())
    if isinstance(names, str):
        names = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [s for s in names if s not in WORKLOADS]
    if unknown:
        raise KeyError(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    return [WORKLOADS[s] for s in names]
