"""An unrolled recurrence compiles as one scan (loops/unrolled.py): a GRU,
an LSTM or a hand-written tanh RNN written out step by step in a Python
loop lowers to one "scan" node whose size does not grow with the steps,
and its loss and every gradient (params and, as grad inputs, each step's
input) are PyTorch's (float64 autograd of the same equations). Steps that
differ (a weight per step) stay unrolled, and a step that reads the state
of two steps before still gets exact gradients."""

import numpy as np
import pytest
import sympy as sp

import symbackprop as sbp
from symbackprop import nn
from symbackprop.ir.node import topological_order
from symbackprop.loops import unrolled
from symbackprop.pipeline import generate, plan

torch = pytest.importorskip("torch")

DEFAULT_MIN_STEPS = unrolled.MIN_STEPS


@pytest.fixture(autouse=True)
def short_runs(monkeypatch):
    """Runs of 4 steps or more become scans, so that the tests compile
    small models in seconds (by default only runs long enough that the
    loop costs less to compile than the steps do)."""
    monkeypatch.setattr(unrolled, "MIN_STEPS", 4)

ROWS, FEATURES, HIDDEN = 3, 4, 5
GATES = {"gru": "rzh", "lstm": "ifgo"}


def gate_params(kind: str) -> tuple[list, list, list]:
    return tuple([sp.MatrixSymbol(f"{k}{g}", *shape) for g in GATES[kind]]  # type: ignore[return-value]
                 for k, shape in (("W", (FEATURES, HIDDEN)), ("U", (HIDDEN, HIDDEN)), ("b", (1, HIDDEN))))


def step_inputs(steps: int, rows=ROWS) -> list[sp.MatrixSymbol]:
    return [sp.MatrixSymbol(f"x{t}", rows, FEATURES) for t in range(steps)]


def gated(kind: str, steps: int, rows=ROWS, sliced: bool = False, every: bool = False) -> sbp.Model:
    """nn.gru_cell or nn.lstm_cell over `steps` inputs (each x_t, or row
    block t of one input X), then the MSE of the last state (with `every`,
    the sum of every state's)."""
    W, U, b = gate_params(kind)
    target = sp.MatrixSymbol("target", rows, HIDDEN)
    if sliced:
        X = sp.MatrixSymbol("X", steps * rows, FEATURES)
        xs, inputs = [X[t * rows:(t + 1) * rows, :] for t in range(steps)], [X]
    else:
        xs = inputs = step_inputs(steps, rows)
    h = c = None
    losses = []
    for x in xs:
        h, c = nn.lstm_cell(x, h, c, W, U, b) if kind == "lstm" else (nn.gru_cell(x, h, W, U, b), None)
        losses.append(nn.mse(h, target))
    name = f"unrolled_{kind}{steps}{'_sliced' if sliced else ''}{'_every' if every else ''}"
    return sbp.Model(name, inputs=[*inputs, target], params=[*W, *U, *b], loss=sp.Add(*losses) if every else losses[-1],
                     grad_inputs=inputs)


def tanh_rnn(steps: int, skip: bool = False, per_step_weights: bool = False, odd: int | None = None) -> sbp.Model:
    """H = tanh(X_t W + H U + B) from H0, by hand (with `skip`, + H_{t-2} V;
    step `odd` a sigmoid in place of the tanh)."""
    H0, B = sp.MatrixSymbol("H0", ROWS, HIDDEN), sp.MatrixSymbol("B", ROWS, HIDDEN)
    W, V = sp.MatrixSymbol("W", FEATURES, HIDDEN), sp.MatrixSymbol("V", HIDDEN, HIDDEN)
    Us = [sp.MatrixSymbol(f"U{t}" if per_step_weights else "U", HIDDEN, HIDDEN) for t in range(steps)]
    xs = step_inputs(steps)
    states = [H0, H0]
    for x, U in zip(xs, Us):
        pre = x * W + states[-1] * U + B
        pre = pre + states[-2] * V if skip else pre
        states.append(nn.sigmoid(pre) if len(states) - 2 == odd else nn.tanh(pre))
    params = [W, *dict.fromkeys(Us), B] + ([V] if skip else [])
    target = sp.MatrixSymbol("target", ROWS, HIDDEN)
    name = f"unrolled_rnn{steps}{'_skip' if skip else ''}{'_weights' if per_step_weights else ''}"
    name += f"_odd{odd}" if odd is not None else ""
    return sbp.Model(name, inputs=[*xs, H0, target], params=params, loss=nn.mse(states[-1], target),
                     grad_inputs=[*xs, H0])


def torch_loss(model: sbp.Model, t: dict):
    """The model's loss in PyTorch, from its own declaration's equations."""
    sig, tanh = torch.sigmoid, torch.tanh
    name, target = model.name, t["target"]
    xs = [t[k] for k in sorted((k for k in t if k[0] == "x" and k[1:].isdigit()), key=lambda k: int(k[1:]))]
    if "_sliced" in name:
        xs = list(torch.split(t["X"], target.shape[0]))
    if name.startswith("unrolled_rnn"):
        h2 = h = t["H0"]
        for k, x in enumerate(xs):
            U = t[f"U{k}"] if "_weights" in name else t["U"]
            pre = x @ t["W"] + h @ U + t["B"] + (h2 @ t["V"] if "_skip" in name else 0)
            new = sig(pre) if name.endswith(f"_odd{k}") else tanh(pre)
            h2, h = h, new
        return ((h - target) ** 2).mean()
    h = c = None
    total = 0
    for x in xs:
        z = {g: x @ t[f"W{g}"] + t[f"b{g}"] + (0 if h is None else h @ t[f"U{g}"]) for g in "rzhifgo" if f"W{g}" in t}
        if "lstm" in name:
            c_new = sig(z["i"]) * tanh(z["g"]) + (0 if c is None else sig(z["f"]) * c)
            h, c = sig(z["o"]) * tanh(c_new), c_new
        elif h is None:
            h = (1 - sig(z["z"])) * tanh(z["h"])
        else:
            m = tanh(x @ t["Wh"] + t["bh"] + sig(z["r"]) * (h @ t["Uh"]))
            h = (1 - sig(z["z"])) * m + sig(z["z"]) * h
        total = total + ((h - target) ** 2).mean()
    return total if "_every" in name else ((h - target) ** 2).mean()


def arrays_for(model: sbp.Model, seed: int = 0, rows: int = ROWS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {str(s): 0.5 * rng.standard_normal(tuple(rows if isinstance(d, sp.Symbol) else int(d) for d in s.shape))
            for s in [*model.inputs, *model.params]}


def check_against_torch(model: sbp.Model, rows: int = ROWS) -> None:
    arrays = arrays_for(model, rows=rows)
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arrays.items()}
    expected = torch_loss(model, tensors)
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-10, atol=1e-12)
    assert set(grads) == {str(s) for s in [*model.params, *model.grad_inputs]}
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, tensors[name].grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def loop_ops(model: sbp.Model) -> tuple[int, dict[str, int]]:
    """The scans of the lowered model, and its other nodes by op (leaves and
    the copies of the step inputs into the sequence aside)."""
    lowered = plan(model, ("forward",)).lowered
    ops = [n.op for n in topological_order([lowered.loss])]
    counted = {op: ops.count(op) for op in set(ops) if op not in ("leaf", "reshape", "slice_scatter", "slice")}
    return counted.pop("scan", 0), counted


@pytest.mark.parametrize("build", [lambda s: gated("gru", s), lambda s: gated("lstm", s), tanh_rnn,
                                   lambda s: gated("gru", s, sliced=True)], ids=["gru", "lstm", "rnn", "gru_sliced"])
def test_an_unrolled_recurrence_lowers_to_one_scan_of_the_same_size(build):
    short, long = loop_ops(build(6)), loop_ops(build(12))
    assert short[0] == 1 and long[0] == 1
    assert short[1] == long[1]  # 12 steps: no more nodes than 6


@pytest.mark.parametrize("model", [gated("gru", 8), gated("lstm", 7), tanh_rnn(9), gated("gru", 6, sliced=True),
                                   gated("lstm", 5, sliced=True)], ids=lambda m: m.name)
def test_the_scan_computes_the_loss_and_every_gradient_of_the_unrolled_steps(model):
    assert loop_ops(model)[0] == 1
    check_against_torch(model)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_a_loss_over_every_state_reads_them_from_the_scan(kind):
    """What the loss reads of each step is a row of a scan's output, not a
    step computed again unrolled beside it: no more products at 14 steps
    than at 8 (the loss's own terms, one a step, remain). (The GRU's loss
    reads its states through a second chain of the same values, nn.mse's
    fused form of h: a second scan.)"""
    short, long = loop_ops(gated(kind, 8, every=True)), loop_ops(gated(kind, 14, every=True))
    assert short[0] == long[0] >= 1
    assert short[1]["matmul"] == long[1]["matmul"]
    check_against_torch(gated(kind, 7, every=True))


def test_a_weight_per_step_is_no_scan_and_computes_the_same():
    model = tanh_rnn(8, per_step_weights=True)
    assert loop_ops(model)[0] == 0
    check_against_torch(model)


def test_a_step_of_another_form_splits_the_run():
    """Step 6 of 13 is a sigmoid: the 6 tanh steps after it are one scan,
    the 6 before it another (or unrolled), and the values are exact."""
    model = tanh_rnn(13, odd=6)
    assert loop_ops(model)[0] >= 1
    check_against_torch(model)


def test_a_step_that_reads_the_state_two_steps_back_has_exact_gradients():
    model = tanh_rnn(10, skip=True)
    check_against_torch(model)


def test_a_batch_bound_at_call_time():
    n = sp.Symbol("n", integer=True, positive=True)
    model = gated("gru", 7, rows=n)
    assert loop_ops(model)[0] == 1
    for rows in (1, 4):
        check_against_torch(model, rows=rows)


def test_the_generated_c_hardly_grows_with_the_steps(monkeypatch):
    """The step's C is written once: each further step adds its input's
    argument and copy, a small part of what an unrolled step adds."""
    def source_size(steps: int) -> int:
        return len(generate(gated("gru", steps))[0].source)

    scanned = source_size(16) - source_size(8)
    monkeypatch.setenv("SYMBACKPROP_UNROLLED_SCANS", "0")
    unrolled = source_size(16) - source_size(8)
    assert 0 < scanned < 0.2 * unrolled, (scanned, unrolled)


def test_the_step_inputs_are_stacked_by_one_loop_whatever_the_steps():
    """The x_t are copied into the scan's sequence by one loop over a table
    of their pointers (ops/slices.py), not a loop each: a further step adds
    its argument (the model's signature, its description) and a table
    entry, under 250 characters of the forward's C (a loop each: 430)."""
    def forward_c(steps: int) -> str:
        return generate(gated("gru", steps), functions=("forward",))[0].source

    short, long = forward_c(20), forward_c(40)
    assert short.count("for (int64_t") == long.count("for (int64_t")
    assert "stacked[at]" in long
    assert (len(long) - len(short)) / 20 < 250, (len(long) - len(short)) / 20


def outside_readers(model: sbp.Model, name: str) -> list[str]:
    """The ops outside a scan's sequence that read the input `name`."""
    lowered = plan(model, ("forward",)).lowered
    return [n.op for n in topological_order([lowered.loss]) if n.op not in ("slice_scatter", "reshape", "scan")
            and any(a.op == "leaf" and a.attrs[0] == name for a in n.args)]


@pytest.mark.parametrize("model", [gated("gru", 6), gated("lstm", 6), gated("gru", 6, sliced=True)],
                         ids=lambda m: m.name)
def test_the_first_step_from_no_state_is_the_loop_from_zeros(model):
    """The first step, built with no state (h None: no U h terms), is the
    step applied to zeros (loops/zero_start.py): the loop starts there, so
    x_0 is read only as the first row of the scan's sequence."""
    assert loop_ops(model)[0] == 1
    first = "X" if "_sliced" in model.name else "x0"
    readers = outside_readers(model, first)
    assert "matmul" not in readers and (first == "X" or readers == []), readers
    check_against_torch(model)


@pytest.mark.parametrize("doubled", ["input", "bias"])
def test_a_first_step_is_in_the_loop_only_where_it_is_the_step_from_zeros(doubled):
    """With its input doubled the first step is still the step from zeros
    (of the input 2 x_0): in the loop. With its biases doubled it is
    another function: it stays unrolled. Either way the loss and gradients
    are PyTorch's."""
    W, U, b = gate_params("gru")
    target = sp.MatrixSymbol("target", ROWS, HIDDEN)
    xs = step_inputs(6)
    h = None
    for k, x in enumerate(xs):
        first = k == 0
        h = nn.gru_cell(2 * x if first and doubled == "input" else x, h, W, U,
                        [2 * v for v in b] if first and doubled == "bias" else b)
    model = sbp.Model(f"unrolled_gru_doubled_{doubled}", inputs=[*xs, target], params=[*W, *U, *b],
                      loss=nn.mse(h, target), grad_inputs=xs)
    assert loop_ops(model)[0] == 1
    assert ("matmul" in outside_readers(model, "x0")) == (doubled == "bias")
    arrays = arrays_for(model, seed=4)
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arrays.items()}
    sig, tanh = torch.sigmoid, torch.tanh
    x0 = 2 * t["x0"] if doubled == "input" else t["x0"]
    scale = 2 if doubled == "bias" else 1
    h = (1 - sig(x0 @ t["Wz"] + scale * t["bz"])) * tanh(x0 @ t["Wh"] + scale * t["bh"])
    for k in range(1, 6):
        x = t[f"x{k}"]
        r, z = (sig(x @ t[f"W{g}"] + t[f"b{g}"] + h @ t[f"U{g}"]) for g in "rz")
        h = (1 - z) * tanh(x @ t["Wh"] + t["bh"] + r * (h @ t["Uh"])) + z * h
    expected = ((h - t["target"]) ** 2).mean()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-10)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, t[name].grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_by_default_only_runs_that_cost_more_unrolled_become_scans(monkeypatch):
    monkeypatch.setattr(unrolled, "MIN_STEPS", DEFAULT_MIN_STEPS)
    assert loop_ops(gated("gru", DEFAULT_MIN_STEPS - 4))[0] == 0
    assert loop_ops(gated("gru", DEFAULT_MIN_STEPS + 4))[0] == 1  # (the first and last steps stay outside)


def test_the_opt_out_leaves_the_steps_unrolled(monkeypatch):
    monkeypatch.setenv("SYMBACKPROP_UNROLLED_SCANS", "0")
    assert loop_ops(gated("gru", 6))[0] == 0


def test_forward_mode_and_hessian_products_through_the_scan():
    """jvp and hvp (forward over reverse) of the scanned GRU, against
    PyTorch's directional derivative and Hessian-vector product."""
    model = gated("gru", 6)
    assert loop_ops(model)[0] == 1
    arrays = arrays_for(model, seed=1)
    rng = np.random.default_rng(2)
    direction = {k: rng.standard_normal(np.shape(v)) if k != "target" else np.zeros(np.shape(v))
                 for k, v in arrays.items()}
    mod = sbp.compile(model, functions=("jvp", "hvp"))
    names = list(arrays)

    def loss_of(*values):
        return torch_loss(model, dict(zip(names, values)))

    point = tuple(torch.tensor(arrays[k], dtype=torch.float64) for k in names)
    toward = tuple(torch.tensor(direction[k], dtype=torch.float64) for k in names)
    _, tangent = torch.autograd.functional.jvp(loss_of, point, toward)
    differentiated = {k: v for k, v in direction.items() if k != "target"}
    np.testing.assert_allclose(mod.jvp(differentiated, **arrays)["loss"], tangent.item(), rtol=1e-9)
    _, products = torch.autograd.functional.hvp(loss_of, point, toward)
    got = mod.hvp(differentiated, **arrays)
    assert set(got) == set(differentiated)
    for name, expected in zip(names, products):
        if name == "target":
            continue
        np.testing.assert_allclose(got[name], expected.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)


def test_an_output_inside_the_run_keeps_its_adjoint():
    """d loss / d h_4, an output inside the steps differentiated with wrt,
    is PyTorch's: a run may end at it (it is that scan's final state) and
    the next one starts after it, never reads it as a row of an output
    (whose adjoint would miss the steps after it)."""
    W, U, b = gate_params("gru")
    target = sp.MatrixSymbol("target", ROWS, HIDDEN)
    xs = step_inputs(10)
    states, h = [], None
    for x in xs:
        h = nn.gru_cell(x, h, W, U, b)
        states.append(h)
    model = sbp.Model("unrolled_gru_output", inputs=[*xs, target], params=[*W, *U, *b], loss=nn.mse(h, target),
                      outputs={"h_mid": states[4], "h_last": h})
    assert loop_ops(model)[0] == 2  # steps 1-5 (from zeros), ending at h_4, then 6-10
    arrays = arrays_for(model, seed=3)
    loss, grads = sbp.compile(model, wrt=["Uz", "h_mid", "h_last"]).value_and_grad(**arrays)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arrays.items()}
    sig, tanh, h = torch.sigmoid, torch.tanh, None
    for k in range(10):
        x = t[f"x{k}"]
        z = {g: x @ t[f"W{g}"] + t[f"b{g}"] + (0 if h is None else h @ t[f"U{g}"]) for g in "rzh"}
        if h is None:
            h = (1 - sig(z["z"])) * tanh(z["h"])
        else:
            h = (1 - sig(z["z"])) * tanh(x @ t["Wh"] + t["bh"] + sig(z["r"]) * (h @ t["Uh"])) + sig(z["z"]) * h
        if k == 4:
            h.retain_grad()
            middle = h
    expected = ((h - t["target"]) ** 2).mean()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-10)
    np.testing.assert_allclose(grads["h_mid"], middle.grad.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(grads["h_last"], 2 * (h - t["target"]).detach().numpy() / h.numel(), rtol=1e-10)
    np.testing.assert_allclose(grads["Uz"], t["Uz"].grad.numpy(), rtol=1e-9, atol=1e-12)


def test_two_stacked_layers():
    """Layer 2 reads layer 1's state of the same step: both recurrences
    become loops (or one loop of both states), with PyTorch's gradients."""
    W1, U1, W2, U2 = (sp.MatrixSymbol(k, *shape) for k, shape in (("W1", (FEATURES, HIDDEN)), ("U1", (HIDDEN, HIDDEN)),
                                                                   ("W2", (HIDDEN, HIDDEN)), ("U2", (HIDDEN, HIDDEN))))
    H0, target = sp.MatrixSymbol("H0", ROWS, HIDDEN), sp.MatrixSymbol("target", ROWS, HIDDEN)
    xs = step_inputs(10)
    h1 = h2 = H0
    for x in xs:
        h1 = nn.tanh(x * W1 + h1 * U1)
        h2 = nn.tanh(h1 * W2 + h2 * U2)
    model = sbp.Model("unrolled_stacked", inputs=[*xs, H0, target], params=[W1, U1, W2, U2],
                      loss=nn.mse(h2, target), grad_inputs=[H0])
    assert loop_ops(model)[0] >= 1
    arrays = arrays_for(model, seed=4)
    loss, grads = sbp.compile(model).value_and_grad(**arrays)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arrays.items()}
    a = b = t["H0"]
    for k in range(10):
        a = torch.tanh(t[f"x{k}"] @ t["W1"] + a @ t["U1"])
        b = torch.tanh(a @ t["W2"] + b @ t["U2"])
    expected = ((b - t["target"]) ** 2).mean()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-10)
    for name in ("W1", "U1", "W2", "U2", "H0"):
        np.testing.assert_allclose(grads[name], t[name].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
