"""scan(batch=B): each step reads the t-th B x D block of a time-major
(T*B) x D sequence and carries a B x H state. Checked against PyTorch
(nn.LSTM, a manual tanh RNN loop) and JAX (lax.scan over a (T, B, D)
array) in float64, and against the unbatched scan run once per sequence."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from oracles import relative_error

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.errors import ModelError

N, B = sp.symbols("N B", integer=True, positive=True)
D, H, OUT = 3, 4, 2
GATES = "ifgo"
SHAPES = [(1, 1), (1, 4), (3, 1), (5, 4), (2, 3)]  # (B, T): batch 1, odd B, T=1
RTOL = 1e-10


def lstm_model(name: str, every: int | None = None) -> sbp.Model:
    X, target = sp.MatrixSymbol("X", N, D), sp.MatrixSymbol("target", N, OUT)
    h0, c0 = sp.MatrixSymbol("h0", B, H), sp.MatrixSymbol("c0", B, H)
    W = [sp.MatrixSymbol(f"W_{g}", D, H) for g in GATES]
    U = [sp.MatrixSymbol(f"U_{g}", H, H) for g in GATES]
    b = [sp.MatrixSymbol(f"b_{g}", 1, H) for g in GATES]
    V = sp.MatrixSymbol("V", H, OUT)
    h, c, x = sp.MatrixSymbol("h", B, H), sp.MatrixSymbol("c", B, H), sp.MatrixSymbol("x", B, D)
    h_next, c_next = nn.lstm_cell(x, h, c, W, U, b)  # x: B x D, a matrix product per gate
    Y = sbp.scan((h_next, c_next), h_next * V, (h, c), x, (h0, c0), X, checkpoint_every=every, batch=B)
    loss = nn.sum_all((Y - target).applyfunc(lambda v: v**2))
    return sbp.Model(name, inputs=[X, target, h0, c0], params=[*W, *U, *b, V], loss=loss, outputs={"Y": Y},
                     grad_inputs=[X, h0, c0])


def lstm_data(rng: np.random.Generator, batch: int, steps: int) -> dict:
    data = {"X": rng.standard_normal((steps * batch, D)), "target": rng.standard_normal((steps * batch, OUT)),
            "h0": rng.standard_normal((batch, H)) * 0.5, "c0": rng.standard_normal((batch, H)) * 0.5,
            "V": rng.uniform(-0.5, 0.5, (H, OUT))}
    for g in GATES:
        data[f"W_{g}"] = rng.uniform(-0.5, 0.5, (D, H))
        data[f"U_{g}"] = rng.uniform(-0.5, 0.5, (H, H))
        data[f"b_{g}"] = rng.uniform(-0.5, 0.5, (1, H))
    return data


@pytest.fixture(scope="module")
def lstm():
    return sbp.compile(lstm_model("lstm_batched"))


def torch_lstm(data: dict, batch: int, steps: int) -> tuple[float, np.ndarray, dict]:
    """torch.nn.LSTM (gates i, f, g, o; one bias) over (T, B, D), float64."""
    torch = pytest.importorskip("torch")
    net = torch.nn.LSTM(D, H, dtype=torch.float64)
    with torch.no_grad():
        net.weight_ih_l0.copy_(torch.tensor(np.concatenate([data[f"W_{g}"].T for g in GATES])))
        net.weight_hh_l0.copy_(torch.tensor(np.concatenate([data[f"U_{g}"].T for g in GATES])))
        net.bias_ih_l0.copy_(torch.tensor(np.concatenate([data[f"b_{g}"][0] for g in GATES])))
        net.bias_hh_l0.zero_()
    t = {k: torch.tensor(data[k], requires_grad=True) for k in ("X", "h0", "c0", "V")}
    out, _ = net(t["X"].reshape(steps, batch, D), (t["h0"][None], t["c0"][None]))
    Y = out.reshape(steps * batch, H) @ t["V"]
    loss = ((Y - torch.tensor(data["target"])) ** 2).sum()
    loss.backward()
    grads = {k: t[k].grad.numpy() for k in t}
    w_ih, w_hh, b_ih = (p.grad.numpy() for p in (net.weight_ih_l0, net.weight_hh_l0, net.bias_ih_l0))
    for k, g in enumerate(GATES):
        rows = slice(k * H, (k + 1) * H)
        grads[f"W_{g}"], grads[f"U_{g}"], grads[f"b_{g}"] = w_ih[rows].T, w_hh[rows].T, b_ih[None, rows]
    return float(loss.detach()), Y.detach().numpy(), grads


def jax_lstm_loss(data: dict, batch: int, steps: int):
    """The same loss in JAX: lax.scan over a (T, B, D) array, float64."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy

    def loss(p):
        def step(carry, x):
            h, c = carry
            z = {g: x @ p[f"W_{g}"] + h @ p[f"U_{g}"] + p[f"b_{g}"] for g in GATES}
            c = jax.nn.sigmoid(z["f"]) * c + jax.nn.sigmoid(z["i"]) * jnp.tanh(z["g"])
            h = jax.nn.sigmoid(z["o"]) * jnp.tanh(c)
            return (h, c), h @ p["V"]

        _, ys = jax.lax.scan(step, (p["h0"], p["c0"]), p["X"].reshape(steps, batch, D))
        return jnp.sum((ys.reshape(steps * batch, OUT) - p["target"]) ** 2)

    return jax, loss


@pytest.mark.parametrize("batch,steps", SHAPES)
def test_batched_lstm_matches_torch(lstm, batch, steps):
    data = lstm_data(np.random.default_rng(batch * 10 + steps), batch, steps)
    loss, grads = lstm.value_and_grad(**data)
    want_loss, want_y, want = torch_lstm(data, batch, steps)
    assert loss == pytest.approx(want_loss, rel=RTOL)
    assert relative_error(lstm.forward(**data)["Y"], want_y) < RTOL
    assert set(grads) == set(want)
    for name, g in want.items():
        assert relative_error(grads[name], g) < RTOL, name


@pytest.mark.parametrize("batch,steps", SHAPES[:3] + [(5, 3)])
def test_batched_lstm_matches_jax_grad_and_jvp(lstm, batch, steps):
    rng = np.random.default_rng(100 + batch * 10 + steps)
    data = lstm_data(rng, batch, steps)
    jax, loss_fn = jax_lstm_loss(data, batch, steps)
    want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(data)
    loss, grads = lstm.value_and_grad(**data)
    assert loss == pytest.approx(float(want_loss), rel=RTOL)
    for name, g in grads.items():
        assert relative_error(g, np.asarray(want[name])) < RTOL, name
    tangents = {k: rng.standard_normal(v.shape) for k, v in data.items() if k not in ("X", "target", "h0", "c0")}
    _, dloss = jax.jit(lambda p, t: jax.jvp(loss_fn, (p,), (t,)))(
        data, {k: tangents.get(k, np.zeros_like(v)) for k, v in data.items()})
    assert lstm.jvp(tangents, **data)["loss"] == pytest.approx(float(dloss), rel=RTOL)


def test_checkpointed_batched_lstm_has_the_same_gradients(lstm):
    kept = sbp.compile(lstm_model("lstm_batched_k", every=2))
    data = lstm_data(np.random.default_rng(7), 3, 5)
    loss, grads = lstm.value_and_grad(**data)
    loss_k, grads_k = kept.value_and_grad(**data)
    assert loss_k == pytest.approx(loss, rel=1e-13)
    for name, g in grads.items():
        assert relative_error(grads_k[name], g) < 1e-12, name


def rnn_model(name: str, batch: sp.Expr) -> sbp.Model:
    """A tanh RNN, h' = tanh(x W + h U + b), output h' v."""
    rows = N if batch != 1 else sp.Symbol("T", integer=True, positive=True)
    X, h0 = sp.MatrixSymbol("X", rows, D), sp.MatrixSymbol("h0", batch, H)
    W, U = sp.MatrixSymbol("W", D, H), sp.MatrixSymbol("U", H, H)
    b, v = sp.MatrixSymbol("b", 1, H), sp.MatrixSymbol("v", H, 1)
    h, x = sp.MatrixSymbol("h", batch, H), sp.MatrixSymbol("x", batch, D)
    h_next = (x * W + h * U + sp.OneMatrix(batch, 1) * b).applyfunc(sp.tanh)
    Y = sbp.scan(h_next, h_next * v, h, x, h0, X, batch=batch)
    loss = nn.sum_all(Y.applyfunc(lambda y: sp.sin(y) + y**2))
    return sbp.Model(name, inputs=[X, h0], params=[W, U, b, v], loss=loss, outputs={"Y": Y}, grad_inputs=[X, h0])


def rnn_data(rng: np.random.Generator, batch: int, steps: int) -> dict:
    return {"X": rng.standard_normal((steps * batch, D)), "h0": rng.standard_normal((batch, H)),
            "W": rng.uniform(-0.6, 0.6, (D, H)), "U": rng.uniform(-0.6, 0.6, (H, H)),
            "b": rng.uniform(-0.6, 0.6, (1, H)), "v": rng.uniform(-0.6, 0.6, (H, 1))}


@pytest.fixture(scope="module")
def rnn_batched():
    return sbp.compile(rnn_model("rnn_batched", B))


def test_batched_rnn_is_the_unbatched_scan_once_per_sequence(rnn_batched):
    batched, single = rnn_batched, sbp.compile(rnn_model("rnn_single", sp.Integer(1)))
    rng = np.random.default_rng(11)
    batch, steps = 5, 6
    data = rnn_data(rng, batch, steps)
    loss, grads = batched.value_and_grad(**data)
    Y = batched.forward(**data)["Y"]
    total, summed = 0.0, {k: np.zeros_like(data[k]) for k in ("W", "U", "b", "v")}
    for s in range(batch):  # sequence s is rows s, s + B, s + 2B, ...
        one = {**data, "X": np.ascontiguousarray(data["X"][s::batch]), "h0": data["h0"][s:s + 1]}
        value, g = single.value_and_grad(**one)
        total += value
        assert relative_error(Y[s::batch], single.forward(**one)["Y"]) < RTOL
        assert relative_error(grads["X"][s::batch], g["X"]) < RTOL
        assert relative_error(grads["h0"][s:s + 1], g["h0"]) < RTOL
        for k in summed:
            summed[k] += g[k]
    assert loss == pytest.approx(total, rel=RTOL)
    for k, g in summed.items():
        assert relative_error(grads[k], g) < RTOL, k


def test_batched_scan_declaration_errors():
    X, h = sp.MatrixSymbol("X", N, D), sp.MatrixSymbol("h", B, H)
    W = sp.MatrixSymbol("W", D, H)
    with pytest.raises(ModelError, match="must be B x 3"):
        sbp.scan(h, None, h, sp.MatrixSymbol("x", 1, D), sp.ZeroMatrix(B, H), X, batch=B)
    x = sp.MatrixSymbol("x", B, D)
    with pytest.raises(ModelError, match="batch must be a positive integer"):
        sbp.scan(h, None, h, x, sp.ZeroMatrix(B, H), X, batch=0)
    with pytest.raises(ModelError, match="a step output has B rows"):
        sbp.scan(x * W, (x * W).T, h, x, sp.ZeroMatrix(B, H), X, batch=B)
    Y = sbp.scan(h + x * W, h + x * W, h, x, sp.ZeroMatrix(B, H), X, batch=B)
    with pytest.raises(ModelError, match="batch=B is not a dimension of any input or param"):
        sbp.compile(sbp.Model("batch_unbound", inputs=[X], params=[W], loss=nn.sum_all(Y)))


def test_example_trains_on_minibatches_as_torch_does():
    """examples/lstm_lm_batched.py: train_epoch over time-major minibatches
    gives PyTorch nn.LSTM's loss curve (same init, order and Adam)."""
    pytest.importorskip("torch")
    example = load_example("lstm_lm_batched")
    rng = np.random.default_rng(0)
    wins = example.windows(example.TEXT * 2)
    start = example.init_params(rng, 8)
    orders = [rng.permutation(len(wins)) for _ in range(2)]
    params = {k: v.copy() for k, v in start.items()}
    _, curves, _ = example.train_symbackprop(params, wins, orders, 8, 1e-2)
    torch_curves, _ = example.train_torch(start, wins, orders, 8, 1e-2)
    assert curves.shape == torch_curves.shape == (2, len(wins) // example.BATCH)
    assert relative_error(curves, torch_curves) < 1e-10


def test_batched_rnn_hvp_matches_jax(rnn_batched):
    """Second order through a batched scan: the hvp (reverse over forward)
    against jax.jvp(jax.grad) over a (T, B, D) array (the LSTM's, slow, below)."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    rng = np.random.default_rng(22)
    batch, steps = 3, 4
    data = rnn_data(rng, batch, steps)

    def loss_fn(p):
        def step(h, x):
            h = jnp.tanh(x @ p["W"] + h @ p["U"] + p["b"])
            return h, h @ p["v"]

        _, ys = jax.lax.scan(step, p["h0"], p["X"].reshape(steps, batch, D))
        return jnp.sum(jnp.sin(ys) + ys**2)

    direction = {k: rng.standard_normal(v.shape) for k, v in data.items() if k not in ("X", "h0")}
    zeros = {k: direction.get(k, np.zeros_like(v)) for k, v in data.items()}
    _, want = jax.jit(lambda p, t: jax.jvp(jax.grad(loss_fn), (p,), (t,)))(data, zeros)
    products = rnn_batched.hvp(direction, **data)
    assert set(products) == set(want)
    for name, product in products.items():
        assert relative_error(product, np.asarray(want[name])) < RTOL, name


@pytest.mark.slow
def test_batched_lstm_hvp_matches_jax(lstm):
    """The same with the LSTM's two states (compiling its hvp takes the
    longest of this file)."""
    rng = np.random.default_rng(21)
    batch, steps = 3, 4
    data = lstm_data(rng, batch, steps)
    jax, loss_fn = jax_lstm_loss(data, batch, steps)
    direction = {k: rng.standard_normal(v.shape) for k, v in data.items() if k not in ("X", "target", "h0", "c0")}
    zeros = {k: direction.get(k, np.zeros_like(v)) for k, v in data.items()}
    _, want = jax.jvp(jax.grad(loss_fn), (data,), (zeros,))
    products = lstm.hvp(direction, **data)
    for name, product in products.items():
        assert relative_error(product, np.asarray(want[name])) < RTOL, name


def test_rows_that_are_not_whole_steps_are_refused_and_nothing_is_written():
    """T = rows / B: rows that are not a multiple of B would leave the last
    rows unread; the C returns status 5 before writing, the call raises."""
    N_, B_ = sp.symbols("N B", integer=True, positive=True)
    X_, h0_ = sp.MatrixSymbol("X", N_, 2), sp.MatrixSymbol("h0", B_, 3)
    W_, U_ = sp.MatrixSymbol("W", 2, 3), sp.MatrixSymbol("U", 3, 3)
    h_, x_ = sp.MatrixSymbol("h", B_, 3), sp.MatrixSymbol("x", B_, 2)
    step = (x_ * W_ + h_ * U_).applyfunc(sp.tanh)
    Y_ = sbp.scan(step, step, h_, x_, h0_, X_, batch=B_)
    mod = sbp.compile(sbp.Model("bscan_whole", inputs=[X_, h0_], params=[W_, U_], loss=nn.sum_all(Y_), outputs={"Y": Y_}))
    rng = np.random.default_rng(0)
    d = {"W": rng.standard_normal((2, 3)), "U": 0.3 * rng.standard_normal((3, 3)), "h0": np.zeros((2, 3))}
    assert mod.forward(X=rng.standard_normal((6, 2)), **d)["Y"].shape == (6, 3)
    for call in (mod.forward, mod.value_and_grad):
        with pytest.raises(sbp.ArgumentError, match="status 5: a batched scan's rows are not a multiple of its batch"):
            call(X=rng.standard_normal((5, 2)), **d)
    assert "% (B) != 0" in mod.source
