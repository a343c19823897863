"""Recurrent helpers and the LSTM example: nn.lstm_cell and nn.gru_cell
against numpy and PyTorch's LSTMCell/GRUCell, finite differences of an
unrolled GRU, and the LSTM example trained with train_epoch."""

import time

import numpy as np
import pytest
import sympy as sp
from conftest import load_example
from oracles import central_differences, lstm_sequence_outputs, relative_error, sigmoid

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.run.optim import Adam


@pytest.fixture(scope="module")
def lstm():
    return load_example("lstm_sequence")


def test_an_unrolled_lstm_declares_quickly():
    """nn.shallow keeps SymPy from re-simplifying the shared state at every
    step (which took minutes for 8 steps)."""
    start = time.perf_counter()
    example = load_example("lstm_sequence")
    assert time.perf_counter() - start < 20
    assert example.STEPS == 8


def test_shallow_builds_what_the_helper_builds():
    n = sp.Symbol("n", integer=True, positive=True)
    X, W, b = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("W", 3, 2), sp.MatrixSymbol("b", 1, 2)
    deep = nn.tanh(X * W)
    assert nn.shallow(nn.linear, deep, sp.eye(2), b) != deep  # something was built
    assert nn.shallow(nn.linear, X, W, b) == nn.linear(X, W, b)  # leaves: no stand-ins
    built = nn.shallow(nn.mse, deep, sp.MatrixSymbol("T", n, 2))
    assert deep in set(sp.preorder_traversal(built))
    assert not any(isinstance(s, sp.Dummy) for s in built.free_symbols)


def test_lstm_matches_pytorch(lstm):
    torch = pytest.importorskip("torch")
    data = lstm.sample_data(np.random.default_rng(3), batch=6)
    mod = sbp.compile(lstm.model)
    out = mod.forward(**data)
    loss, grads = mod.value_and_grad(**data)
    hidden = lstm.HIDDEN
    cell = torch.nn.LSTMCell(1, hidden).double()
    with torch.no_grad():  # torch stacks the gates i, f, g, o, each (out, in)
        cell.weight_ih.copy_(torch.tensor(np.concatenate([data[f"W_{g}"].T for g in "ifgo"])))
        cell.weight_hh.copy_(torch.tensor(np.concatenate([data[f"U_{g}"].T for g in "ifgo"])))
        cell.bias_ih.copy_(torch.tensor(np.concatenate([data[f"b_{g}"][0] for g in "ifgo"])))
        cell.bias_hh.zero_()
    head = {k: torch.tensor(data[k], requires_grad=True) for k in ("V", "c0")}
    state = None
    for step in range(1, lstm.STEPS + 1):
        state = cell(torch.tensor(data[f"x{step}"]), state)
    logit = state[0] @ head["V"] + head["c0"]
    torch_loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, torch.tensor(data["y"]))
    torch_loss.backward()
    torch_grads = {k: v.grad.numpy() for k, v in head.items()}
    for k, g in enumerate("ifgo"):
        rows = slice(k * hidden, (k + 1) * hidden)
        torch_grads[f"W_{g}"] = cell.weight_ih.grad[rows].numpy().T
        torch_grads[f"U_{g}"] = cell.weight_hh.grad[rows].numpy().T
        torch_grads[f"b_{g}"] = cell.bias_ih.grad[rows].numpy()[None, :]
    np.testing.assert_allclose(out["logit"], logit.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert loss == pytest.approx(torch_loss.item(), rel=1e-12)
    assert set(grads) == set(torch_grads)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, torch_grads[name], rtol=1e-9, atol=1e-13, err_msg=name)
    np.testing.assert_allclose(out["logit"], lstm_sequence_outputs(data), rtol=1e-12, atol=1e-14)


# --- an unrolled GRU ----------------------------------------------------------

STEPS, FEATURES, HIDDEN = 3, 2, 4


def _gru_model():
    n = sp.Symbol("n", integer=True, positive=True)
    xs = [sp.MatrixSymbol(f"x{t}", n, FEATURES) for t in range(STEPS)]
    T = sp.MatrixSymbol("T", n, HIDDEN)
    W = [sp.MatrixSymbol(f"W_{g}", FEATURES, HIDDEN) for g in "rzn"]
    U = [sp.MatrixSymbol(f"U_{g}", HIDDEN, HIDDEN) for g in "rzn"]
    b = [sp.MatrixSymbol(f"b_{g}", 1, HIDDEN) for g in "rzn"]
    h = None
    for x in xs:
        h = nn.gru_cell(x, h, W, U, b)
    return sbp.Model("gru", inputs=[*xs, T], params=[*W, *U, *b], loss=nn.shallow(nn.mse, h, T), outputs={"h": h})


def _gru_data(rng, rows=5):
    data = {f"x{t}": rng.standard_normal((rows, FEATURES)) for t in range(STEPS)}
    data["T"] = rng.standard_normal((rows, HIDDEN))
    for g in "rzn":
        data[f"W_{g}"] = rng.uniform(-0.5, 0.5, (FEATURES, HIDDEN))
        data[f"U_{g}"] = rng.uniform(-0.5, 0.5, (HIDDEN, HIDDEN))
        data[f"b_{g}"] = rng.uniform(-0.5, 0.5, (1, HIDDEN))
    return data


def _gru_numpy(d):
    h = np.zeros_like(d["T"])
    for t in range(STEPS):
        x = d[f"x{t}"]
        r = sigmoid(x @ d["W_r"] + h @ d["U_r"] + d["b_r"])
        z = sigmoid(x @ d["W_z"] + h @ d["U_z"] + d["b_z"])
        m = np.tanh(x @ d["W_n"] + d["b_n"] + r * (h @ d["U_n"]))
        h = (1 - z) * m + z * h
    return h


def test_gru_matches_numpy_and_finite_differences():
    mod = sbp.compile(_gru_model())
    data = _gru_data(np.random.default_rng(0))
    loss_of = lambda d: float(np.mean((_gru_numpy(d) - d["T"]) ** 2))  # noqa: E731
    out = mod.forward(**data)
    np.testing.assert_allclose(out["h"], _gru_numpy(data), rtol=1e-12, atol=1e-14)
    loss, grads = mod.value_and_grad(**data)
    assert loss == pytest.approx(loss_of(data), rel=1e-12)
    for name, grad in grads.items():
        assert relative_error(grad, central_differences(loss_of, data, name)) < 1e-6, name


def test_gru_matches_pytorch():
    torch = pytest.importorskip("torch")
    data = _gru_data(np.random.default_rng(1))
    h = torch.zeros(5, HIDDEN, dtype=torch.float64)
    cell = torch.nn.GRUCell(FEATURES, HIDDEN).double()
    with torch.no_grad():  # torch's gates are stacked r, z, n as (out, in)
        cell.weight_ih.copy_(torch.tensor(np.concatenate([data[f"W_{g}"].T for g in "rzn"])))
        cell.weight_hh.copy_(torch.tensor(np.concatenate([data[f"U_{g}"].T for g in "rzn"])))
        cell.bias_ih.copy_(torch.tensor(np.concatenate([data[f"b_{g}"][0] for g in "rzn"])))
        cell.bias_hh.zero_()
        for t in range(STEPS):
            h = cell(torch.tensor(data[f"x{t}"]), h)
    np.testing.assert_allclose(sbp.compile(_gru_model()).forward(**data)["h"], h.numpy(), rtol=1e-12, atol=1e-14)


def test_cells_check_their_weights():
    n = sp.Symbol("n", integer=True, positive=True)
    x, h = sp.MatrixSymbol("x", n, 1), sp.MatrixSymbol("h", n, 2)
    W = [sp.MatrixSymbol(f"W{k}", 1, 2) for k in range(3)]
    with pytest.raises(sbp.ModelError, match="4 input weights"):
        nn.lstm_cell(x, None, None, W, W, W)
    with pytest.raises(sbp.ModelError, match="both states"):
        nn.lstm_cell(x, h, None, W + W[:1], W + W[:1], W + W[:1])


# --- the LSTM example, trained -------------------------------------------------


def test_the_lstm_example_learns_its_task(lstm):
    """Five epochs (one train_epoch call each) take it above 90% accuracy on
    held-out sequences, from 50% by chance; the epoch equals train_step calls."""
    rng = np.random.default_rng(0)
    train, test = lstm.make_task(rng, 1024), lstm.make_task(rng, 512)
    params = lstm.init_params(rng)
    mod = sbp.compile(lstm.model, optimizer=Adam(lr=1e-2))
    assert 0.3 < lstm.accuracy(mod, params, test) < 0.7
    check = sbp.compile(lstm.model, optimizer=Adam(lr=1e-2))
    copy = {k: v.copy() for k, v in params.items()}
    order = rng.permutation(1024)
    first = mod.train_epoch(100, order, **train, **params)  # 10 batches of 100 and one of 24
    steps = [check.train_step(**{k: v[order[s:s + 100]] for k, v in train.items()}, **copy)
             for s in range(0, 1024, 100)]
    np.testing.assert_array_equal(first, steps)
    for k in params:
        np.testing.assert_array_equal(params[k], copy[k])
    for _ in range(4):
        losses = mod.train_epoch(32, rng.permutation(1024), **train, **params)
    assert losses.mean() < 0.5 * first.mean()
    assert lstm.accuracy(mod, params, test) > 0.9
