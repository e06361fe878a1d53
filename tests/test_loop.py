"""The loop against the seeds' hand-written loops: training, validation, losses weighted by
samples, a stop mid-epoch, evaluate/predict, and what the loop leaves behind."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import AMP, GradAccumulation, Metrics
from hookloop.engine.data import move_to_device

from builders import MLP, classification_dataset, make_loop, shuffled, shuffled_run, two_layers


def _dataset(samples: int = 50, features: int = 6, classes: int = 3) -> TensorDataset:
    return classification_dataset(samples, features=features, classes=classes, seed=1)


class DictModel(nn.Module):
    """Hugging Face style: called with keyword inputs, returns a dict holding the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, labels):
        logits = self.mlp(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def _seed_train_one_epoch(model, loader, optimizer, device):
    """Seed 000, train_one_epoch: model(**batch), outputs["loss"], backward, step, zero_grad."""
    model.train()
    for batch in loader:
        batch = move_to_device(batch, device)
        outputs = model(**batch)
        loss = outputs["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _seed_validate(model, loader, device):
    """Seed 000, validate; weighted by batch size as SPEC asks (equal here for even batches)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            batch = move_to_device(batch, device)
            outputs = model(**batch)
            size = batch["labels"].shape[0]
            total += outputs["loss"].item() * size
            count += size
    return total / count


def _dict_loader(dataset, batch_size, shuffle=False, seed=0):
    def collate(items):
        x, y = zip(*items)
        return {"x": torch.stack(x), "labels": torch.stack(y)}

    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=collate,
                      generator=generator)


def test_no_callbacks_equals_the_seed_plain_loop() -> None:
    dataset = _dataset()
    torch.manual_seed(3)
    reference = DictModel()
    model = copy.deepcopy(reference)
    device = torch.device("cpu")

    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train, val = _dict_loader(dataset, 8, shuffle=True), _dict_loader(dataset, 10)
    val_losses = []
    for _ in range(3):
        _seed_train_one_epoch(reference, train, optimizer, device)
        val_losses.append(_seed_validate(reference, val, device))

    loop_val_losses = []

    class Collect(Callback):
        def on_validation_end(self, loop):
            loop_val_losses.append(loop.state.metrics["val_loss"])

    loop = Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                _dict_loader(dataset, 8, shuffle=True), val_data=_dict_loader(dataset, 10),
                callbacks=[Collect()], device="cpu")
    state = loop.fit(3)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    assert loop_val_losses == pytest.approx(val_losses, rel=1e-6)
    assert state.step == 3 * 7  # ceil(50 / 8) steps per epoch


def test_pair_batches_with_loss_fn_equal_the_mvp_loop_and_losses_are_sample_weighted() -> None:
    dataset = _dataset(samples=23)  # uneven last batch: 5 + 5 + 5 + 5 + 3
    torch.manual_seed(5)
    reference = MLP()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(dataset, batch_size=5)
    total, count = 0.0, 0
    reference.train()
    for inputs, labels in loader:  # seed 002, section 2.1 (plus the epoch loss)
        outputs = reference(inputs)
        loss = F.cross_entropy(outputs, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item() * len(labels)
        count += len(labels)
    reference.eval()
    with torch.no_grad():
        val_total = sum(F.cross_entropy(reference(x), y, reduction="sum").item() for x, y in loader)

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                DataLoader(dataset, batch_size=5), val_data=DataLoader(dataset, batch_size=5),
                loss_fn=F.cross_entropy, device="cpu")
    state = loop.fit(1)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    assert state.metrics["train_loss"] == pytest.approx(total / count, rel=1e-6)
    assert state.metrics["val_loss"] == pytest.approx(val_total / 23, rel=1e-6)


def test_empty_training_set_is_reported_before_training() -> None:
    model = MLP()
    empty = DataLoader(TensorDataset(torch.randn(0, 6), torch.zeros(0)), batch_size=4)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), empty,
                loss_fn=F.cross_entropy, device="cpu")
    with pytest.raises(ConfigurationError, match="train_data is empty"):
        loop.fit(1)


def test_empty_iterable_without_length_is_reported() -> None:
    model = MLP()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), iter(()),
                loss_fn=F.cross_entropy, device="cpu")
    with pytest.raises(ConfigurationError, match="no batches"):
        loop.fit(1)


@pytest.mark.parametrize("epochs", [-1, 1.5, "2", True])
def test_bad_epochs_are_rejected(epochs) -> None:
    model = MLP()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], device="cpu")
    with pytest.raises(ConfigurationError, match="epochs must be"):
        loop.fit(epochs)


def test_bad_model_and_optimizer_are_rejected() -> None:
    with pytest.raises(ConfigurationError, match="torch.nn.Module"):
        Loop(lambda x: x, None, [])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="torch.optim.Optimizer"):
        Loop(MLP(), [1, 2], [])  # type: ignore[arg-type]


def _shuffled_run(seed: int = 0):
    loop = make_loop(model=lambda: two_layers(6, 16, 3, nn.Dropout(0.3), nn.ReLU()),
                     train=shuffled(_dataset(samples=40), 4, seed=seed),
                     loss_fn=F.cross_entropy, seed=seed)
    return loop.model, loop


def test_a_fit_stopped_mid_epoch_continues_that_epoch_with_the_same_order() -> None:
    reference, loop = _shuffled_run()
    loop.fit(2)
    model, loop = _shuffled_run()
    assert loop.fit(2, max_steps=3).step == 3
    assert loop.fit(2).step == 20
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)


def test_stop_inside_an_accumulation_window_finishes_the_window() -> None:
    class Window(Callback):
        def setup(self, loop):
            loop.accumulation_steps = 3

        def on_batch_end(self, loop):
            seen.append(loop.state.batch_idx)
            if loop.state.batch_idx == 0:
                loop.stop("asked at the first micro-batch")

    seen: list[int] = []
    model, loop = _shuffled_run()
    loop.callbacks = [Window()]
    state = loop.fit(1)
    assert seen == [0, 1, 2] and state.step == 1
    assert all(p.grad is None for p in model.parameters())  # nothing left half-accumulated


def test_val_loss_of_dict_of_lists_batches_is_sample_weighted() -> None:
    class Lengths(nn.Module):
        """Loss of a batch = mean over its samples of (sequence length); one weight to train."""

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))

        def forward(self, tokens, labels):
            lengths = torch.tensor([float(len(t)) for t in tokens])
            return {"loss": (lengths * self.weight).mean()}

    val = [{"tokens": [[1] * 7, [1, 1]], "labels": [0, 1]},      # lengths 7, 2: mean 4.5
           {"tokens": [[1], [1], [1], [1]], "labels": [0] * 4}]  # lengths 1 x 4: mean 1
    model = Lengths()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.0), val, val_data=val,
                device="cpu")
    hand = (7 + 2 + 1 + 1 + 1 + 1) / 6  # every sample once
    assert loop.validate()["val_loss"] == pytest.approx(hand)


def test_every_on_fit_end_runs_even_when_one_raises() -> None:
    closed = []

    class Broken(Callback):
        def on_fit_end(self, loop):
            raise OSError("disk full")

    class Closer(Callback):
        def on_fit_end(self, loop):
            closed.append(True)

    model = MLP()
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,)))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                callbacks=[Broken(), Closer()], device="cpu")
    with pytest.raises(OSError, match="disk full") as info:
        loop.fit(1)
    assert closed == [True]
    assert "Broken at event on_fit_end" in "\n".join(info.value.__notes__)

    class Failing(Callback):
        def on_batch_end(self, loop):
            raise RuntimeError("mid-batch")

    loop.callbacks = [Failing(), Broken(), Closer()]
    with pytest.raises(RuntimeError, match="mid-batch") as info:
        loop.fit(2)
    assert closed == [True, True]
    assert "on_fit_end also raised OSError('disk full')" in "\n".join(info.value.__notes__)


# ------------------------------------------------------- passes outside training


def test_evaluate_and_predict() -> None:
    model, loop = shuffled_run([Metrics(acc=lambda out, y: (out.argmax(-1) == y).float().mean())])
    loop.fit(1)
    data = list(loop.train_data)[:3]
    model.eval()
    with torch.no_grad():
        outputs = torch.cat([model(inputs) for inputs, _ in data])
        targets = torch.cat([labels for _, labels in data])
    model.train()
    result = loop.evaluate(data, prefix="test")
    assert set(result) == {"test_loss", "test_acc"}
    assert result["test_loss"] == pytest.approx(F.cross_entropy(outputs, targets).item(), rel=1e-6)
    assert result["test_acc"] == pytest.approx((outputs.argmax(-1) == targets).float().mean().item())
    assert model.training  # the mode is put back
    predicted = loop.predict(data)
    assert torch.equal(predicted, outputs)
    assert loop.predict([inputs for inputs, _ in data]).shape == outputs.shape


def test_passes_outside_training_keep_each_submodule_s_mode() -> None:
    model, loop = shuffled_run()
    loop.val_data = list(loop.train_data)[:2]
    model.train()
    model[1].eval()  # a frozen dropout: the user's choice survives every pass
    loop.validate()
    loop.evaluate(loop.val_data)
    loop.predict(loop.val_data)
    assert model.training and not model[1].training


def test_the_state_releases_the_last_batch_after_fit() -> None:
    _, loop = shuffled_run()
    state = loop.fit(1)
    assert state.batch is None and state.outputs is None and state.loss is None
    assert state.targets is None


# --------------------------------------------------- one way to change the loss


class L2Penalty(Callback):
    def __init__(self, weight: float) -> None:
        self.weight = weight

    def after_forward(self, loop: Loop) -> None:
        penalty = sum(param.pow(2).sum() for param in loop.model.parameters())
        loop.state.loss = loop.state.loss + self.weight * penalty


@pytest.mark.parametrize("with_amp", [False, True])
def test_a_penalty_added_in_after_forward_counts_once_under_accumulation_and_amp(
        with_amp: bool) -> None:
    weight, k = 0.01, 4
    torch.manual_seed(0)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(8)]
    hand = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    start = {name: value.clone() for name, value in hand.state_dict().items()}
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.1)
    losses = []
    for index, (inputs, targets) in enumerate(data):
        loss = F.cross_entropy(hand(inputs), targets)
        loss = loss + weight * sum(param.pow(2).sum() for param in hand.parameters())
        losses.append(loss.item())
        (loss / k).backward()
        if (index + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model.load_state_dict(start)
    callbacks: list[Callback] = [AMP(torch.float16, scaler={"init_scale": 1024.0})] if with_amp else []
    callbacks += [GradAccumulation(k), L2Penalty(weight)]
    if with_amp:  # float16 autocast on CPU computes in half precision: compare loosely
        callbacks[0] = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                callbacks=callbacks, device="cpu")
    state = loop.fit(1)
    tolerance = 5e-3 if with_amp else 1e-6
    for ours, theirs in zip(model.parameters(), hand.parameters()):
        assert torch.allclose(ours, theirs, atol=tolerance), (ours - theirs).abs().max()
    assert state.metrics["train_loss"] == pytest.approx(sum(losses) / len(losses),
                                                        rel=1e-2 if with_amp else 1e-6)


def test_the_step_geometry_is_one_value_for_the_whole_fit() -> None:
    """As DDP does: setup gives the loop a shard of the data (half its batches), on_fit_end
    gives the user's data back. Every callback reads the fit's counts up to the last
    on_fit_end (a DDP fit read 24 at on_fit_start and 48 at on_fit_end); outside a fit
    they are read afresh."""
    seen: list[tuple[str, int | None, int | None]] = []

    class Shard(Callback):
        def setup(self, loop):
            self.whole, loop.train_data = loop.train_data, loop.train_data[::2]

        def on_fit_end(self, loop):
            loop.train_data = self.whole

    class Read(Callback):
        def on_fit_start(self, loop):
            seen.append(("on_fit_start", loop.batches_per_epoch, loop.total_steps))

        def on_epoch_start(self, loop):
            seen.append(("on_epoch_start", loop.batches_per_epoch, loop.total_steps))

        def on_fit_end(self, loop):
            seen.append(("on_fit_end", loop.batches_per_epoch, loop.total_steps))

    loop = make_loop([Shard(), Read(), GradAccumulation(2)],
                     train=lambda: [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(12)])
    state = loop.fit(2)
    # By hand: 6 batches of the shard an epoch, windows of 2: 3 steps, 2 epochs: 6.
    assert state.step == 6
    assert seen == [("on_fit_start", 6, 6), ("on_epoch_start", 6, 6),
                    ("on_epoch_start", 6, 6), ("on_fit_end", 6, 6)]
    assert (loop.batches_per_epoch, loop.steps_per_epoch) == (12, 6)  # afresh after the fit


def test_a_model_whose_train_override_returns_nothing_validates_and_trains() -> None:
    """A common override keeps BatchNorm frozen and forgets ``return self``: the loop sets
    the mode and reads it back, never relying on what ``train()``/``eval()`` return."""

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.norm = nn.Linear(3, 1), nn.BatchNorm1d(1)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.norm(self.linear(inputs))

        def train(self, mode: bool = True) -> None:  # type: ignore[override]
            super().train(mode)
            self.norm.eval()

    model = Frozen()
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    seen: list[bool] = []

    class Modes(Callback):
        def on_batch_start(self, loop: Loop) -> None:
            seen.append(loop.state.training and loop.model.training)
            assert not model.norm.training  # the override's own choice holds

        def on_validation_batch_start(self, loop: Loop) -> None:
            seen.append(loop.state.training or loop.model.training)

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data,
                loss_fn=F.mse_loss, device="cpu", callbacks=[Modes()])
    loop.fit(2)
    assert seen == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3
