"""The loop against the seeds' hand-written loops, and the four loss rules."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, ConfigurationError, Loop
from hookloop.data import move_to_device


def _dataset(samples: int = 50, features: int = 6, classes: int = 3) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, features, generator=generator)
    targets = torch.randint(0, classes, (samples,), generator=generator)
    return TensorDataset(inputs, targets)


class MLP(nn.Module):
    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))

    def forward(self, x):
        return self.net(x)


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


def test_custom_forward_is_used_as_is() -> None:
    calls = []

    def forward(loop, batch):
        inputs, targets = batch
        calls.append(loop.state.training)
        outputs = loop.model(inputs)
        return outputs, F.cross_entropy(outputs, targets) * 0 + 2.5 + outputs.sum() * 0

    model = MLP()
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(2)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=F.mse_loss, forward=forward, device="cpu", sanity_val_batches=0)
    state = loop.fit(1)
    assert calls == [True, True, False]
    assert state.metrics["train_loss"] == pytest.approx(2.5)
    assert state.metrics["val_loss"] == pytest.approx(2.5)


def test_model_output_with_loss_attribute_is_accepted() -> None:
    Output = collections.namedtuple("Output", "logits loss")

    class AttrModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x, targets):
            logits = self.mlp(x)
            return Output(logits, F.cross_entropy(logits, targets))

    model = AttrModel()
    data = [{"x": torch.randn(4, 6), "targets": torch.randint(0, 3, (4,))}]
    seen = []

    class Spy(Callback):
        def after_forward(self, loop):
            seen.append((loop.state.targets, loop.state.batch_size))

    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, callbacks=[Spy()],
         device="cpu").fit(1)
    assert torch.equal(seen[0][0], data[0]["targets"]) and seen[0][1] == 4


def _fit_error(batch, **kwargs) -> str:
    model = kwargs.pop("model", MLP())
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch], device="cpu", **kwargs)
    with pytest.raises(ConfigurationError) as info:
        loop.fit(1)
    return str(info.value)


def test_pair_without_loss_fn_says_what_to_pass() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])))
    assert "(inputs, targets) pair" in message and "loss_fn=" in message and "forward=" in message


def test_mapping_output_without_loss_lists_its_keys() -> None:
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x):
            return {"logits": self.mlp(x)}

    message = _fit_error({"x": torch.randn(2, 6)}, model=NoLoss())
    assert "model(**batch)" in message and "logits" in message and "'loss'" in message


def test_unusable_batch_lists_the_three_rules() -> None:
    message = _fit_error(torch.randn(2, 6))
    assert "Tensor" in message
    assert "forward=" in message and "loss_fn=" in message and "mapping" in message


def test_non_scalar_loss_is_reported_with_its_shape() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])),
                         loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"))
    assert "shape (2,)" in message and "reduction='mean'" in message


def test_loss_without_grad_is_reported() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])),
                         loss_fn=lambda out, y: F.cross_entropy(out.detach(), y))
    assert "does not require grad" in message


def test_forward_returning_one_value_is_reported() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])),
                         forward=lambda loop, batch: loop.model(batch[0]).sum())
    assert "(outputs, loss)" in message


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


def test_nested_batches_are_moved_with_their_containers() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(1), (torch.zeros(1), Pair(torch.ones(2), "tag"))], "n": 3}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["x"][0].device.type == "meta"
    assert isinstance(moved["x"][1], tuple) and isinstance(moved["x"][1][1], Pair)
    assert moved["x"][1][1].a.device.type == "meta" and moved["x"][1][1].b == "tag"
    assert moved["n"] == 3


def test_device_none_means_cuda_when_available_else_cpu() -> None:
    model = MLP()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [])
    assert loop.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def _shuffled_run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    loader = DataLoader(_dataset(samples=40), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    return model, Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                       loss_fn=F.cross_entropy, device="cpu")


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


@pytest.mark.parametrize("batch,targets,size", [
    ({"tokens": [[1, 2, 3, 4, 5, 6, 7], [1, 2], [3]], "labels": [0, 1, 1]}, [0, 1, 1], 3),
    ({"scale": torch.tensor(2.0), "x": torch.zeros(4, 3)}, None, 4),
    ({"meta": [torch.zeros(7)], "x": torch.zeros(5, 2)}, None, 5),
    ((torch.zeros(6, 2), torch.zeros(6)), torch.zeros(6), 6),
])
def test_batch_size_comes_from_the_samples_not_from_a_nested_sequence(batch, targets, size) -> None:
    from hookloop.data import batch_size_of

    assert batch_size_of(batch, targets) == size


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
