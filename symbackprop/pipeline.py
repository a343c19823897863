"""The pipeline from a Model to generated C: lower, differentiate, schedule,
emit. Each stage is a plain function of the previous stage's value.

A module holds one C function per requested kind:

    forward         inputs -> loss, named outputs
    value_and_grad  inputs -> loss, grad_<w> for each w differentiated
    vjp             inputs, seed_<y> -> grad_<w> of sum(seed * y), per named output y
    jvp             inputs, tangent_<w> -> tangents of the loss and of each output
    hvp             inputs, direction_<w> -> loss, grad_<w>, hvp_<w> (Hessian times direction)
    train_step      inputs, hyperparameters, optimizer state -> loss; params and state updated in place

A module with a train_step also gets `<prefix>_train_epoch`, which runs it on
each minibatch of the data in turn (see epoch.py), when the model has a
batch dimension.

`w` ranges over the differentiated names: parameters, chosen inputs, and
chosen named outputs (whose gradient is the adjoint of an intermediate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import sympy as sp

from symbackprop._version import __version__
from symbackprop.base.cnames import CNamer, abi_names, comment_text, function_base, real_macro, sanitize
from symbackprop.base.functions import HELPER_C_NAMES
from symbackprop.declare.model import Model, leaf_name
from symbackprop.deep import run_deep
from symbackprop.diff.autodiff import jvp, vjp
from symbackprop.diff.hessian import hessian_vector
from symbackprop.emit.cfunction import emit_function, emit_wrapper
from symbackprop.emit.codegen import REAL_TYPES, CFunction, CModule, render
from symbackprop.emit.cunits import split_units
from symbackprop.emit.derivation import plan_derivation, render_derivation
from symbackprop.emit.emitted import Emitted
from symbackprop.emit.epoch import epoch_c, reserved_names, try_epoch_plan
from symbackprop.emit.kernelkinds import share_kernels
from symbackprop.emit.maps import share_maps
from symbackprop.emit.products import share_products
from symbackprop.emit.sizes import shared_size_checks
from symbackprop.emit.stepcall import calling_step
from symbackprop.errors import ModelError
from symbackprop.gcpause import gc_paused
from symbackprop.ir.construct import const, leaf
from symbackprop.ir.lower import Lowered, lower
from symbackprop.ir.node import SCALAR, Node, topological_order
from symbackprop.log import op_counts, stage
from symbackprop.loops.unrolled import recognize_scans
from symbackprop.plan import DEFAULT_FUNCTIONS, FunctionPlan, Plan
from symbackprop.schedule.naming import Naming
from symbackprop.schedule.scheduler import FunctionSchedule, schedule

KINDS = ("forward", "value_and_grad", "vjp", "jvp", "hvp", "train_step")

# The most distinct SymPy subexpressions a model's loss and outputs may hold
# (matrix expressions count one each, however large their matrices). The
# Python stages are linear in them (a chain of tanh links, 3 a link: 1,000
# in 2.2 s, 4,000 in 8.7 s), but the C of an unrolled chain is about 380
# characters a subexpression and GCC -O3 takes 10-40 us a character: 10,000
# took 185 s in all on a shared 2-vCPU VM (160 s of it GCC). Past this limit
# a compile would take a quarter of an hour or more, so plan refuses it at
# once, naming the count (count_operations). An unrolled 1,000-step GRU
# (tests/compiled/test_depth.py) holds 37,024.
MAX_OPERATIONS = 40_000
# The most inputs and params (leaves) a model may have: each is an argument
# of every C function and of its cffi wrapper, and 1,000 scalar parameters
# (2,000 leaves with their inputs) took 56 s to compile, 41 s of it GCC;
# 10,000 did not finish in 10 minutes. A 1,000-layer stack of linear layers
# has 2,001.
MAX_LEAVES = 4096

SHARED_SUMMARY = ("The forward pass (the loss and the named outputs), then, when with_grads is 1, the gradient: "
                  "forward and value_and_grad call it.")

SUMMARIES = {
    "forward": "Forward pass: the loss and the named outputs.",
    "value_and_grad": "The loss and its gradient (reverse mode).",
    "vjp": "Vector-Jacobian product: the gradient of sum(seed * output) (reverse mode).",
    "jvp": "Jacobian-vector product: tangents of the loss and outputs (forward mode).",
    "hvp": "Hessian-vector product: the loss, its gradient, and the Hessian times a direction.",
    "train_step": "One training step: the loss, then the optimizer updates the parameters and its state in place.",
}


def _targets(lowered: Lowered, model: Model, wrt: Sequence[str] | None) -> list[tuple[str, Node]]:
    names = list(wrt) if wrt is not None else [leaf_name(s) for s in model.differentiated]
    targets = []
    for name in names:
        node = lowered.leaves.get(name) or lowered.outputs.get(name)
        if node is None:
            known = list(lowered.leaves) + list(lowered.outputs)
            raise ModelError(f"cannot differentiate with respect to {name!r}: not an input, param or output {known}")
        targets.append((name, node))
    if len({n for n, _ in targets}) != len(targets):
        raise ModelError(f"wrt names a value twice: {names}")
    return targets


class _Planner:
    """Builds the requested functions, naming everything in one namespace."""

    def __init__(self, model: Model, wrt: Sequence[str] | None):
        self.model = model
        with stage("lower", model.name):
            self.lowered = recognize_scans(lower(model))  # an unrolled recurrence as one loop
        self.targets = _targets(self.lowered, model, wrt)
        self.forward_results = [("loss", self.lowered.loss)] + list(self.lowered.outputs.items())
        named = [(sanitize(name), node) for name, node in self.lowered.named]  # as the C will read it
        self.naming = Naming(self.lowered.leaves, self.forward_results, {}, named)

    def _grads(self, roots: list[tuple[Node, Node]]) -> list[Node]:
        grads, origins = vjp(roots, [node for _, node in self.targets])
        self.naming.add_origins(origins)
        return grads

    def _leaf_targets(self, why: str) -> list[tuple[str, Node]]:
        leaves = [(n, node) for n, node in self.targets if node.op == "leaf"]
        if not leaves:
            raise ModelError(f"{why} needs at least one input or param to differentiate")
        return leaves

    def _extra(self, stem: str, name: str, shape) -> tuple[str, Node]:
        """A further input leaf (a seed, tangent or direction) named stem_name."""
        arg = self.naming.claim(f"{stem}_{name}")
        node = leaf(arg, shape, stem)
        self.naming.names[node] = arg
        return arg, node

    def _schedule(self, kind: str, results: list[tuple[str, Node]], function_name: str | None = None) -> FunctionSchedule:
        return schedule(function_name or kind, results, self.naming)

    def forward(self) -> list[FunctionPlan]:
        returns = tuple(("loss", "loss", "loss") if n == "loss" else (n, "outputs", n) for n, _ in self.forward_results)
        return [FunctionPlan("forward", self._schedule("forward", self.forward_results), (), returns)]

    def value_and_grad(self) -> list[FunctionPlan]:
        grads = self._grads([(self.lowered.loss, const(1, SCALAR))])
        names = [self.naming.claim("grad_" + n) for n, _ in self.targets]
        results = [("loss", self.lowered.loss)] + list(zip(names, grads))
        returns = (("loss", "loss", "loss"),) + tuple((g, "grads", n) for g, (n, _) in zip(names, self.targets))
        return [FunctionPlan("value_and_grad", self._schedule("value_and_grad", results), (), returns)]

    def forward_and_gradient(self) -> list[FunctionPlan]:
        """forward and value_and_grad as one schedule: the loss and outputs
        first, then the gradient; forward stops after the first part, so
        the forward pass is emitted once."""
        grads = self._grads([(self.lowered.loss, const(1, SCALAR))])
        names = [self.naming.claim("grad_" + n) for n, _ in self.targets]
        results = self.forward_results + list(zip(names, grads))
        first = frozenset(n for n, _ in self.forward_results)
        shared = schedule("value_and_grad", results, self.naming, first=first)
        forward_returns = tuple(("loss", "loss", "loss") if n == "loss" else (n, "outputs", n) for n, _ in self.forward_results)
        gradient_returns = (("loss", "loss", "loss"),) + tuple((g, "grads", n) for g, (n, _) in zip(names, self.targets))
        return [FunctionPlan("forward", shared, (), forward_returns, shared=True),
                FunctionPlan("value_and_grad", shared, (), gradient_returns, shared=True)]

    def vjp(self) -> list[FunctionPlan]:
        plans = []
        for out_name, node in self.lowered.outputs.items():
            seed_arg, seed = self._extra("seed", out_name, node.shape)
            grads = self._grads([(node, seed)])
            names = [self.naming.claim(f"grad_{n}") for n, _ in self.targets]
            returns = tuple((g, "grads", n) for g, (n, _) in zip(names, self.targets))
            function_name = self.naming.claim(function_base(f"vjp_{out_name}"))  # the C name as it stands
            fn = self._schedule("vjp", list(zip(names, grads)), function_name)
            plans.append(FunctionPlan("vjp", fn, ((seed_arg, seed),), returns, out_name))
        return plans

    def jvp(self) -> list[FunctionPlan]:
        extra = [self._extra("tangent", n, node.shape) for n, node in self._leaf_targets("jvp")]
        roles = tuple((arg, "tangent", n) for (arg, _), (n, _) in zip(extra, self._leaf_targets("jvp")))
        targets = self._leaf_targets("jvp")
        tangents = {node: t for (_, node), (_, t) in zip(targets, extra)}
        roots = [node for _, node in self.forward_results]
        names = [self.naming.claim(f"tangent_{n}") for n, _ in self.forward_results]
        results = list(zip(names, jvp(roots, tangents)))
        returns = tuple((t, "loss" if n == "loss" else "outputs", n) for t, (n, _) in zip(names, self.forward_results))
        return [FunctionPlan("jvp", self._schedule("jvp", results), tuple(extra), returns, extra_roles=roles)]

    def hvp(self) -> list[FunctionPlan]:
        targets = self._leaf_targets("hvp")
        extra = [self._extra("direction", n, node.shape) for n, node in targets]
        roles = tuple((arg, "direction", n) for (arg, _), (n, _) in zip(extra, targets))
        grads, products, origins = hessian_vector(self.lowered.loss, [node for _, node in targets],
                                                  [d for _, d in extra])
        self.naming.add_origins(origins)
        grad_names = [self.naming.claim(f"grad_{n}") for n, _ in targets]
        hvp_names = [self.naming.claim(f"hvp_{n}") for n, _ in targets]
        results = [("loss", self.lowered.loss)] + list(zip(grad_names, grads)) + list(zip(hvp_names, products))
        returns = (
            (("loss", "loss", "loss"),)
            + tuple((g, "grads", n) for g, (n, _) in zip(grad_names, targets))
            + tuple((h, "hvp", n) for h, (n, _) in zip(hvp_names, targets))
        )
        return [FunctionPlan("hvp", self._schedule("hvp", results), tuple(extra), returns, extra_roles=roles)]


    def train_step(self, optimizer, calls: FunctionPlan | None = None) -> list[FunctionPlan]:
        """Forward, backward and the optimizer's update, written in place.
        With `calls` (the module's value_and_grad), the step calls it for
        the loss and the gradient and schedules the update alone: the C of
        the forward and backward passes is in one place."""
        self._leaf_targets("train_step")
        if calls is None:
            grads = self._grads([(self.lowered.loss, const(1, SCALAR))])[: len(self.targets)]
        else:  # each gradient as value_and_grad returns it, a leaf the update reads
            grads = [leaf(g, node.shape, "gradient") for g, (_, node) in zip(_grad_outputs(calls), self.targets)]
            self.naming.names.update((g, g.attrs[0]) for g in grads)
        params, grads = _updated(self.model, self.targets, grads)
        extra, roles = [], []

        def add(stem: str, role: str, shape=SCALAR) -> Node:
            arg = self.naming.claim(stem)
            node = leaf(arg, shape, role)
            self.naming.names[node] = arg
            extra.append((arg, node))
            roles.append((arg, role, stem))
            return node

        hyper = {h: add(h, "hyper") for h in optimizer.hyper()}
        shared = {s: add(s, "state") for s in optimizer.shared_state}
        new_shared = optimizer.shared_update(shared)
        shared_now = {k: new_shared.get(k, v) for k, v in shared.items()}
        results = [("loss", self.lowered.loss)] if calls is None else []
        for (name, param), grad in zip(params, grads):
            state = {k: add(f"{k}_{name}", "state", param.shape) for k in optimizer.per_param_state}
            new = optimizer.update(param, grad, state, hyper, shared_now)
            for gradient in (grad, new["grad"]):
                self.naming.names.setdefault(gradient, self.naming.claim(f"grad_{name}"))
            for label, node in new.get("names", {}).items():  # the optimizer's intermediates
                if node not in self.naming.names:
                    self.naming.names[node] = self.naming.claim(label)
            results.append((name, new["param"]))
            results += [(state[k].attrs[0], new[k]) for k in optimizer.per_param_state]
        results += [(shared[k].attrs[0], v) for k, v in new_shared.items()]
        inplace = frozenset(name for name, _ in results if name != "loss")
        fn = schedule("train_step", results, self.naming, inplace)
        return [FunctionPlan("train_step", fn, tuple(extra), (("loss", "loss", "loss"),), None, inplace, tuple(roles),
                             calls=calls)]


def _updated(model: Model, targets: list[tuple[str, Node]],
             grads: list[Node]) -> tuple[list[tuple[str, Node]], list[Node]]:
    """The targets an optimizer updates, with their gradients: the model's
    params only. A grad input (an adversarial example's X) is data the
    caller owns: its gradient is value_and_grad's, never a step's write."""
    names = {leaf_name(p) for p in model.params}
    kept = [(target, g) for target, g in zip(targets, grads) if target[1].op == "leaf" and target[0] in names]
    if not kept:
        raise ModelError("train_step needs at least one param to update; the optimizer updates params, "
                         "never inputs (grad_inputs are differentiated, not trained)")
    return [target for target, _ in kept], [g for _, g in kept]


def _grad_outputs(gradient: FunctionPlan) -> list[str]:
    """The names of value_and_grad's gradient outputs, in order."""
    return [out for out, group, _ in gradient.returns if group == "grads"]


def _sharable(lowered: Lowered) -> bool:
    """Whether forward can be the first part of value_and_grad at no cost:
    every named output is on the way to the loss (value_and_grad computes
    them all; bundle adjustment's per-observation Jacobians, an output the
    loss does not need, would double its time), and no scan (its forward
    pass would keep every state for a backward pass a forward-only call
    never runs)."""
    needed = set(topological_order([lowered.loss]))
    if any(node not in needed for node in lowered.outputs.values()):
        return False
    return not any(node.op == "scan" for node in needed)


def count_operations(exprs: Sequence[object], limit: int) -> int:
    """The distinct SymPy subexpressions of exprs (an explicit matrix's
    entries each), counted in one walk that stops past `limit`."""
    seen: set[sp.Basic] = set()
    stack = list(exprs)
    while stack and len(seen) <= limit:
        expr = stack.pop()
        if isinstance(expr, sp.MatrixBase):  # (a mutable one has no hash)
            stack.extend(expr)
        elif isinstance(expr, sp.Basic) and expr not in seen:
            seen.add(expr)
            stack.extend(a for a in expr.args if a not in seen)
    return len(seen)


def plan(model: Model, functions: Sequence[str] = DEFAULT_FUNCTIONS, wrt: Sequence[str] | None = None,
         optimizer=None) -> Plan:
    """Lower the model, differentiate it and schedule the requested functions
    ("train_step" needs an optimizer from symbackprop.optim). Runs on a
    large stack (deep.py), so that a deep model does not exhaust Python's."""
    with gc_paused():
        return run_deep(f"the model {model.name!r}", _plan, model, functions, wrt, optimizer)


def _plan(model: Model, functions: Sequence[str], wrt: Sequence[str] | None, optimizer) -> Plan:
    unknown = [f for f in functions if f not in KINDS]
    if unknown or not functions:
        raise ModelError(f"functions must be some of {KINDS}; got {list(functions)}")
    if "train_step" in functions and optimizer is None:
        raise ModelError("train_step needs an optimizer, such as symbackprop.Adam(lr=1e-3)")
    count = count_operations([model.loss, *model.outputs.values()], MAX_OPERATIONS)
    if count > MAX_OPERATIONS:
        raise ModelError(f"the model {model.name!r} holds over {MAX_OPERATIONS} distinct subexpressions (counted "
                         f"{count} before stopping), over the limit of {MAX_OPERATIONS} it compiles in reasonable "
                         "time (symbackprop.pipeline.MAX_OPERATIONS): write repeated work as matrix operations, "
                         "sbp.map_examples or sbp.scan instead of unrolled scalars")
    leaves = len(model.inputs) + len(model.params)
    if leaves > MAX_LEAVES:
        raise ModelError(f"the model {model.name!r} has {leaves} inputs and params, over the limit of {MAX_LEAVES} it "
                         "compiles in reasonable time (symbackprop.pipeline.MAX_LEAVES: each is an argument of every C "
                         "function): gather scalars into matrices (one sp.MatrixSymbol of many entries is one leaf)")
    planner = _Planner(model, wrt)
    with stage("differentiate", model.name) as logged:  # and schedule: fuse, CSE, buffers
        together = "forward" in functions and "value_and_grad" in functions and _sharable(planner.lowered)
        plans = planner.forward_and_gradient() if together else []
        for kind in KINDS:
            if kind not in functions or (together and kind in ("forward", "value_and_grad")):
                continue
            gradient = next((p for p in plans if p.kind == "value_and_grad"), None)
            plans += planner.train_step(optimizer, gradient) if kind == "train_step" else getattr(planner, kind)()
        logged.detail(lambda: op_counts(plans))  # counting is work: only when logged
    return Plan(planner.lowered, tuple(plans), tuple(n for n, _ in planner.targets), planner.naming)


def generate(
    model: Model, dtype: str = "float64", functions: Sequence[str] = DEFAULT_FUNCTIONS, wrt: Sequence[str] | None = None,
    optimizer=None, derivation: bool = True,
) -> tuple[Emitted, Plan]:
    """C source, header, cffi declarations and derivation for the model
    (on a large stack, as plan). With derivation=False the derivation is
    left empty: `derivation_text` of the plan writes it later (compile
    writes it while the C compiles)."""
    with gc_paused():  # (see gcpause: collections walked every SymPy object built)
        return run_deep(f"the model {model.name!r}", _generate, model, dtype, functions, wrt, optimizer, derivation)


def derivation_text(the_plan: Plan, name: str, dtype: str) -> str:
    """The derivation (Markdown) of a plan, as generate writes it (on a large stack)."""
    with gc_paused():
        return run_deep(f"the model {name!r}", _derivation_text, the_plan, name, dtype)


def _derivation_text(the_plan: Plan, name: str, dtype: str) -> str:
    derived = plan_derivation(the_plan, name, dtype)
    return "" if derived is None else render_derivation(derived)


def _generate(model: Model, dtype: str, functions: Sequence[str], wrt: Sequence[str] | None,
              optimizer, derivation: bool = True) -> tuple[Emitted, Plan]:
    if dtype not in REAL_TYPES:
        raise ModelError(f"dtype must be one of {sorted(REAL_TYPES)}; got {dtype!r}")
    the_plan = plan(model, functions, wrt, optimizer)
    emitting = stage("emit", model.name).start()
    lowered = the_plan.lowered
    prefix = sanitize(model.name).lower()
    real = replace(REAL_TYPES[dtype], c=real_macro(prefix))  # its text names the type by a macro
    named = [*functions, *(fn.function_name for fn in the_plan.functions)]  # the kinds and each vjp_<output>
    reserved = frozenset({prefix}) | HELPER_C_NAMES | abi_names(prefix, named)  # helpers (base.functions), ABI
    namer = CNamer(reserved | (reserved_names(prefix) if "train_step" in functions else frozenset()))
    dims = {d: namer.name(str(d)) for d in lowered.dims}
    leaves = [(name, node.shape) for name, node in lowered.leaves.items()]
    indices = frozenset(name for name, node in lowered.leaves.items() if node.attrs[1] == "index")
    emitted_functions = []
    internal: list[CFunction] = []
    for fn in the_plan.functions:
        inputs = leaves + [(name, node.shape) for name, node in fn.extra_inputs]
        outputs = [(name, node.shape) for name, node in fn.schedule.results]
        if fn.shared:  # one static function computes both; forward and value_and_grad call it
            if not internal:
                internal.append(emit_function(fn.schedule, namer, dims, real, inputs, outputs, SHARED_SUMMARY, prefix,
                                              indices=indices, shared=namer.name(f"{prefix}_run")))
            mine = {out for out, _, _ in fn.returns}
            emitted_functions.append(emit_wrapper(internal[0], f"{prefix}_{fn.kind}", SUMMARIES[fn.kind], mine,
                                                  fn.kind == "value_and_grad", fn.schedule.written_before_split))
            continue
        if fn.calls is not None:  # the loss, from value_and_grad
            outputs = [("loss", lowered.loss.shape), *outputs]
        emitted = emit_function(fn.schedule, namer, dims, real, inputs, outputs, SUMMARIES[fn.kind], prefix, fn.inplace,
                                indices)
        if fn.calls is not None:
            emitted = calling_step(emitted, emitted_functions[the_plan.functions.index(fn.calls)])
        emitted_functions.append(emitted)
    checked, size_functions = shared_size_checks([*internal, *emitted_functions], namer.name)
    internal, emitted_functions = checked[:len(internal)], checked[len(internal):]
    epoch = None
    if "train_step" in functions:  # and a batch dimension: the whole epoch as one C function
        step = the_plan.function("train_step")
        batched = try_epoch_plan(lowered, step)
        if batched is not None:
            emitted_step = emitted_functions[the_plan.functions.index(step)]
            epoch = epoch_c(batched, emitted_step, namer, dims, real, prefix)
    module = CModule(
        prefix=prefix,
        guard=f"{prefix.upper()}_H",
        model_name=comment_text(model.name),
        real=real.name,
        real_c=real.c,
        dims=tuple(dims.values()),
        functions=tuple(emitted_functions),
        internal=tuple(internal),
        version=__version__,
        epoch=epoch,
        sizes=size_functions,
        least=tuple(({str(d): c for d, c in dims.items()}[d], value, comment_text(why))
                    for d, value, why in lowered.minimums),
    )
    module = share_products(module, namer.name)  # many matrix products: a function per kind
    module = share_maps(module, namer.name)  # element-wise loops that repeat: a function per kind
    module = share_kernels(module, namer.name)  # long kernels (layer norm, attention): a function per kind
    module = split_units(module)  # a large module: its C compiled as several units at once
    source, header, cdef = render(module)
    text = _derivation_text(the_plan, model.name, dtype) if derivation else ""
    emitting.stop()
    return Emitted(prefix, source, header, cdef, text, module), the_plan


__all__ = ["DEFAULT_FUNCTIONS", "KINDS", "FunctionPlan", "Plan", "derivation_text", "generate", "plan"]
