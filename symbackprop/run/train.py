"""Training with a compiled module: the optimizer's state, fused steps,
whole epochs, and checkpoints.

A step is one C call (forward, backward, update); the parameters passed are
updated in place, so they must be writable, aligned, C-contiguous arrays of
the module's dtype that share no memory with another argument (the binder,
binding.py, checks this for train_step, train_epoch and prepare alike). The optimizer's state (momentum, Adam's moments, the step
count) lives in arrays held here, which `save` and `load` write to and read
from an .npz file together with the parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from symbackprop.errors import ArgumentError
from symbackprop.progress import Progress, ProgressArg
from symbackprop.run.function import empty_workspace

if TYPE_CHECKING:  # only for annotations
    from symbackprop.base.abi import FunctionSpec, ModuleSpec
    from symbackprop.run.function import Function
    from symbackprop.run.optim import SGD, Adam


class Trainer:
    """The training state of one compiled module and one optimizer.

    Made by ``CompiledModule.trainer()``; ``hyperparameters`` (a dict, the
    optimizer's by default) may be changed between steps, ``state`` holds the
    optimizer state arrays by argument name.

    Args:
        module: the compiled module, built with an optimizer.
        function: its train_step function.

    Raises:
        ArgumentError: the module has no optimizer.
    """

    def __init__(self, module: Training, function: Function) -> None:
        if module.optimizer is None:  # compile() makes no train_step without one
            raise ArgumentError("train_step needs an optimizer: compile(model, optimizer=symbackprop.Adam(...))")
        self.module = module
        self.function = function
        roles = function.spec.extra_roles
        shapes = {spec.name: spec.shape for spec in function.inputs}
        self.hyperparameters: dict[str, float] = dict(module.optimizer.hyper())
        self._hyper_arrays = {key: np.zeros((1, 1), dtype=module.dtype) for arg, role, key in roles if role == "hyper"}
        self._hyper_args = {arg: key for arg, role, key in roles if role == "hyper"}
        self._state_shapes = {arg: shapes[arg] for arg, role, _ in roles if role == "state"}
        self.state: dict[str, np.ndarray] = {}
        self._epoch: tuple[Any, Any, int] | None = None

    def _ensure_state(self, arrays: Mapping[str, Any]) -> None:
        """Zero state arrays, sized from the parameters, on the first step."""
        if self.state:
            return
        for arg, shape in self._state_shapes.items():
            if any(isinstance(d, str) for d in shape):
                raise ArgumentError(f"optimizer state {arg} has a symbolic shape {shape}; parameters must have fixed shapes")
            self.state[arg] = np.zeros(tuple(int(d) for d in shape), dtype=self.module.dtype)

    def _arguments(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        self._ensure_state(arrays)
        for key, array in self._hyper_arrays.items():
            array[0, 0] = self.hyperparameters[key]
        hyper = {arg: self._hyper_arrays[key] for arg, key in self._hyper_args.items()}
        return {**arrays, **self.state, **hyper}

    def step(self, **arrays: Any) -> float:
        """One training step: forward, backward and the optimizer's update of
        the parameter arrays, in place, in one C call.

        Args:
            **arrays: every input and parameter by name; the parameters must
                be writable C-contiguous arrays of the module's dtype.

        Returns:
            The loss before the update.

        Raises:
            ArgumentError: a parameter cannot be updated in place (read-only,
                not C-contiguous, another dtype, sharing memory with another
                argument), a parameter has a symbolic shape, or any check of
                the binder fails.
        """
        return self.function.answer(self._arguments(arrays))

    def epoch(self, batch_size: Any = None, order: Any = None, /, **arrays: Any) -> np.ndarray:
        """One epoch in one C call: a training step on each minibatch of
        `batch_size` rows of the data inputs (the inputs whose first dimension
        is the batch dimension), in order, or in the row order `order` (any
        sequence of row numbers: rng.permutation(rows), a subset, repeats,
        as PyTorch's samplers allow; the epoch runs over len(order) rows). The
        last minibatch is smaller when batch_size does not divide the rows
        (as PyTorch's DataLoader with drop_last=False). Other arguments are
        passed whole to every step, as to `step`. Returns the losses of the
        minibatches, in the order they ran; the result is the same, bit for
        bit, as calling `step` on each minibatch.

        `batch_size` and `order` may be given by keyword, unless the model has
        an input or parameter of that name (then they go by position).

        An Index's row numbers refer to the rows of the whole array it
        gathers from, as passed. An Index that gathers from a data input
        (an array this sliced into minibatches) is refused before anything
        runs: give that array a dimension of its own.

        Args:
            batch_size: rows per minibatch, a positive integer.
            order: the row numbers in the order they run, or None for 0 ... rows-1.
            **arrays: every input and parameter by name, as for `step`.

        Returns:
            The minibatches' losses, a 1-D array of the module's dtype.

        Raises:
            ArgumentError: the model has no batch dimension; an Index gathers
                from a data input; batch_size is not a positive integer; order
                is not a non-empty 1-D sequence of integer row numbers in
                0 ... rows-1; or any argument `step` would reject.
        """
        c_function, c_work_len, batch_index = self._epoch_function()
        leaves = self.module.spec.leaves
        if batch_size is None and "batch_size" in arrays and "batch_size" not in leaves:
            batch_size = arrays.pop("batch_size")
        if order is None and "order" in arrays and "order" not in leaves:
            order = arrays.pop("order")
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ArgumentError(f"batch_size must be a positive integer; got {batch_size!r}")
        values, dims = self.function.bind(self._arguments(arrays))
        rows = dims[batch_index]
        other = [d for k, d in enumerate(dims) if k != batch_index]
        order_array = None if order is None else _check_order(order, rows)
        if order_array is not None and order_array.shape[0] != rows:  # a subset, or more rows than the data
            values = _gathered(values, self.function.input_names, self.function.spec.epoch_data, order_array)
            dims[batch_index] = rows = order_array.shape[0]
            order_array = None
        batch = min(int(batch_size), rows)
        _check_smallest_minibatch(self.function.spec, rows, batch)
        losses = np.empty(-(-rows // batch), dtype=self.module.dtype)
        work = empty_workspace(c_work_len(rows, batch, *other), self.module.dtype)
        buf, ffi = self.function.from_buffer, self.function.ffi
        status = c_function(rows, batch, *other, ffi.NULL if order_array is None else buf(order_array),
                            *[buf(v) for v in values], buf(losses), buf(work))
        if status != 0:  # the checks above make this unreachable: C checks again for C callers
            self.function.binder.diagnose(dict(zip(self.function.input_names, values)), status, "train_epoch")
        return losses

    def batch_rows(self, arrays: Mapping[str, Any]) -> int:
        """The number of rows of the data inputs (what `epoch` splits into minibatches).

        Args:
            arrays: every input and parameter by name, as for `epoch`.

        Returns:
            The rows.

        Raises:
            ArgumentError: as `epoch`.
        """
        _, _, batch_index = self._epoch_function()
        return int(self.function.bind(self._arguments(arrays))[1][batch_index])

    def _epoch_function(self) -> tuple[Any, Any, int]:
        """The C epoch function, its work_len, and the batch dimension's
        position among the dimensions."""
        if self._epoch is None:
            spec = self.function.spec
            if spec.epoch_batch is None:
                raise ArgumentError(
                    "train_epoch needs one batch dimension: a symbolic dimension that is the first dimension of "
                    "the data inputs and appears nowhere else; this model has none (or several)")
            _check_gathers(spec.epoch_batch, spec.epoch_data, self.function.index_bounds)
            name = self.function.c_name.rsplit("_train_step", 1)[0] + "_train_epoch"
            lib = self.function.lib
            self._epoch = (getattr(lib, name), getattr(lib, name + "_work_len"), list(self.function.dims).index(spec.epoch_batch))
        return self._epoch

    def save(self, path: str | Path, params: Mapping[str, np.ndarray]) -> None:
        """Write the parameters, the optimizer state and hyperparameters to .npz.

        Args:
            path: the file (numpy adds ".npz" to a name without it).
            params: the parameter arrays by name.

        Raises:
            OSError: the file cannot be written.
        """
        contents = {f"param/{k}": np.asarray(v) for k, v in params.items()}
        contents.update({f"state/{k}": v for k, v in self.state.items()})
        contents.update({f"hyper/{k}": np.float64(v) for k, v in self.hyperparameters.items()})
        # every key has a "param/", "state/" or "hyper/" prefix, so none is savez's allow_pickle
        np.savez(path, **contents)  # type: ignore[arg-type]

    def load(self, path: str | Path) -> dict[str, np.ndarray]:
        """Restore the optimizer state and hyperparameters from .npz.

        Args:
            path: a file that `save` wrote.

        Returns:
            The saved parameters by name (fresh writable arrays).

        Raises:
            ArgumentError: the file lacks some of the optimizer's state.
            OSError: the file cannot be read.
        """
        with np.load(path) as data:
            params = _section(data, "param/", self.module.dtype)
            self.state = _section(data, "state/", self.module.dtype)
            self.hyperparameters.update({k.split("/", 1)[1]: float(data[k]) for k in data.files if k.startswith("hyper/")})
        missing = set(self._state_shapes) - set(self.state)
        if missing:
            raise ArgumentError(f"{path} lacks the optimizer state {sorted(missing)}")
        return params


def _check_gathers(batch: str, data: tuple[str, ...], bounds: Mapping[str, Any]) -> None:
    """Refuse an Index that gathers from a data input: its row numbers
    refer to the whole array, which train_epoch would cut into minibatches."""
    for index, rows in bounds.items():
        if batch in rows:
            raise ArgumentError(
                f"train_epoch: the Index {index!r} gathers rows from an array with the batch dimension {batch} "
                f"(a data input: one of {list(data)}), which train_epoch slices into minibatches, while {index!r} "
                "numbers the rows of the whole array; give the array it gathers from a dimension of its own "
                "(e.g. MatrixSymbol('P', m, k) instead of n rows)")


def _check_smallest_minibatch(spec: FunctionSpec, rows: int, batch: int) -> None:
    """The last minibatch (the smallest) as large as the fixed rows the
    model takes of the batch dimension (FunctionSpec.minimums) need."""
    last = rows - (rows - 1) // batch * batch
    for dim, least, why in spec.minimums:
        if dim == spec.epoch_batch and last < least:
            raise ArgumentError(f"train_epoch's last minibatch has {dim} = {last} rows ({rows} rows in minibatches of "
                                f"{batch}), but {why}: {dim} must be at least {least} in every minibatch; choose a "
                                "batch_size that leaves enough rows for the last one")


def _check_order(order: Any, rows: int) -> np.ndarray:
    """The row order as a contiguous int64 array, checked so that C never
    reads outside the data: any non-empty sequence of row numbers in
    0 ... rows-1 (a permutation, a subset, repeats), as PyTorch's samplers."""
    is_sequence = isinstance(order, (np.ndarray, Sequence)) and not isinstance(order, (str, bytes))
    array = np.asarray(order) if is_sequence else None
    if array is None or array.ndim != 1 or (array.dtype.kind not in "iu" and array.size):
        what = f"{array.ndim}-D array of {array.dtype}" if array is not None else type(order).__name__
        raise ArgumentError(f"order must be a 1-D sequence of integer row numbers (such as rng.permutation({rows}), "
                            f"or a subset of the rows); got a {what}")
    if array.size == 0:
        raise ArgumentError("order names no row: give at least one row number")
    if array.min() < 0 or array.max() >= rows:
        raise ArgumentError(f"order must hold row numbers in 0 ... {rows - 1} (the data has {rows} rows); "
                            f"got values from {array.min()} to {array.max()}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _shuffler(shuffle: Any) -> np.random.Generator | np.random.RandomState | None:
    """fit's `shuffle` as a generator of row orders, or None for the rows in order."""
    if shuffle is None or shuffle is False or (isinstance(shuffle, np.bool_) and not shuffle):
        return None
    if shuffle is True or isinstance(shuffle, np.bool_):
        return np.random.default_rng()
    if isinstance(shuffle, (int, np.integer)):
        if shuffle < 0:
            raise ArgumentError(f"shuffle as a seed must be a non-negative integer; got {shuffle!r}")
        return np.random.default_rng(int(shuffle))
    if isinstance(shuffle, (np.random.Generator, np.random.RandomState)):
        return shuffle
    raise ArgumentError(f"shuffle must be True or False, an integer seed, or a numpy Generator "
                        f"(np.random.default_rng(seed)); got {type(shuffle).__name__} {shuffle!r}")


def _gathered(values: list[Any], names: Sequence[str], data: Sequence[str], order: np.ndarray) -> list[Any]:
    """The arguments with each data input's rows taken in `order` (an order
    of another length than the rows: the epoch then runs over these)."""
    return [np.ascontiguousarray(np.take(v, order, axis=0)) if name in data else v for name, v in zip(names, values)]


def _section(data: Any, prefix: str, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The arrays of an .npz stored under `prefix`, as fresh writable arrays."""
    return {k[len(prefix):]: np.array(data[k], dtype=dtype) for k in data.files if k.startswith(prefix)}


class Training:
    """train_step, train_epoch and the optimizer's state, for
    CompiledModule (which gives the attributes and methods declared here)."""

    optimizer: SGD | Adam | None
    dtype: np.dtype
    spec: ModuleSpec
    _trainer: Trainer | None

    if TYPE_CHECKING:  # CompiledModule's

        def function(self, kind: str, output: str | None = None) -> Function: ...

    @property
    def trainer(self) -> Trainer:
        """The training state of this module (see symbackprop.run.train.Trainer);
        made, and train_step compiled, on first use. Raises ArgumentError when
        compile was given no optimizer."""
        if self._trainer is None:
            self._trainer = Trainer(self, self.function("train_step"))
        return self._trainer

    def train_step(self, **arrays: Any) -> float:
        """Forward, backward and the optimizer's update in one C call; the
        parameter arrays passed are updated in place.

        Args:
            **arrays: every input and param by name.

        Returns:
            The loss before the update.

        Raises:
            ArgumentError: no optimizer was given to compile, a parameter is
                not a writable C-contiguous array of the module's dtype, or
                any check of value_and_grad fails.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        return self.trainer.step(**arrays)

    def train_epoch(self, batch_size: Any = None, order: Any = None, /, **arrays: Any) -> np.ndarray:
        """train_step over every minibatch of the data inputs, in one C call
        (see Trainer.epoch).

        Args:
            batch_size: rows per minibatch, a positive integer.
            order: the row numbers in the order they run (a permutation, a
                subset, repeats), or None.
            **arrays: every input and param by name.

        Returns:
            The minibatches' losses, in the order they ran.

        Raises:
            ArgumentError: as train_step, or a bad batch_size or order, or a
                model without a batch dimension.
            ModelError, BuildError: compiling the C function on first use failed.
        """
        return self.trainer.epoch(batch_size, order, **arrays)

    def fit(self, epochs: int, batch_size: int, /, *, shuffle: np.random.Generator | bool | int | None = None,
            progress: ProgressArg = None, **arrays: Any) -> np.ndarray:
        """`epochs` calls of train_epoch, as a PyTorch or Keras training loop:
        the parameter arrays are updated in place, and a progress bar (tqdm,
        when installed) shows the epochs and the last epoch's mean loss.

        Args:
            epochs: the number of epochs, a positive integer.
            batch_size: rows per minibatch (see train_epoch).
            shuffle: each epoch's row order: a numpy Generator (or
                RandomState) draws it (rng.permutation(rows)); True: a fresh
                np.random.default_rng(); an integer: default_rng(that seed);
                None or False: the rows in order.
            progress: None (a bar when stderr is a terminal), True, False, or
                a callable progress(epoch, epochs, {"loss": mean loss}) (see symbackprop.progress).
            **arrays: every input and param by name, as for train_epoch (an
                input named shuffle or progress: call train_epoch instead).

        Returns:
            The minibatches' losses, one row per epoch; the same, bit for bit,
            as the train_epoch calls, with or without progress.

        Raises:
            ArgumentError: epochs is not a positive integer, shuffle is none
                of the above, or as train_epoch.
        """
        shuffler = _shuffler(shuffle)
        if isinstance(epochs, (bool, np.bool_)) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
            raise ArgumentError(f"epochs must be a positive integer; got {epochs!r}")
        rows = self.trainer.batch_rows(arrays) if shuffler is not None else 0
        curves = []
        with Progress(int(epochs), "epoch", progress) as bar:
            for _ in range(int(epochs)):
                order = None if shuffler is None else shuffler.permutation(rows)
                curves.append(self.train_epoch(batch_size, order, **arrays))
                bar.step(loss=float(np.mean(curves[-1])))
        return np.stack(curves)

    @property
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer's state arrays (momentum, moments, step count), by
        name; empty before the first step. Raises ArgumentError when compile
        was given no optimizer."""
        return self.trainer.state
