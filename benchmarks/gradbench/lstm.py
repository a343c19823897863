"""GradBench `lstm`: ADBench's LSTM objective (diagonal weights) over a text.

Definition (cpp/gradbench/evals/lstm.hpp): l layers of width b (the bits of a
character), c characters; per step t < c-1, with x = sequence[t] * in_weight and,
for each layer (hidden h, cell s), elementwise:
    forget = sigmoid(x Wf + bf), ingate = sigmoid(h Wi + bi), outgate = sigmoid(x Wo + bo),
    change = tanh(h Wc + bc), s = s forget + ingate change, h = outgate tanh(s), x = h;
    ypred = x out_weight + out_bias, lse = log(sum(exp(ypred)) + 2),
    total += sum(sequence[t+1] (ypred - lse)).
objective = -total / ((c-1) b); `jacobian` is its gradient with respect to
main_params (2l x 4b: per layer a row of weights [forget, ingate, outgate, change] and a
row of biases) and extra_params (3 x b: in_weight, out_weight, out_bias).
Data (evals/lstm/data/gen_data.py): the first c characters of Shakespeare's sonnets
(data/lstm_text.txt, as in ADBench's lstm_l*_c*.txt files), each character as the
b = 14 bits of its code point (most significant first); state, main_params and
extra_params are np.random.random draws (GradBench's files hold one unseeded draw;
the port draws them from np.random.RandomState(31337)). Published sizes: l in (2, 4),
c in (1024, 4096).

symbackprop: `scan` over the c-1 steps (state: h and s of every layer, input: the
rows t and t+1); JAX: `lax.scan`; PyTorch eager: a Python loop over the steps
(torch.compile is not run: dynamo would unroll thousands of steps). The derivative
reference is JAX's; the objective is also checked against a numpy loop, and the
gradient against finite differences at small sizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._common import Unsupported, jax_module, jax_value_grad_pair, torch_module, torch_value_grad_pair

NAME = "lstm"
PRIMAL, DERIVATIVE = "objective", "jacobian"
SIZES = [{"l": layers, "c": c} for layers in (2, 4) for c in (1024, 4096)]
DEFAULT = {"l": 4, "c": 4096}  # issue 15's table
SMALL = {"l": 2, "c": 1024}
SCALING = [{"l": 2, "c": c} for c in (256, 1024, 4096)]
PARAMS = ("main_params", "extra_params")
BITS = 14
TEXT = Path(__file__).with_name("data") / "lstm_text.txt"


def label(size: dict) -> str:
    return f"l={size['l']},c={size['c']}"


def work(size: dict) -> float:
    return float(size["l"] * size["c"])


def generate(size: dict) -> dict:
    layers, c = size["l"], size["c"]
    text = TEXT.read_text(encoding="utf8")[:c]
    if len(text) < c:
        raise ValueError(f"the text has {len(text)} characters; c={c} asked")
    seq = np.array([[int(bit) for bit in bin(ord(ch))[2:].zfill(BITS)] for ch in text], dtype=np.float64)
    rs = np.random.RandomState(31337)
    state = rs.random_sample((2 * layers, BITS))
    main = rs.random_sample((2 * layers, 4 * BITS))
    extra = rs.random_sample((3, BITS))
    return {"main_params": main, "extra_params": extra, "state": state, "sequence": seq}


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def objective(data: dict) -> float:
    main, extra, seq = data["main_params"], data["extra_params"], data["sequence"]
    layers, b = main.shape[0] // 2, seq.shape[1]
    hs = [data["state"][2 * i].copy() for i in range(layers)]
    cs = [data["state"][2 * i + 1].copy() for i in range(layers)]
    total = 0.0
    for t in range(len(seq) - 1):
        x = seq[t] * extra[0]
        for i in range(layers):
            w, bias = main[2 * i].reshape(4, b), main[2 * i + 1].reshape(4, b)
            forget = _sigmoid(x * w[0] + bias[0])
            ingate = _sigmoid(hs[i] * w[1] + bias[1])
            outgate = _sigmoid(x * w[2] + bias[2])
            change = np.tanh(hs[i] * w[3] + bias[3])
            cs[i] = cs[i] * forget + ingate * change
            hs[i] = outgate * np.tanh(cs[i])
            x = hs[i]
        ypred = x * extra[1] + extra[2]
        lse = np.log(np.exp(ypred).sum() + 2)
        total += float((seq[t + 1] * (ypred - lse)).sum())
    return -total / ((len(seq) - 1) * b)


def reference(data: dict) -> tuple[dict, dict | None]:
    return {"value": objective(data)}, None


def fd_error(data: dict, deriv: dict, eps: float = 1e-6) -> float:
    rng = np.random.default_rng(1)
    v = {p: rng.standard_normal(data[p].shape) for p in PARAMS}
    plus = objective({**data, **{p: data[p] + eps * v[p] for p in PARAMS}})
    minus = objective({**data, **{p: data[p] - eps * v[p] for p in PARAMS}})
    fd = (plus - minus) / (2 * eps)
    got = sum(float(np.sum(np.asarray(deriv[p]).reshape(v[p].shape) * v[p])) for p in PARAMS)
    return abs(got - fd) / max(abs(fd), 1e-300)


GATES = ("f", "i", "o", "c")  # forget, ingate, outgate, change: GradBench's order


def build_model(size: dict):
    import sympy as sp

    import symbackprop as sbp
    from symbackprop.declare import nn

    layers, b = size["l"], BITS
    T = sp.Symbol("T", integer=True, positive=True)
    X, Y = sp.MatrixSymbol("X", T, b), sp.MatrixSymbol("Y", T, b)  # rows t and t+1
    row = lambda name: sp.MatrixSymbol(name, 1, b)  # noqa: E731
    W = [[row(f"W{i}{g}") for g in GATES] for i in range(layers)]
    B = [[row(f"B{i}{g}") for g in GATES] for i in range(layers)]
    in_w, out_w, out_b = row("in_w"), row("out_w"), row("out_b")
    h0 = [row(f"h0_{i}") for i in range(layers)]
    s0 = [row(f"s0_{i}") for i in range(layers)]
    h = [row(f"h{i}") for i in range(layers)]
    s = [row(f"s{i}") for i in range(layers)]
    x, y = row("x"), row("y")
    # the step in rows (1 x b), as the JAX port writes it: elementwise
    # products and functions of rows, fused by the compiler into one loop
    mul = sp.HadamardProduct
    inp = mul(x, in_w)
    new_h, new_s = [], []
    for i in range(layers):
        wf, wi, wo, wc = W[i]
        bf, bi, bo, bc = B[i]
        forget = nn.sigmoid(mul(inp, wf) + bf)
        ingate = nn.sigmoid(mul(h[i], wi) + bi)
        outgate = nn.sigmoid(mul(inp, wo) + bo)
        change = nn.tanh(mul(h[i], wc) + bc)
        cell = mul(s[i], forget) + mul(ingate, change)
        new_s.append(cell)
        new_h.append(mul(outgate, nn.tanh(cell)))
        inp = new_h[-1]
    ypred = mul(inp, out_w) + out_b
    lse = sp.log(sbp.as_scalar(nn.sum_all(ypred.applyfunc(sp.exp))) + 2)  # as_scalar: m[0, 0] would write the sum out
    gain = nn.sum_all(mul(y, ypred - lse * nn.ones(1, b)))  # 1 x 1 a step
    states = tuple(v for pair in zip(h, s) for v in pair)
    steps = tuple(v for pair in zip(new_h, new_s) for v in pair)
    inits = tuple(v for pair in zip(h0, s0) for v in pair)
    gains = sbp.scan(steps, gain, states, (x, y), inits, (X, Y))  # T x 1
    loss = -nn.sum_all(gains) / (T * b)
    params = [v for i in range(layers) for v in (*W[i], *B[i])] + [in_w, out_w, out_b]
    return sbp.Model(f"gradbench_lstm_l{layers}", inputs=[X, Y, *h0, *s0], params=params, loss=loss)


SBP_FUNCTIONS = ("forward", "value_and_grad")


def _sbp_arrays(data: dict) -> dict:
    main, extra, state, seq = data["main_params"], data["extra_params"], data["state"], data["sequence"]
    layers, b = main.shape[0] // 2, BITS
    arrays = {"X": np.ascontiguousarray(seq[:-1]), "Y": np.ascontiguousarray(seq[1:]),
              "in_w": extra[0:1].copy(), "out_w": extra[1:2].copy(), "out_b": extra[2:3].copy()}
    for i in range(layers):
        arrays[f"h0_{i}"] = state[2 * i:2 * i + 1].copy()
        arrays[f"s0_{i}"] = state[2 * i + 1:2 * i + 2].copy()
        for k, g in enumerate(GATES):
            arrays[f"W{i}{g}"] = main[2 * i:2 * i + 1, k * b:(k + 1) * b].copy()
            arrays[f"B{i}{g}"] = main[2 * i + 1:2 * i + 2, k * b:(k + 1) * b].copy()
    return arrays


def sbp_calls(mod, data: dict):
    arrays = _sbp_arrays(data)
    layers = data["main_params"].shape[0] // 2

    def derivative():
        g = mod.value_and_grad(**arrays)[1]
        main = np.concatenate([np.concatenate([g[f"{m}{i}{gate}"] for gate in GATES], axis=1)
                               for i in range(layers) for m in ("W", "B")], axis=0)
        extra = np.concatenate([g["in_w"], g["out_w"], g["out_b"]], axis=0)
        return {"main_params": main, "extra_params": extra}

    return (lambda: {"value": mod.forward(**arrays)["loss"]}), derivative


def jax_calls(data: dict):
    jax = jax_module()
    import jax.numpy as jnp

    def loss(p, c):
        main, extra, seq, state = p["main_params"], p["extra_params"], c["sequence"], c["state"]
        layers, b = main.shape[0] // 2, seq.shape[1]
        w = main.reshape(layers, 2, 4, b)

        def step(carry, rows):
            hs, ss = carry
            xt, yt = rows
            x = xt * extra[0]
            new_h, new_s = [], []
            for i in range(layers):
                (wf, wi, wo, wc), (bf, bi, bo, bc) = w[i, 0], w[i, 1]
                forget = jax.nn.sigmoid(x * wf + bf)
                ingate = jax.nn.sigmoid(hs[i] * wi + bi)
                outgate = jax.nn.sigmoid(x * wo + bo)
                change = jnp.tanh(hs[i] * wc + bc)
                cell = ss[i] * forget + ingate * change
                x = outgate * jnp.tanh(cell)
                new_h.append(x)
                new_s.append(cell)
            ypred = x * extra[1] + extra[2]
            lse = jnp.log(jnp.sum(jnp.exp(ypred)) + 2)
            return (jnp.stack(new_h), jnp.stack(new_s)), jnp.sum(yt * (ypred - lse))

        _, gains = jax.lax.scan(step, (state[0::2], state[1::2]), (seq[:-1], seq[1:]))
        return -jnp.sum(gains) / ((seq.shape[0] - 1) * b)

    return jax_value_grad_pair(loss, {p: data[p] for p in PARAMS},
                               {"sequence": data["sequence"], "state": data["state"]})


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()
    if compiled:
        raise Unsupported("torch.compile would unroll the Python loop over thousands of steps")

    def loss(p, c):
        main, extra, seq, state = p["main_params"], p["extra_params"], c["sequence"], c["state"]
        layers, b = main.shape[0] // 2, seq.shape[1]
        w = main.reshape(layers, 2, 4, b)
        hs = [state[2 * i] for i in range(layers)]
        ss = [state[2 * i + 1] for i in range(layers)]
        total = 0.0
        for t in range(seq.shape[0] - 1):
            x = seq[t] * extra[0]
            for i in range(layers):
                (wf, wi, wo, wc), (bf, bi, bo, bc) = w[i, 0], w[i, 1]
                forget = torch.sigmoid(x * wf + bf)
                ingate = torch.sigmoid(hs[i] * wi + bi)
                outgate = torch.sigmoid(x * wo + bo)
                change = torch.tanh(hs[i] * wc + bc)
                ss[i] = ss[i] * forget + ingate * change
                hs[i] = outgate * torch.tanh(ss[i])
                x = hs[i]
            ypred = x * extra[1] + extra[2]
            lse = torch.log(torch.sum(torch.exp(ypred)) + 2)
            total = total + torch.sum(seq[t + 1] * (ypred - lse))
        return -total / ((seq.shape[0] - 1) * b)

    return torch_value_grad_pair(loss, {p: data[p] for p in PARAMS},
                                 {"sequence": data["sequence"], "state": data["state"]}, compiled)
