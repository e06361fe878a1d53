"""TerminateOnNaN: the non-finite batch never reaches the weights (hand-written loop as oracle),
training stops with a message naming epoch and step, and no NaN checkpoint replaces a good one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, TerminateOnNaN


def batches(bad: int | None, count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(count)]
    if bad is not None:
        data[bad][1][0, 0] = float("nan")
    return data


def hand_written(data: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                 accumulate: int = 1) -> nn.Module:
    """Plain loop over the first ``steps`` optimizer steps (the finite ones)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done = 0
    for index, (inputs, targets) in enumerate(data):
        if done == steps:
            break
        loss = nn.functional.mse_loss(model(inputs), targets)
        (loss / accumulate).backward()
        if (index + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
            done += 1
    return model


def make_loop(data: list[tuple[torch.Tensor, torch.Tensor]], callbacks: list[Callback]) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                loss_fn=nn.functional.mse_loss, callbacks=callbacks, device="cpu")


class Events(Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_epoch_end(self, loop: Loop) -> None:
        self.seen.append("epoch_end")

    def on_fit_end(self, loop: Loop) -> None:
        self.seen.append("fit_end")


def test_keeps_the_last_finite_weights_and_stops(capsys: pytest.CaptureFixture[str]) -> None:
    data = batches(bad=3)
    events = Events()
    loop = make_loop(data, [TerminateOnNaN(), events])
    state = loop.fit(5)
    expected = hand_written(data, steps=3)
    assert torch.equal(loop.model.weight, expected.weight)
    assert torch.equal(loop.model.bias, expected.bias)
    assert state.step == 3 and state.epoch == 0 and state.batch_idx == 3
    assert events.seen == ["epoch_end", "fit_end"]
    message = loop.stop_reason or ""
    assert "epoch 0" in message and "batch 3" in message and "step 4" in message
    assert message in capsys.readouterr().out


def test_with_accumulation_one_sync_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookloop.callbacks import GradAccumulation

    data = batches(bad=5, count=8)  # windows of 2: the NaN is in the third window
    reads = [0]
    real_item = torch.Tensor.item

    def item(self: torch.Tensor) -> object:
        reads[0] += 1
        return real_item(self)

    loop = make_loop(data, [GradAccumulation(2), TerminateOnNaN()])
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "item", item)
        loop.fit(1)
    expected = hand_written(data, steps=2, accumulate=2)
    assert torch.equal(loop.model.weight, expected.weight)
    assert loop.state.step == 2
    assert "accumulation window ending at batch 5" in (loop.stop_reason or "")
    assert reads[0] == 3  # one read per step boundary reached, none per micro-batch


def test_no_nan_checkpoint_replaces_a_good_one(tmp_path: Path) -> None:
    data = batches(bad=3)
    checkpoint = Checkpoint(tmp_path, every_n_steps=1, keep_last=1)
    loop = make_loop(data, [TerminateOnNaN(), checkpoint])
    loop.fit(5)
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["epoch=0000-step=00000003.pt"]
    saved = torch.load(tmp_path / files[0], weights_only=True)
    expected = hand_written(data, steps=3)
    assert torch.equal(saved["model"]["weight"], expected.weight)
    assert saved["loop"]["step"] == 3


def test_without_terminate_on_nan_checkpoint_refuses_nan_weights(tmp_path: Path) -> None:
    data = batches(bad=3)
    loop = make_loop(data, [Checkpoint(tmp_path, every_n_steps=1, keep_last=1)])
    with pytest.warns(RuntimeWarning, match="not finite"):
        loop.fit(2)
    assert torch.isnan(loop.model.weight).all()
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["epoch=0000-step=00000003.pt"]  # the last good file, not pruned
    saved = torch.load(tmp_path / files[0], weights_only=True)
    assert torch.isfinite(saved["model"]["weight"]).all()


def test_finite_run_is_untouched() -> None:
    data = batches(bad=None)
    loop = make_loop(data, [TerminateOnNaN()])
    loop.fit(1)
    expected = hand_written(data, steps=6)
    assert torch.equal(loop.model.weight, expected.weight)
    assert not loop.stop_requested


def test_raise_error_raises_after_skipping_the_step_and_checkpoint_saves_the_good_one(
        tmp_path: Path) -> None:
    from hookloop import NonFiniteError

    data = batches(bad=3)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[TerminateOnNaN(raise_error=True), Checkpoint(tmp_path)])
    with pytest.raises(NonFiniteError, match="non-finite loss in epoch 0, batch 3.*after step 3"):
        loop.fit(2)
    expected = hand_written(data, steps=3)
    for ours, theirs in zip(model.parameters(), expected.parameters()):
        assert torch.equal(ours, theirs)
    saved = torch.load(tmp_path / "epoch=0000-step=00000003.pt", weights_only=True)
    assert torch.equal(saved["model"]["weight"], expected.weight)


def test_raise_error_must_be_a_bool() -> None:
    from hookloop import ConfigurationError

    with pytest.raises(ConfigurationError, match="raise_error must be True or False"):
        TerminateOnNaN(raise_error="yes")
