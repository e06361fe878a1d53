"""Metrics(targets=, outputs=) on mapping batches and HF-style outputs; the DDP shard warning."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import Metrics
from hookloop.callbacks.metrics import synchronises_itself
import hookloop.distributed

from builders import accuracy


@dataclass
class Output:
    """A Hugging Face style model output: attributes, not a tensor."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, image: torch.Tensor, label: torch.Tensor | None = None) -> Output:
        logits = self.linear(image)
        loss = None if label is None else nn.functional.cross_entropy(logits, label)
        return Output(logits, loss)


def batches(count: int = 3) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"image": torch.randn(6, 4, generator=generator),
             "label": torch.randint(0, 3, (6,), generator=generator)} for _ in range(count)]


def test_targets_and_outputs_selectors_give_the_hand_computed_accuracy() -> None:
    model = Classifier()
    val = batches(3)
    metrics = Metrics(acc=accuracy, targets=lambda batch: batch["label"],
                      outputs=lambda out: out.logits)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(2), val_data=val,
                callbacks=[metrics], device="cpu")
    loop.fit(1)
    with torch.no_grad():
        correct = sum(int((model(b["image"]).logits.argmax(-1) == b["label"]).sum()) for b in val)
    assert loop.state.metrics["val_acc"] == pytest.approx(correct / 18)


def test_object_metrics_receive_the_selected_values() -> None:
    seen: list[tuple[type, type]] = []

    class Recorder:
        def reset(self) -> None:
            pass

        def update(self, outputs: object, targets: object) -> None:
            seen.append((type(outputs), type(targets)))

        def compute(self) -> float:
            return 1.0

    model = Classifier()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(1),
                val_data=batches(2), device="cpu", sanity_val_batches=0,
                callbacks=[Metrics(seen=Recorder(), targets=lambda b: b["label"],
                                   outputs=lambda out: out.logits)])
    loop.fit(1)
    assert seen == [(torch.Tensor, torch.Tensor)] * 2


def test_missing_targets_fail_at_the_first_batch_with_the_fix() -> None:
    model = Classifier()
    counter = {"batches": 0}

    class Count(Metrics):
        pass

    def counting_forward(loop: Loop, batch: dict[str, torch.Tensor]) -> tuple[object, torch.Tensor]:
        counter["batches"] += 1
        output = loop.model(**batch)
        return output, output.loss

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(3),
                val_data=batches(3), forward=counting_forward, device="cpu",
                callbacks=[Metrics(acc=accuracy, outputs=lambda out: out.logits)])
    with pytest.raises(ConfigurationError, match=r"no targets.*targets=lambda batch: batch\['label'\]"):
        loop.fit(1)
    assert counter["batches"] == 1  # the sanity check's first validation batch, before training
    assert loop.state.step == 0


def test_bad_selectors_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"Metrics targets must be a function.*got 'label'"):
        Metrics(acc=accuracy, targets="label")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"Metrics outputs must be a function.*got 1\."):
        Metrics(acc=accuracy, outputs=1)  # type: ignore[arg-type]


class LocalMean:
    """An update/compute metric that keeps its own rank's sums only."""

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += float(outputs.sum())
        self.count += outputs.numel()

    def compute(self) -> float:
        return self.total / max(self.count, 1)


class SyncedMean(LocalMean):
    """The same protocol plus what torchmetrics' Metric has: it synchronises itself."""

    dist_sync_on_step = False

    def sync(self) -> None:  # pragma: no cover - never called here
        pass


def test_self_synchronising_objects_are_recognised() -> None:
    assert not synchronises_itself(LocalMean())
    assert synchronises_itself(SyncedMean())

    class OnlyToSync(LocalMean):
        _to_sync = True

    assert synchronises_itself(OnlyToSync())


@pytest.mark.parametrize("world", [1, 2])
def test_under_ddp_an_unsynchronised_object_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                       world: int) -> None:
    # Two ranks as the metrics see them, without a process group: reductions are identity.
    monkeypatch.setattr(hookloop.distributed, "world_size", lambda: world)
    monkeypatch.setattr(hookloop.distributed, "_reduce", lambda tensor, op: tensor)
    model = nn.Linear(4, 1)
    data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(2)]
    metrics = Metrics(local=LocalMean(), synced=SyncedMean(), mean=lambda o, t: o.mean())
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data,
                loss_fn=nn.functional.mse_loss, callbacks=[metrics], device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit(3)  # a sanity check and three validations: one warning
    shard = [w for w in caught if "shard" in str(w.message)]
    if world == 1:
        assert shard == []
    else:
        assert len(shard) == 1
        message = str(shard[0].message)
        assert "'local'" in message and "'synced'" not in message and "'mean'" not in message
