"""CasADi: build the loss and its reverse-mode gradient symbolically, generate
C with casadi's CodeGenerator, compile it with cffi, call it through a small
hand-written C wrapper that takes one pointer per array.

Layout: casadi stores matrices column-major, numpy (here) row-major, so each
numpy array of shape (r, c) is handed to casadi as its (c, r) transpose, with
no copy. The model is written directly in that transposed space, and the
gradients casadi writes are, read row-major, the gradients of the original
arrays.

Small workloads use SX (scalar graph, fully unrolled code); large ones use
MX (matrix graph, loops and casadi's dense matrix product), because unrolled
SX code for them would be millions of lines.
"""

from __future__ import annotations

import casadi as ca

from .. import workloads
from ._common import (
    C_TYPES,
    CffiCall,
    Unsupported,
    build_cffi,
    c_signature,
    cffi_variants,
    timed,
)

VERSION = ca.__version__
SX_MAX_FLOPS = 200_000  # above this many flops per step, use MX
WRAPPER = "casadi_call"

_ACTIVATIONS = {
    "sigmoid": lambda z: 1 / (1 + ca.exp(-z)),
    "tanh": ca.tanh,
    "relu": lambda z: ca.fmax(z, 0),
}


def _symbols(kind, shapes: dict, names) -> dict:
    """Column-major views: a (r, c) array becomes a (c, r) symbol."""
    return {k: kind.sym(k, shapes[k][1], shapes[k][0]) for k in names}


def _loss(workload, v: dict):
    """The loss from the transposed views ``v`` (Mt stands for M.T)."""
    x_name, t_name = workload.input_names
    act = _ACTIVATIONS[workload.activation]
    a = v[x_name]
    for k in range(1, workload.n_layers + 1):
        if workload.layout == "rows":  # (A W + 1 b).T = Wt At + bt 1t
            z = ca.mtimes(v[f"W{k}"], a) + ca.repmat(v[f"b{k}"], 1, workload.batch)
        else:  # (W A).T = At Wt
            z = ca.mtimes(a, v[f"W{k}"])
        a = act(z) if k < workload.n_layers else z
    d = a - v[t_name]
    if workload.loss == "mse":
        return ca.sumsqr(d) / (d.shape[0] * d.shape[1])
    if workload.loss == "half_sse":
        return 0.5 * ca.sumsqr(d)
    if workload.loss == "softmax_ce":
        # a is (classes, n): one column per example. No max shift: the logits
        # of this workload are bounded by the tanh layer (|z| < ~10).
        lse = ca.log(ca.sum1(ca.exp(a)))
        return (ca.sum2(lse) - ca.dot(v[t_name], a)) / workload.batch
    raise Unsupported(f"loss {workload.loss!r}")


def _function(workload, kind):
    shapes = workload.shapes()
    names = list(workload.input_names) + list(workload.param_names)
    v = _symbols(kind, shapes, names)
    loss = _loss(workload, v)
    grads = [ca.gradient(loss, v[p]) for p in workload.param_names]
    return ca.Function(f"casadi_{workload.name}", [v[k] for k in names], [loss, *grads])


def _c_source(f, dtype: str) -> tuple[str, str]:
    """(cdef, source): casadi's generated code plus a one-call wrapper."""
    ctype = C_TYPES[dtype]
    gen = ca.CodeGenerator(f"{f.name()}.c", {"casadi_real": ctype, "with_header": False})
    gen.add(f)
    n_in, n_out = f.n_in(), f.n_out()
    signature = c_signature(WRAPPER, ctype, n_in, n_out)
    args = ", ".join([f"a{i}" for i in range(n_in)] + ["0"] * (f.sz_arg() - n_in))
    ress = ", ".join([f"r{i}" for i in range(n_out)] + ["0"] * (f.sz_res() - n_out))
    wrapper = f"""
static casadi_int casadi_call_iw[{max(f.sz_iw(), 1)}];
static casadi_real casadi_call_w[{max(f.sz_w(), 1)}];
{signature} {{
  const casadi_real* arg[{f.sz_arg()}] = {{{args}}};
  casadi_real* res[{f.sz_res()}] = {{{ress}}};
  return {f.name()}(arg, res, casadi_call_iw, casadi_call_w, 0);
}}
"""
    return signature + ";", gen.dump() + wrapper


def _build(workload, dtype, kind):
    """Symbolic build + codegen + C compile; the module and total seconds."""
    (cdef, source), seconds = timed(lambda: _c_source(_function(workload, kind), dtype))
    module = build_cffi(f"casadi_{workload.name}_{dtype}_{kind.__name__}", cdef, source)
    module.seconds += seconds
    return module


def setup(workload, dtype, inputs, params):
    if workloads.is_example(workload):
        raise Unsupported("not written for the example workloads (W5-W10B)")
    kind = ca.SX if workload.flops <= SX_MAX_FLOPS else ca.MX
    cold = _build(workload, dtype, kind)
    cached = _build(workload, dtype, kind)
    in_names = list(inputs) + list(params)
    shapes = workload.shapes()
    caller = CffiCall(cold, WRAPPER, dtype, in_names, {k: shapes[k] for k in params})
    note = f"casadi {kind.__name__}"
    if kind is ca.MX:
        note += f" (SX unrolled code infeasible at {workload.flops:.2g} flops/step)"
    return cffi_variants("casadi_c", caller, {**inputs, **params}, cold, cached, notes=[note])
