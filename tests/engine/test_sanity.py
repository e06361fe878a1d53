"""The sanity check before training: it finds a broken metric or target before the first
training batch, runs only the batches asked for, and changes nothing of the run: a run with
it ends on the same weights as a run without it (torch.equal on CPU), also with a
persistent-worker validation loader and with a callback that carries state across
batches, and a restored callback state is never touched by it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, ConfigurationError, Loop, Phase
from hookloop.callbacks import EarlyStopping, Metrics

from builders import BatchCounter
from builders import dropout_loop as make_loop


def test_a_metric_of_the_wrong_shape_fails_before_the_first_training_batch() -> None:
    counter = BatchCounter()
    loop = make_loop([counter, Metrics(per_sample=lambda outputs, targets: outputs - targets)])
    with pytest.raises(ConfigurationError, match="shape"):
        loop.fit(3)
    assert counter.batches == 0 and loop.state.step == 0


def test_a_missing_target_fails_before_the_first_training_batch() -> None:
    counter = BatchCounter()
    model = nn.Linear(3, 2)
    data = [{"x": torch.randn(4, 3), "label": torch.randint(0, 2, (4,))}]

    def forward(loop: Loop, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = loop.model(batch["x"])
        return outputs, F.cross_entropy(outputs, batch["label"])

    accuracy = Metrics(acc=lambda outputs, targets: (outputs.argmax(-1) == targets).float().mean())
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data * 50, val_data=data,
                forward=forward, callbacks=[counter, accuracy], device="cpu")
    with pytest.raises(ConfigurationError, match="no targets"):
        loop.fit(1)
    assert counter.batches == 0


def test_sanity_check_off_finds_the_error_after_the_epoch() -> None:
    counter = BatchCounter()
    loop = make_loop([counter, Metrics(per_sample=lambda outputs, targets: outputs - targets)],
                     sanity_val_batches=0)
    with pytest.raises(ConfigurationError, match="shape"):
        loop.fit(3)
    assert counter.batches == 4


def test_sanity_check_changes_nothing() -> None:
    """Dropout and a shuffled loader: any random draw the check made would show here."""
    runs = []
    for batches in (2, 0):
        metrics = Metrics(mean=lambda outputs, targets: outputs.mean())
        loop = make_loop([metrics, EarlyStopping(patience=3)], sanity_val_batches=batches)
        loop.fit(3)
        runs.append((loop, torch.get_rng_state()))
    (checked, rng_checked), (plain, rng_plain) = runs
    for name, value in plain.model.state_dict().items():
        assert torch.equal(checked.model.state_dict()[name], value), name
    assert checked.state.history == plain.state.history
    assert checked.state.metrics == plain.state.metrics
    assert torch.equal(rng_checked, rng_plain)
    assert torch.equal(checked.train_data.generator.get_state(), plain.train_data.generator.get_state())


def test_sanity_check_runs_only_the_requested_batches() -> None:
    seen = []

    class Seen(Metrics):
        def on_validation_batch_end(self, loop: Loop) -> None:
            if loop.sanity_checking:
                seen.append(loop.state.batch_idx)
            super().on_validation_batch_end(loop)

    loop = make_loop([Seen(mean=lambda o, t: o.mean())], sanity_val_batches=1)
    loop.fit(1)
    assert seen == [0]


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_bad_sanity_val_batches(value: object) -> None:
    with pytest.raises(ConfigurationError, match="sanity_val_batches"):
        make_loop(sanity_val_batches=value)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in model.state_dict().values()]


# ------------------------------------------------- a DataLoader with persistent workers
def _persistent_run(sanity_val_batches: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    features, labels = torch.randn(48, 5), torch.randint(0, 3, (48,))
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.Linear(8, 3))
    # shuffle=True without a generator: the order of every epoch is drawn from torch's
    # generator, so one extra or missing draw anywhere shifts every later epoch.
    train = DataLoader(TensorDataset(features[:32], labels[:32]), batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(features[32:], labels[32:]), batch_size=8, num_workers=1,
                     persistent_workers=True)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), train, val_data=val,
                loss_fn=F.cross_entropy, device="cpu", sanity_val_batches=sanity_val_batches)
    loop.fit(3)
    return _weights(model)


def test_a_persistent_worker_validation_loader_gives_the_same_weights_with_the_check() -> None:
    without, with_check = _persistent_run(0), _persistent_run(2)
    assert all(torch.equal(a, b) for a, b in zip(without, with_check))


# ------------------------------------ a callback that keeps state across batches
class Hidden(Callback):
    """Keeps a recurrent state across batches, as word_language_model does: reset to zeros
    of the batch size at each epoch start and each validation start, carried (detached)
    from batch to batch. The loop's forward is this callback's ``forward``."""

    def __init__(self, model: nn.Module, width: int, train_size: int, val_size: int) -> None:
        self.model, self.width = model, width
        self.train_size, self.val_size = train_size, val_size
        self.hidden: torch.Tensor | None = None
        self.resets = 0

    def on_epoch_start(self, loop):
        self.hidden = torch.zeros(self.train_size, self.width)

    def on_validation_start(self, loop):
        self.resets += 1
        self.hidden = torch.zeros(self.val_size, self.width)

    def forward(self, loop, batch):
        inputs, targets = batch
        assert self.hidden is not None and self.hidden.shape[0] == inputs.shape[0], (
            "the hidden state is not the one of this pass")
        self.hidden = torch.tanh(self.model[0](inputs) + self.model[1](self.hidden))
        outputs = self.model[2](self.hidden)
        self.hidden = self.hidden.detach()
        return outputs, F.cross_entropy(outputs, targets)

    def state_dict(self):
        return {"hidden": self.hidden}

    def load_state_dict(self, state):
        self.hidden = state["hidden"]


def _recurrent(sanity_val_batches: int, seed: int = 0) -> tuple[Loop, Hidden]:
    data = torch.Generator().manual_seed(0)  # the same data whatever the model's seed
    train = [(torch.randn(5, 4, generator=data), torch.randint(0, 2, (5,), generator=data))
             for _ in range(4)]
    val = [(torch.randn(3, 4, generator=data), torch.randint(0, 2, (3,), generator=data))
           for _ in range(2)]
    torch.manual_seed(seed)
    model = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 6, bias=False), nn.Linear(6, 2)])
    hidden = Hidden(model, 6, train_size=5, val_size=3)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), train, val_data=val,
                forward=hidden.forward, callbacks=[hidden], device="cpu",
                sanity_val_batches=sanity_val_batches)
    return loop, hidden


def test_a_forward_backed_by_a_stateful_callback_works_with_the_check_on() -> None:
    plain, _ = _recurrent(0)
    plain.fit(2)
    checked, hidden = _recurrent(2)
    checked.fit(2)  # crashed before training: the check never reset the hidden state
    assert hidden.resets == 3  # the check and two validations
    assert all(torch.equal(a, b) for a, b in zip(_weights(plain.model), _weights(checked.model)))


def test_the_check_does_not_touch_a_restored_callback_state() -> None:
    reference, reference_hidden = _recurrent(0)
    reference.fit(1)
    saved = reference.state_dict()
    kept = reference_hidden.hidden.clone()
    resumed, resumed_hidden = _recurrent(2, seed=1)
    resumed.load_state_dict(saved)

    class Sees(Callback):
        def on_fit_start(self, loop):
            self.hidden = resumed_hidden.hidden.clone()

        def on_epoch_start(self, loop):  # before Hidden resets it: after the check
            self.after_check = resumed_hidden.hidden.clone()

    sees = Sees()
    resumed.callbacks.insert(0, sees)
    resumed.fit(2)
    assert torch.equal(sees.hidden, kept)  # restored before on_fit_start
    assert torch.equal(sees.after_check, kept)  # and the check put it back
    reference.fit(2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(reference.model),
                                                 _weights(resumed.model)))


def test_loggers_and_monitors_never_see_the_check() -> None:
    seen: list[Phase] = []

    class Watcher(Callback):
        def monitors(self):
            return ["val_loss"]

        def on_validation_start(self, loop):
            seen.append(loop.phase)

    class Reporter(Callback):
        rank_zero_only = True

        def on_validation_start(self, loop):
            seen.append(loop.phase)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loop, hidden = _recurrent(2)
    loop.callbacks += [Watcher(), Reporter()]
    loop.fit(1)
    assert seen == [Phase.VALIDATE, Phase.VALIDATE]
