"""The digits example end to end (needs scikit-learn): it reaches 95% test
accuracy, train_epoch and train_step calls agree bit for bit, and PyTorch
trained from the same start in the same data order follows the same loss
curve (where PyTorch is installed)."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import EXAMPLES, load_example

pytest.importorskip("sklearn")

EPOCHS, BATCH, LR = 12, 32, 3e-3


@pytest.fixture(scope="module")
def script():
    return load_example("train_digits")


@pytest.fixture(scope="module")
def start(script):
    return script.setup(seed=0, epochs=EPOCHS)


@pytest.fixture(scope="module")
def trained(script, start):
    return script.train_symbackprop(start, BATCH, LR, "epoch")


def test_the_data_is_the_bundled_digits(start):
    data = start["data"]
    assert data["X_train"].shape == (1438, 64) and data["X_test"].shape == (359, 64)
    assert data["X_train"].min() >= 0.0 and data["X_train"].max() <= 1.0
    assert set(np.unique(data["y_train"])) == set(range(10))
    assert len(start["orders"]) == EPOCHS
    assert all(sorted(order) == list(range(1438)) for order in start["orders"])


def test_training_reaches_95_percent_test_accuracy(script, start, trained):
    mod, params, curves, _ = trained
    digits = start["digits"]
    assert curves.shape == (EPOCHS, 45)  # 1438 rows: 44 batches of 32 and one of 30
    assert curves[-1].mean() < 0.25 * curves[0].mean()
    accuracy = script.accuracy(mod, params, start["data"]["X_test"], start["data"]["y_test"], digits.CLASSES)
    assert accuracy >= 0.95


def test_accuracy_is_counted_by_hand(script, start, trained):
    """The script's accuracy against logits computed in numpy."""
    mod, params, _, _ = trained
    X, y = start["data"]["X_test"], start["data"]["y_test"]
    logits = np.tanh(X @ params["W1"] + params["b1"]) @ params["W2"] + params["b2"]
    assert script.accuracy(mod, params, X, y, 10) == pytest.approx(np.mean(logits.argmax(axis=1) == y))


def test_train_step_calls_give_the_same_curve(script, start, trained):
    _, _params, curves, _ = trained
    _, _step_params, step_curves, _ = script.train_symbackprop(start, BATCH, LR, "step", epochs=3)
    np.testing.assert_array_equal(step_curves, curves[:3])


def test_pytorch_follows_the_same_loss_curve(script, start, trained):
    torch = pytest.importorskip("torch")
    _, params, curves, _ = trained
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # its spinning threads crawl on a busy 2-core machine
    try:
        torch_curves, _, torch_params = script.train_torch(start, BATCH, LR)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_allclose(torch_curves, curves, rtol=1e-9, atol=1e-12)
    for k, v in params.items():
        np.testing.assert_allclose(torch_params[k], v, rtol=1e-7, atol=1e-10, err_msg=k)


def test_the_script_runs_and_reports(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "12", "--no-torch"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "epoch  12/12 [########################] loss" in out
    assert "accuracy: test" in out
    assert "median time per epoch: symbackprop train_epoch" in out and "train_step loop" in out
