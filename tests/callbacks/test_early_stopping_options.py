"""EarlyStopping options (Keras/Lightning): the epoch it stops at, and the weights restored."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping

from builders import ScriptedMetric, regression_batches, same_weights, two_layers
from builders import make_loop as build_loop


class Scripted(ScriptedMetric):
    """val_score = values[epoch] at each validation; records the weights validated, by epoch."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(values, weights_by="epoch")


def make_loop(callbacks: list[Callback]) -> Loop:
    return build_loop(callbacks, model=lambda: two_layers(3, 4, 1, nn.BatchNorm1d(4)),
                      train=lambda: regression_batches(2), val=slice(1))


def run(values: list[float], **kwargs: object) -> tuple[Loop, EarlyStopping, Scripted]:
    scripted = Scripted(values)
    stopper = EarlyStopping("val_score", **{"mode": "min", **kwargs})  # type: ignore[arg-type]
    loop = make_loop([scripted, stopper])
    loop.fit(len(values))
    return loop, stopper, scripted


# ----------------------------------------------------------------- stopping epochs
@pytest.mark.parametrize(("values", "kwargs", "last_epoch"), [
    # baseline 0.5 never beaten: stop after patience=2 validations (epoch 1)
    ([0.9, 0.8, 0.7, 0.6, 0.55], dict(patience=2, baseline=0.5), 1),
    # beaten at epoch 1 (wait 0), then 2 validations without improvement: epoch 3
    ([0.9, 0.4, 0.45, 0.5, 0.6, 0.7], dict(patience=2, baseline=0.5), 3),
    # start_from_epoch=2: the low values of epochs 0-1 are not counted
    ([0.1, 0.2, 0.9, 0.8, 0.85, 0.86, 0.87], dict(patience=2, start_from_epoch=2), 5),
    ([0.1, 0.2, 0.9, 0.8, 0.85, 0.86, 0.87], dict(patience=2), 2),
    # stopping_threshold: stop once strictly better (Lightning: torch.lt for min)
    ([0.9, 0.7, 0.5, 0.3, 0.2], dict(patience=9, stopping_threshold=0.5), 3),
    # divergence_threshold: stop once strictly worse
    ([0.9, 0.7, 2.0, 2.5, 0.1], dict(patience=9, divergence_threshold=2.0), 3),
    # check_finite (default): a NaN stops at once
    ([0.9, 0.7, math.nan, 0.5, 0.4], dict(patience=9), 2),
    ([0.9, 0.7, math.inf, 0.5, 0.4], dict(patience=9), 2),
    ([0.9, 0.7, math.nan, 0.5, 0.4], dict(patience=9, check_finite=False), 4),
])
def test_stops_at_the_documented_epoch(values: list[float], kwargs: dict[str, object],
                                       last_epoch: int) -> None:
    loop, stopper, _ = run(values, **kwargs)
    assert loop.state.epoch == last_epoch
    assert loop.stop_requested == (last_epoch < len(values) - 1)


def test_mode_max_thresholds() -> None:
    loop, _, _ = run([0.1, 0.5, 0.9, 0.95], mode="max", patience=9, stopping_threshold=0.9)
    assert loop.state.epoch == 3  # 0.9 is not strictly better than 0.9
    loop, _, _ = run([0.5, 0.6, 0.2, 0.9], mode="max", patience=9, divergence_threshold=0.3)
    assert loop.state.epoch == 2
    assert "divergence threshold" in (loop.stop_reason or "")


def test_messages_say_why() -> None:
    loop, _, _ = run([0.9, math.nan, 0.5], patience=9)
    assert "not finite" in (loop.stop_reason or "")
    loop, _, _ = run([0.9, 0.4, 0.3], patience=9, stopping_threshold=0.5)
    assert "stopping threshold" in (loop.stop_reason or "")


# ------------------------------------------------------------ restore_best_weights
def test_restores_the_weights_of_the_best_validation_when_it_stops() -> None:
    values = [0.9, 0.5, 0.7, 0.8, 0.6, 0.1]
    loop, stopper, scripted = run(values, patience=3, restore_best_weights=True)
    assert loop.state.epoch == 4 and stopper.best_epoch == 1
    assert same_weights(loop.model, scripted.weights_at[1])
    assert not same_weights(loop.model, scripted.weights_at[4])


def test_restores_also_when_the_epoch_limit_ends_the_run() -> None:
    """PITFALLS 19 (keras #12511): restore applies however training ends."""
    values = [0.9, 0.5, 0.7, 0.8]
    loop, stopper, scripted = run(values, patience=10, restore_best_weights=True)
    assert not loop.stop_requested and loop.state.epoch == 3
    assert same_weights(loop.model, scripted.weights_at[1])


def test_restores_the_value_that_reached_the_stopping_threshold() -> None:
    loop, stopper, scripted = run([0.9, 0.6, 0.3, 0.1], patience=9, stopping_threshold=0.5,
                                  restore_best_weights=True)
    assert loop.state.epoch == 2 and stopper.best == 0.3
    assert same_weights(loop.model, scripted.weights_at[2])


def test_no_restore_without_the_option() -> None:
    loop, _, scripted = run([0.9, 0.5, 0.7, 0.8], patience=10)
    assert not same_weights(loop.model, scripted.weights_at[1])


def test_a_nan_keeps_the_earlier_best_weights() -> None:
    loop, _, scripted = run([0.9, 0.5, 0.7, math.nan, 0.1], patience=10,
                            restore_best_weights=True)
    assert loop.state.epoch == 3 and same_weights(loop.model, scripted.weights_at[1])


def test_best_weights_survive_a_resume(tmp_path: Path) -> None:
    values = [0.9, 0.5, 0.7, 0.8, 0.6, 0.65, 0.4]
    first_scripted = Scripted(values)
    first_stopper = EarlyStopping("val_score", mode="min", patience=3, restore_best_weights=True)
    make_loop([first_scripted, first_stopper, Checkpoint(tmp_path)]).fit(3)
    saved = torch.load(tmp_path / "epoch=0002-step=00000006.pt", weights_only=True)
    held = saved["callbacks"]["EarlyStopping"]["best_weights"]
    for name, value in first_scripted.weights_at[1].items():  # the state holds them, on CPU
        assert torch.equal(held[name], value) and held[name].device.type == "cpu"
    # The file keeps the last weights for resuming (restore happened after it was written).
    assert not torch.equal(saved["model"]["0.weight"], first_scripted.weights_at[1]["0.weight"])

    stopper = EarlyStopping("val_score", mode="min", patience=3, restore_best_weights=True)
    scripted = Scripted(values)
    loop = make_loop([scripted, stopper, Checkpoint(tmp_path, resume=True)])
    loop.fit(len(values))
    assert loop.state.epoch == 4 and stopper.best_epoch == 1  # 0.7, 0.8, 0.6: patience out
    assert same_weights(loop.model, first_scripted.weights_at[1])  # from the first process
    # And the uninterrupted run ends with the same weights.
    whole, whole_stopper, _ = run(values, patience=3, restore_best_weights=True)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(loop.model.state_dict()[name], value)


def test_not_restored_after_an_exception() -> None:
    class Boom(Callback):
        def on_epoch_start(self, loop: Loop) -> None:
            if loop.state.epoch == 3:
                raise RuntimeError("boom")

    scripted = Scripted([0.9, 0.5, 0.7, 0.8])
    stopper = EarlyStopping("val_score", mode="min", patience=10, restore_best_weights=True)
    loop = make_loop([scripted, stopper, Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        loop.fit(4)
    # The last weights stay (a later fit continues from them), not the best of epoch 1.
    assert same_weights(loop.model, scripted.weights_at[2])
    assert not same_weights(loop.model, scripted.weights_at[1])
