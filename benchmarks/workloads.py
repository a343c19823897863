"""The benchmark workloads, described once and shared by every peer.

W1-W4 are multi-layer perceptrons (``Workload``); W5-W12B are the
repository's example models (``ExampleWorkload``, see below).

Each MLP workload is described by its layer sizes, its hidden activation,
its loss and its layout:

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

import ast
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class Workload:
    """A multi-layer perceptron workload (W1-W4)."""

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
    def result_names(self) -> tuple[str, ...]:
        """The names of the arrays a call returns beside the loss: the gradients."""
        return self.param_names

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


# --------------------------------------------------------------------------
# The example models (W5-W12B)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class ExampleWorkload:
    """One of the repository's example models (``examples/<example>.py``) on
    data of a chosen size.

    ``inputs`` and ``params`` name the model's arrays as the example
    declares them. A call returns ``(loss, {name: array})``: the gradients
    of the params (``outputs`` empty: a value_and_grad workload), or the
    named forward outputs (``outputs`` given: a forward workload, e.g. the
    per-observation Jacobian of bundle adjustment).

    The data is made here, without importing the example (which imports
    SymPy), drawing from ``numpy.random.default_rng(0)`` in exactly the
    order of the example's own ``sample_data`` (``test_harness.py`` checks
    that they agree), then cast: float arrays to the dtype, index arrays
    stay int64.
    """

    name: str
    description: str
    example: str  # examples/<example>.py
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    size: tuple[tuple[str, int], ...]  # keyword arguments of the data generator
    outputs: tuple[str, ...] = ()  # forward workload: these outputs, no gradients
    flops: int | None = None  # not counted for these (no GFLOP/s column)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.inputs

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.params

    @property
    def function(self) -> str:
        """The symbackprop function timed: "value_and_grad" or "forward"."""
        return "forward" if self.outputs else "value_and_grad"

    @property
    def result_names(self) -> tuple[str, ...]:
        """The names of the arrays a call returns beside the loss."""
        return self.outputs or self.params

    def resized(self, **size: int) -> "ExampleWorkload":
        """The same workload on data of another size (tests use small ones)."""
        return ExampleWorkload(self.name, self.description, self.example, self.inputs,
                               self.params, tuple({**dict(self.size), **size}.items()),
                               self.outputs, self.flops)

    def make_data(self, dtype: str = "float64") -> tuple[dict, dict]:
        """Deterministic ``(inputs, params)``, two dicts of C-contiguous arrays."""
        data = DATA[self.example](np.random.default_rng(0), **dict(self.size))
        cast = lambda v: np.ascontiguousarray(v, dtype=dtype if v.dtype.kind == "f" else np.int64)
        return ({k: cast(data[k]) for k in self.inputs},
                {k: cast(data[k]) for k in self.params})


GMM_D = 3  # examples/gmm.py fixes the dimension


def _gmm_data(rng, points: int, components: int) -> dict:
    """examples/gmm.py's sample_data."""
    D = GMM_D
    return {
        "X": rng.standard_normal((points, D)),
        "alpha": rng.standard_normal((components, 1)),
        "means": rng.standard_normal((components, D)),
        "qd": 0.3 * rng.standard_normal((components, D)),
        "ql": 0.3 * rng.standard_normal((components, D * (D - 1) // 2)),
    }


def _bundle_adjustment_data(rng, cameras: int, points: int, observations: int) -> dict:
    """examples/bundle_adjustment.py's sample_data."""
    cams = np.zeros((cameras, 11))
    cams[:, 0:3] = 0.3 * rng.standard_normal((cameras, 3))
    cams[:, 3:6] = rng.standard_normal((cameras, 3))
    cams[:, 6] = 1.0 + 0.1 * rng.random(cameras)
    cams[:, 7:9] = 0.1 * rng.standard_normal((cameras, 2))
    cams[:, 9:11] = 0.01 * rng.standard_normal((cameras, 2))
    pts = rng.standard_normal((points, 3))
    pts[:, 2] += 8.0  # in front of the cameras
    return {
        "cams": cams,
        "pts": pts,
        "weights": 1.0 + 0.1 * rng.standard_normal((observations, 1)),
        "feats": rng.standard_normal((observations, 2)),
        "cam": rng.integers(0, cameras, observations),
        "pt": rng.integers(0, points, observations),
    }


POLY_DEGREE = 5  # examples/polynomial_fit.py's DEGREE


def _polynomial_fit_data(rng, count: int) -> dict:
    """examples/polynomial_fit.py's sample_data."""
    x = rng.uniform(-1, 1, count)
    return {
        "points": np.stack([x, np.cos(3 * x) + 0.1 * rng.standard_normal(count)], axis=1),
        "coeffs": rng.standard_normal((1, POLY_DEGREE + 1)),
    }


def _big_logsumexp_data(rng, length: int) -> dict:
    """examples/big_logsumexp.py's sample_data."""
    return {"v": 30.0 * rng.standard_normal((length, 1))}


LSTM_GATES = ("i", "f", "g", "o")  # examples/lstm_lm.py's GATES
LSTM_HIDDEN = 16  # examples/lstm_lm.py's HIDDEN


@lru_cache(maxsize=1)
def lstm_text() -> str:
    """examples/lstm_lm.py's TEXT, read from the file (not imported: it imports SymPy)."""
    tree = ast.parse((EXAMPLES / "lstm_lm.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["TEXT"]:
            return ast.literal_eval(node.value)
    raise LookupError("examples/lstm_lm.py defines no TEXT")


def _lstm_lm_data(rng, repeats: int) -> dict:
    """examples/lstm_lm.py's text_data(TEXT * repeats) and init_params(rng),
    as its main() trains on (T = repeats * len(TEXT) - 1 characters)."""
    text = lstm_text() * repeats
    chars = sorted(set(text))
    vocab, hidden = len(chars), LSTM_HIDDEN
    codes = np.eye(vocab)[[chars.index(ch) for ch in text]]
    data = {"X": codes[:-1], "Y": codes[1:]}
    bound = 1.0 / np.sqrt(hidden)
    for g in LSTM_GATES:
        data[f"W_{g}"] = rng.uniform(-bound, bound, (vocab, hidden))
        data[f"U_{g}"] = rng.uniform(-bound, bound, (hidden, hidden))
        data[f"b_{g}"] = rng.uniform(-bound, bound, (1, hidden))
    data["V"] = rng.uniform(-bound, bound, (hidden, vocab))
    data["c"] = rng.uniform(-bound, bound, (1, vocab))
    return data


# examples/cnn_digits.py's sizes: 1 x 8 x 8 images, conv 3x3 to 16 then 32
# channels (padding 1, each followed by relu and a 2 x 2 max pool), linear 64, 10 classes
CNN_SIDE, CNN_C1, CNN_C2, CNN_HIDDEN, CNN_CLASSES = 8, 16, 32, 64, 10
CNN_FLAT = CNN_C2 * (CNN_SIDE // 4) ** 2


def _cnn_digits_data(rng, batch: int) -> dict:
    """examples/cnn_digits.py's sample_data: pixels U(0, 1), one-hot labels,
    then init_params (PyTorch's default U(+-1/sqrt(fan_in)), in its SHAPES order)."""
    c1, c2, flat, hidden = CNN_C1, CNN_C2, CNN_FLAT, CNN_HIDDEN
    data = {"X": rng.random((batch, CNN_SIDE * CNN_SIDE)),
            "T": np.eye(CNN_CLASSES)[rng.integers(0, CNN_CLASSES, size=batch)]}
    shapes = [("K1", (c1, 9), 9), ("c1", (1, c1), 9), ("K2", (c2, c1 * 9), c1 * 9), ("c2", (1, c2), c1 * 9),
              ("W1", (flat, hidden), flat), ("b1", (1, hidden), flat),
              ("W2", (hidden, CNN_CLASSES), hidden), ("b2", (1, CNN_CLASSES), hidden)]
    for name, shape, fan_in in shapes:
        data[name] = rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in)
    return data


# examples/transformer_lm.py's sizes: context 64, d=64, 4 heads, 2 pre-norm
# blocks (mlp 4d), on the first 12288 characters of argparse's docstrings
TRANSFORMER_CONTEXT, TRANSFORMER_D, TRANSFORMER_HEADS, TRANSFORMER_BLOCKS = 64, 64, 4, 2


@lru_cache(maxsize=1)
def transformer_text() -> str:
    """examples/transformer_lm.py's TEXT: its corpus() (and the CHARS it
    reads), run from the file's source, not imported (it imports SymPy)."""
    tree = ast.parse((EXAMPLES / "transformer_lm.py").read_text())
    wanted = [node for node in tree.body
              if (isinstance(node, ast.FunctionDef) and node.name == "corpus")
              or (isinstance(node, ast.Assign) and "CHARS" in ast.unparse(node.targets[0]))]
    namespace: dict = {"argparse": __import__("argparse"), "inspect": __import__("inspect")}
    exec(compile(ast.Module(wanted, []), "transformer_lm.py", "exec"), namespace)
    return namespace["corpus"]()


def transformer_shapes(vocab: int) -> list[tuple[str, tuple[int, int]]]:
    """examples/transformer_lm.py's SHAPES, in its order."""
    d, blocks = TRANSFORMER_D, TRANSFORMER_BLOCKS

    def block(b: int) -> list[tuple[str, tuple[int, int]]]:
        return [(f"g{b}a", (1, d)), (f"b{b}a", (1, d)), *((f"W{q}{b}", (d, d)) for q in "qkvo"),
                (f"g{b}m", (1, d)), (f"b{b}m", (1, d)), (f"W{b}up", (d, 4 * d)), (f"c{b}up", (1, 4 * d)),
                (f"W{b}down", (4 * d, d)), (f"c{b}down", (1, d))]

    return [("E", (vocab, d)), ("P", (TRANSFORMER_CONTEXT, d)), *(s for b in range(blocks) for s in block(b)),
            ("gf", (1, d)), ("bf", (1, d)), ("Wout", (d, vocab))]


def _transformer_lm_data(rng, sequences: int) -> dict:
    """The text's first ``sequences`` windows of 64 characters (rows of
    ``ids``, ``positions`` and ``targets``, the example's windows()) and the
    example's init_params(rng)."""
    text = transformer_text()
    alphabet = sorted(set(text))
    codes = np.array([alphabet.index(ch) for ch in text[:sequences * TRANSFORMER_CONTEXT + 1]], dtype=np.int64)
    rows = np.arange(sequences * TRANSFORMER_CONTEXT)
    data = {"ids": codes[rows], "targets": codes[rows + 1], "positions": rows % TRANSFORMER_CONTEXT}
    shapes = transformer_shapes(len(alphabet))
    for name, shape in shapes:
        if name in ("E", "P"):
            data[name] = 0.02 * rng.standard_normal(shape)
        elif name[0] == "g":
            data[name] = np.ones(shape)
        elif name[0] == "b":
            data[name] = np.zeros(shape)
        else:
            fan_in = dict(shapes)["W" + name[1:]][0] if name[0] == "c" else shape[0]
            data[name] = rng.uniform(-1, 1, size=shape) / np.sqrt(fan_in)
    return data


# examples/lstm_lm_batched.py: windows of 32 characters, hidden 64 (its main's default)
LSTM_WINDOW, LSTM_BATCHED_HIDDEN = 32, 64


def _lstm_lm_batched_data(rng, batch: int) -> dict:
    """A minibatch of examples/lstm_lm_batched.py: ``batch`` windows of
    WINDOW characters of lstm_lm.py's text (repeated as far as needed),
    time-major (row t*batch + s: character t of window s), and its
    init_params(rng, 64)."""
    text = lstm_text()
    chars = sorted(set(text))
    text = text * (batch * LSTM_WINDOW // len(text) + 2)
    codes = np.array([chars.index(ch) for ch in text[:batch * LSTM_WINDOW + 1]])
    wins = np.stack([codes[k * LSTM_WINDOW:k * LSTM_WINDOW + LSTM_WINDOW + 1] for k in range(batch)])
    steps = wins.T  # (WINDOW + 1, batch)
    eye = np.eye(len(chars))
    data = {"X": eye[steps[:-1].reshape(-1)], "Y": eye[steps[1:].reshape(-1)]}
    hidden, vocab = LSTM_BATCHED_HIDDEN, len(chars)
    bound = 1.0 / np.sqrt(hidden)
    for g in LSTM_GATES:
        data[f"W_{g}"] = rng.uniform(-bound, bound, (vocab, hidden))
        data[f"U_{g}"] = rng.uniform(-bound, bound, (hidden, hidden))
        data[f"b_{g}"] = rng.uniform(-bound, bound, (1, hidden))
    data["V"] = rng.uniform(-bound, bound, (hidden, vocab))
    data["c"] = rng.uniform(-bound, bound, (1, vocab))
    return data


DATA = {
    "transformer_lm": _transformer_lm_data,
    "lstm_lm_batched": _lstm_lm_batched_data,
    "cnn_digits": _cnn_digits_data,
    "gmm": _gmm_data,
    "bundle_adjustment": _bundle_adjustment_data,
    "polynomial_fit": _polynomial_fit_data,
    "big_logsumexp": _big_logsumexp_data,
    "lstm_lm": _lstm_lm_data,
}

_BA = dict(example="bundle_adjustment", inputs=("feats", "cam", "pt"),
           params=("cams", "pts", "weights"),
           size=(("cameras", 20), ("points", 1000), ("observations", 5000)))

EXAMPLE_WORKLOADS = [
    ExampleWorkload(
        "W5", "GMM negative log-likelihood, N=1000 points, K=10 components, D=3 (examples/gmm.py)",
        example="gmm", inputs=("X",), params=("alpha", "means", "qd", "ql"),
        size=(("points", 1000), ("components", 10)),
    ),
    ExampleWorkload(
        "W6", "bundle adjustment, sum of squared residuals, C=20 cameras, P=1000 points, "
        "N=5000 observations (examples/bundle_adjustment.py)", **_BA,
    ),
    ExampleWorkload(
        "W6J", "bundle adjustment forward: loss, residuals (5000x2) and per-observation "
        "2x15 Jacobians (5000x30), no gradient", outputs=("residual", "jacobian"), **_BA,
    ),
    ExampleWorkload(
        "W7", "polynomial (degree 5) least squares, N=100000 points (examples/polynomial_fit.py)",
        example="polynomial_fit", inputs=("points",), params=("coeffs",),
        size=(("count", 100_000),),
    ),
    ExampleWorkload(
        "W8", "log-sum-exp of a vector of 1,000,000 entries (examples/big_logsumexp.py)",
        example="big_logsumexp", inputs=(), params=("v",), size=(("length", 1_000_000),),
    ),
    ExampleWorkload(
        "W9", "LSTM character LM (hidden 16, vocab 30) over T=2943 characters, "
        "softmax cross-entropy (examples/lstm_lm.py)",
        example="lstm_lm", inputs=("X", "Y"),
        params=tuple(f"{m}_{g}" for m in "WUb" for g in LSTM_GATES) + ("V", "c"),
        size=(("repeats", 8),),
    ),
    *(ExampleWorkload(
        name, f"LeNet-style CNN on 8x8 digits, batch {batch}: conv 3x3 (16) -> relu -> max pool 2 -> "
        "conv 3x3 (32) -> relu -> max pool 2 -> linear(64) -> relu -> linear(10), softmax cross-entropy "
        "(examples/cnn_digits.py)",
        example="cnn_digits", inputs=("X", "T"), params=("K1", "c1", "K2", "c2", "W1", "b1", "W2", "b2"),
        size=(("batch", batch),),
    ) for name, batch in (("W10", 32), ("W10B", 128))),
    *(ExampleWorkload(
        name, f"character transformer LM, batch {batch} sequences of 64: token + position embedding -> "
        "2 pre-norm blocks (causal self-attention, 4 heads, d=64; mlp 256 gelu) -> layer norm -> linear, "
        "softmax cross-entropy (examples/transformer_lm.py)",
        example="transformer_lm", inputs=("ids", "positions", "targets"),
        params=tuple(name for name, _ in transformer_shapes(1)), size=(("sequences", batch),),
    ) for name, batch in (("W11", 32), ("W11B", 128))),
    *(ExampleWorkload(
        name, f"batched LSTM character LM, batch {batch} windows of 32 characters, hidden 64, "
        "softmax cross-entropy (examples/lstm_lm_batched.py)",
        example="lstm_lm_batched", inputs=("X", "Y"),
        params=tuple(f"{m}_{g}" for m in "WUb" for g in LSTM_GATES) + ("V", "c"), size=(("batch", batch),),
    ) for name, batch in (("W12", 32), ("W12B", 128))),
]

WORKLOADS: dict[str, Workload | ExampleWorkload] = {
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
        *EXAMPLE_WORKLOADS,
    ]
}

# A tiny model, not one of the benchmarks, that each worker sets up once
# before the real ones so that one-time framework initialisation (imports,
# compiler start-up) is not charged to the first workload's compile time.
WARMUP = Workload("warmup", "one-off framework warm-up, never reported",
                  batch=3, sizes=(2, 3, 1), activation="tanh", loss="mse")


def is_example(workload) -> bool:
    """Whether ``workload`` is one of the example models (W5-W12B)."""
    return isinstance(workload, ExampleWorkload)


def get(names: str | list[str] | None = None, batch: int | None = None) -> list[Workload | ExampleWorkload]:
    """Workloads by name (comma-separated string or list); all when None.
    ``batch``: the number of rows of the batch MLPs (rows layout: W1, W3,
    W4) instead of their own; the others stay as they are."""
    if names is None:
        names = list(WORKLOADS)
    if isinstance(names, str):
        names = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [s for s in names if s not in WORKLOADS]
    if unknown:
        raise KeyError(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    chosen = [WORKLOADS[s] for s in names]
    if batch is None:
        return chosen
    return [replace(w, batch=batch) if isinstance(w, Workload) and w.layout == "rows" else w for w in chosen]
