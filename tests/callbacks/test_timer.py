"""Time as data (issue 28, item 7): `Timer`'s ``time/train``, ``time/val`` and
``time/total``, the learning rate of every validation in ``state.history``, and
`TimeLimit.time_elapsed`/`time_remaining`.

The clocks are replaced by one a callback advances: 1 s per training batch and 2 s per
validation batch, so every total is known by hand (no wall time is measured)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, LRScheduler, TimeLimit, Timer

from builders import make_loop, regression_batches


class Ticks(Callback):
    """The fake clock: +1 s at each training batch, +2 s at each validation batch."""

    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now

    def on_batch_end(self, loop: Loop) -> None:
        self.now += 1.0

    def on_validation_batch_end(self, loop: Loop) -> None:
        self.now += 2.0


@pytest.fixture()
def ticks(monkeypatch: pytest.MonkeyPatch) -> Ticks:
    clock = Ticks()
    monkeypatch.setattr("hookloop.callbacks.timer.time.monotonic", clock)
    return clock


def _loop(callbacks: list[Callback], **options: object) -> Loop:
    # 4 training batches, 2 validation batches (slice of the training list)
    return make_loop(callbacks, train=lambda: regression_batches(4), val=slice(0, 2), **options)


def _times(row: dict[str, float]) -> tuple[float, float, float]:
    return row["time/train"], row["time/val"], row["time/total"]


def test_the_three_times_are_in_every_history_row_and_the_metrics(ticks: Ticks) -> None:
    loop = _loop([ticks, Timer()])
    state = loop.fit(3)
    # per epoch: 4 s of training batches, 2 x 2 s of validation
    assert [_times(row) for row in state.history] == [(4, 4, 8), (8, 8, 16), (12, 12, 24)]
    assert _times(state.metrics) == (12, 12, 24)


def test_validate_inside_fit_counts_as_validation_and_evaluate_alone_not(ticks: Ticks) -> None:
    class ValidateAtEpochStart(Callback):
        def on_epoch_start(self, loop: Loop) -> None:
            if loop.state.epoch == 1:
                loop.validate()  # 4 s, inside fit

    loop = _loop([ticks, ValidateAtEpochStart(), Timer()])
    loop.fit(2)
    assert _times(loop.state.history[-1]) == (8, 12, 20)
    loop.evaluate(loop.val_data)  # outside fit: not the run's time
    assert loop.callbacks[-1].seconds() == {"time/train": 8, "time/val": 12, "time/total": 20}


def test_a_resumed_run_goes_on_counting(ticks: Ticks, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _loop([ticks, Timer(), Checkpoint(tmp_path)]).fit(1)
    later = Ticks()  # another launch, another clock origin
    later.now = 9000.0
    monkeypatch.setattr("hookloop.callbacks.timer.time.monotonic", later)
    resumed = _loop([later, Timer(), Checkpoint(tmp_path, resume=True)])
    resumed.fit(3)
    assert [_times(row) for row in resumed.state.history] == [(4, 4, 8), (8, 8, 16),
                                                              (12, 12, 24)]


def test_the_learning_rate_of_every_validation_is_in_the_history() -> None:
    def halving(optimizer: torch.optim.Optimizer,
                total: int) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)

    loop = _loop([LRScheduler(halving)])  # sgd(0.1), a step scheduler: 4 steps an epoch
    state = loop.fit(2)
    assert [row["lr"] for row in state.history] == [0.1 * 0.5 ** 4, 0.1 * 0.5 ** 8]
    model = torch.nn.Linear(3, 1)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.3}]
    two = make_loop(model=model, val=slice(0, 2),
                    optimizer=lambda parameters: torch.optim.SGD(groups, lr=0.1))
    row = two.fit(1).history[0]
    assert (row["lr_group0"], row["lr_group1"]) == (0.1, 0.3) and "lr" not in row
    no_validation = make_loop()
    assert no_validation.fit(1).history[0]["lr"] == 0.1  # an epoch-end row has it too


def test_time_limit_tells_the_time_elapsed_and_remaining(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("hookloop.callbacks.time_limit.time.monotonic", lambda: now[0])
    limit = TimeLimit(60, start="created")  # counted from here, on the fake clock
    first = limit.time_elapsed()
    assert first == limit.elapsed and limit.time_remaining() == 60 - first
    now[0] += 25.0
    assert limit.time_elapsed() == first + 25.0
    assert limit.time_remaining() == 60 - first - 25.0
    now[0] += 100.0
    assert limit.time_remaining() == 0.0 and limit.time_elapsed() == first + 125.0


def test_ema_validating_both_weights_counts_both_passes_as_validation(ticks: Ticks) -> None:
    """EMA(validate="both") runs its pass inside the validation (issue 33, item 16): the
    Timer after it counts the two passes as one validation, and still writes its row."""
    from hookloop.callbacks import EMA

    loop = _loop([ticks, EMA(0.9, validate="both"), Timer()])
    state = loop.fit(2)
    # per epoch: 4 s of training batches, 2 x 2 s with the model's weights, 2 x 2 s with EMA's
    assert [_times(row) for row in state.history] == [(4, 8, 12), (8, 16, 24)]
