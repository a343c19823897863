"""Where a real-size step's time goes, symbackprop's beside its peers'
(`python benchmarks/real_sizes.py --breakdown --models gpt,mlp`).

For the decoder, the MNIST MLP and the ResNet, in one process pinned to
one CPU and interleaved as real_sizes.py's cells are, each peer's:

- whole training step and inference (real_sizes.py's calls);
- dense products: every gemm of the step (each linear layer's forward
  X W, its input gradient dY W^T where one is needed, its weight gradient
  X^T dY), timed shape by shape in the library each peer calls: the
  OpenBLAS symbackprop links (its cblas entry points through ctypes,
  one thread), torch.matmul (oneMKL), a jax.jit of the product (XLA);
- the ResNet's convolutions, each one's forward, weight gradient and
  input gradient as `real_sizes.py --layers` times them, beside
  PyTorch's F.conv2d (oneDNN in float32);
- the decoder's attention core, each block's causal attention of Q, K, V
  (m x d): symbackprop's ops as a model of their own (forward(), and
  value_and_grad by Q, K and V of sum(attention * G)), PyTorch's
  scaled_dot_product_attention (is_causal) and its backward, JAX's
  written-out attention (real_sizes.gpt_loss's) and its VJP;
- the rest, the step less its products and attention core: layer norms,
  activations, batch norms, the softmax cross-entropy, the skips and
  Adam's update.

Besides: the step's FLOPs in its products and attention (the whole
causal square, as the BLAS computes it, where a peer does), and the time
they would take at the BLAS's rate on one large product (1024^3, the
same library and dtype): a floor for any peer that calls a BLAS for them.
Instruction counts and memory traffic are not measured: `perf stat`
reports the hardware counters as not supported in this VM.
"""

from __future__ import annotations

import ctypes

import numpy as np
import sympy as sp

import symbackprop as sbp
from benchmarks import real_sizes as rs
from symbackprop import nn
from symbackprop.toolchain.blas import find_blas

ROWS = rs.GPT_BATCH * rs.GPT_LEN
# workload: [(m, k, n, layers, input gradient)]: each forward product m x k by k x n, how many
# layers have it, and whether the step computes the gradient by its left operand
PRODUCTS = {
    "gpt": [(ROWS, rs.GPT_D, 3 * rs.GPT_D, rs.GPT_BLOCKS, True), (ROWS, rs.GPT_D, rs.GPT_D, rs.GPT_BLOCKS, True),
            (ROWS, rs.GPT_D, 4 * rs.GPT_D, rs.GPT_BLOCKS, True), (ROWS, 4 * rs.GPT_D, rs.GPT_D, rs.GPT_BLOCKS, True),
            (ROWS, rs.GPT_D, rs.GPT_VOCAB, 1, True)],
    "mlp": [(rs.MLP_BATCH, *rs.MLP_SIZES[:2], 1, False), (rs.MLP_BATCH, *rs.MLP_SIZES[1:], 1, True)],
}


def gemms(workload: str, training: bool) -> list[tuple[str, int, int, int, bool, bool, int]]:
    """(what, rows, inner, columns, A transposed, B transposed, count) of each gemm of a step (or inference)."""
    out = []
    for m, k, n, count, input_grad in PRODUCTS[workload]:
        out.append((f"X W {m}x{k}x{n}", m, k, n, False, False, count))
        if training and input_grad:
            out.append((f"dY W^T {m}x{n}x{k}", m, n, k, False, True, count))
        if training:
            out.append((f"X^T dY {k}x{m}x{n}", k, m, n, True, False, count))
    return out


class Cblas:
    """gemm of the library symbackprop links (OpenBLAS, or oneMKL), called through ctypes."""

    def __init__(self, dtype: str, threads: int = 1):
        blas = find_blas()
        lib = ctypes.CDLL(str(blas.library))
        prefix = "scipy_" if blas.name == "openblas" else ""
        getattr(lib, blas.set_threads)(ctypes.c_int(threads))
        self.gemm = getattr(lib, f"{prefix}cblas_{'s' if dtype == 'float32' else 'd'}gemm")
        real, i, p = ctypes.c_float if dtype == "float32" else ctypes.c_double, ctypes.c_int, ctypes.c_void_p
        self.gemm.argtypes = [i, i, i, i, i, i, real, p, i, p, i, real, p, i]
        self.name = blas.name

    def call(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, ta: bool, tb: bool):
        """c = op(a) op(b), row-major (a call of no arguments)."""
        m, n = c.shape
        k = a.shape[0] if ta else a.shape[1]
        args = (101, 112 if ta else 111, 112 if tb else 111, m, n, k, 1, a.ctypes.data, a.shape[1],
                b.ctypes.data, b.shape[1], 0, c.ctypes.data, n)
        return lambda keep=(a, b, c): self.gemm(*args)  # keep: the arrays live as long as the call


def product_calls(gemm: tuple, dtype: str, cblas: Cblas, peers: list[str]) -> dict:
    """{peer: call} of one gemm shape in each peer's library."""
    _, m, k, n, ta, tb, _ = gemm
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
    c = np.empty((m, n), dtype=dtype)
    calls = {"symbackprop": cblas.call(a, b, c, ta, tb)}
    if "torch_eager" in peers:
        import torch

        ta_, tb_ = torch.from_numpy(a), torch.from_numpy(b)
        x, y = (ta_.T if ta else ta_), (tb_.T if tb else tb_)
        calls["torch_eager"] = lambda: torch.matmul(x, y)
    if "jax_jit" in peers:
        import jax
        import jax.numpy as jnp

        ja, jb = jnp.asarray(a), jnp.asarray(b)
        product = jax.jit(lambda a, b: (a.T if ta else a) @ (b.T if tb else b))
        calls["jax_jit"] = lambda: product(ja, jb).block_until_ready()
    return calls


def attention_calls(dtype: str, peers: list[str], training: bool) -> dict:
    """{peer: call} of one block's causal attention of Q, K, V (ROWS x d), with the gradients by all
    three of sum(attention * G) where `training`."""
    d, heads, length = rs.GPT_D, rs.GPT_HEADS, rs.GPT_LEN
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal((ROWS, d)).astype(dtype) for name in ("Q", "K", "V", "G")}
    m = sp.Symbol("m", integer=True, positive=True)
    q, k, v = (sbp.sequences(name, m, length, d) for name in "QKV")
    g = sp.MatrixSymbol("G", m, d)
    loss = nn.sum_all(sp.HadamardProduct(nn.causal_attention(q, k, v, heads).matrix, g))
    model = sbp.Model("attention_core", inputs=[q.matrix, k.matrix, v.matrix, g], params=[], loss=loss,
                      grad_inputs=[q.matrix, k.matrix, v.matrix])
    mod = sbp.compile(model, dtype=dtype)
    calls = {"symbackprop": mod.prepare("value_and_grad" if training else "forward", **arrays)}
    if "torch_eager" in peers:
        calls["torch_eager"] = _torch_attention(arrays, training)
    if "jax_jit" in peers:
        calls["jax_jit"] = _jax_attention(arrays, training)
    return calls


def _torch_attention(arrays: dict, training: bool):
    import torch
    import torch.nn.functional as F

    shape = (rs.GPT_BATCH, rs.GPT_LEN, rs.GPT_HEADS, rs.GPT_D // rs.GPT_HEADS)
    q, k, v, g = (torch.from_numpy(arrays[n]).reshape(shape).transpose(1, 2) for n in "QKVG")

    def call():
        if not training:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        (F.scaled_dot_product_attention(*leaves, is_causal=True) * g).sum().backward()
        return leaves

    return call


def _jax_attention(arrays: dict, training: bool):
    import jax
    import jax.numpy as jnp

    heads, dh, length = rs.GPT_HEADS, rs.GPT_D // rs.GPT_HEADS, rs.GPT_LEN
    causal = np.tril(np.ones((length, length), dtype=bool))

    def attention(q, k, v):  # real_sizes.gpt_loss's
        q, k, v = (z.reshape(-1, length, heads, dh) for z in (q, k, v))
        scores = jnp.einsum("nthk,nshk->nhts", q, k) / np.sqrt(dh)
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return jnp.einsum("nhts,nshk->nthk", weights, v).reshape(-1, heads * dh)

    q, k, v, g = (jnp.asarray(arrays[n]) for n in "QKVG")
    if not training:
        forward = jax.jit(attention)
        return lambda: forward(q, k, v).block_until_ready()
    grads = jax.jit(jax.value_and_grad(lambda q, k, v: (attention(q, k, v) * g).sum(), argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(grads(q, k, v))


def conv_part(dtype: str, peers: list[str], training: bool, timing: tuple, threads: int = 1) -> tuple[dict, list]:
    """({peer: seconds} of the ResNet's convolutions in a step (forward, weight gradient, and the input
    gradient but the stem's) or in inference, [each convolution's kernels' {conv, seconds, GFLOP/s}]):
    symbackprop's as real_sizes.py --layers times them (small models' differences, built as the
    whole model is for `threads`), PyTorch's F.conv2d."""
    rng = np.random.default_rng(0)
    batch, total, kernels = rs.RES_BATCH, {}, []
    for name, c_in, side, c_out, k, stride, pad in rs.resnet_convs():
        models = rs.layer_models(c_in, side, c_out, k, pad, stride)
        out_side = (side + 2 * pad - k) // stride + 1
        arrays = {"X": rng.random((batch, c_in * side * side)).astype(dtype),
                  "G": rng.standard_normal((batch, c_out * out_side ** 2)).astype(dtype),
                  "K": rng.standard_normal((c_out, c_in * k * k)).astype(dtype)}
        by_k, by_kx = (sbp.compile(models[m], dtype=dtype, options=rs.build_options(threads)) for m in ("by_k", "by_kx"))
        calls = {"symbackprop forward": by_k.prepare("forward", **arrays),
                 "symbackprop by_K": by_k.prepare("value_and_grad", **arrays),
                 "symbackprop by_K_X": by_kx.prepare("value_and_grad", **arrays)}
        if "torch_eager" in peers:
            import torch
            import torch.nn.functional as F

            x = torch.from_numpy(arrays["X"]).reshape(batch, c_in, side, side)
            g = torch.from_numpy(arrays["G"]).reshape(batch, c_out, out_side, out_side)
            w = torch.from_numpy(arrays["K"]).reshape(c_out, c_in, k, k)
            for label, wrt in (("forward", ()), ("by_K", ("w",)), ("by_K_X", ("w", "x"))):
                calls[f"torch_eager {label}"] = lambda a=(x, w, (F.conv2d, stride, pad, g)), wrt=wrt: \
                    rs.torch_conv(*a, wrt)
        medians = timed(calls, *timing)
        flops = 2 * batch * c_out * out_side ** 2 * c_in * k * k
        for peer in {label.split()[0] for label in calls}:
            fwd, wk, wkx = (medians[f"{peer} {label}"] for label in ("forward", "by_K", "by_K_X"))
            parts = {"forward": fwd, "weight grad": wk - fwd, "input grad": wkx - wk}
            kernels.append({"conv": name, "peer": peer, "seconds": parts,
                            "gflops": {what: round(flops / s / 1e9, 1) for what, s in parts.items()}})
            used = (wkx if name != "K0" else wk) if training else fwd
            total[peer] = total.get(peer, 0.0) + used
            print(f"  {name} {peer}: " + ", ".join(f"{what} {s * 1e3:.3f} ms {flops / s / 1e9:.1f} GFLOP/s"
                                                   for what, s in parts.items()), flush=True)
    return total, kernels


def conv_flops(training: bool) -> int:
    """The ResNet's convolutions' FLOPs in a step (three products each, two for the stem) or inference."""
    total = 0
    for name, c_in, side, c_out, k, stride, pad in rs.resnet_convs():
        out_side = (side + 2 * pad - k) // stride + 1
        times = (2 if name == "K0" else 3) if training else 1
        total += times * 2 * rs.RES_BATCH * c_out * out_side ** 2 * c_in * k * k
    return total


def attention_flops(training: bool) -> int:
    """The decoder's attention products' FLOPs in a step (or inference): 2 L^2 dh a head and
    sequence for the scores and the mix, four more in the gradients, the whole square."""
    per = 2 * rs.GPT_BATCH * rs.GPT_HEADS * rs.GPT_LEN ** 2 * (rs.GPT_D // rs.GPT_HEADS)
    return per * (6 if training else 2) * rs.GPT_BLOCKS


def blas_rate(dtype: str, cblas: Cblas, repeat: int = 10, clock: str = "cpu") -> float:
    """FLOP/s of the library's 1024 x 1024 by 1024 x 1024 product, the fastest of `repeat` (on the clock
    the parts are timed with: per CPU-second on "cpu", per second on "wall")."""
    side = 1024
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((side, side)).astype(dtype) for _ in range(2))
    call = cblas.call(a, b, np.empty((side, side), dtype=dtype), False, False)
    now, best = rs.CLOCKS[clock], float("inf")
    for _ in range(repeat):
        t0 = now()
        call()
        best = min(best, now() - t0)
    return 2 * side ** 3 / best


def timed(calls: dict, rounds: int, per_round: int, clock: str, settle: float = 0.0) -> dict:
    """{peer: median of round medians} of interleaved calls (real_sizes.interleave), each turn
    after `settle` seconds of sleep (on several threads: the last peer's pools stop spinning)."""
    return {peer: result[0] for peer, result in
            rs.interleave(calls, rounds, per_round, warmup=2, clock=clock, settle=settle).items()}


def products_part(workload: str, dtype: str, peers: list[str], training: bool, timing: tuple,
                  threads: int = 1) -> tuple[dict, list]:
    """({peer: seconds} of all the step's gemms, [each shape's {what, count, seconds, GFLOP/s}])."""
    cblas, kernels, total = Cblas(dtype, threads), [], dict.fromkeys(["symbackprop", *peers], 0.0)
    for gemm in gemms(workload, training):
        what, m, k, n, _, _, count = gemm
        seconds = timed(product_calls(gemm, dtype, cblas, peers), *timing)
        kernels.append({"gemm": what, "count": count, "seconds": seconds,
                        "gflops": {p: round(2 * m * k * n / s / 1e9, 1) for p, s in seconds.items()}})
        print(f"  {what:22} x{count}: " + ", ".join(f"{p} {s * 1e3:.3f} ms {2 * m * k * n / s / 1e9:.1f} GFLOP/s"
                                                   for p, s in seconds.items()), flush=True)
        for peer, s in seconds.items():
            total[peer] += count * s
    sbp.set_num_threads(threads)  # back to symbackprop's own setting (Cblas set the BLAS's)
    return total, kernels


def breakdown_rows(workload: str, dtype: str, peers: list[str], timing: tuple, notes: dict,
                   threads: int = 1) -> list[dict]:
    """The rows of one workload and dtype: for the training step and inference, the whole call, its
    products, its attention core (the decoder), the rest; the FLOPs at the BLAS's rate; the fastest peer's / 1.5.
    On `threads` threads: every peer's, the BLAS's and symbackprop's kernels built with OpenMP."""
    timing = (*timing[:3], 0.05 if threads > 1 else 0.0)  # as real_sizes.py's --settle
    step_calls, infer_calls = rs.functional_calls(workload, dtype, peers, notes, threads)
    rate = blas_rate(dtype, Cblas(dtype, threads), clock=timing[2])
    sbp.set_num_threads(threads)  # back to symbackprop's own setting (its OpenMP modules keep the BLAS at one)
    short = {"gpt": "decoder", "mlp": "MNIST MLP", "resnet": "ResNet"}[workload]
    rows = []
    for training, calls in ((True, step_calls), (False, infer_calls)):
        name = f"{short} {dtype}, {'training step' if training else 'inference'}{rs.thread_label(threads)}"
        print(f"{name}:", flush=True)
        whole = timed(calls, *timing)
        direct = [p for p in peers if p != "torch_compile"]
        if workload == "resnet":
            products, kernels = conv_part(dtype, direct, training, timing, threads)
            flops = conv_flops(training)
            what = f"convolutions ({flops / 1e9:.2f} GFLOP)"
        else:
            # on several threads, the products of symbackprop's BLAS alone: OpenBLAS's pool spins about
            # 0.1 s after a call, and PyTorch's products timed next in this process ran at 2-64 GFLOP/s
            products, kernels = products_part(workload, dtype, direct if threads == 1 else [], training, timing,
                                              threads)
            flops = sum(2 * m * k * n * count for _, m, k, n, _, _, count in gemms(workload, training))
            what = f"dense products ({sum(g[-1] for g in gemms(workload, training))} gemms, {flops / 1e9:.2f} GFLOP)"
        if "torch_eager" in products:  # Inductor calls aten's mm, conv
            products.setdefault("torch_compile", products["torch_eager"])
        parts = [(what, products, {"kernels": kernels})]
        if workload == "gpt":
            core = timed(attention_calls(dtype, direct, training), *timing)
            core = {p: s * rs.GPT_BLOCKS for p, s in core.items()}
            if "torch_eager" in core:  # the same SDPA kernel
                core.setdefault("torch_compile", core["torch_eager"])
            flops += attention_flops(training)
            parts.append((f"attention core ({rs.GPT_BLOCKS} blocks, {attention_flops(training) / 1e9:.2f} GFLOP)",
                          core, {}))
        rest = {p: s - sum(part[1][p] for part in parts) for p, s in whole.items() if all(p in part[1] for part in parts)}
        fastest = min(s for p, s in whole.items() if p != "symbackprop")
        rows += [{"label": f"{name}: the whole call", "seconds": whole},
                 *({"label": f"{name}: {what}", "seconds": {p: s for p, s in part.items() if p in whole}, **more}
                   for what, part, more in parts),
                 {"label": f"{name}: the rest (the whole less the above)", "seconds": rest},
                 {"label": f"{name}: its products' {flops / 1e9:.2f} GFLOP at the BLAS's {rate / 1e9:.0f} GFLOP/s "
                           "(1024^3 gemm)", "seconds": {"symbackprop": flops / rate}},
                 {"label": f"{name}: 1.5x the fastest peer (its time / 1.5)", "seconds": {"symbackprop": fastest / 1.5}}]
        for row in rows[-len(parts) - 4:]:
            print(f"  {row['label']}: " + ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in row["seconds"].items()),
                  flush=True)
    return rows


def save(name: str, models: list[str], rows: list[dict], argv: list[str], peers: list[str], notes: dict,
         threads: int = 1, clock: str = "cpu") -> None:
    """benchmarks/results/NAME.json of the breakdown rows."""
    from benchmarks import tables

    labels = {"symbackprop": "symbackprop", "torch_eager": "PyTorch eager", "torch_compile": "torch.compile",
              "jax_jit": "JAX jit"}
    note = ("Products: symbackprop's column is the BLAS it links (OpenBLAS) called through ctypes at each gemm "
            "shape of the step, PyTorch's torch.matmul (oneMKL), JAX's a jax.jit of the product; torch.compile's "
            "products and attention are PyTorch eager's (Inductor calls the same mm and SDPA kernels). The "
            "attention core: symbackprop's attention ops compiled alone, PyTorch's scaled_dot_product_attention "
            "(is_causal), JAX's written-out attention. Instruction counts and memory traffic: not measured, "
            "perf stat reports the hardware counters as not supported in this VM. A negative rest: that peer's "
            "parts timed alone took longer than inside its whole call (a jax.jit or PyTorch call's dispatch, paid "
            "per product here; torch.compile's convolutions with batch norm and relu fused and no per-op autograd).")
    for row in rows:
        row["note"] = note
    data = {"title": "Where the time of a real-size call goes: " + ", ".join(rs.WORKLOADS[m][0] for m in models),
            **tables.provenance(),
            "command": "python benchmarks/real_sizes.py " + " ".join(argv),
            "conditions": ("every peer in one process pinned to one CPU, one thread; " if threads == 1 else
                           f"every peer in one process pinned to {threads} CPUs, {threads} threads (the BLAS's "
                           f"too; symbackprop built with OpenMP); ")
                          + ("the process's CPU time; " if clock == "cpu" else "the wall clock; ")
                          + "rounds of calls of each peer in turn, each turn's first call untimed"
                          + (", after 50 ms of sleep (the last peer's pools stop spinning), " if threads > 1 else ", ")
                          + "median of the round medians; a part's time is its calls' medians times their count "
                          "in the call",
            "source": "benchmarks/real_sizes_breakdown.py (real_sizes.py --breakdown)",
            "row_header": "part of the call", "baseline": "symbackprop",
            "columns": [{"key": k, "label": labels[k], "ratio": k != "symbackprop"} for k in labels
                        if k == "symbackprop" or k in peers],
            "rows": rows}
    print(f"wrote {tables.save(name, data)}")
