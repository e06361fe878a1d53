"""``fit(min_epochs=..., min_steps=...)`` (issue 28, item 5; Lightning's Trainer flags): a
stop asked before they are reached (early stopping, ``loop.stop()``) is held and takes
effect at the first boundary where they are; ``max_steps``, ``force=True`` (TerminateOnNaN)
and a launch's end are not held; a held stop survives a checkpoint. The oracle of each
length is a run told that length directly (``max_steps``/``epochs``), compared with
``torch.equal``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping, TerminateOnNaN

from builders import Crash, RaiseAfterStep, ScriptedMetric, dropout_loop


class StopAtStep(Callback):
    """Calls ``loop.stop`` once, after optimizer step ``step``."""

    def __init__(self, step: int, **options: object) -> None:
        self.step, self.options, self.done = step, options, False

    def on_batch_end(self, loop: Loop) -> None:
        if not self.done and loop.state.step == self.step:
            self.done = True
            loop.stop(f"stopped at step {self.step}", **self.options)


def _same(first: Loop, second: Loop) -> bool:
    return all(torch.equal(value, second.model.state_dict()[key])
               for key, value in first.model.state_dict().items())


def test_early_stopping_waits_for_min_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    worse = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # patience 1: stops after epoch 1
    plain = dropout_loop([ScriptedMetric(worse), EarlyStopping("val_score", mode="min",
                                                               patience=1)])
    plain.fit(8)
    assert plain.state.epoch == 1 and plain.state.step == 8
    held = dropout_loop([ScriptedMetric(worse), EarlyStopping("val_score", mode="min",
                                                              patience=1)])
    capsys.readouterr()
    held.fit(8, min_epochs=4)
    printed = capsys.readouterr().out
    assert held.state.epoch == 3 and held.state.step == 16 and held.epoch_completed
    assert [row["val_score"] for row in held.state.history] == worse[:4]
    assert "held until min_epochs=4 was reached" in held.stop_reason
    assert printed.count("training goes on until it is") == 1
    assert "min_epochs=4 is not reached (1 epochs done, step 8)" in printed
    reference = dropout_loop()
    reference.fit(4)
    assert _same(held, reference)


def test_a_stop_waits_for_min_steps_and_then_ends_at_that_step() -> None:
    loop = dropout_loop([StopAtStep(2)])
    loop.fit(5, min_steps=6)
    assert loop.state.step == 6 and not loop.epoch_completed  # in epoch 1, after its 2nd step
    reference = dropout_loop()
    reference.fit(5, max_steps=6)
    assert _same(loop, reference)
    both = dropout_loop([StopAtStep(1)])
    both.fit(5, min_epochs=2, min_steps=6)  # both must be reached: step 8, two epochs
    assert both.state.step == 8
    early_enough = dropout_loop([StopAtStep(7)])
    early_enough.fit(5, min_steps=6)  # already reached: the stop takes effect at once
    assert early_enough.state.step == 7


def test_max_steps_force_and_non_finite_losses_are_not_held() -> None:
    capped = dropout_loop([StopAtStep(1)])
    capped.fit(3, max_steps=3, min_epochs=3)  # max_steps wins
    assert capped.state.step == 3
    forced = dropout_loop([StopAtStep(1, force=True)])
    forced.fit(3, min_epochs=3)
    assert forced.state.step == 1 and forced.stop_reason == "stopped at step 1"

    class NaNAtStep(Callback):
        def after_forward(self, loop: Loop) -> None:
            if loop.state.step == 2:
                loop.state.loss = loop.state.loss * float("nan")

    nan = dropout_loop([NaNAtStep(), TerminateOnNaN()])
    nan.fit(3, min_epochs=3)
    assert nan.state.step == 2 and "TerminateOnNaN" in nan.stop_reason


def test_a_held_stop_survives_a_checkpoint_and_the_resume_ends_where_the_run_would(
        tmp_path: Path) -> None:
    uninterrupted = dropout_loop([StopAtStep(2)])
    uninterrupted.fit(6, min_epochs=3)
    assert uninterrupted.state.step == 12
    first = dropout_loop([StopAtStep(2), RaiseAfterStep(6), Checkpoint(tmp_path)])
    with pytest.raises(Crash):
        first.fit(6, min_epochs=3)  # the exception's checkpoint holds the held stop
    second = dropout_loop([Checkpoint(tmp_path, resume=True)])
    second.fit(6, min_epochs=3)
    assert second.state.step == 12 and "stopped at step 2" in second.stop_reason
    assert _same(second, uninterrupted)


def test_bad_minimums_are_refused_before_training() -> None:
    loop = dropout_loop()
    with pytest.raises(ConfigurationError, match="min_epochs=4 is more than epochs=3"):
        loop.fit(3, min_epochs=4)
    with pytest.raises(ConfigurationError, match="min_steps=5 is more than max_steps=4"):
        loop.fit(3, max_steps=4, min_steps=5)
    with pytest.raises(ConfigurationError, match="min_epochs must be an int >= 1"):
        loop.fit(3, min_epochs=0)
    assert loop.state.step == 0


def test_the_epoch_end_that_reaches_min_epochs_saves_the_stopped_run(tmp_path: Path) -> None:
    """The held stop takes effect at the end of the epoch that reaches ``min_epochs``, so
    that epoch's ``on_epoch_end`` sees it: ``Checkpoint`` writes the stopped run there even
    when its cadence would not, and a relaunch says the run ended."""
    loop = dropout_loop([StopAtStep(2), Checkpoint(tmp_path, every_n_epochs=10, keep_last=None)])
    loop.fit(6, min_epochs=3)
    files = sorted(path.name for path in tmp_path.glob("epoch=*.pt"))
    assert files == ["epoch=0002-step=00000012.pt"]
    saved = torch.load(tmp_path / files[0], weights_only=True)
    assert "held until min_epochs=3" in saved["loop"]["ended"]["reason"]
    relaunch = dropout_loop([Checkpoint(tmp_path, resume=True)])
    relaunch.fit(6, min_epochs=3)
    assert relaunch.state.step == 12 and "already ended" in relaunch.stop_reason
