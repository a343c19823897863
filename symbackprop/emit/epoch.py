"""A whole epoch in one C call: `<prefix>_train_epoch` runs `<prefix>_train_step`
on each minibatch of the data in turn.

The data inputs are the model's inputs whose first dimension is the batch
dimension: a symbolic dimension that is the first dimension of some input
and appears nowhere else (no second dimension, no parameter). Minibatches
are consecutive blocks of `batch` rows, taken in order or through a row
order the caller passes (a permutation of the rows, gathered into the
workspace); the last one is smaller when `batch` does not divide the rows,
as with PyTorch's DataLoader(drop_last=False). Other inputs, the parameters,
the hyperparameters and the optimizer's state are passed whole.

An Index of the batch dimension (one row number per example) is data, sliced
with the examples. An Index's row numbers refer to the rows of the whole
array it gathers from, as the caller passed it: the runtime (train.py)
refuses, before anything runs, an Index that gathers from a data input,
which the epoch would cut into minibatches. The C checks every Index once,
before the first step, so a failing epoch trains nothing.

`epoch_plan` decides what is sliced (plain data the runtime uses too);
`epoch_c` turns it into the small dataclass the template `epoch.c.j2` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy as sp

from symbackprop.base.abi import SIZE_DOES_NOT_FIT
from symbackprop.base.cnames import describing
from symbackprop.errors import ModelError

if TYPE_CHECKING:  # only for annotations
    from symbackprop.base.cnames import CNamer
    from symbackprop.emit.codegen import CFunction
    from symbackprop.emit.emitted import RealType
    from symbackprop.ir.lower import Lowered
    from symbackprop.plan import FunctionPlan

SUMMARY = "One epoch: train_step on each minibatch in turn; {losses}[{b}] is the loss of minibatch {b}."


@dataclass(frozen=True)
class EpochPlan:
    """What an epoch slices: the batch dimension and the data inputs."""

    batch: sp.Symbol
    data: tuple[str, ...]  # inputs sliced by rows, in argument order
    dims: tuple[sp.Symbol, ...]  # every symbolic dimension, in the train step's order

    @property
    def other_dims(self) -> tuple[sp.Symbol, ...]:
        return tuple(d for d in self.dims if d != self.batch)


def epoch_plan(lowered: Lowered, step: FunctionPlan) -> EpochPlan:
    """The batch dimension and the data inputs of a train step.

    Raises:
        ModelError: no symbolic dimension qualifies as the batch dimension,
            or more than one does (the message says why).
    """
    leaves = list(lowered.leaves.items()) + list(step.extra_inputs)
    data_like = [
        (name, node) for name, node in lowered.leaves.items()
        if node.attrs[1] in ("input", "index") and name not in step.inplace and isinstance(node.shape[0], sp.Symbol)
    ]
    candidates = []
    # an Index of the batch dimension (one row number per example) is data too; an
    # Index of a length of its own is passed whole, and makes no batch dimension
    arrays = [node.shape[0] for _, node in data_like if node.attrs[1] == "input"]
    for dim in dict.fromkeys(arrays or [node.shape[0] for _, node in data_like]):
        elsewhere = [
            name for name, node in leaves
            if dim in node.shape[1:] or (dim == node.shape[0] and (name, node) not in data_like)
        ]
        if not elsewhere:
            candidates.append(dim)
    if len(candidates) != 1:
        why = "none does" if not candidates else f"{[str(d) for d in candidates]} all do"
        raise ModelError(
            "train_epoch needs one batch dimension: a symbolic dimension that is the first dimension of "
            f"the data inputs and appears nowhere else; {why}"
        )
    batch = candidates[0]
    data = tuple(name for name, node in data_like if node.shape[0] == batch)
    return EpochPlan(batch, data, lowered.dims)


# --- what the template gets --------------------------------------------------


@dataclass(frozen=True)
class CBatchInput:
    """One data input: the whole array, and the minibatch passed to the step."""

    cname: str  # the parameter: every row
    ctype: str  # its entries' C type: the real type, or int64_t for an Index (row numbers)
    batch: str  # local pointer to the minibatch's first row
    gathered: str  # workspace slot the rows are gathered into (with an order)
    slot: str  # C expression: where that slot begins
    row_len: str  # C expression: entries in one row
    offset: str  # C expression: the entry where row `start` begins


@dataclass(frozen=True)
class CEpoch:
    name: str  # <prefix>_train_epoch
    step: str  # <prefix>_train_step
    step_len: str  # static helper: the train step's workspace for the epoch
    summary: str
    rows: str
    batch: str  # the minibatch size argument
    size: str  # the current minibatch's size: the batch dimension's C name
    order: str
    losses: str
    work: str
    start: str  # first row of the current minibatch
    index: str  # the current minibatch's number
    last: str  # the last minibatch's size
    full: str  # workspace of a full minibatch's step
    part: str  # workspace of the last minibatch's step
    dims: tuple[str, ...]  # other symbolic dimensions, passed through
    real: str
    params: tuple[tuple[str, str], ...]  # (role, C declaration) in argument order
    data: tuple[CBatchInput, ...]
    step_args: tuple[str, ...]
    step_dims: tuple[str, ...]  # the train step's dimension arguments
    gather_len: str  # C expression: workspace entries for the gathered rows
    checks: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # the step's index checks for the whole epoch
    words: int = 1  # workspace entries an int64_t takes (gathered Index rows are aligned to it)
    statuses: tuple[int, ...] = (0, 1, 2)  # what it returns (base.abi.STATUS_TEXT): it checks its order too
    # the step's sizes with every row one minibatch, checked C (emit/sizes.py): they bound the
    # epoch's (its data, order and losses; a step's workspace and the gathered rows)
    size_check: str | None = None

    @property
    def dim_params(self) -> str:
        return ", ".join(f"int64_t {d}" for d in (self.rows, self.batch, *self.dims))

    @property
    def uses_last(self) -> bool:
        """Whether an index check bounds by the smallest minibatch's rows."""
        word = re.compile(rf"\b{re.escape(self.last)}\b")
        return any(word.search(bound) for _, _, bounds in self.checks for bound in bounds)

    @property
    def dim_args(self) -> str:
        return ", ".join((self.rows, self.batch, *self.dims))

    def step_len_args(self, size: str) -> str:
        """Arguments of the train step's work_len with `size` rows a batch."""
        return ", ".join(size if d == self.size else d for d in self.step_dims)

    @property
    def all_params(self) -> str:
        return ", ".join(decl for _, decl in self.params)

    @property
    def cffi_params(self) -> str:
        """Arrays as `void *` (untyped buffers), as for the other functions."""
        out = []
        for role, decl in self.params:
            out.append(decl if role == "dim" else "void *" + decl.rsplit("*", 1)[1])
        return ", ".join(out)


def reserved_names(prefix: str) -> frozenset[str]:
    """C names the epoch calls or defines (its self-description too): no
    user name may shadow them."""
    names = {f"{prefix}_{n}" for n in ("train_step", "train_step_work_len", "train_epoch", "train_epoch_work_len",
                                       "train_epoch_step_len")}
    return frozenset(names | set(describing(f"{prefix}_train_epoch").values()))


def epoch_c(plan: EpochPlan, step: CFunction, namer: CNamer, dims: dict[sp.Symbol, str], real: RealType,
            prefix: str) -> CEpoch:
    """Template data of `<prefix>_train_epoch` for a train step emitted as `step`."""
    local = lambda what: namer.name("\0" + what)  # noqa: E731 - names no user name can take
    size = dims[plan.batch]
    batch = local("batch")
    dim_args = ", ".join((local("rows"), batch, *(dims[d] for d in plan.other_dims)))
    words = 2 if real.name == "float32" else 1  # an int64_t in workspace entries
    data, gather_len = _batch_inputs(plan, step, local, f"work + {prefix}_train_epoch_step_len({dim_args})", batch,
                                     real, words)
    batches = {d.cname: d.batch for d in data}
    losses = local("losses")
    index = local("b")
    params: list[tuple[str, str]] = [("dim", f"int64_t {local('rows')}"), ("dim", f"int64_t {local('batch')}")]
    params += [("dim", f"int64_t {dims[d]}") for d in plan.other_dims]
    params.append(("order", f"const int64_t *{local('order')}"))
    step_args = []
    for p in step.params:
        if p.role == "dim":
            step_args.append(p.cname)
        elif p.role == "output":  # the loss
            step_args.append(f"{losses} + {index}")
        elif p.role == "work":
            step_args.append(p.cname)
        else:
            step_args.append(batches.get(p.cname, p.cname))
        if p.role in ("input", "inout"):
            params.append((p.role, p.decl))
    params.append(("output", f"{real.c} *{losses}"))
    params.append(("work", f"{real.c} *work"))
    return CEpoch(
        name=f"{prefix}_train_epoch",
        step=step.name,
        step_len=f"{prefix}_train_epoch_step_len",
        summary=SUMMARY.format(losses=losses, b=index),
        rows=local("rows"),
        batch=local("batch"),
        size=size,
        order=local("order"),
        losses=losses,
        work="work",
        start=local("start"),
        index=index,
        last=local("last"),
        full=local("full"),
        part=local("part"),
        dims=tuple(dims[d] for d in plan.other_dims),
        real=real.c,
        params=tuple(params),
        data=tuple(data),
        step_args=tuple(step_args),
        gather_len=gather_len,
        step_dims=tuple(p.cname for p in step.params if p.role == "dim"),
        checks=epoch_checks(step, size, local("rows"), local("last")),
        words=words,
        statuses=(0, 1, 2) + ((5,) if step.divides else ()) + (SIZE_DOES_NOT_FIT,),  # 5: a minibatch that is not
        # whole steps of a batched scan
        size_check=re.sub(rf"\b{re.escape(size)}\b", local("rows"), step.size_check) if step.size_check else None,
    )


def _batch_inputs(plan: EpochPlan, step: CFunction, local: Any, start: str, batch: str, real: RealType,
                  words: int) -> tuple[list[CBatchInput], str]:
    """The data inputs, and the workspace entries their gathered rows take
    after the step's: Index rows first (int64_t, aligned: the step's part is
    rounded up to `words` entries), then the real ones."""
    by_name = {p.name: p for p in step.params}
    params = [by_name[name] for name in plan.data]
    placed = sorted(params, key=lambda p: not _is_index(p))
    at: dict[str, str] = {}
    terms: list[str] = []
    for param in placed:
        row_len = param.shape[1]
        at[param.name] = " + ".join([start, *terms])
        count = batch if row_len == "1" else f"{batch}*{row_len}"
        terms.append(f"{count}*{words}" if _is_index(param) and words > 1 else count)
    data = []
    for param in params:
        row_len = param.shape[1]
        ctype = "int64_t" if _is_index(param) else real.c
        slot = at[param.name] if ctype == real.c else f"(int64_t *)(void *)({at[param.name]})"
        data.append(CBatchInput(
            cname=param.cname,
            ctype=ctype,
            batch=local(f"{param.cname} batch"),
            gathered=local(f"{param.cname} rows"),
            slot=slot,
            row_len=row_len,
            offset=local("start") if row_len == "1" else f"{local('start')}*{row_len}",
        ))
    return data, " + ".join(terms) or "0"


def _is_index(param: Any) -> bool:
    return bool(param.index)


def epoch_checks(step: CFunction, size: str, rows: str, last: str) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """The step's index checks, once for the whole epoch: an Index sliced
    with the examples is checked over all `rows` of it; an array it gathers
    from that has the batch dimension (sliced too) over the rows of the
    smallest minibatch (`last`), so that no step can fail after another
    has trained."""
    word = re.compile(rf"\b{re.escape(size)}\b")
    return tuple((index, word.sub(rows, count), tuple(word.sub(last, b) for b in bounds))
                 for index, count, bounds in step.checks)


def try_epoch_plan(lowered: Lowered, step: FunctionPlan) -> EpochPlan | None:
    try:
        return epoch_plan(lowered, step)
    except ModelError:
        return None


__all__ = ["CEpoch", "EpochPlan", "epoch_c", "epoch_plan", "reserved_names", "try_epoch_plan"]
