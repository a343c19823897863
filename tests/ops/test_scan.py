"""symbackprop.scan: a recurrence declared in SymPy, run as a C loop over a
symbolic number of steps. Against the same model unrolled in SymPy, numpy,
finite differences and PyTorch; checkpointing; the C's size; training;
declaration errors."""

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, write_runtime_header
from oracles import central_differences, relative_error, sigmoid

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate
from symbackprop.run.optim import SGD, Adam
from symbackprop.toolchain.builder import DEFAULT_FLAGS, BuildOptions

T = sp.Symbol("T", integer=True, positive=True)

# --- a tiny tanh RNN, and the same model unrolled ------------------------------

H, D, STEPS = 3, 2, 5
W, Ux, b = sp.MatrixSymbol("W", H, H), sp.MatrixSymbol("Ux", D, H), sp.MatrixSymbol("b", 1, H)
Vo, h0 = sp.MatrixSymbol("Vo", H, 1), sp.MatrixSymbol("h0", 1, H)
h, x = sp.MatrixSymbol("h", 1, H), sp.MatrixSymbol("x", 1, D)


def rnn_step(state, row):
    return (state * W + row * Ux + b).applyfunc(sp.tanh)


def rnn_model(checkpoint_every=None, name="rnn"):
    X, Z = sp.MatrixSymbol("X", T, D), sp.MatrixSymbol("Z", T, 1)
    new = rnn_step(h, x)
    Y = sbp.scan(new, new * Vo, h, x, h0, X, checkpoint_every=checkpoint_every)  # T x 1
    E = Y - Z
    loss = sp.OneMatrix(1, T) * sp.HadamardProduct(E, E) + sbp.final_state(Y) * sp.OneMatrix(H, 1)
    return sbp.Model(name, inputs=[X, Z], params=[W, Ux, b, Vo, h0], loss=loss, outputs={"Y": Y})


def unrolled_model():
    xs = [sp.MatrixSymbol(f"x{t}", 1, D) for t in range(STEPS)]
    zs = [sp.MatrixSymbol(f"z{t}", 1, 1) for t in range(STEPS)]
    state, terms = h0, []
    for t in range(STEPS):
        state = nn.shallow(rnn_step, state, xs[t])
        terms.append(nn.shallow(lambda s, z: sp.HadamardPower(s * Vo - z, 2), state, zs[t]))
    terms.append(nn.shallow(lambda s: s * sp.OneMatrix(H, 1), state))
    loss = nn.shallow(lambda *parts: sp.MatAdd(*parts), *terms)
    return sbp.Model("rnn_unrolled", inputs=[*xs, *zs], params=[W, Ux, b, Vo, h0], loss=loss)


def rnn_numpy(d):
    state, loss = d["h0"], 0.0
    for t in range(d["X"].shape[0]):
        state = np.tanh(state @ d["W"] + d["X"][t:t + 1] @ d["Ux"] + d["b"])
        loss += float((state @ d["Vo"] - d["Z"][t])[0, 0] ** 2)
    return loss + float(state.sum())


def rnn_data(rng, steps=STEPS):
    return {
        "X": rng.standard_normal((steps, D)), "Z": rng.standard_normal((steps, 1)),
        "W": 0.6 * rng.standard_normal((H, H)), "Ux": rng.standard_normal((D, H)),
        "b": rng.standard_normal((1, H)), "Vo": rng.standard_normal((H, 1)), "h0": rng.standard_normal((1, H)),
    }


@pytest.fixture(scope="module")
def rnn():
    return sbp.compile(rnn_model())


def test_rnn_matches_the_unrolled_model(rnn):
    data = rnn_data(np.random.default_rng(0))
    unrolled = sbp.compile(unrolled_model())
    flat = {k: v for k, v in data.items() if k not in ("X", "Z")}
    flat.update({f"x{t}": data["X"][t:t + 1] for t in range(STEPS)})
    flat.update({f"z{t}": data["Z"][t:t + 1] for t in range(STEPS)})
    loss, grads = rnn.value_and_grad(**data)
    loss_u, grads_u = unrolled.value_and_grad(**flat)
    assert loss == pytest.approx(loss_u, rel=1e-12)
    assert loss == pytest.approx(rnn_numpy(data), rel=1e-12)
    for name in grads:
        np.testing.assert_allclose(grads[name], grads_u[name], rtol=1e-12, atol=1e-14, err_msg=name)
    assert rnn.forward(**data)["Y"].shape == (STEPS, 1)  # one row a step


@pytest.mark.parametrize("steps", [1, 5, 13])
def test_rnn_gradients_match_finite_differences(rnn, steps):
    data = rnn_data(np.random.default_rng(steps), steps)
    loss, grads = rnn.value_and_grad(**data)
    assert loss == pytest.approx(rnn_numpy(data), rel=1e-12)
    for name, grad in grads.items():
        assert relative_error(grad, central_differences(rnn_numpy, data, name)) < 1e-7, name


def test_gradient_of_the_sequence_and_a_vjp_of_the_outputs():
    data = rnn_data(np.random.default_rng(3), 6)
    model = rnn_model()
    mod = sbp.compile(sbp.Model("rnn_x", inputs=list(model.inputs), params=list(model.params), loss=model.loss,
                                outputs=model.outputs, grad_inputs=[model.inputs[0]]))
    _, grads = mod.value_and_grad(**data)
    assert relative_error(grads["X"], central_differences(rnn_numpy, data, "X")) < 1e-7
    seed = np.random.default_rng(4).standard_normal((6, 1))

    def seeded(d):
        return float((mod.forward(**d)["Y"] * seed).sum())

    by_vjp = mod.vjp("Y", seed, **data)
    for name in ("W", "h0", "X"):
        assert relative_error(by_vjp[name], central_differences(seeded, data, name)) < 1e-7, name


def test_jvp_is_a_scan_over_tangents_and_hvp_the_vjp_of_that_scan(rnn):
    rng = np.random.default_rng(5)
    data = rnn_data(rng, 7)
    tangents = {k: rng.standard_normal(v.shape) for k, v in data.items() if k not in ("X", "Z")}
    out = rnn.jvp(tangents, **data)
    eps = 1e-6
    plus = {**data, **{k: data[k] + eps * t for k, t in tangents.items()}}
    minus = {**data, **{k: data[k] - eps * t for k, t in tangents.items()}}
    assert out["loss"] == pytest.approx((rnn_numpy(plus) - rnn_numpy(minus)) / (2 * eps), rel=1e-7)
    fd_y = (rnn.forward(**plus)["Y"] - rnn.forward(**minus)["Y"]) / (2 * eps)
    assert relative_error(out["Y"], fd_y) < 1e-7
    hvp = rnn.hvp(tangents, **data)  # reverse over forward (tests/ops/test_scan_second_order.py: against JAX)
    grads_plus, grads_minus = rnn.value_and_grad(**plus)[1], rnn.value_and_grad(**minus)[1]
    for name, product in hvp.items():
        assert relative_error(product, (grads_plus[name] - grads_minus[name]) / (2 * eps)) < 1e-6, name


# --- the LSTM over thousands of steps ------------------------------------------

LH, LD, LO, LONG = 8, 4, 3, 2000
GATES = "ifgo"
LW = [sp.MatrixSymbol(f"W_{g}", LD, LH) for g in GATES]
LU = [sp.MatrixSymbol(f"U_{g}", LH, LH) for g in GATES]
LB = [sp.MatrixSymbol(f"b_{g}", 1, LH) for g in GATES]
LV = sp.MatrixSymbol("V", LH, LO)


def lstm_model(checkpoint_every=None):
    X, target = sp.MatrixSymbol("X", T, LD), sp.MatrixSymbol("target", T, LO)
    hh, cc, xx = sp.MatrixSymbol("h", 1, LH), sp.MatrixSymbol("c", 1, LH), sp.MatrixSymbol("x", 1, LD)
    h_next, c_next = nn.lstm_cell(xx, hh, cc, LW, LU, LB)
    zero = sp.ZeroMatrix(1, LH)
    logits = sbp.scan((h_next, c_next), h_next * LV, (hh, cc), xx, (zero, zero), X, checkpoint_every=checkpoint_every)
    name = "lstm_scan" if checkpoint_every is None else f"lstm_scan_{checkpoint_every}"
    return sbp.Model(name, inputs=[X, target], params=[*LW, *LU, *LB, LV],
                     loss=nn.softmax_cross_entropy(logits, target), outputs={"logits": logits})


def lstm_data(rng, steps=LONG):
    data = {"X": rng.standard_normal((steps, LD)), "target": np.eye(LO)[rng.integers(0, LO, steps)]}
    bound = 1 / np.sqrt(LH)
    for p in (*LW, *LU, *LB, LV):
        data[p.name] = rng.uniform(-bound, bound, p.shape)
    return data


def lstm_numpy(d):
    state = cell = np.zeros((1, LH))
    logits = []
    for t in range(d["X"].shape[0]):
        z = {g: d["X"][t:t + 1] @ d[f"W_{g}"] + state @ d[f"U_{g}"] + d[f"b_{g}"] for g in GATES}
        cell = sigmoid(z["f"]) * cell + sigmoid(z["i"]) * np.tanh(z["g"])
        state = sigmoid(z["o"]) * np.tanh(cell)
        logits.append(state @ d["V"])
    z = np.concatenate(logits)
    top = z.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    return float(np.mean(lse - (d["target"] * z).sum(axis=1)))


@pytest.fixture(scope="module")
def lstm(tmp_path_factory):
    start = time.perf_counter()
    # the cold compile is timed: at the production flags (a module fixture: the default_flags marker comes too late)
    options = BuildOptions(flags=DEFAULT_FLAGS, cache_dir=tmp_path_factory.mktemp("cold"))
    mod = sbp.compile(lstm_model(), options=options)
    seconds = time.perf_counter() - start
    return mod, seconds


def test_lstm_over_2000_steps_compiles_in_seconds(lstm, capsys):
    mod, seconds = lstm
    with capsys.disabled():
        print(f"\nLSTM (hidden {LH}, input {LD}) scan: cold compile {seconds:.2f} s, "
              f"{mod.source.count(chr(10))} lines of C ({len(mod.source)} bytes)")
    assert seconds < 60  # a sanity bound for slow machines: it takes a few seconds


def test_lstm_gradient_matches_finite_differences(lstm):
    mod, _ = lstm
    data = lstm_data(np.random.default_rng(7))
    loss, grads = mod.value_and_grad(**data)
    assert loss == pytest.approx(lstm_numpy(data), rel=1e-12)
    step = 1e-5
    for name, index in (("U_f", (2, 3)), ("W_i", (0, 1)), ("b_o", (0, 5)), ("U_g", (7, 0)), ("V", (7, 2))):
        values = []
        for sign in (1, -1):
            shifted = data[name].copy()
            shifted[index] += sign * step
            values.append(lstm_numpy({**data, name: shifted}))
        expected = (values[0] - values[1]) / (2 * step)
        assert grads[name][index] == pytest.approx(expected, rel=1e-5, abs=1e-10), name


def test_lstm_matches_pytorch(lstm):
    torch = pytest.importorskip("torch")
    mod, _ = lstm
    data = lstm_data(np.random.default_rng(8), 300)
    loss, grads = mod.value_and_grad(**data)
    cell = torch.nn.LSTMCell(LD, LH).double()
    with torch.no_grad():  # torch stacks the gates i, f, g, o, each (out, in)
        cell.weight_ih.copy_(torch.tensor(np.concatenate([data[f"W_{g}"].T for g in GATES])))
        cell.weight_hh.copy_(torch.tensor(np.concatenate([data[f"U_{g}"].T for g in GATES])))
        cell.bias_ih.copy_(torch.tensor(np.concatenate([data[f"b_{g}"][0] for g in GATES])))
        cell.bias_hh.zero_()
    V = torch.tensor(data["V"], requires_grad=True)
    X = torch.tensor(data["X"])
    state, outputs = None, []
    for t in range(X.shape[0]):
        state = cell(X[t:t + 1], state)
        outputs.append(state[0] @ V)
    logits = torch.cat(outputs)
    torch_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(data["target"].argmax(axis=1)))
    torch_loss.backward()
    assert loss == pytest.approx(torch_loss.item(), rel=1e-12)
    np.testing.assert_allclose(grads["V"], V.grad.numpy(), rtol=1e-9, atol=1e-13)
    for k, g in enumerate(GATES):
        rows = slice(k * LH, (k + 1) * LH)
        np.testing.assert_allclose(grads[f"W_{g}"], cell.weight_ih.grad[rows].numpy().T, rtol=1e-9, atol=1e-13)
        np.testing.assert_allclose(grads[f"U_{g}"], cell.weight_hh.grad[rows].numpy().T, rtol=1e-9, atol=1e-13)
        np.testing.assert_allclose(grads[f"b_{g}"][0], cell.bias_ih.grad[rows].numpy(), rtol=1e-9, atol=1e-13)


# --- checkpointing ----------------------------------------------------------------


@pytest.mark.parametrize("every", [7, 50])
def test_checkpointing_gives_the_same_gradients_in_less_memory(lstm, every):
    mod, _ = lstm
    data = lstm_data(np.random.default_rng(9), 523)  # segments of every steps, and a shorter last one
    loss, grads = mod.value_and_grad(**data)
    kept = sbp.compile(lstm_model(every))
    loss_k, grads_k = kept.value_and_grad(**data)
    assert loss_k == pytest.approx(loss, rel=1e-14)  # up to FMA contraction, as the gradients
    for name in grads:  # equal up to FMA contraction and libmvec (bit for bit without them: below)
        np.testing.assert_allclose(grads_k[name], grads[name], rtol=1e-12, atol=1e-16, err_msg=name)
    full, less = mod.memory(T=LONG), kept.memory(T=LONG)
    width, item = 2 * LH, 8
    saved = (LONG - -(-LONG // every)) * width * item  # states kept: T rows -> ceil(T/k) rows
    assert full["kept_for_backward"] - less["kept_for_backward"] == saved
    assert less["value_and_grad"] < full["value_and_grad"] - saved // 2
    assert less["prediction"] == full["prediction"]


def test_checkpointing_is_exact_without_contraction(tmp_path):
    options = BuildOptions(flags=("-O2", "-ffp-contract=off", "-std=c99"), vector_math=False, cache_dir=tmp_path)
    data = lstm_data(np.random.default_rng(10), 97)
    loss, grads = sbp.compile(lstm_model(), options=options).value_and_grad(**data)
    loss_k, grads_k = sbp.compile(lstm_model(8), options=options).value_and_grad(**data)
    assert loss_k == loss
    for name in grads:
        assert np.array_equal(grads_k[name], grads[name]), name


def test_the_reverse_step_reads_the_products_the_recompute_kept():
    source = generate(lstm_model(8))[0].source
    backward = source[source.index("backward scan over"):]
    for g in GATES:  # in the recompute loop of a segment, not again in the reverse step
        assert backward.count(f"= h @ U_{g} */") == 1, g
        assert f"grad_U_{g} += h^T @ " in backward, g  # added straight into the adjoint: no outer product
        assert f"grad_U_{g} = grad_U_{g} + " not in backward, g


def test_kept_memory_is_t_over_k_states():
    every, kept = sbp.compile(rnn_model()), sbp.compile(rnn_model(4))
    for steps in (400, 4001):
        saved = every.memory(T=steps)["kept_for_backward"] - kept.memory(T=steps)["kept_for_backward"]
        assert saved == (steps - -(-steps // 4)) * H * 8


# --- the generated C ------------------------------------------------------------


def fixed_length_model(steps):
    X = sp.MatrixSymbol("X", steps, D)
    new = rnn_step(h, x)
    Y = sbp.scan(new, new * Vo, h, x, h0, X)
    return sbp.Model("rnn_fixed", inputs=[X], params=[W, Ux, b, Vo, h0], loss=sp.OneMatrix(1, steps) * Y)


def test_the_c_does_not_grow_with_the_number_of_steps():
    symbolic = generate(rnn_model())[0].source
    ten, many = generate(fixed_length_model(10))[0].source, generate(fixed_length_model(100_000))[0].source
    def code(source: str) -> str:  # a comment wraps at 100 columns: a longer number may take a line more
        return re.sub(r"/\*.*?\*/", "", source, flags=re.S)

    assert len(code(ten).splitlines()) == len(code(many).splitlines())
    assert "for (int64_t" in symbolic and "tanh" in symbolic
    assert symbolic.count("tanh(") < 20  # the step once (forward, backward), not once a step


def test_the_c_compiles_without_warnings(tmp_path):
    # (not vjp: a vjp function leaves unread inputs unused, which -Wextra flags for any model)
    emitted, _ = generate(strided_model(), functions=("forward", "value_and_grad", "jvp"))
    source = tmp_path / f"{emitted.prefix}.c"
    source.write_text(emitted.source)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    result = subprocess.run(["cc", *STRICT_FLAGS, "-c", str(source), "-o", str(tmp_path / "m.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


# --- shapes: columns, matrices, scalars, strided views ------------------------------


def strided_model():
    """Column states, the sequence given transposed (rows gathered at each
    step), a matrix-shaped state started from a transposed matrix (copied),
    and a loss that reads the outputs transposed (the rows of their adjoint
    are strided: gathered at each step of the backward loop)."""
    XT, Zin = sp.MatrixSymbol("XT", D, T), sp.MatrixSymbol("Zin", T, 2)  # the sequence, one column a step
    A, M, V2 = sp.MatrixSymbol("A", H, H), sp.MatrixSymbol("M", 2, 3), sp.MatrixSymbol("V2", H, 2)
    s, m, xc = sp.MatrixSymbol("s", H, 1), sp.MatrixSymbol("m", 3, 2), sp.MatrixSymbol("xc", D, 1)
    s_next = (A * s + Ux.T * xc).applyfunc(sp.tanh)
    m_next = m * sp.Rational(1, 2) + M.T
    Y = sbp.scan((s_next, m_next), s_next.T * V2, (s, m), xc, (h0.T, M.T * 2), XT.T, checkpoint_every=3)
    final_s, final_m = sbp.final_state(Y)
    loss = (sp.OneMatrix(1, 2) * sp.HadamardPower(Y.T * Zin, 2) * sp.OneMatrix(2, 1)
            + sp.OneMatrix(1, 3) * final_m * sp.OneMatrix(2, 1) + final_s.T * final_s)
    return sbp.Model("strided", inputs=[XT, Zin], params=[A, Ux, V2, h0, M], loss=loss, outputs={"Y": Y})


def strided_numpy(d):
    s, m = d["h0"].T, 2 * d["M"].T
    ys = []
    for t in range(d["XT"].shape[1]):
        s = np.tanh(d["A"] @ s + d["Ux"].T @ d["XT"][:, t:t + 1])
        m = m / 2 + d["M"].T
        ys.append(s.T @ d["V2"])
    return float(((np.concatenate(ys).T @ d["Zin"]) ** 2).sum() + m.sum() + (s * s).sum())


def test_columns_matrices_and_strided_views():
    rng = np.random.default_rng(11)
    data = {"XT": rng.standard_normal((D, 8)), "Zin": rng.standard_normal((8, 2)), "A": 0.5 * rng.standard_normal((H, H)),
            "Ux": rng.standard_normal((D, H)), "V2": rng.standard_normal((H, 2)),
            "h0": rng.standard_normal((1, H)), "M": rng.standard_normal((2, 3))}
    mod = sbp.compile(strided_model())
    loss, grads = mod.value_and_grad(**data)
    assert loss == pytest.approx(strided_numpy(data), rel=1e-12)
    for name, grad in grads.items():
        assert relative_error(grad, central_differences(strided_numpy, data, name)) < 1e-7, name


@pytest.mark.parametrize("make", [strided_model, lambda: lstm_model(7)], ids=["strided", "lstm_checkpointed"])
def test_scans_are_clean_under_sanitizers(make, tmp_path):
    """Gathered rows, copied inits, strided adjoints and checkpoint segments
    (T = 1000: a shorter last segment) under AddressSanitizer and UBSan, as
    tests/compiled/test_memory_safety.py runs the examples."""
    import importlib
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiled"))  # a test module, not a package
    safety = importlib.import_module("test_memory_safety")
    if not safety._sanitizer_works(tmp_path):
        pytest.skip("no working -fsanitize=address,undefined runtime for cc")
    model = make()
    emitted, _ = generate(model)
    (tmp_path / f"{emitted.prefix}.c").write_text(emitted.source)
    (tmp_path / f"{emitted.prefix}.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    functions = safety.read_header(emitted.header)
    (tmp_path / "driver.c").write_text(safety.driver(f"{emitted.prefix}.h", functions))
    exe = tmp_path / "driver"
    subprocess.run(["cc", *safety.SANITIZE, f"-I{tmp_path}", str(tmp_path / f"{emitted.prefix}.c"),
                    str(tmp_path / "driver.c"), "-o", str(exe), "-lm"], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, env={**os.environ, **safety.SANITIZER_ENV},
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "runtime error" not in run.stderr and "Sanitizer" not in run.stderr, run.stderr[-4000:]
    safety._assert_matches_python(model, emitted, functions, safety.parse_output(run.stdout))


def test_a_scalar_recurrence_from_its_final_state():
    """An exponential moving average, used through its final value only."""
    a, s, xs, s0 = sp.symbols("a s xs s0")
    X = sp.MatrixSymbol("X", T, 1)
    final = sbp.scan(a * s + (1 - a) * xs, None, s, xs, s0, X)
    mod = sbp.compile(sbp.Model("ema", inputs=[X], params=[a, s0], loss=final[0, 0] ** 2, grad_inputs=[X]))
    values = np.random.default_rng(12).standard_normal((9, 1))

    def numpy_loss(d):
        v = d["s0"]
        for row in d["X"][:, 0]:
            v = d["a"] * v + (1 - d["a"]) * row
        return float(v) ** 2

    data = {"X": values, "a": 0.7, "s0": 0.3}
    loss, grads = mod.value_and_grad(**data)
    assert loss == pytest.approx(numpy_loss(data), rel=1e-12)
    for name in ("a", "s0", "X"):
        fd = central_differences(numpy_loss, {**data, "a": np.array(0.7), "s0": np.array(0.3)}, name)
        assert relative_error(grads[name], fd) < 1e-7, name


# --- training --------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [Adam(lr=3e-2), SGD(lr=2.0, momentum=0.9)])
def test_training_lowers_the_loss(optimizer):
    mod = sbp.compile(lstm_model(16), optimizer=optimizer)
    data = lstm_data(np.random.default_rng(13), 400)
    rng = np.random.default_rng(14)
    data["target"] = np.eye(LO)[(data["X"][:, :LO].argmax(axis=1) + rng.integers(0, 2, 400)) % LO]  # learnable
    params = {p.name: np.ascontiguousarray(data.pop(p.name)) for p in (*LW, *LU, *LB, LV)}
    first = mod.value_and_grad(**data, **params)[0]
    for _ in range(40):
        mod.train_step(**data, **params)
    assert mod.value_and_grad(**data, **params)[0] < 0.8 * first


def test_the_lm_example_trains():
    from conftest import load_example

    example = load_example("lstm_lm")
    mod = sbp.compile(example.model, optimizer=Adam(lr=1e-2))
    data = example.text_data(example.TEXT)
    params = example.init_params(np.random.default_rng(0))
    losses = [mod.train_step(**data, **params) for _ in range(30)]
    assert losses[-1] < 0.9 * losses[0]


# --- declarations -------------------------------------------------------------------------


def test_bad_declarations_are_model_errors():
    X = sp.MatrixSymbol("X", T, D)
    new = rnn_step(h, x)
    column = sp.MatrixSymbol("col", H, 1)
    with pytest.raises(sbp.ModelError, match=r"the state h has shape \(1, 3\) but its step_state has shape \(3, 1\)"):
        sbp.scan(new.T, None, h, x, h0, X)
    with pytest.raises(sbp.ModelError, match="its init has shape"):
        sbp.scan(new, None, h, x, sp.MatrixSymbol("h2", 1, H + 1), X)
    with pytest.raises(sbp.ModelError, match="stands for one row of the sequence X3 .*a vector of 3 entries"):
        sbp.scan(new, None, h, sp.MatrixSymbol("x", 1, D), h0, sp.MatrixSymbol("X3", T, 3))
    with pytest.raises(sbp.ModelError, match="2 states need as many step_state"):
        sbp.scan((new,), None, (h, column), x, h0, X)
    with pytest.raises(sbp.ModelError, match="checkpoint_every must be a positive integer"):
        sbp.scan(new, None, h, x, h0, X, checkpoint_every=0)
    with pytest.raises(sbp.ModelError, match="must be MatrixSymbols or Symbols"):
        sbp.scan(new, None, h * 2, x, h0, X)
    with pytest.raises(sbp.ModelError, match="final_state needs the result of symbackprop.scan"):
        sbp.final_state(h)


def test_undeclared_symbols_in_the_step_are_named():
    X = sp.MatrixSymbol("X", T, D)
    stray = sp.MatrixSymbol("stray", H, H)
    final = sbp.scan(rnn_step(h, x) * stray, None, h, x, h0, X)
    model = sbp.Model("bad", inputs=[X], params=[W, Ux, b, h0], loss=final * sp.OneMatrix(H, 1))
    with pytest.raises(sbp.ModelError, match=r"in the step of a scan .*stray is neither an input nor a param"):
        generate(model)


def test_a_state_cannot_also_be_a_param():
    X = sp.MatrixSymbol("X", T, D)
    final = sbp.scan(rnn_step(h, x), None, h, x, h0, X)
    model = sbp.Model("bad", inputs=[X], params=[W, Ux, b, h0, h], loss=final * sp.OneMatrix(H, 1))
    with pytest.raises(sbp.ModelError, match="cannot also be an input or param"):
        generate(model)


# --- random steps against a numpy loop and finite differences -----------------

ACTIVATIONS = {
    "tanh": (lambda m: m.applyfunc(sp.tanh), np.tanh),
    "sin": (lambda m: m.applyfunc(sp.sin), np.sin),
    "sigmoid": (nn.sigmoid, sigmoid),
    "softplus": (nn.softplus, lambda z: np.log1p(np.exp(z))),
    "identity": (lambda m: m, lambda z: z),
}


@pytest.mark.parametrize("seed", range(12))
def test_random_steps_match_a_numpy_loop_and_finite_differences(seed):
    """A step drawn at random (activations, a gate on the state, a residual
    term, checkpointing, the number of steps): the loss against a numpy loop
    of the same step, every gradient against central differences of it."""
    rng = np.random.default_rng(100 + seed)
    first, gate, out = (list(ACTIVATIONS)[k] for k in rng.integers(0, len(ACTIVATIONS), 3))
    gated, residual = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
    every = [None, 1, 2, 3][int(rng.integers(0, 4))]
    steps = int(rng.integers(1, 8))

    new = ACTIVATIONS[first][0](h * W + x * Ux + b)
    if gated:
        new = sp.HadamardProduct(new, ACTIVATIONS[gate][0](h))
    if residual:
        new = new + h
    X, Z = sp.MatrixSymbol("X", T, D), sp.MatrixSymbol("Z", T, 1)
    Y = sbp.scan(new, ACTIVATIONS[out][0](new) * Vo, h, x, h0, X, checkpoint_every=every)
    E = Y - Z
    loss = sp.OneMatrix(1, T) * sp.HadamardProduct(E, E) + sbp.final_state(Y) * sp.OneMatrix(H, 1)
    model = sbp.Model(f"random_step_{seed}", inputs=[X, Z], params=[W, Ux, b, Vo, h0], loss=loss)

    def reference(d):
        state, total = d["h0"], 0.0
        for t in range(d["X"].shape[0]):
            value = ACTIVATIONS[first][1](state @ d["W"] + d["X"][t:t + 1] @ d["Ux"] + d["b"])
            if gated:
                value = value * ACTIVATIONS[gate][1](state)
            state = value + state if residual else value
            total += float((ACTIVATIONS[out][1](state) @ d["Vo"] - d["Z"][t])[0, 0] ** 2)
        return total + float(state.sum())

    data = rnn_data(rng, steps)
    with np.errstate(all="ignore"):
        expected = reference(data)
    if not abs(expected) < 1e4:  # a gate of the state on itself can make the recurrence diverge
        pytest.skip(f"the drawn recurrence diverges (loss {expected:.3g}): finite differences cannot judge it")
    mod = sbp.compile(model)
    loss_value, grads = mod.value_and_grad(**data)
    assert loss_value == pytest.approx(expected, rel=1e-11)
    for name in ("W", "Ux", "b", "Vo", "h0"):
        assert relative_error(grads[name], central_differences(reference, data, name)) < 1e-6, (name, first, gate, out)
