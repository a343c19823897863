"""The loss and gradient over a data set held as Dask arrays, chunk by chunk
on the workers, and data-parallel training on top of it.

    from symbackprop.dask import value_and_grad, train

    loss, grads = value_and_grad(mod, params, {"X": x, "T": t}, client=client)
    losses = train(mod, params, {"X": x, "T": t}, optimizer=sbp.Adam(lr=0.01), epochs=10)

The data arrays (`data`) are split along their first axis, the batch
dimension, by their Dask chunks; every other argument (`params`) is passed
whole to every chunk. Each chunk is one task: a worker evaluates the
module's `value_and_grad` on it, and the chunks' results are added in a
tree on the cluster; only the sum comes back to the driver.

A worker never receives a pointer or a cffi object: it receives a
`ModuleSpec` (the model, its generated C source, header and cffi
declarations, the ABI spec that wraps them as JSON (abi.py), and the build
settings), builds the
C with its own compiler through the content-addressed cache of build.py
(a worker on the machine that compiled the module finds it there) and
keeps the loaded module for later tasks. A worker whose symbackprop code
differs from the driver's regenerates the C from the model instead.

This module imports Dask; `import symbackprop` does not import this module.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import dask
import dask.array as da
import dask.base
import numpy as np

from symbackprop.base.abi import ModuleSpec as AbiSpec
from symbackprop.base.abi import show
from symbackprop.declare.model import Model
from symbackprop.emit.emitted import Emitted
from symbackprop.progress import Progress, ProgressArg
from symbackprop.run.function import Function
from symbackprop.run.module import CompiledModule
from symbackprop.run.optim import OPTIMIZERS, SGD, Adam, NumpyStep
from symbackprop.run.runtime import compile as compile_model
from symbackprop.toolchain.builder import BuildOptions, build
from symbackprop.toolchain.key import digest as key_digest
from symbackprop.toolchain.memo import package_digest

__all__ = ["ModuleSpec", "train", "value_and_grad"]

REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, eq=False)
class ModuleSpec:
    """What a worker needs to rebuild a compiled module: picklable with the
    standard pickle, no pointers. `ModuleSpec.of(mod)` makes one; `load()`
    builds (or finds in the cache) and wraps the module, once per process.

    Args:
        model: the Model (compiled again from it only where symbackprop's
            code differs from the driver's).
        emitted: the generated C source, header and cffi declarations.
        abi: how the runtime wraps the C functions: the ABI spec as JSON
            (abi.ModuleSpec.to_json()).
        dtype: "float64" or "float32".
        options: the BuildOptions (compiler flags, cache folder, BLAS).
        optimizer: None, or the SGD/Adam the module was compiled with.
        wrt: the differentiated names.
        digest: build.memo.package_digest() of the code that generated the C.
        key: identifies the module (its C, settings and digest).
    """

    model: Model
    emitted: Emitted  # the C source, header and cffi declarations
    abi: dict  # how the runtime wraps the C functions: abi.ModuleSpec.to_json()
    dtype: str  # "float64" or "float32"
    options: BuildOptions | None  # compiler flags, cache folder, BLAS
    optimizer: Any  # None, or the SGD/Adam the module was compiled with
    wrt: tuple[str, ...]
    digest: str  # symbackprop's code that generated the C (build.memo.package_digest)
    key: str  # identifies the module: the source, settings and digest

    @classmethod
    def of(cls, module: CompiledModule) -> ModuleSpec:
        """The spec of a compiled module (which this process then reuses
        when a task runs here, instead of loading it again).

        Args:
            module: a CompiledModule from symbackprop.compile.

        Raises:
            TypeError: module is not a CompiledModule.
        """
        if not isinstance(module, CompiledModule):
            raise TypeError(f"module must be a CompiledModule (from symbackprop.compile); got {type(module).__name__}")
        emitted, dtype, digest = module.emitted, module.dtype.name, package_digest()
        parts = (emitted.prefix, emitted.source, emitted.header, emitted.cdef, dtype, repr(module.options),
                 repr(module.optimizer), repr(tuple(module.wrt)), digest)
        key = key_digest("dask-spec", *parts)
        spec = cls(module.model, emitted, module.spec.to_json(), dtype, module.options, module.optimizer,
                   tuple(module.wrt), digest, key)
        with _LOCK:
            _LOADED.setdefault(key, module)
        return spec

    def load(self) -> CompiledModule:
        """The compiled module in this process: built from the shipped C (a
        cache hit where it was built before), or, when this process runs
        other symbackprop code than the one that generated it, compiled
        from the model.

        Raises:
            BuildError: the C compiler is missing or failed here.
        """
        with _LOCK:
            found = _LOADED.get(self.key)
            if found is None:
                found = _LOADED[self.key] = self._build()
            return found

    def _build(self) -> CompiledModule:
        if self.digest != package_digest():
            return compile_model(self.model, self.dtype, self.options, wrt=self.wrt, optimizer=self.optimizer)
        e = self.emitted
        built, folder = build(e.prefix, e.source, e.header, e.cdef, self.options)
        return CompiledModule(self.model, e, AbiSpec.from_json(self.abi), built.lib, built.ffi, folder, self.dtype,
                              self.options, self.optimizer)


_LOCK = threading.Lock()
_LOADED: dict[str, CompiledModule] = {}  # by ModuleSpec.key, in each process


# --- what runs on the workers -----------------------------------------------


def _chunk_value_and_grad(spec: ModuleSpec, whole: Mapping[str, Any], names: Sequence[str], weight: float,
                          *blocks: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """One chunk's loss and gradients, times its weight."""
    loss, grads = spec.load().value_and_grad(**whole, **dict(zip(names, blocks)))
    return loss * weight, {key: grad * weight for key, grad in grads.items()}


def _sum_parts(*parts: tuple[float, dict[str, np.ndarray]]) -> tuple[float, dict[str, np.ndarray]]:
    loss = math.fsum(part[0] for part in parts)
    grads = {key: grad.copy() for key, grad in parts[0][1].items()}  # the inputs are other tasks' results: not changed
    for _, more in parts[1:]:
        for key, grad in more.items():
            grads[key] += grad
    return loss, grads


def _check_split(spec: ModuleSpec, whole: Mapping[str, Any], names: Sequence[str], reduction: str,
                 *blocks: np.ndarray) -> None:
    """The loss must combine over rows as `reduction` says: the chunk's
    loss and gradient against those of its two halves."""
    module = spec.load()
    rows = blocks[0].shape[0]
    half = rows // 2

    def at(part: slice) -> tuple[float, dict[str, np.ndarray]]:
        return module.value_and_grad(**whole, **{n: np.ascontiguousarray(b[part]) for n, b in zip(names, blocks)})

    full, first, second = at(slice(None)), at(slice(0, half)), at(slice(half, None))
    tolerance = 1e-7 if module.dtype == np.float64 else 1e-3

    def combines(w1: float, w2: float) -> bool:
        for key in [None, *full[1]]:
            a, b = ((first[0], second[0]) if key is None else (first[1][key], second[1][key]))
            whole_value = full[0] if key is None else full[1][key]
            combined = w1 * np.asarray(a, np.float64) + w2 * np.asarray(b, np.float64)
            scale = w1 * np.abs(a) + w2 * np.abs(b) + np.abs(whole_value)
            if not np.all(np.abs(combined - whole_value) <= tolerance * np.max(scale)):
                return False
        return True

    weights = {"mean": (half / rows, (rows - half) / rows), "sum": (1.0, 1.0)}
    if combines(*weights[reduction]):
        return
    other = "sum" if reduction == "mean" else "mean"
    hint = (f"it combines as a {other}: pass reduction={other!r}" if combines(*weights[other])
            else "its loss is neither a sum of per-row terms nor a mean of them (plus terms that do not depend on the data)")
    w1, w2 = weights[reduction]
    raise ValueError(
        f"reduction={reduction!r}, but the loss of model {module.model.name!r} does not decompose that way over rows: "
        f"on a chunk of {rows} rows it is {full[0]:.6g}, while the {reduction} of its two halves' losses "
        f"({first[0]:.6g} and {second[0]:.6g}) is {w1 * first[0] + w2 * second[0]:.6g}; {hint} "
        "(or check=False to skip this check)"
    )


# --- the driver ---------------------------------------------------------------


def _client(client: Any) -> Any:
    """The given client, else the distributed client Dask would use now (the
    default client, unless dask.config names another scheduler), else None:
    Dask's configured local scheduler."""
    if client is not None:
        return client
    scheduler = dask.base.get_scheduler()
    owner = getattr(scheduler, "__self__", None)
    try:
        from distributed import Client
    except ImportError:
        return None
    return owner if isinstance(owner, Client) else None


class _Job:
    """Checked arguments: the module, the whole arguments, the data arrays
    with one column chunk each, and the rows of every chunk."""

    def __init__(self, module: Any, params: Any, data: Any, reduction: str):
        if isinstance(module, ModuleSpec):
            self.spec, self.module = module, module.load()
        elif isinstance(module, CompiledModule):
            self.spec, self.module = ModuleSpec.of(module), module
        else:
            raise TypeError(f"module must be a CompiledModule (from symbackprop.compile) or a ModuleSpec; "
                            f"got {type(module).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a dict of name -> array; got {type(params).__name__}")
        if not isinstance(data, Mapping) or not data:
            raise TypeError(f"data must be a non-empty dict of name -> dask array; got {data!r:.80}")
        self.reduction = reduction
        fn = self.module.function("value_and_grad")
        self.batch = self._check_names(fn, params, data)
        arrays = self._check_arrays(fn, data)
        self.whole = self._check_whole(fn, params, arrays)
        self.names = tuple(arrays)
        self.arrays = {name: (a if a.ndim == 1 or a.numblocks[1] == 1 else a.rechunk({1: -1})) for name, a in arrays.items()}
        self.rows = [int(r) for r in next(iter(arrays.values())).chunks[0]]
        self.chunks = [i for i, r in enumerate(self.rows) if r > 0]  # the module takes no empty arrays
        self._refresh()

    def _check_names(self, fn: Function, params: Mapping[str, Any], data: Mapping[str, Any]) -> str:
        specs = {spec.name: spec for spec in fn.inputs}
        name = self.module.model.name
        for key in data:
            if key not in specs:
                raise ValueError(f"data names {key!r}, which is not an argument of model {name!r}; "
                                 f"its arguments are {list(specs)}")
        both = sorted(set(params) & set(data))
        if both:
            raise ValueError(f"{both} given in both params and data; data holds the arrays split into chunks of rows, "
                             "params what every chunk gets whole")
        firsts = {}
        for key in data:
            spec = specs[key]
            first = spec.shape[0]
            if spec.scalar or not isinstance(first, str):
                raise ValueError(f"data[{key!r}] is declared with shape {show(spec.shape)}, whose first dimension is "
                                 "not a batch (symbolic) dimension; pass it in params")
            firsts[key] = first
        batches = set(firsts.values())
        if len(batches) > 1:
            raise ValueError(f"the data arrays must share their first (batch) dimension; the model declares {_dims(firsts)}")
        batch = batches.pop()
        for index, bounds in fn.index_bounds.items():
            if batch in bounds:
                raise ValueError(f"the Index {index!r} holds row numbers of arrays with the batch dimension {batch}; "
                                 "chunks of rows would renumber them")
        for spec in fn.inputs:
            if batch in spec.shape and spec.name not in data:
                raise ValueError(f"the argument {spec.name!r} has the batch dimension {batch} in its shape "
                                 f"{show(spec.shape)}: pass it in data as a dask array split along its first axis")
            if spec.name in data and batch in spec.shape[1:]:
                raise ValueError(f"data[{spec.name!r}] has the batch dimension {batch} beyond its first axis "
                                 f"{show(spec.shape)}; chunks of rows cannot split it")
        missing = [spec.name for spec in fn.inputs if spec.name not in params and spec.name not in data]
        unknown = [key for key in params if key not in specs]
        if missing or unknown:
            parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
            raise ValueError(f"params: {'; '.join(parts)}; model {name!r} takes {list(specs)} "
                             f"({list(data)} in data, the others in params)")
        for out in fn.outputs:
            if out.group == "grads" and batch in out.shape:
                raise ValueError(f"the module differentiates with respect to {out.key!r}, whose gradient has the batch "
                                 f"dimension {batch} (shape {show(out.shape)}); a sum over chunks cannot hold it: "
                                 "compile without it in wrt")
        return batch

    def _check_arrays(self, fn: Function, data: Mapping[str, Any]) -> dict[str, Any]:
        specs = {spec.name: spec for spec in fn.inputs}
        dtype = self.module.dtype
        arrays: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(value, da.Array):
                raise TypeError(f"data[{key!r}] must be a dask.array.Array (split into chunks of rows); got "
                                f"{type(value).__name__}: wrap it with dask.array.from_array(x, chunks=(rows_per_chunk, -1))")
            spec = specs[key]
            if spec.index:  # an Index: integer row numbers, 1-D or one column
                if value.dtype.kind not in "iu" or value.dtype == np.uint64:
                    raise TypeError(f"data[{key!r}] is an Index: integer row numbers; got dtype {value.dtype}")
                if value.ndim not in (1, 2) or value.shape[1:] not in ((), (1,)):
                    raise ValueError(f"data[{key!r}] is an Index: a 1-D or (rows, 1) array; got shape {value.shape}")
            else:
                if value.dtype != dtype:
                    raise TypeError(f"data[{key!r}] has dtype {value.dtype}; the module computes in {dtype}: "
                                    f"convert it with .astype({dtype.name!r})")
                if value.ndim != 2:
                    raise ValueError(f"data[{key!r}] must be 2-D of shape {show(spec.shape)}; got {value.ndim}-D "
                                     f"shape {value.shape}")
                cols = spec.shape[1]
                if not isinstance(cols, str) and value.shape[1] != cols:
                    raise ValueError(f"data[{key!r}] must have shape {show(spec.shape)}; got {value.shape}")
            if any(math.isnan(c) for c in value.chunks[0]):
                raise ValueError(f"data[{key!r}] has chunks of unknown size; call .compute_chunk_sizes() on it first")
            arrays[key] = value
        (first, a), *others = arrays.items()
        for key, b in others:
            if b.shape[0] != a.shape[0]:
                raise ValueError(f"data[{key!r}] has {b.shape[0]} rows but data[{first!r}] has {a.shape[0]}")
            if b.chunks[0] != a.chunks[0]:
                raise ValueError(f"data[{key!r}] and data[{first!r}] are chunked differently along the rows "
                                 f"({_chunks(b)} and {_chunks(a)}); rechunk one like the other: "
                                 f"{key} = {key}.rechunk({{0: {first}.chunks[0]}})")
        if a.shape[0] == 0:
            raise ValueError(f"data[{first!r}] has no rows")
        return arrays

    def _check_whole(self, fn: Function, params: Mapping[str, Any], arrays: Mapping[str, Any]) -> dict[str, Any]:
        """params as the module takes them, checked by the module itself on
        one-row stand-ins for the data."""
        stand_ins = {key: np.zeros((1, *a.shape[1:]), dtype=a.dtype) for key, a in arrays.items()}
        values, _ = fn.bind({**params, **stand_ins})
        return {spec.name: value for spec, value in zip(fn.inputs, values) if spec.name in params}

    def _refresh(self) -> None:
        """Dask handles of the current data arrays' blocks, chunk by chunk."""
        blocks = {name: a.to_delayed().ravel() for name, a in self.arrays.items()}
        self.blocks = [tuple(blocks[name][i] for name in self.names) for i in range(len(self.rows))]

    def persist(self, client: Any) -> None:
        """Keep the data in the workers' memory (for repeated passes)."""
        arrays = [self.arrays[name] for name in self.names]
        kept = client.persist(arrays) if client is not None else dask.persist(*arrays)
        self.arrays = dict(zip(self.names, kept))
        self._refresh()

    def graph(self, spec: Any, chunks: Sequence[int], check: bool) -> tuple[Any, Any]:
        """Delayed (loss, grads) summed over the chunks given, and the
        decomposition check (or None)."""
        whole = dask.delayed(self.whole_snapshot(), pure=True, traverse=False)
        rows = sum(self.rows[i] for i in chunks)
        parts = []
        for i in chunks:
            weight = self.rows[i] / rows if self.reduction == "mean" else 1.0
            task = dask.delayed(_chunk_value_and_grad, pure=True)
            parts.append(task(spec, whole, self.names, weight, *self.blocks[i]))
        while len(parts) > 1:
            parts = [dask.delayed(_sum_parts, pure=True)(*parts[k:k + 8]) for k in range(0, len(parts), 8)]
        checked = None
        splittable = [i for i in chunks if self.rows[i] >= 2]
        if check and splittable:
            i = splittable[0]
            checked = dask.delayed(_check_split, pure=True)(spec, whole, self.names, self.reduction, *self.blocks[i])
        return parts[0], checked

    def whole_snapshot(self) -> dict[str, Any]:
        return {key: np.array(value) for key, value in self.whole.items()}


def _ship(spec: ModuleSpec, client: Any) -> Any:
    """The spec as a graph dependency: sent once to every worker with a
    client, else a named literal for the local scheduler."""
    if client is not None:
        return client.scatter(spec, broadcast=True, hash=False)
    return dask.delayed(spec, name=f"symbackprop-spec-{spec.key}", traverse=False)


def _compute(client: Any, *values: Any) -> tuple[Any, ...]:
    if client is not None:
        return tuple(client.gather(client.compute(list(values))))
    return dask.compute(*values)


def value_and_grad(module: CompiledModule | ModuleSpec, params: Mapping[str, Any], data: Mapping[str, Any], *,
                   reduction: str = "mean", client: Any = None, check: bool = True) -> tuple[float, dict[str, np.ndarray]]:
    """The loss and its gradients over a whole data set held as Dask
    arrays: each chunk of rows is evaluated by `module.value_and_grad` on a
    worker, and the chunks' results are combined on the cluster.

    The combination is exact only for a loss that decomposes over rows:

    - reduction="mean" (the default, for `nn.mse`, `nn.softmax_cross_entropy`
      and other means over the batch): chunk k of r_k rows out of N weighs
      r_k / N, so the result is the loss of the whole data set for a mean of
      per-row terms plus any terms that do not depend on the data (an
      `nn.l2_penalty` of the weights);
    - reduction="sum": the chunks' results are added, which is exact for a
      sum of per-row terms (and nothing else: a data-independent term would
      be counted once per chunk).

    With check=True the first chunk (of two rows or more) is also evaluated
    in two halves on its worker, and a ValueError says so when the halves
    do not combine as `reduction` says (at these parameters: a term that
    is 0 here escapes it).

    Args:
        module: a CompiledModule, or its ModuleSpec.of(module).
        params: what every chunk gets whole, by name: the parameters and any
            input without the batch dimension (numpy arrays or numbers).
        data: the inputs with the batch dimension, by name: 2-D dask arrays
            of the module's dtype (an Index: integers, 1-D or one column),
            with the same rows and the same chunks along the rows (column
            chunks are joined; chunks of no rows are skipped).
        reduction: "mean" or "sum" (above).
        client: a distributed.Client; default: the current default client,
            else Dask's local scheduler in this process.
        check: test the reduction on the first chunk (above).

    Returns:
        (loss, {name: gradient}) as the module's value_and_grad returns
        them, for the whole data set.

    Raises:
        TypeError: module, params or data of the wrong kind; a data array
            that is not a dask array or is of another dtype.
        ValueError: a name missing, unknown or given twice; a data array
            without the batch dimension first, or of the wrong shape; data
            arrays with different rows or row chunks; a module that
            differentiates something with the batch dimension; a loss that
            does not decompose as `reduction` says. symbackprop.ArgumentError
            (a ValueError) for params the module rejects.
    """
    job = _Job(module, params, data, reduction)
    client = _client(client)
    total, checked = job.graph(_ship(job.spec, client), job.chunks, check)
    (loss, grads), _ = _compute(client, total, checked)
    return loss, grads


def train(module: CompiledModule | ModuleSpec, params: Mapping[str, np.ndarray], data: Mapping[str, Any], *,
          optimizer: SGD | Adam | None = None, epochs: int = 1, chunks_per_step: int | None = None,
          reduction: str = "mean", state: dict[str, np.ndarray] | None = None, client: Any = None,
          check: bool = True, persist: bool = True, progress: ProgressArg = None) -> np.ndarray:
    """Data-parallel training: each step's gradient is computed on the
    workers (as `value_and_grad` computes it) and the driver updates the
    parameters in place with the optimizer, as `train_step` would.

    With chunks_per_step=None each step takes the whole data set (full-batch
    gradient descent: one step per epoch). With chunks_per_step=k each step
    takes the next k chunks, in order (a minibatch of those rows, weighed as
    `reduction` says), and an epoch is ceil(chunks / k) steps; with the rows
    in chunks of b, k=1 makes the same steps as `train_epoch(b)` on the
    whole arrays in one process, up to rounding.

    Args:
        module: a CompiledModule, or its ModuleSpec.
        params: as for value_and_grad; the differentiated ones must be
            writable C-contiguous numpy arrays of the module's dtype, and
            are updated in place.
        data: as for value_and_grad.
        optimizer: symbackprop.SGD or symbackprop.Adam (PyTorch's updates,
            as in train_step); default: the one the module was compiled with.
        epochs: passes over the data.
        chunks_per_step: chunks per step; None: all of them.
        reduction: "mean" or "sum", as for value_and_grad.
        state: the optimizer's state by name (as `mod.optimizer_state`
            names it: "velocity_W", "m_W", "v_W", "step"): read when given
            and updated in place; pass the same dict to continue training.
        client: as for value_and_grad.
        check: test the reduction once, on the first step.
        persist: keep the data in the workers' memory for the epochs
            (else every step computes the data arrays again).
        progress: a bar over the epochs with the last epoch's mean loss
            (tqdm, if installed): None (when stderr is a terminal), True,
            False, or a callable progress(epoch, epochs, {"loss": ...})
            (see symbackprop.progress).

    Returns:
        The loss of each step, before its update.

    Raises:
        TypeError, ValueError: as value_and_grad, and for an optimizer
            that is not SGD or Adam, a non-positive epochs or
            chunks_per_step, or a state array of the wrong shape.
        symbackprop.ArgumentError: a differentiated parameter that is not
            a writable C-contiguous array of the module's dtype.
    """
    job = _Job(module, params, data, reduction)
    optimizer = _checked_optimizer(job, optimizer, epochs, chunks_per_step)
    update = _update(job, optimizer, params, state)
    client = _client(client)
    if persist:
        job.persist(client)
    spec = _ship(job.spec, client)
    count = len(job.chunks)
    per_step = count if chunks_per_step is None else int(chunks_per_step)
    losses = []
    bar = Progress(int(epochs), "epoch", progress)  # ends itself after the last epoch
    for _ in range(int(epochs)):
        for start in range(0, count, per_step):
            total, checked = job.graph(spec, job.chunks[start:start + per_step], check)
            check = False
            (loss, grads), _ = _compute(client, total, checked)
            update(grads)
            job.whole.update(update.params)
            losses.append(loss)
        bar.step(loss=float(np.mean(losses[-math.ceil(count / per_step):])))  # this epoch's steps
    return np.array(losses, dtype=job.module.dtype)


def _checked_optimizer(job: _Job, optimizer: SGD | Adam | None, epochs: int, chunks_per_step: int | None) -> SGD | Adam:
    """The optimizer train steps with (given, else the module's), once it
    and the counts of epochs and chunks are checked."""
    optimizer = optimizer if optimizer is not None else job.module.optimizer
    if not isinstance(optimizer, OPTIMIZERS):
        raise TypeError(f"optimizer must be symbackprop.SGD or symbackprop.Adam; got {type(optimizer).__name__} "
                        "(and the module was compiled without one)")
    for what, value in (("epochs", epochs), ("chunks_per_step", chunks_per_step)):
        if value is None and what == "chunks_per_step":
            continue
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{what} must be a positive integer; got {value!r}")
    return optimizer


def _update(job: _Job, optimizer: SGD | Adam, params: Mapping[str, np.ndarray],
            state: dict[str, np.ndarray] | None) -> NumpyStep:
    """The driver's update of the differentiated params, in place (each
    checked as the binder checks what it writes)."""
    from symbackprop.run.binding import check_writable

    fn = job.module.function("value_and_grad")
    differentiated = [out.key for out in fn.outputs if out.group == "grads"]
    specs = {spec.name: spec for spec in fn.inputs}
    for key in differentiated:
        if key not in params:
            raise ValueError(f"the module differentiates {key!r}, which is not in params; train updates params only")
        check_writable(specs[key], params[key], job.module.dtype)  # the binder's rule for what is written in place
    return NumpyStep(optimizer, {key: params[key] for key in differentiated}, state if state is not None else {})


def _dims(firsts: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}: {dim}" for key, dim in firsts.items())


def _chunks(array: Any) -> str:
    rows = array.chunks[0]
    return str(rows) if len(rows) <= 6 else f"({', '.join(map(str, rows[:5]))}, ... {len(rows)} chunks)"
