"""Metrics against hand computations over the whole dataset, with an uneven last batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Metrics

from builders import accuracy


class MeanAbsoluteError:
    """torchmetrics-style object: update/compute/reset, sums kept inside."""

    def __init__(self) -> None:
        self.resets = 0
        self.reset()

    def reset(self) -> None:
        self.total, self.count = 0.0, 0
        self.resets += 1

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        picked = outputs.gather(1, targets[:, None]).squeeze(1)
        self.total += float((picked - 1).abs().sum())
        self.count += len(targets)

    def compute(self) -> torch.Tensor:
        return torch.tensor(self.total / self.count)


def data() -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(13, 5, generator=generator),
                          torch.randint(0, 3, (13,), generator=generator))
    val = TensorDataset(torch.randn(10, 5, generator=generator),
                        torch.randint(0, 3, (10,), generator=generator))
    return train, val


def test_validation_metrics_match_a_hand_computation() -> None:
    """10 validation samples in batches of 4, 4, 2: a mean of batch means would be wrong."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    train, val = data()
    mae = MeanAbsoluteError()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(train, batch_size=4),
                val_data=DataLoader(val, batch_size=4), loss_fn=nn.functional.cross_entropy,
                callbacks=[Metrics(acc=accuracy, mae=mae)], device="cpu")
    loop.fit(2)
    with torch.no_grad():
        outputs = model(val.tensors[0])
    targets = val.tensors[1]
    expected_acc = (outputs.argmax(-1) == targets).sum().item() / 10
    expected_mae = (outputs.gather(1, targets[:, None]).squeeze(1) - 1).abs().sum().item() / 10
    assert loop.state.metrics["val_acc"] == pytest.approx(expected_acc, abs=1e-12)
    assert loop.state.metrics["val_mae"] == pytest.approx(expected_mae, rel=1e-6)
    batch_means = [accuracy(model(x), y).item() for x, y in DataLoader(val, batch_size=4)]
    assert sum(batch_means) / 3 != pytest.approx(expected_acc)  # the test can tell them apart
    assert mae.resets >= 3  # once at creation, once per validation pass
    assert isinstance(loop.state.metrics["val_acc"], float)


def test_train_metrics_match_a_hand_written_loop() -> None:
    """train_<name> uses each batch's training outputs (before its step), sample-weighted."""
    train, val = data()
    torch.manual_seed(0)
    reference = nn.Linear(5, 3)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    correct = 0
    for inputs, targets in DataLoader(train, batch_size=4):  # 4, 4, 4, 1
        outputs = reference(inputs)
        correct += (outputs.argmax(-1) == targets).sum().item()
        nn.functional.cross_entropy(outputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(train, batch_size=4),
                loss_fn=nn.functional.cross_entropy,
                callbacks=[Metrics(acc=accuracy, on_train=True)], device="cpu")
    loop.fit(1)
    assert loop.state.metrics["train_acc"] == pytest.approx(correct / 13, abs=1e-12)
    assert "val_acc" not in loop.state.metrics  # no validation data


def test_metrics_are_written_before_later_callbacks_read_them() -> None:
    seen: list[tuple[str, set[str]]] = []

    class Reader(Callback):
        def monitors(self) -> list[str]:
            return ["val_acc", "train_acc"]

        def on_validation_start(self, loop: Loop) -> None:
            seen.append(("validation_start", set(loop.state.metrics)))

        def on_validation_end(self, loop: Loop) -> None:
            seen.append(("validation_end", set(loop.state.metrics)))

    train, val = data()
    model = nn.Linear(5, 3)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(train, batch_size=4),
                val_data=DataLoader(val, batch_size=4), loss_fn=nn.functional.cross_entropy,
                callbacks=[Metrics(acc=accuracy, on_train=True), Reader()], device="cpu")
    loop.fit(1)
    assert seen == [("validation_start", {"train_loss", "train_acc"}),
                    ("validation_end", {"train_loss", "train_acc", "val_loss", "val_acc"})]


def test_produces_declares_the_names() -> None:
    assert list(Metrics(acc=accuracy).produces(None)) == ["val_acc"]
    assert sorted(Metrics(acc=accuracy, on_train=True).produces(None)) == ["train_acc", "val_acc"]


def test_validate_alone_writes_val_metrics() -> None:
    train, val = data()
    model = nn.Linear(5, 3)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(train, batch_size=4),
                val_data=DataLoader(val, batch_size=4), loss_fn=nn.functional.cross_entropy,
                callbacks=[Metrics(acc=accuracy, on_train=True)], device="cpu")
    metrics = loop.validate()
    assert set(metrics) == {"val_loss", "val_acc"}


def test_no_host_sync_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host reads (.tolist/.item) do not grow with the number of batches: one per pass."""
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def count_reads(batch_size: int) -> int:
        calls = [0]

        def tolist(self: torch.Tensor) -> object:
            calls[0] += 1
            return real_tolist(self)

        def item(self: torch.Tensor) -> object:
            calls[0] += 1
            return real_item(self)

        train, val = data()
        model = nn.Linear(5, 3)
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    DataLoader(train, batch_size=batch_size),
                    val_data=DataLoader(val, batch_size=batch_size),
                    loss_fn=nn.functional.cross_entropy,
                    callbacks=[Metrics(acc=accuracy, on_train=True)], device="cpu")
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "tolist", tolist)
            patch.setattr(torch.Tensor, "item", item)
            loop.fit(1)
        return calls[0]

    assert count_reads(1) == count_reads(13)


def test_bad_metrics() -> None:
    with pytest.raises(ConfigurationError, match="at least one"):
        Metrics()
    with pytest.raises(ConfigurationError, match=r"Metrics acc must be a function.*got 3\."):
        Metrics(acc=3)
    train, val = data()
    model = nn.Linear(5, 3)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(train, batch_size=4),
                val_data=DataLoader(val, batch_size=4), loss_fn=nn.functional.cross_entropy,
                callbacks=[Metrics(per_class=lambda out, y: out.mean(0))], device="cpu")
    with pytest.raises(ConfigurationError, match="shape \\(3,\\)"):
        loop.fit(1)


def test_metrics_take_a_name() -> None:
    metrics = Metrics(acc=lambda out, y: (out.argmax(-1) == y).float().mean(), name="x")
    assert metrics.state_key == "x" and list(metrics.produces(None)) == ["val_acc"]
