"""An empty C function with one pointer per array, called through cffi.

It does no work, so its time is the floor of any cffi-called peer: binding
every array with ``ffi.from_buffer`` (and allocating the outputs) on each
call for the plain variant, the bare C call for the ``.prepared`` variant.
Its "gradients" are not computed, so it is not verified.
"""

from __future__ import annotations

import cffi

from .. import workloads
from ._common import C_TYPES, CffiCall, Unsupported, build_cffi, c_signature, cffi_variants

VERSION = cffi.__version__
FUNC = "bare_call"
VERIFY = False  # it computes nothing: timed, never checked


def setup(workload, dtype, inputs, params):
    if workloads.is_example(workload):
        raise Unsupported("the per-call floor is measured on the MLP workloads (W1-W4) only")
    shapes = workload.shapes()
    in_names = list(inputs) + list(params)
    signature = c_signature(FUNC, C_TYPES[dtype], len(in_names), 1 + len(params))
    module = build_cffi(f"bare_{workload.name}_{dtype}", signature + ";",
                        signature + " { return 0; }")
    caller = CffiCall(module, FUNC, dtype, in_names, {k: shapes[k] for k in params})
    arrays = {**inputs, **params}
    return cffi_variants("bare_cffi", caller, arrays, module)

