"""symbackprop.interop.dask: the loss and gradient over chunks of Dask arrays on a
LocalCluster of two worker processes equal one call on the whole data, and
data-parallel training makes the steps train_step / train_epoch make."""

import dataclasses
import importlib.util
import pickle

import numpy as np
import pytest
import sympy as sp
from conftest import load_example

import symbackprop as sbp
from symbackprop.declare import nn

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
sbd = pytest.importorskip("symbackprop.interop.dask")

n = sp.Symbol("n", integer=True, positive=True)
X, T = sp.MatrixSymbol("X", n, 3), sp.MatrixSymbol("T", n, 1)
W, b = sp.MatrixSymbol("W", 3, 1), sp.MatrixSymbol("b", 1, 1)
lam = sp.Symbol("lam", positive=True)
RESIDUAL = nn.linear(X, W, b) - T
# a mean over rows plus a penalty that does not depend on the data, with a scalar input passed whole
RIDGE = sbp.Model("dask_ridge", inputs=[X, T, lam], params=[W, b],
                  loss=nn.mse(nn.linear(X, W, b), T) + lam * nn.l2_penalty(W))
# a sum over rows
SUMMED = sbp.Model("dask_summed", inputs=[X, T], params=[W, b], loss=nn.sum_all(sp.HadamardPower(RESIDUAL, 2)))


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None)
    with cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def mlp():
    example = load_example("mlp")
    data = example.sample_data(np.random.default_rng(0), batch=60)
    params = {k: data[k] for k in ("W1", "b1", "W2", "b2")}
    return example.model, sbp.compile(example.model), params, data["X"], data["T"]


def chunked(x, rows=16, cols=-1):
    return da.from_array(x, chunks=(rows, cols))


def assert_same(result, reference, rtol=1e-12):
    loss, grads = result
    assert loss == pytest.approx(reference[0], rel=rtol)
    assert set(grads) == set(reference[1])
    for key, grad in reference[1].items():
        np.testing.assert_allclose(grads[key], grad, rtol=rtol, atol=1e-14, err_msg=key)


def test_mean_loss_over_chunks_equals_the_whole(client, mlp):
    _model, mod, params, x, t = mlp
    reference = mod.value_and_grad(X=x, T=t, **params)
    # uneven chunks (16, 16, 16, 12), and X in two column chunks (joined)
    result = sbd.value_and_grad(mod, params, {"X": chunked(x, cols=2), "T": chunked(t)}, client=client)
    assert_same(result, reference)
    # chunks of no rows are skipped
    empty = ((20, 0, 40), (3,))
    result = sbd.value_and_grad(mod, params, {"X": da.from_array(x, chunks=empty), "T": chunked(t, empty[0])}, client=client)
    assert_same(result, reference)
    # a spec works as well as the module, and so does one chunk
    assert_same(sbd.value_and_grad(sbd.ModuleSpec.of(mod), params, {"X": chunked(x, 60), "T": chunked(t, 60)},
                                   client=client), reference)


def test_workers_build_the_module_themselves(client, mlp):
    """Each worker process loaded the module from the spec (no pointers
    travel): the spec pickles with the standard pickle."""
    _, mod, params, x, t = mlp
    spec = sbd.ModuleSpec.of(mod)
    assert b"cffi" not in pickle.dumps(spec)
    sbd.value_and_grad(mod, params, {"X": chunked(x, 8), "T": chunked(t, 8)}, client=client)

    def loaded_keys():  # a local function: pickled by value, so workers need not import this file
        import symbackprop.interop.dask

        return sorted(symbackprop.interop.dask._LOADED)

    loaded = client.run(loaded_keys)
    assert any(spec.key in keys for keys in loaded.values())  # the tasks ran there (on one worker or both)


def test_mean_plus_penalty_and_a_scalar_input(client):
    mod = sbp.compile(RIDGE)
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((50, 3)), rng.standard_normal((50, 1))
    params = {"W": rng.standard_normal((3, 1)), "b": np.zeros((1, 1)), "lam": 0.3}
    reference = mod.value_and_grad(X=x, T=t, **params)
    assert_same(sbd.value_and_grad(mod, params, {"X": chunked(x, 7), "T": chunked(t, 7)}, client=client), reference)


def test_sum_loss(client):
    mod = sbp.compile(SUMMED)
    rng = np.random.default_rng(2)
    x, t = rng.standard_normal((40, 3)), rng.standard_normal((40, 1))
    params = {"W": rng.standard_normal((3, 1)), "b": np.ones((1, 1))}
    reference = mod.value_and_grad(X=x, T=t, **params)
    data = {"X": chunked(x, 15), "T": chunked(t, 15)}
    assert_same(sbd.value_and_grad(mod, params, data, reduction="sum", client=client), reference)
    with pytest.raises(ValueError, match="reduction='sum'"):
        sbd.value_and_grad(mod, params, data, client=client)  # the default, mean, does not fit


def test_the_reduction_check(client, mlp):
    _, mod, params, x, t = mlp
    data = {"X": chunked(x), "T": chunked(t)}
    with pytest.raises(ValueError, match="pass reduction='mean'"):
        sbd.value_and_grad(mod, params, data, reduction="sum", client=client)
    loss, _ = sbd.value_and_grad(mod, params, data, reduction="sum", client=client, check=False)
    assert loss == pytest.approx(sum(mod.value_and_grad(X=x[k:k + 16], T=t[k:k + 16], **params)[0] for k in range(0, 60, 16)))


def test_an_index_is_split_with_the_rows(client):
    tensor = pytest.importorskip("symbackprop.declare.tensor")
    E, Y = sp.MatrixSymbol("E", 5, 2), sp.MatrixSymbol("Y", n, 2)
    rows = tensor.Index("I", n)
    mod = sbp.compile(sbp.Model("dask_embed", inputs=[Y, rows], params=[E], loss=nn.mse(tensor.gather(E, rows), Y)))
    rng = np.random.default_rng(3)
    y, i, e = rng.standard_normal((30, 2)), rng.integers(0, 5, 30), rng.standard_normal((5, 2))
    data = {"Y": chunked(y, 8), "I": da.from_array(i, chunks=8)}  # 1-D int64, as the module takes it
    assert_same(sbd.value_and_grad(mod, {"E": e}, data, client=client), mod.value_and_grad(Y=y, I=i, E=e))
    with pytest.raises(TypeError, match=r"data\['I'\] is an Index"):
        sbd.value_and_grad(mod, {"E": e}, {**data, "I": da.from_array(i.astype(float), chunks=8)})
    # row numbers of the batch itself cannot be split
    shuffled = sbp.Model("dask_shuffled", inputs=[Y, rows], params=[E], loss=nn.mse(tensor.gather(Y, rows), Y * E.T * E))
    with pytest.raises(ValueError, match="chunks of rows would renumber them"):
        sbd.value_and_grad(sbp.compile(shuffled), {"E": e}, data)


def test_local_scheduler_without_a_client(mlp):
    import dask

    _, mod, params, x, t = mlp
    with dask.config.set(scheduler="threads"):
        assert sbd._client(None) is None
        result = sbd.value_and_grad(mod, params, {"X": chunked(x), "T": chunked(t)})
    assert_same(result, mod.value_and_grad(X=x, T=t, **params))


def test_a_worker_with_other_code_compiles_from_the_model(mlp):
    _, mod, params, x, t = mlp
    spec = pickle.loads(pickle.dumps(sbd.ModuleSpec.of(mod)))
    other = dataclasses.replace(spec, digest="other symbackprop code", key="test-other-code")
    rebuilt = other.load()
    assert rebuilt is not mod and rebuilt.source == mod.source
    assert_same(rebuilt.value_and_grad(X=x, T=t, **params), mod.value_and_grad(X=x, T=t, **params), rtol=0)


def copy(params):
    return {k: np.array(v) for k, v in params.items()}


def test_full_batch_training_matches_train_step(client, mlp):
    model, mod, params, x, t = mlp
    adam = sbp.Adam(lr=0.05)
    one = sbp.compile(model, optimizer=adam)
    alone, spread = copy(params), copy(params)
    expected = [one.train_step(X=x, T=t, **alone) for _ in range(6)]
    state = {}
    losses = sbd.train(mod, spread, {"X": chunked(x), "T": chunked(t)}, optimizer=adam, epochs=6, state=state, client=client)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, expected, rtol=1e-12)
    for key in params:
        np.testing.assert_allclose(spread[key], alone[key], rtol=1e-9, atol=1e-12, err_msg=key)
    assert set(state) == set(one.optimizer_state)
    np.testing.assert_allclose(state["m_W1"], one.optimizer_state["m_W1"], rtol=1e-9, atol=1e-13)
    # continuing with the same state is the same as training longer
    more = sbd.train(mod, spread, {"X": chunked(x), "T": chunked(t)}, optimizer=adam, state=state, client=client)
    assert more[0] == pytest.approx(one.train_step(X=x, T=t, **alone), rel=1e-10)


def test_chunk_steps_match_train_epoch(client, mlp):
    model, _mod, params, x, t = mlp
    sgd = sbp.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    one = sbp.compile(model, optimizer=sgd)
    alone, spread = copy(params), copy(params)
    expected = np.concatenate([one.train_epoch(16, X=x, T=t, **alone) for _ in range(2)])
    losses = sbd.train(sbp.compile(model, optimizer=sgd), spread, {"X": chunked(x), "T": chunked(t)},
                       epochs=2, chunks_per_step=1, client=client)  # the module's own optimizer
    np.testing.assert_allclose(losses, expected, rtol=1e-10)
    for key in params:
        np.testing.assert_allclose(spread[key], alone[key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_training_reports_progress_per_epoch_and_the_same_losses(mlp, capsys):
    import dask

    model, _mod, params, x, t = mlp
    sgd = sbp.SGD(lr=0.1, momentum=0.9)
    data = {"X": chunked(x), "T": chunked(t)}  # 4 chunks: 4 steps an epoch
    reports, runs = [], []
    with dask.config.set(scheduler="threads"):
        for progress in (False, lambda done, total, info: reports.append((done, total, info["loss"])), True):
            params_now = copy(params)
            runs.append(sbd.train(sbp.compile(model, optimizer=sgd), params_now, data, epochs=3, chunks_per_step=1,
                                  progress=progress))
    for other in runs[1:]:
        np.testing.assert_array_equal(other, runs[0])  # progress changes nothing
    assert [(d, n) for d, n, _ in reports] == [(1, 3), (2, 3), (3, 3)]
    assert [loss for _, _, loss in reports] == [float(np.mean(runs[0][k:k + 4])) for k in (0, 4, 8)]
    if importlib.util.find_spec("tqdm") is not None:
        assert "3/3" in capsys.readouterr().err  # the bar asked for with True


BAD = {
    "numpy data": (lambda x, t: {"X": x, "T": chunked(t)}, {}, TypeError, r"data\['X'\] must be a dask.array.Array"),
    "float32 data": (lambda x, t: {"X": chunked(x.astype(np.float32)), "T": chunked(t)}, {}, TypeError,
                     r"data\['X'\] has dtype float32"),
    "chunks differ": (lambda x, t: {"X": chunked(x, 16), "T": chunked(t, 20)}, {}, ValueError, "chunked differently"),
    "rows differ": (lambda x, t: {"X": chunked(x), "T": chunked(t[:50])}, {}, ValueError, r"data\['T'\] has 50 rows"),
    "missing input": (lambda x, t: {"X": chunked(x)}, {}, ValueError, r"'T' has the batch dimension"),
    "missing param": (lambda x, t: {"X": chunked(x), "T": chunked(t)}, {"drop": "b2"}, ValueError, r"missing \['b2'\]"),
    "unknown param": (lambda x, t: {"X": chunked(x), "T": chunked(t)}, {"add": "Z"}, ValueError, r"unknown \['Z'\]"),
    "unknown data": (lambda x, t: {"X": chunked(x), "T": chunked(t), "Z": chunked(t)}, {}, ValueError, "'Z', which is not"),
    "param as data": (lambda x, t: {"X": chunked(x), "T": chunked(t), "W1": chunked(np.ones((3, 4)))}, {"drop": "W1"},
                      ValueError, r"data\['W1'\] .* not a batch"),
    "wrong columns": (lambda x, t: {"X": chunked(x[:, :2]), "T": chunked(t)}, {}, ValueError, r"data\['X'\] must have shape"),
    "wrong param": (lambda x, t: {"X": chunked(x), "T": chunked(t)}, {"replace": ("W1", np.ones((4, 3)))},
                    sbp.ArgumentError, "W1 must have shape"),
    "1-D data": (lambda x, t: {"X": chunked(x), "T": da.from_array(t[:, 0], chunks=16)}, {}, ValueError, "must be 2-D"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_named(mlp, case):
    _, mod, params, x, t = mlp
    make, change, error, message = BAD[case]
    params = dict(params)
    if "drop" in change:
        del params[change["drop"]]
    if "add" in change:
        params[change["add"]] = np.ones((1, 1))
    if "replace" in change:
        params[change["replace"][0]] = change["replace"][1]
    with pytest.raises(error, match=message):
        sbd.value_and_grad(mod, params, make(x, t))


def test_bad_arguments_are_named(mlp):
    model, mod, params, x, t = mlp
    data = {"X": chunked(x), "T": chunked(t)}
    with pytest.raises(TypeError, match="CompiledModule"):
        sbd.value_and_grad(model, params, data)
    with pytest.raises(ValueError, match="reduction must be"):
        sbd.value_and_grad(mod, params, data, reduction="max")
    with pytest.raises(ValueError, match=r"\['W1'\] given in both"):
        sbd.value_and_grad(mod, params, {**data, "W1": chunked(np.ones((3, 4)))})
    with pytest.raises(ValueError, match="differentiates with respect to 'X'"):
        sbd.value_and_grad(sbp.compile(model, wrt=["W1", "X"]), params, data)
    with pytest.raises(TypeError, match="optimizer must be"):
        sbd.train(mod, copy(params), data)
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        sbd.train(mod, copy(params), data, optimizer=sbp.SGD(), epochs=0)
    with pytest.raises(ValueError, match="chunks_per_step must be a positive integer"):
        sbd.train(mod, copy(params), data, optimizer=sbp.SGD(), chunks_per_step=0)
    with pytest.raises(sbp.ArgumentError, match="W1 is updated in place"):
        sbd.train(mod, {**params, "W1": params["W1"].tolist()}, data, optimizer=sbp.SGD())
