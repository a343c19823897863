"""Progress over long work (symbackprop.progress): mod.fit's epochs, build's
models. Progress is reported (a callback, a real tqdm bar), silent where
not asked for, and never changes a result."""

import sys

import numpy as np
import pytest
from conftest import ROOT, load_example

import symbackprop as sbp
from symbackprop.cli import main
from symbackprop.run.optim import Adam

PARAMS = ("W1", "b1", "W2", "b2")


@pytest.fixture(scope="module")
def example():
    return load_example("mlp")


def _start(example, rows=19):
    arrays = example.sample_data(np.random.default_rng(3), batch=rows)
    return {k: arrays[k] for k in ("X", "T")}, {k: arrays[k].copy() for k in PARAMS}


def _by_hand(example, epochs, batch_size, seed):
    """The loop fit replaces: train_epoch on rng.permutation(rows), epoch by epoch."""
    mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
    data, params = _start(example)
    rng = np.random.default_rng(seed)
    curves = [mod.train_epoch(batch_size, rng.permutation(len(data["X"])), **data, **params) for _ in range(epochs)]
    return np.stack(curves), params


@pytest.mark.parametrize("progress", [None, False, True, "callback"])
def test_fit_equals_the_train_epoch_loop_with_or_without_progress(example, progress, capsys):
    pytest.importorskip("tqdm")
    expected, expected_params = _by_hand(example, epochs=4, batch_size=5, seed=7)
    reports = []
    mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
    data, params = _start(example)
    chosen = (lambda done, total, info: reports.append((done, total, info))) if progress == "callback" else progress
    curves = mod.fit(4, 5, shuffle=np.random.default_rng(7), progress=chosen, **data, **params)
    np.testing.assert_array_equal(curves, expected)  # bit for bit
    for k in PARAMS:
        np.testing.assert_array_equal(params[k], expected_params[k])
    err = capsys.readouterr().err
    if progress == "callback":
        assert [(d, t) for d, t, _ in reports] == [(1, 4), (2, 4), (3, 4), (4, 4)]
        assert [info["loss"] for _, _, info in reports] == [float(np.mean(row)) for row in expected]
    if progress is True:  # a real tqdm bar on stderr (not a terminal here: asked for)
        assert "epochs" in err and "4/4" in err and f"loss={float(np.mean(expected[-1])):.3g}" in err
    else:
        assert err == ""  # stderr is no terminal under pytest: no bar unless asked


def test_without_tqdm_progress_is_silent(example, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails, as when tqdm is not installed
    mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
    data, params = _start(example)
    curves = mod.fit(2, 5, progress=True, **data, **params)
    assert curves.shape == (2, 4) and capsys.readouterr().err == ""


def test_fit_checks_epochs(example):
    mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
    data, params = _start(example)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(sbp.ArgumentError, match="epochs must be a positive integer"):
            mod.fit(bad, 5, **data, **params)


def test_build_shows_progress_over_models_when_asked(tmp_path, capsys):
    pytest.importorskip("tqdm")
    files = [str(ROOT / "examples" / f"{name}.py") for name in ("mlp", "relu_net")]
    assert main(["build", *files, "--out", str(tmp_path / "a"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "models" in err and "2/2" in err
    assert main(["build", *files, "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""  # not a terminal, not asked
    for folder in ("mlp", "relu_net"):  # the same files either way
        for path in (tmp_path / "a" / folder).iterdir():
            assert path.read_bytes() == (tmp_path / "b" / folder / path.name).read_bytes()


def test_fit_takes_a_seed_or_a_bool_as_shuffle(example):
    """shuffle=42 (or np.int64): default_rng(42)'s orders; True: fresh random
    orders; False and None: the rows in order."""
    expected, expected_params = _by_hand(example, epochs=3, batch_size=5, seed=42)
    for seed in (42, np.int64(42)):
        mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
        data, params = _start(example)
        np.testing.assert_array_equal(mod.fit(3, 5, shuffle=seed, **data, **params), expected)
        for k in PARAMS:
            np.testing.assert_array_equal(params[k], expected_params[k])
    in_order = []
    for shuffle in (None, False, np.False_, 0, True):
        mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
        data, params = _start(example)
        in_order.append(mod.fit(2, 5, shuffle=shuffle, **data, **params))
    np.testing.assert_array_equal(in_order[0], in_order[1])
    np.testing.assert_array_equal(in_order[0], in_order[2])
    assert not np.array_equal(in_order[0], in_order[3])  # 0 is a seed, not False
    assert in_order[4].shape == (2, 4) and np.isfinite(in_order[4]).all()


@pytest.mark.parametrize("bad", ["yes", 1.5, [1, 2], -1, object()])
def test_fit_refuses_another_shuffle_by_name(example, bad):
    mod = sbp.compile(example.model, optimizer=Adam(lr=0.01))
    data, params = _start(example)
    before = {k: v.copy() for k, v in params.items()}
    with pytest.raises(sbp.ArgumentError, match="shuffle"):
        mod.fit(2, 5, shuffle=bad, **data, **params)
    for k in PARAMS:
        np.testing.assert_array_equal(params[k], before[k])  # nothing trained
