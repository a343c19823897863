"""Benchmark peers: one module per peer.

Every peer module imports what it needs at the top (an ImportError means
"not installed") and defines::

    def setup(workload, dtype, inputs, params) -> list[Variant]

raising ``Unsupported`` when it cannot run that workload/dtype.
"""

PEERS = (
    "numpy_ref",
    "bare_cffi",
    "symbackprop",
    "casadi_c",
    "torch_eager",
    "torch_compile",
    "jax_jit",
)
