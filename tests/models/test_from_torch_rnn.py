"""sbp.from_torch of torch.nn.LSTM and torch.nn.GRU (one scan a layer over
the time-major rows) in a sequence classifier, against the same network run
by PyTorch in float64: the loss and every parameter's gradient from torch
autograd to 1e-12 relative, at L = 1 and 5, batch 1 and 3, hidden 4 and 7."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import symbackprop as sbp  # noqa: E402

tnn = torch.nn
FEATURES, CLASSES = 3, 5


class Classifier(tnn.Module):
    """x -> LSTM/GRU -> Linear of the last step's hidden state (out[:, -1],
    out[-1] time-major, or the final state h_n[-1])."""

    def __init__(self, kind, hidden, layers=1, batch_first=True, last="out"):
        super().__init__()
        self.rnn = getattr(tnn, kind)(FEATURES, hidden, num_layers=layers, batch_first=batch_first)
        self.fc = tnn.Linear(hidden, CLASSES)
        self.kind, self.last, self.batch_first = kind, last, batch_first

    def forward(self, x):
        if self.kind == "LSTM":
            out, (h, _c) = self.rnn(x)
        else:
            out, h = self.rnn(x)
        if self.last == "h":
            return self.fc(h[-1])
        return self.fc(out[:, -1] if self.batch_first else out[-1])


def _check(net, batch, steps, batch_first=True):
    torch.manual_seed(1)
    for p in net.parameters():
        torch.nn.init.uniform_(p, -0.6, 0.6)
    x = torch.randn(batch, steps, FEATURES, dtype=torch.float64)
    given = x if batch_first else x.transpose(0, 1)
    labels = torch.arange(batch) % CLASSES
    model, params = sbp.from_torch(net, given, loss="cross_entropy_labels")
    rows = np.ascontiguousarray(x.transpose(0, 1).reshape(-1, FEATURES).numpy())   # time-major
    loss, grads = sbp.compile(model).value_and_grad(X=rows, T=labels.numpy(), **params)
    expected = torch.nn.functional.cross_entropy(net(given), labels)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    ours = params.state_dict(grads)
    assert sorted(ours) == sorted(key for key, _ in net.named_parameters())   # weight_ih_l0, ... by torch's names
    for key, grad in ours.items():
        want = net.get_parameter(key).grad
        np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-12, atol=1e-12 * float(want.abs().max()),
                                   err_msg=key)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize(("batch", "steps", "hidden"), [(1, 1, 4), (3, 5, 7), (3, 1, 7), (1, 5, 4)])
def test_a_recurrent_classifier_matches_torch(kind, batch, steps, hidden):
    _check(Classifier(kind, hidden).double(), batch, steps)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("last", ["out", "h"])
def test_time_major_input_and_the_final_state_match_torch(kind, last):
    _check(Classifier(kind, 4, batch_first=False, last=last).double(), 3, 5, batch_first=False)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_stacked_layers_match_torch(kind):
    """num_layers=2: the second layer's scan reads the first's outputs; h_n[-1] is the top layer's."""
    _check(Classifier(kind, 4, layers=2, last="h").double(), 3, 5)
    _check(Classifier(kind, 7, layers=3).double(), 1, 5)


def test_one_module_takes_any_number_of_steps():
    """The steps L are X's rows over n, bound at call time: L = 2 and 6 on the model of L = 4."""
    net = Classifier("GRU", 4).double()
    model, params = sbp.from_torch(net, torch.zeros(2, 4, FEATURES, dtype=torch.float64), loss="cross_entropy_labels")
    mod = sbp.compile(model)
    for steps in (2, 6):
        x = torch.randn(2, steps, FEATURES, dtype=torch.float64)
        rows = np.ascontiguousarray(x.transpose(0, 1).reshape(-1, FEATURES).numpy())
        loss, _ = mod.value_and_grad(X=rows, T=np.array([1, 3]), **params)
        expected = torch.nn.functional.cross_entropy(net(x), torch.tensor([1, 3]))
        assert loss == pytest.approx(expected.item(), rel=1e-12)


class Bidirectional(tnn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = tnn.LSTM(FEATURES, 4, batch_first=True, bidirectional=True)
        self.fc = tnn.Linear(8, CLASSES)

    def forward(self, x):
        out, _ = self.encoder(x)
        return self.fc(out[:, -1])


class EveryStep(tnn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = tnn.GRU(FEATURES, 4, batch_first=True)
        self.fc = tnn.Linear(4, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out)


class FirstStep(EveryStep):
    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, 0])


@pytest.mark.parametrize(("net", "message"), [
    (Bidirectional(), r"encoder: LSTM\(bidirectional=True\) is not supported"),
    (EveryStep(), r"fc: .*of a sequence .* is not translated"),
    (FirstStep(), r"only the last step \(out\[:, -1\]"),
])
def test_what_is_not_translated_is_refused_by_its_module(net, message):
    with pytest.raises(sbp.ModelError, match=message):
        sbp.from_torch(net.double(), torch.zeros(2, 3, FEATURES, dtype=torch.float64), loss="cross_entropy_labels")


def test_sequences_need_a_loss_and_a_sequence():
    with pytest.raises(sbp.ModelError, match="takes a loss"):
        sbp.from_torch(Classifier("LSTM", 4).double(), torch.zeros(2, 3, FEATURES, dtype=torch.float64), loss=None)
    with pytest.raises(sbp.ModelError, match=r"LSTM takes a sequence"):
        sbp.from_torch(tnn.Sequential(tnn.Linear(FEATURES, 3), tnn.LSTM(3, 4)).double(),
                       torch.zeros(2, FEATURES, dtype=torch.float64))


class NoBias(tnn.Module):
    """Two layers without biases, dropout between them (eval mode: none), time-major."""

    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(tnn, kind)(FEATURES, 4, num_layers=2, bias=False, dropout=0.3)
        self.fc = tnn.Linear(4, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[-1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_layers_without_biases_in_eval_mode_match_torch_and_refuse_training_dropout(kind):
    net = NoBias(kind).double()
    with pytest.raises(sbp.ModelError, match=rf"rnn: {kind}\(dropout=0.3\) in training mode"):
        sbp.from_torch(net, torch.zeros(5, 3, FEATURES, dtype=torch.float64), loss="cross_entropy_labels")
    _check(net.eval(), 3, 5, batch_first=False)
