"""sbp.from_torch of torch.nn.LSTM and torch.nn.GRU (one scan a layer and
direction over the time-major rows) in sequence classifiers and per-step
models, against the same network run by PyTorch in float64: the loss and
every parameter's gradient from torch autograd to 1e-12 relative, at L = 1
and 5, batch 1 and 3, hidden 4 and 7, bidirectional or not; and what is
not translated, refused by its module."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.nn.utils.rnn import pack_padded_sequence  # noqa: E402

import symbackprop as sbp  # noqa: E402

tnn = torch.nn
FEATURES, CLASSES = 3, 5


class Classifier(tnn.Module):
    """x -> LSTM/GRU -> Linear of one step: the last (out[:, -1], out[-1]
    time-major), the first (out[:, 0]), the final state h_n[-1], or both
    directions' final states side by side (cat(h_n[-2], h_n[-1]))."""

    def __init__(self, kind, hidden, layers=1, batch_first=True, last="out", bidirectional=False):
        super().__init__()
        self.rnn = getattr(tnn, kind)(FEATURES, hidden, num_layers=layers, batch_first=batch_first,
                                      bidirectional=bidirectional)
        width = hidden * (2 if bidirectional and last in ("out", "first", "cat") else 1)
        self.fc = tnn.Linear(width, CLASSES)
        self.kind, self.last, self.batch_first = kind, last, batch_first

    def forward(self, x):
        if self.kind == "LSTM":
            out, (h, _c) = self.rnn(x)
        else:
            out, h = self.rnn(x, None)  # hx=None: the zero state
        if self.last == "h":
            return self.fc(h[-1])
        if self.last == "cat":
            return self.fc(torch.cat((h[-2], h[-1]), dim=1))
        step = 0 if self.last == "first" else -1
        return self.fc(out[:, step] if self.batch_first else out[step])


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


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize(("last", "batch_first", "layers"), [
    ("out", True, 1), ("first", False, 2), ("h", True, 2), ("cat", False, 1)])
def test_bidirectional_layers_match_torch(kind, last, batch_first, layers):
    """The backward direction a reversed scan: its outputs beside the forward's
    per step (its last step its first state), h_n in torch's order."""
    net = Classifier(kind, 4, layers=layers, batch_first=batch_first, last=last, bidirectional=True).double()
    _check(net, 3, 5, batch_first=batch_first)


@pytest.mark.parametrize("last", ["out", "first"])
def test_the_first_and_last_steps_of_one_direction_match_torch(last):
    _check(Classifier("GRU", 4, last=last).double(), 2, 4)


class Steps(tnn.Module):
    """Ends of two bidirectional layers and of a sum computed per step."""

    def __init__(self):
        super().__init__()
        self.gru = tnn.GRU(FEATURES, 4, batch_first=True, bidirectional=True)
        self.lstm = tnn.LSTM(FEATURES, 4, batch_first=True, bidirectional=True)
        self.fc = tnn.Linear(24, CLASSES)

    def forward(self, x):
        a, _ = self.gru(x)
        b, _ = self.lstm(x)
        return self.fc(torch.cat((a[:, -1], b[:, -1], (a + b)[:, 0]), dim=1))


def test_steps_of_several_layers_and_of_their_sum_match_torch():
    _check(Steps().double(), 3, 5)


class EveryStep(tnn.Module):
    """A score per step: Linear, an activation and arithmetic on every step's output."""

    def __init__(self, kind="GRU", batch_first=True):
        super().__init__()
        self.rnn = getattr(tnn, kind)(FEATURES, 4, batch_first=batch_first)
        self.fc = tnn.Linear(4, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(x)
        return torch.tanh(self.fc(out)) * 2 + 1


@pytest.mark.parametrize(("kind", "batch_first"), [("GRU", True), ("LSTM", False)])
def test_every_steps_outputs_match_torch(kind, batch_first):
    """Y is the time-major (L*n) x k rows of torch's output; a mean squared
    error against T of those rows, at two lengths with one module."""
    net = EveryStep(kind, batch_first).double()
    example = torch.zeros((2, 3, FEATURES) if batch_first else (3, 2, FEATURES), dtype=torch.float64)
    model, params = sbp.from_torch(net, example, loss="mse")
    mod = sbp.compile(model)
    for batch, steps in ((2, 3), (3, 6)):
        x, t = torch.randn(batch, steps, FEATURES, dtype=torch.float64), torch.randn(batch, steps, CLASSES,
                                                                                      dtype=torch.float64)
        given, target = (x, t) if batch_first else (x.transpose(0, 1), t.transpose(0, 1))
        rows = {"X": _time_major(x), "T": _time_major(t), "batch": np.arange(batch)}
        loss, grads = mod.value_and_grad(**rows, **params)
        net.zero_grad()
        out = net(given)
        expected = torch.nn.functional.mse_loss(out, target)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
        rows_out = out.transpose(0, 1) if batch_first else out
        np.testing.assert_allclose(mod.forward(**rows, **params)["Y"], rows_out.reshape(-1, CLASSES).detach().numpy(),
                                   rtol=1e-12)
        for key, grad in params.state_dict(grads).items():
            want = net.get_parameter(key).grad
            np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-12, atol=1e-12 * float(want.abs().max()))


def _time_major(x):
    """(n, L, k) as the (L*n) x k rows from_torch reads."""
    return np.ascontiguousarray(x.transpose(0, 1).reshape(-1, x.shape[-1]).numpy())


def test_without_a_loss_the_batch_input_binds_n():
    net = Classifier("LSTM", 4, bidirectional=True).double()
    model, params = sbp.from_torch(net, torch.zeros(2, 3, FEATURES, dtype=torch.float64), loss=None)
    assert [str(i) for i in model.inputs] == ["X", "batch"]
    x = torch.randn(3, 5, FEATURES, dtype=torch.float64)
    got = sbp.compile(model).forward(X=_time_major(x), batch=np.arange(3), **params)["Y"]
    np.testing.assert_allclose(got, net(x).detach().numpy(), rtol=1e-12)


class Middle(tnn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = tnn.GRU(FEATURES, 4, batch_first=True)
        self.fc = tnn.Linear(4, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, 1])


class Reshaped(Middle):
    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out).reshape(-1, CLASSES)


class Projected(Middle):
    def __init__(self):
        super().__init__()
        self.rnn = tnn.LSTM(FEATURES, 4, batch_first=True, proj_size=2)
        self.fc = tnn.Linear(2, CLASSES)


class Packed(Middle):
    def forward(self, x):
        packed = tnn.utils.rnn.pack_padded_sequence(x, [3, 3], batch_first=True)
        out, _ = self.rnn(packed)
        out, _ = tnn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.fc(out)


class PackedByName(Middle):
    def forward(self, x):
        out, _ = self.rnn(pack_padded_sequence(x, [3, 3], batch_first=True))
        return self.fc(out)


class StateComputed(Middle):
    def forward(self, x, h0):
        out, _ = self.rnn(x, h0 * 2)
        return self.fc(out[:, -1])


class TokensIntoLSTM(Middle):
    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out)


@pytest.mark.parametrize(("net", "message"), [
    (Middle(), r"only the last or the first step \(out\[:, -1\] or out\[:, 0\]"),
    (Reshaped(), r"Tensor.reshape\(\) of sequences is not translated.*return them as they are"),
    (Projected(), r"rnn: LSTM\(proj_size=2\) is not translated; use proj_size=0"),
    (Packed(), r"packed sequences .* are not translated.*pass it the padded"),
    (PackedByName(), r"packed sequences .* are not translated"),
])
def test_what_is_not_translated_is_refused_by_its_module(net, message):
    with pytest.raises(sbp.ModelError, match=message):
        sbp.from_torch(net.double(), torch.zeros(2, 3, FEATURES, dtype=torch.float64), loss="cross_entropy_labels")


def test_initial_states_not_as_torch_takes_them_are_refused():
    """A state computed in the forward, one of another number of layers, an
    LSTM's h_0 alone, and an example state that is not (layers, batch, H)."""
    x, h0 = torch.zeros(2, 3, FEATURES, dtype=torch.float64), torch.zeros(1, 2, 4, dtype=torch.float64)
    with pytest.raises(sbp.ModelError, match=r"got the initial states h0 \(the model's inputs h0\), which from_torch "
                       r"translates only as an LSTM's or GRU's hx"):
        sbp.from_torch(StateComputed().double(), (x, h0), loss="cross_entropy_labels")
    with pytest.raises(sbp.ModelError, match=r"rnn: LSTM's initial states must be \(h_0, c_0\), each of 2 layers"):
        sbp.from_torch(Started("LSTM", layers=2).double(), (x, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)),
                       loss="cross_entropy_labels")
    with pytest.raises(sbp.ModelError, match=r"rnn: LSTM's initial states must be \(h_0, c_0\)"):
        sbp.from_torch(Started("LSTM", pair=False).double(), (x, h0), loss="cross_entropy_labels")
    with pytest.raises(sbp.ModelError, match=r"initial states of an LSTM or GRU.*got one of shape \(2, 4\)"):
        sbp.from_torch(Started("GRU").double(), (x, h0[0]), loss="cross_entropy_labels")


class Started(tnn.Module):
    """x -> LSTM/GRU from the initial states the forward is given -> Linear
    of the last step: forward(x, h0, c0), forward(x, (h0, c0)) (`pair`), or
    an LSTM handed h0 alone (pair=False, refused as torch refuses it)."""

    def __init__(self, kind, layers=1, bidirectional=False, pair=None):
        super().__init__()
        self.rnn = getattr(tnn, kind)(FEATURES, 4, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.fc = tnn.Linear(4 * (2 if bidirectional else 1), CLASSES)
        self.kind, self.pair = kind, pair

    def forward(self, x, h0, c0=None):
        if self.kind == "GRU" or self.pair is False:
            out, _ = self.rnn(x, h0)
        else:
            out, _ = self.rnn(x, h0 if self.pair else (h0, c0))
        return self.fc(out[:, -1])


def _states(name, tensor):
    """An initial state tensor (layers * directions, n, H) as the model's inputs."""
    if len(tensor) == 1:
        return {name: tensor[0].numpy()}
    return {f"{name}_{k}": tensor[k].numpy() for k in range(len(tensor))}


@pytest.mark.parametrize(("kind", "layers", "bidirectional", "pair"), [
    ("LSTM", 1, False, False), ("LSTM", 2, True, False), ("LSTM", 2, False, True),
    ("GRU", 1, False, False), ("GRU", 2, True, False)])
def test_initial_states_are_inputs_and_match_torch(kind, layers, bidirectional, pair):
    """forward(x, h0[, c0]) or forward(x, (h0, c0)): each layer and
    direction's initial states are the model's inputs (h0 or h0_0, h0_1,
    ... in torch's order; of a pair given as `h0`, h0_0_k and h0_1_k), the
    loss and every parameter's gradient torch autograd's, at two batches."""
    torch.manual_seed(3)
    net = Started(kind, layers, bidirectional, pair=pair or None).double()
    for p in net.parameters():
        torch.nn.init.uniform_(p, -0.6, 0.6)
    count = layers * (2 if bidirectional else 1)
    example = [torch.zeros(2, 3, FEATURES, dtype=torch.float64), torch.zeros(count, 2, 4, dtype=torch.float64)]
    if kind == "LSTM":
        example = [example[0], tuple(example[1:]) * 2] if pair else example + [example[1]]
    model, params = sbp.from_torch(net, tuple(example), loss="cross_entropy_labels")
    mod = sbp.compile(model)
    for batch, steps in ((3, 4), (2, 1)):
        x = torch.randn(batch, steps, FEATURES, dtype=torch.float64)
        h0, c0 = (torch.randn(count, batch, 4, dtype=torch.float64) for _ in range(2))
        labels = torch.arange(batch) % CLASSES
        if kind == "GRU":
            states, args = _states("h0", h0), (h0,)
        elif pair:
            states, args = {**_states("h0_0", h0), **_states("h0_1", c0)}, ((h0, c0),)
        else:
            states, args = {**_states("h0", h0), **_states("c0", c0)}, (h0, c0)
        assert sorted(str(i) for i in model.inputs) == sorted(["X", "T", *states])
        loss, grads = mod.value_and_grad(X=_time_major(x), T=labels.numpy(), **states, **params)
        net.zero_grad()
        expected = torch.nn.functional.cross_entropy(net(x, *args), labels)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-12)
        for key, grad in params.state_dict(grads).items():
            want = net.get_parameter(key).grad
            np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-12, atol=1e-12 * float(want.abs().max()),
                                       err_msg=key)


class EncoderDecoder(tnn.Module):
    """An encoder's final states as the decoder's initial ones (seq2seq)."""

    def __init__(self, kind):
        super().__init__()
        self.encoder = getattr(tnn, kind)(FEATURES, 4, num_layers=2, batch_first=True)
        self.decoder = getattr(tnn, kind)(FEATURES, 4, num_layers=2, batch_first=True)
        self.fc = tnn.Linear(4, CLASSES)

    def forward(self, x):
        _, state = self.encoder(x)
        out, _ = self.decoder(x, state)
        return self.fc(out[:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_an_encoders_final_states_start_the_decoder_as_in_torch(kind):
    _check(EncoderDecoder(kind).double(), 3, 4)


def test_token_ids_into_a_recurrent_layer_say_to_embed_them():
    with pytest.raises(sbp.ModelError, match=r"rnn: GRU of token ids: embed them first"):
        sbp.from_torch(TokensIntoLSTM().double(), torch.zeros(2, 3, dtype=torch.int64), loss="cross_entropy_labels")


def test_a_recurrent_layer_needs_a_sequence():
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


class NamedBatch(EveryStep):
    """A parameter named like the input that gives the number of sequences."""

    def __init__(self):
        super().__init__()
        self.batch = tnn.Parameter(torch.zeros(CLASSES))

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out) + self.batch


def test_a_parameter_named_batch_is_refused_where_the_input_needs_the_name():
    with pytest.raises(sbp.ModelError, match="a parameter is named 'batch'"):
        sbp.from_torch(NamedBatch().double(), torch.zeros(2, 3, FEATURES, dtype=torch.float64), loss="mse")
