"""JAX: jax.jit(jax.value_and_grad(loss)) on the CPU.

Compile time "cold" is lowering plus XLA compilation with an empty
persistent compilation cache; "cached" is the same after jax.clear_caches(),
served from that on-disk cache.
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)  # noqa: E402 (before any array exists)

import jax.numpy as jnp  # noqa: E402

from ._common import Ops, Variant, cache_root, mlp_loss, timed  # noqa: E402

VERSION = jax.__version__
OPS = Ops(
    activations={"sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "relu": jax.nn.relu},
    logsumexp_rows=lambda z: jax.nn.logsumexp(z, axis=1),
    sum_rows=lambda z: z.sum(axis=1),
)

jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _compile(workload, ji, jp):
    jax.clear_caches()
    f = jax.value_and_grad(lambda p, i: mlp_loss(workload, OPS, i, p))
    return timed(lambda: jax.jit(f).lower(jp, ji).compile())


def setup(workload, dtype, inputs, params):
    ji = {k: jnp.asarray(v) for k, v in inputs.items()}
    jp = {k: jnp.asarray(v) for k, v in params.items()}
    _, cold = _compile(workload, ji, jp)
    compiled, cached = _compile(workload, ji, jp)
    call = lambda: jax.block_until_ready(compiled(jp, ji))
    return [Variant("jax_jit", call, compile_cold_s=cold, compile_cached_s=cached)]
