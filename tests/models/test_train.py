"""Training in C: train_step against numpy references of PyTorch's SGD and
Adam (and PyTorch itself where it is installed), its errors, hyperparameter
changes, checkpoints, and train_epoch against the same train_step calls."""

import subprocess

import numpy as np
import pytest
import sympy as sp
from c_driver import STRICT_FLAGS, write_runtime_header
from conftest import load_example
from oracles import sigmoid

import symbackprop as sbp
from symbackprop.declare import nn
from symbackprop.pipeline import generate
from symbackprop.run.optim import SGD, Adam, NumpyStep

PARAMS = ("W1", "b1", "W2", "b2")


@pytest.fixture(scope="module")
def mlp():
    return load_example("mlp")


def _data(mlp, rows=8, seed=0):
    data = mlp.sample_data(np.random.default_rng(seed), batch=rows)
    return {k: data[k] for k in ("X", "T")}, {k: data[k] for k in PARAMS}


def _copy(params):
    return {k: v.copy() for k, v in params.items()}


# --- an independent reference: the mlp's gradient by hand, torch's updates ---


def mlp_value_and_grad(d):
    """Loss and gradients of examples/mlp.py, backpropagated by hand in numpy."""
    z1 = d["X"] @ d["W1"] + d["b1"]
    h = sigmoid(z1)
    y = h @ d["W2"] + d["b2"]
    diff = y - d["T"]
    loss = float(np.mean(diff**2))
    dy = 2 * diff / diff.size
    dh = dy @ d["W2"].T
    dz1 = dh * h * (1 - h)
    grads = {"W2": h.T @ dy, "b2": dy.sum(axis=0, keepdims=True), "W1": d["X"].T @ dz1,
             "b1": dz1.sum(axis=0, keepdims=True)}
    return loss, grads


class TorchSGD:
    """torch.optim.SGD's update (dampening 0, no nesterov) in numpy."""

    def __init__(self, lr, momentum=0.0, weight_decay=0.0):
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buf = {}

    def step(self, params, grads):
        for k, p in params.items():
            d = grads[k] + self.weight_decay * p if self.weight_decay else grads[k]
            if self.momentum:
                d = d.copy() if k not in self.buf else self.momentum * self.buf[k] + d
                self.buf[k] = d
            params[k] = p - self.lr * d


class TorchAdam:
    """torch.optim.Adam's update (no amsgrad) in numpy, in the paper's form."""

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.lr, (self.b1, self.b2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.m, self.v, self.t = {}, {}, 0

    def step(self, params, grads):
        self.t += 1
        for k, p in params.items():
            g = grads[k] + self.weight_decay * p
            self.m[k] = self.b1 * self.m.get(k, 0.0) + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v.get(k, 0.0) + (1 - self.b2) * g * g
            m_hat = self.m[k] / (1 - self.b1**self.t)
            v_hat = self.v[k] / (1 - self.b2**self.t)
            params[k] = p - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


OPTIMIZERS = [
    (SGD(lr=0.1), lambda: TorchSGD(0.1)),
    (SGD(lr=0.05, momentum=0.9, weight_decay=0.01), lambda: TorchSGD(0.05, 0.9, 0.01)),
    (Adam(lr=0.01), lambda: TorchAdam(0.01)),
    (Adam(lr=0.02, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
     lambda: TorchAdam(0.02, (0.8, 0.99), 1e-6, 0.1)),
]


@pytest.mark.parametrize("optimizer, reference", OPTIMIZERS, ids=lambda o: repr(o) if not callable(o) else "")
def test_train_step_matches_the_numpy_reference(mlp, optimizer, reference):
    mod = sbp.compile(mlp.model, optimizer=optimizer)
    ref = reference()
    ours, theirs = _copy(_data(mlp)[1]), _copy(_data(mlp)[1])
    for step in range(6):
        batch, _ = _data(mlp, rows=5 + step, seed=10 + step)  # a different batch (and size) each step
        loss = mod.train_step(**batch, **ours)
        ref_loss, grads = mlp_value_and_grad({**batch, **theirs})
        ref.step(theirs, grads)
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        for k in PARAMS:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-12, atol=1e-14, err_msg=f"{k} at step {step}")
    if isinstance(optimizer, Adam):
        assert mod.optimizer_state["step"][0, 0] == 6
        np.testing.assert_allclose(mod.optimizer_state["m_W1"], ref.m["W1"], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(mod.optimizer_state["v_W1"], ref.v["W1"], rtol=1e-12, atol=1e-15)
    elif optimizer.momentum:
        np.testing.assert_allclose(mod.optimizer_state["velocity_W1"], ref.buf["W1"], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("optimizer, reference", OPTIMIZERS, ids=lambda o: repr(o) if not callable(o) else "")
def test_numpy_step_matches_the_reference_and_train_step(mlp, optimizer, reference):
    """NumpyStep (the update symbackprop.interop.dask makes on the driver) evaluates
    optim's update graph: the same steps as the numpy reference for the
    same gradients, and as the C train_step (float64, bias correction)."""
    mod = sbp.compile(mlp.model, optimizer=optimizer)
    ref = reference()
    ours, theirs, in_c = (_copy(_data(mlp)[1]) for _ in range(3))
    state = {}
    step = NumpyStep(optimizer, ours, state)
    for k in range(5):
        batch, _ = _data(mlp, rows=6, seed=30 + k)
        _, grads = mod.value_and_grad(**batch, **ours)
        step(grads)
        ref.step(theirs, grads)
        mod.train_step(**batch, **in_c)
        for name in PARAMS:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-14, err_msg=f"{name} at {k}")
            np.testing.assert_allclose(ours[name], in_c[name], rtol=1e-12, atol=1e-14, err_msg=f"{name} at {k}")
    assert set(state) == set(mod.optimizer_state)
    for key, value in state.items():
        np.testing.assert_allclose(value, mod.optimizer_state[key], rtol=1e-12, atol=1e-15, err_msg=key)
    if isinstance(optimizer, Adam):
        assert state["step"][0, 0] == 5
        np.testing.assert_allclose(state["m_W1"], ref.m["W1"], rtol=1e-12, atol=1e-15)


def test_numpy_step_checks_the_state_shapes(mlp):
    params = _data(mlp)[1]
    with pytest.raises(ValueError, match=r"state\['m_W1'\] has shape \(2, 2\)"):
        NumpyStep(Adam(), params, {"m_W1": np.zeros((2, 2))})


@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
                                       Adam(lr=0.02, weight_decay=0.1)], ids=repr)
def test_train_step_matches_pytorch(mlp, optimizer):
    torch = pytest.importorskip("torch")
    mod = sbp.compile(mlp.model, optimizer=optimizer)
    _, init = _data(mlp)
    ours = _copy(init)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    if isinstance(optimizer, SGD):
        opt = torch.optim.SGD(tensors.values(), lr=optimizer.lr, momentum=optimizer.momentum,
                              weight_decay=optimizer.weight_decay)
    else:
        opt = torch.optim.Adam(tensors.values(), lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2),
                               eps=optimizer.eps, weight_decay=optimizer.weight_decay)
    for step in range(8):
        batch, _ = _data(mlp, rows=6, seed=20 + step)
        loss = mod.train_step(**batch, **ours)
        opt.zero_grad()
        t = tensors
        y = torch.sigmoid(torch.tensor(batch["X"]) @ t["W1"] + t["b1"]) @ t["W2"] + t["b2"]
        torch_loss = torch.mean((y - torch.tensor(batch["T"])) ** 2)
        torch_loss.backward()
        opt.step()
        assert loss == pytest.approx(torch_loss.item(), rel=1e-11)
    for k in PARAMS:
        np.testing.assert_allclose(ours[k], tensors[k].detach().numpy(), rtol=1e-10, atol=1e-13, err_msg=k)


# --- errors ---------------------------------------------------------------


def test_train_step_without_an_optimizer_says_how(mlp):
    mod = sbp.compile(mlp.model)
    data, params = _data(mlp)
    with pytest.raises(sbp.ArgumentError, match="optimizer"):
        mod.train_step(**data, **params)
    with pytest.raises(sbp.ArgumentError, match="optimizer"):
        mod.train_epoch(4, **data, **params)
    with pytest.raises(sbp.ModelError, match="optimizer"):
        sbp.compile(mlp.model, functions=("train_step",))


@pytest.mark.parametrize("spoil, what", [
    (lambda a: a.setflags(write=False) or a, "writable"),
    (lambda a: a.astype(np.float32), "float32"),
    (lambda a: np.asfortranarray(np.repeat(a, 2, axis=0))[::2], "strided"),
    (lambda a: np.asfortranarray(a), "Fortran order"),
    (lambda a: a.tolist(), "a list"),
])
def test_a_parameter_that_cannot_be_updated_in_place_is_named(mlp, spoil, what):
    mod = sbp.compile(mlp.model, optimizer=SGD(lr=0.1))
    data, params = _data(mlp)
    params["W1"] = spoil(params["W1"].copy())
    if isinstance(params["W1"], np.ndarray) and params["W1"].flags.c_contiguous and params["W1"].flags.writeable \
            and params["W1"].dtype == np.float64:
        pytest.skip(f"{what} happens to be C-contiguous here")
    before = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    for call in (lambda: mod.train_step(**data, **params), lambda: mod.train_epoch(4, **data, **params)):
        with pytest.raises(sbp.ArgumentError, match=r"W1 is updated in place"):
            call()
    for k in ("b1", "W2", "b2"):  # nothing was trained
        np.testing.assert_array_equal(params[k], before[k])


def test_train_epoch_checks_the_order_and_batch_size_before_calling_c(mlp):
    mod = sbp.compile(mlp.model, optimizer=Adam(lr=0.01))
    data, params = _data(mlp, rows=10)
    before = _copy(params)
    bad_orders = [
        (np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 10]), r"0 \.\.\. 9 \(the data has 10 rows\)"),
        (np.array([-1, 1, 2, 3, 4, 5, 6, 7, 8, 9]), r"0 \.\.\. 9"),
        ([3, 10], r"0 \.\.\. 9"),
        ([-5], r"0 \.\.\. 9"),
        (np.arange(10, dtype=np.float64), "integer"),
        ([0.0, 1.0], "integer"),
        ([True, False], "integer"),
        (np.arange(10).reshape(2, 5), "1-D"),
        ("0123456789", "integer"),
        (7, "integer"),
        ([], "names no row"),
        (np.array([], dtype=np.int64), "names no row"),
    ]
    for order, message in bad_orders:
        with pytest.raises(sbp.ArgumentError, match=message):
            mod.train_epoch(4, order, **data, **params)
    for size in (0, -3, 2.5, True, None):
        with pytest.raises(sbp.ArgumentError, match="batch_size"):
            mod.train_epoch(size, None, **data, **params)
    with pytest.raises(sbp.ArgumentError, match="T must have shape"):
        mod.train_epoch(4, None, X=data["X"], T=data["T"][:9], **params)
    for k in PARAMS:
        np.testing.assert_array_equal(params[k], before[k])
    assert not mod.optimizer_state["step"].any()


def test_the_c_epoch_refuses_an_order_out_of_range(mlp):
    """C callers get the check too: status 2, and nothing trained."""
    mod = sbp.compile(mlp.model, optimizer=SGD(lr=0.1))
    data, params = _data(mlp, rows=6)
    before = _copy(params)
    mod.train_step(**data, **params)  # builds the module and the state
    params = _copy(before)
    fn = mod.function("train_step")
    lib, ffi = fn.lib, fn.ffi
    order = np.array([0, 1, 2, 3, 4, 6], dtype=np.int64)
    state = mod.trainer._arguments({**data, **params})
    values, _ = fn.bind(state)
    losses = np.zeros(2)
    work = np.zeros(lib.mlp_train_epoch_work_len(6, 3))
    buf = ffi.from_buffer
    status = lib.mlp_train_epoch(6, 3, buf(order), *[buf(v) for v in values], buf(losses), buf(work))
    assert status == 2
    for k in PARAMS:
        np.testing.assert_array_equal(params[k], before[k])
    assert lib.mlp_train_epoch(0, 3, ffi.NULL, *[buf(v) for v in values], buf(losses), buf(work)) == 1


def test_train_epoch_needs_a_batch_dimension():
    x, w = sp.MatrixSymbol("x", 3, 1), sp.MatrixSymbol("w", 1, 3)
    model = sbp.Model("fixed_shapes", inputs=[x], params=[w], loss=nn.sum_all(nn.tanh(w * x)))
    mod = sbp.compile(model, optimizer=SGD(lr=0.1))
    data = {"x": np.ones((3, 1)), "w": np.full((1, 3), 0.5)}
    mod.train_step(**data)  # a step works
    with pytest.raises(sbp.ArgumentError, match="batch dimension"):
        mod.train_epoch(2, **data)


# --- hyperparameters and checkpoints -----------------------------------------


def test_a_learning_rate_schedule_takes_effect(mlp):
    mod = sbp.compile(mlp.model, optimizer=SGD(lr=0.1, momentum=0.5))
    ref = TorchSGD(0.1, 0.5)
    data, init = _data(mlp)
    ours, theirs = _copy(init), _copy(init)
    for _step, lr in enumerate([0.1, 0.05, 0.0, 0.2, 0.01]):
        mod.trainer.hyperparameters["lr"] = lr
        ref.lr = lr
        before = _copy(ours)
        mod.train_step(**data, **ours)
        ref.step(theirs, mlp_value_and_grad({**data, **theirs})[1])
        for k in PARAMS:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-12, atol=1e-15)
            if lr == 0.0:
                np.testing.assert_array_equal(ours[k], before[k])
    mod.trainer.hyperparameters["momentum"] = 0.0  # any hyperparameter, not only lr
    ref.momentum, ref.buf = 0.0, {}
    mod.train_step(**data, **ours)
    ref.step(theirs, mlp_value_and_grad({**data, **theirs})[1])
    for k in PARAMS:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9), Adam(lr=0.01)], ids=repr)
def test_a_checkpoint_resumes_bit_for_bit(mlp, optimizer, tmp_path):
    batches = [_data(mlp, rows=7, seed=30 + k)[0] for k in range(8)]
    _, init = _data(mlp)

    straight = sbp.compile(mlp.model, optimizer=optimizer)
    params = _copy(init)
    straight_losses = [straight.train_step(**b, **params) for b in batches]

    first = sbp.compile(mlp.model, optimizer=optimizer)
    resumed = _copy(init)
    losses = [first.train_step(**b, **resumed) for b in batches[:3]]
    first.trainer.hyperparameters["lr"] = optimizer.lr  # saved with the state
    first.trainer.save(tmp_path / "ckpt.npz", resumed)

    fresh = sbp.compile(mlp.model, optimizer=type(optimizer)(lr=123.0))  # lr restored from the file
    loaded = fresh.trainer.load(tmp_path / "ckpt.npz")
    assert fresh.trainer.hyperparameters["lr"] == optimizer.lr
    losses += [fresh.train_step(**b, **loaded) for b in batches[3:]]
    assert losses == straight_losses
    for k in PARAMS:
        np.testing.assert_array_equal(loaded[k], params[k])
    for k, v in straight.optimizer_state.items():
        np.testing.assert_array_equal(fresh.optimizer_state[k], v)


def test_a_checkpoint_without_the_state_is_refused(mlp, tmp_path):
    mod = sbp.compile(mlp.model, optimizer=Adam())
    _, params = _data(mlp)
    np.savez(tmp_path / "params_only.npz", **{f"param/{k}": v for k, v in params.items()})
    with pytest.raises(sbp.ArgumentError, match="optimizer state"):
        mod.trainer.load(tmp_path / "params_only.npz")


# --- train_epoch ----------------------------------------------------------


def _steps(mod, batch_size, order, data, params):
    """train_step on each minibatch of `order`'s rows (all rows: None), gathered here."""
    order = np.arange(len(next(iter(data.values())))) if order is None else np.asarray(order)
    return np.array([
        mod.train_step(**{k: v[order[s:s + batch_size]] for k, v in data.items()}, **params)
        for s in range(0, len(order), batch_size)
    ])


def _orders(rows: int) -> dict:
    rng = np.random.default_rng(rows)
    return {
        "subset": rng.choice(rows, rows // 2, replace=False),
        "repeats": rng.integers(0, rows, rows),  # a full length with repeats (C checks bounds only)
        "bootstrap_longer": rng.integers(0, rows, rows + 9),
        "one_row": np.array([rows - 1]),
        "list": [int(i) for i in rng.permutation(rows)[:5]],
        "range": range(rows - 1, 0, -2),
        "uint32": rng.choice(rows, 6).astype(np.uint32),
        "strided_view": rng.permutation(2 * rows)[::2] % rows,
    }


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", sorted(_orders(13)))
def test_any_sequence_of_rows_is_an_order(mlp, kind, dtype):
    """As PyTorch's samplers: a subset, repeats, more rows than the data; the
    epoch runs over len(order) rows and equals train_step on the gathered
    minibatches bit for bit."""
    data, init = _data(mlp, rows=13, seed=3)
    data = {k: v.astype(dtype) for k, v in data.items()}
    init = {k: v.astype(dtype) for k, v in init.items()}
    order = _orders(13)[kind]
    epoch_mod, step_mod = (sbp.compile(mlp.model, dtype=dtype, optimizer=Adam(lr=0.01)) for _ in range(2))
    a, b = _copy(init), _copy(init)
    for _ in range(2):
        losses = epoch_mod.train_epoch(4, order, **data, **a)
        assert losses.shape == (-(-len(order) // 4),)
        np.testing.assert_array_equal(losses, _steps(step_mod, 4, order, data, b).astype(dtype))
        for k in PARAMS:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9, weight_decay=0.01), Adam(lr=0.01)], ids=repr)
@pytest.mark.parametrize("rows, batch_size, shuffle", [(37, 8, False), (37, 8, True), (32, 8, True), (5, 16, True),
                                                       (7, 1, False)])
def test_train_epoch_equals_train_step_calls(mlp, optimizer, rows, batch_size, shuffle):
    data, init = _data(mlp, rows=rows, seed=rows)
    order = np.random.default_rng(rows).permutation(rows) if shuffle else None
    epoch_mod, step_mod = sbp.compile(mlp.model, optimizer=optimizer), sbp.compile(mlp.model, optimizer=optimizer)
    a, b = _copy(init), _copy(init)
    for _ in range(2):
        losses = epoch_mod.train_epoch(batch_size, order, **data, **a)
        expected = _steps(step_mod, batch_size, order, data, b)
        assert losses.shape == (-(-rows // batch_size),)
        np.testing.assert_array_equal(losses, expected)
        for k in PARAMS:
            np.testing.assert_array_equal(a[k], b[k])
        for k, v in step_mod.optimizer_state.items():
            np.testing.assert_array_equal(epoch_mod.optimizer_state[k], v)


def test_train_epoch_passes_other_inputs_and_dimensions_whole():
    """Inputs without the batch dimension (a matrix, a scalar) reach every step
    whole; another symbolic dimension passes through."""
    n, m = sp.Symbol("n", integer=True, positive=True), sp.Symbol("m", integer=True, positive=True)
    X, A = sp.MatrixSymbol("X", n, m), sp.MatrixSymbol("A", m, 3)
    T, W = sp.MatrixSymbol("T", n, 2), sp.MatrixSymbol("W", 3, 2)
    lam = sp.Symbol("lam")
    Y = nn.tanh(X * A * W)
    model = sbp.Model("epoch_dims", inputs=[X, A, T, lam], params=[W],
                      loss=nn.mse(Y, T) + lam * nn.l2_penalty(W))
    rng = np.random.default_rng(5)
    data = {"X": rng.standard_normal((11, 4)), "T": rng.standard_normal((11, 2))}
    whole = {"A": rng.standard_normal((4, 3)), "lam": 0.01}
    init = rng.standard_normal((3, 2))
    for optimizer in (SGD(lr=0.1, momentum=0.5), Adam(lr=0.05)):
        epoch_mod, step_mod = sbp.compile(model, optimizer=optimizer), sbp.compile(model, optimizer=optimizer)
        a, b = {"W": init.copy()}, {"W": init.copy()}
        order = rng.permutation(11)
        losses = epoch_mod.train_epoch(4, order, **data, **whole, **a)
        expected = _steps(step_mod, 4, order, data, {**whole, **b})
        np.testing.assert_array_equal(losses, expected)
        np.testing.assert_array_equal(a["W"], b["W"])


def test_train_epoch_in_float32(mlp):
    data, init = _data(mlp, rows=13)
    data = {k: v.astype(np.float32) for k, v in data.items()}
    init = {k: v.astype(np.float32) for k, v in init.items()}
    mods = [sbp.compile(mlp.model, dtype="float32", optimizer=Adam(lr=0.01)) for _ in range(2)]
    a, b = _copy(init), _copy(init)
    order = np.random.default_rng(1).permutation(13)
    losses = mods[0].train_epoch(5, order, **data, **a)
    assert losses.dtype == np.float32
    np.testing.assert_array_equal(losses, _steps(mods[1], 5, order, data, b).astype(np.float32))
    for k in PARAMS:
        assert a[k].dtype == np.float32
        np.testing.assert_array_equal(a[k], b[k])


def test_the_epoch_is_plain_c(mlp, tmp_path):
    """The train_step module with its epoch function compiles without warnings
    under strict flags; every symbol it defines carries the prefix."""
    emitted, _ = generate(mlp.model, functions=("train_step",), optimizer=Adam())
    assert "int mlp_train_epoch(" in emitted.header and "mlp_train_epoch_work_len" in emitted.cdef
    source = tmp_path / "mlp.c"
    source.write_text(emitted.source)
    (tmp_path / "mlp.h").write_text(emitted.header)
    write_runtime_header(tmp_path)
    result = subprocess.run(["cc", *STRICT_FLAGS, "-c", str(source), "-o", str(tmp_path / "mlp.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    defined = subprocess.run(["nm", "-g", "--defined-only", str(tmp_path / "mlp.o")], capture_output=True,
                             text=True, check=True).stdout.split()[2::3]
    describing = {"mlp_n_dims", "mlp_name_dim"} | {f"mlp_{kind}_{what}" for kind in ("train_step", "train_epoch") for what in (
        "n_dims", "name_dim", "n_in", "n_out", "name_in", "name_out", "kind_in", "shape_in", "shape_out", "call",
        "call_work_len")}  # the self-description and the array-form call
    assert set(defined) == {"mlp_train_step", "mlp_train_step_work_len", "mlp_train_epoch", "mlp_train_epoch_work_len",
                            *describing}
    assert "train_epoch" not in generate(mlp.model)[0].source  # only modules with a train step have one


def test_user_names_cannot_shadow_the_functions_the_epoch_calls():
    n = sp.Symbol("n", integer=True, positive=True)
    X = sp.MatrixSymbol("hostile_train_step", n, 2)  # the name of the function the epoch calls
    W = sp.MatrixSymbol("hostile_train_epoch_work_len", 2, 1)
    model = sbp.Model("hostile", inputs=[X], params=[W], loss=nn.sum_all(nn.tanh(X * W)) / n)
    mod = sbp.compile(model, optimizer=SGD(lr=0.1))
    rng = np.random.default_rng(0)
    data = {"hostile_train_step": rng.standard_normal((5, 2))}
    a, b = {"hostile_train_epoch_work_len": np.ones((2, 1))}, {"hostile_train_epoch_work_len": np.ones((2, 1))}
    losses = mod.train_epoch(2, None, **data, **a)
    np.testing.assert_array_equal(losses, _steps(sbp.compile(model, optimizer=SGD(lr=0.1)), 2, None, data, b))


def test_names_the_epoch_uses_for_itself_are_free_for_the_model():
    """Dimensions, inputs and params named like the epoch's own C locals and
    Python keywords ("order", "batch", "losses", ...) work; `order` then goes
    by position."""
    n, m = sp.Symbol("full", integer=True, positive=True), sp.Symbol("part", integer=True, positive=True)
    X, A, T = sp.MatrixSymbol("rows", n, m), sp.MatrixSymbol("batch", m, 2), sp.MatrixSymbol("start", n, 2)
    W, L, Q = sp.MatrixSymbol("b", 2, 2), sp.MatrixSymbol("losses", 1, 2), sp.MatrixSymbol("order", 1, 2)
    model = sbp.Model("locals", inputs=[X, A, T, Q], params=[W, L],
                      loss=nn.mse(nn.tanh(X * A * W) + sp.OneMatrix(n, 1) * (L + Q), T))
    rng = np.random.default_rng(0)
    data = {"rows": rng.standard_normal((9, 3)), "start": rng.standard_normal((9, 2))}
    whole = {"batch": rng.standard_normal((3, 2)), "order": rng.standard_normal((1, 2))}
    init = {"b": rng.standard_normal((2, 2)), "losses": rng.standard_normal((1, 2))}
    a, b = _copy(init), _copy(init)
    perm = rng.permutation(9)
    losses = sbp.compile(model, optimizer=SGD(lr=0.1)).train_epoch(4, perm, **data, **whole, **a)
    np.testing.assert_array_equal(losses, _steps(sbp.compile(model, optimizer=SGD(lr=0.1)), 4, perm, data,
                                                 {**whole, **b}))
    np.testing.assert_array_equal(a["b"], b["b"])


def test_batch_size_and_order_by_keyword(mlp):
    data, init = _data(mlp, rows=10)
    perm = np.random.default_rng(2).permutation(10)
    a, b = _copy(init), _copy(init)
    by_keyword = sbp.compile(mlp.model, optimizer=SGD(lr=0.1)).train_epoch(batch_size=3, order=perm, **data, **a)
    by_position = sbp.compile(mlp.model, optimizer=SGD(lr=0.1)).train_epoch(3, perm, **data, **b)
    np.testing.assert_array_equal(by_keyword, by_position)
    assert by_keyword.shape == (4,)
