"""EarlyStopping against the seeds' patience loop on scripted metric sequences."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hookloop import CallbackOrderError, Callback, ConfigurationError, Loop
from hookloop.callbacks import EarlyStopping

from builders import ScriptedMetric as Scripted
from builders import make_loop, regression_batches, sgd


def seed_patience_loop(values: list[float], patience: int, min_delta: float = 0.0,
                       mode: str = "min") -> tuple[int, float, int]:
    """The seeds' loop (000, 'early stopping outside the epoch'), with min_delta and mode.

    Returns the number of epochs trained, the best value and the final bad-epoch count.
    """
    sign = 1.0 if mode == "min" else -1.0
    best_loss = float("inf")
    bad_epochs = 0
    epochs = 0
    for value in values:
        epochs += 1
        val_loss = sign * value
        if val_loss < best_loss - min_delta:
            best_loss = val_loss
            bad_epochs = 0
        else:
            bad_epochs += 1
        if bad_epochs >= patience:
            break
    return epochs, sign * best_loss, bad_epochs


def fit(values: list[float], stopper: EarlyStopping) -> Loop:
    loop = make_loop([Scripted(values), stopper], model=lambda: nn.Linear(2, 1),
                     train=lambda: regression_batches(1, size=3, features=2),
                     val=lambda train: train, optimizer=sgd(0.01), seed=None)
    loop.fit(len(values))
    return loop


SEQUENCES = [
    [1.0, 0.9, 0.95, 0.97, 0.91, 0.8, 0.85, 0.86, 0.9, 0.99, 0.7],
    [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # equal is not an improvement
    [3.0, 2.0, 1.0, 0.5, 0.25, 0.1],  # always improving: never stops
    [1.0, math.nan, math.nan, 0.9, 0.95, 0.96, 0.97],  # NaN never improves
    [0.3, 0.29, 0.289, 0.2885, 0.288, 0.2879, 0.1],  # small steps vs min_delta
]


@pytest.mark.parametrize("values", SEQUENCES)
@pytest.mark.parametrize("patience", [1, 2, 3])
@pytest.mark.parametrize("min_delta", [0.0, 0.005])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_matches_the_seed_patience_loop(values: list[float], patience: int, min_delta: float,
                                        mode: str) -> None:
    epochs, best, wait = seed_patience_loop(values, patience, min_delta, mode)
    # check_finite=False: the seed's loop counts a NaN as an epoch without improvement.
    stopper = EarlyStopping("val_score", mode=mode, patience=patience, min_delta=min_delta,
                            check_finite=False)
    loop = fit(values, stopper)
    assert loop.state.epoch + 1 == epochs
    assert (stopper.best, stopper.wait) == (best, wait)
    stopped = epochs < len(values) or wait >= patience
    assert loop.stop_requested == stopped
    if stopped:
        assert "EarlyStopping: val_score did not improve" in (loop.stop_reason or "")


def test_first_epoch_improves_even_with_patience_one() -> None:
    stopper = EarlyStopping("val_score", mode="min", patience=1)
    loop = fit([5.0, 4.0, 3.0], stopper)
    assert loop.state.epoch == 2 and not loop.stop_requested and stopper.best == 3.0


def test_state_round_trip_continues_the_count() -> None:
    values = [1.0, 0.5, 0.6, 0.7, 0.8, 0.9]
    first = EarlyStopping("val_score", mode="min", patience=3)
    for value in values[:3]:
        first.update(value)
    second = EarlyStopping("val_score", mode="min", patience=3)
    second.load_state_dict(first.state_dict())
    results = [second.update(value) for value in values[3:]]
    assert results == [False, True, True]
    assert seed_patience_loop(values, 3) == (5, 0.5, 3)


def test_state_dict_is_plain() -> None:
    state = EarlyStopping().state_dict()
    assert state == {"best": math.inf, "wait": 0, "best_epoch": -1, "best_step": -1}


def test_monitored_metric_must_exist_and_come_first() -> None:
    model = nn.Linear(2, 1)
    data = [(torch.randn(3, 2), torch.randn(3, 1))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                loss_fn=nn.functional.mse_loss, callbacks=[EarlyStopping()], device="cpu")
    with pytest.raises(CallbackOrderError, match="'val_loss'.*val_data"):
        loop.fit(1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data, val_data=data,
                loss_fn=nn.functional.mse_loss,
                callbacks=[EarlyStopping("val_score"), Scripted([1.0])], device="cpu")
    with pytest.raises(CallbackOrderError, match="must come after"):
        loop.fit(1)


def test_monitoring_train_loss_without_validation() -> None:
    model = nn.Linear(2, 1)
    torch.manual_seed(0)
    data = [(torch.randn(3, 2), torch.randn(3, 1))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=10.0), data,
                loss_fn=nn.functional.mse_loss, callbacks=[EarlyStopping("train_loss", patience=2)],
                device="cpu")
    loop.fit(50)  # lr=10 diverges: the loss stops improving at once
    assert loop.stop_requested and loop.state.epoch < 49


@pytest.mark.parametrize("kwargs", [dict(patience=0), dict(patience=-1), dict(patience=1.5),
                                    dict(mode="lowest"), dict(min_delta=-0.1),
                                    dict(min_delta=math.nan), dict(monitor=""), dict(name="")])
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        EarlyStopping(**kwargs)  # type: ignore[arg-type]


class EveryEpochEnd(Callback):
    """Writes the next scripted value at every on_epoch_end, a cut-short epoch's too."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def produces(self, loop: Loop) -> list[str]:
        return ["score"]

    def on_epoch_end(self, loop: Loop) -> None:
        loop.state.metrics["score"] = self.values.pop(0)


class StopInEpoch(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch, self.done = epoch, False

    def on_batch_end(self, loop: Loop) -> None:
        if not self.done and loop.state.epoch == self.epoch and loop.state.batch_idx == 0:
            self.done = True
            loop.stop("test")


def test_an_epoch_cut_short_by_stop_is_not_counted_even_with_the_metric_present() -> None:
    whole = [1.0, 0.9, 0.95, 0.97, 0.99]  # the values of the whole epochs 0..4
    decoy = 0.1  # written at the end of epoch 2, cut short: it must not become the best
    stopper = EarlyStopping("score", mode="min", patience=3)
    model = nn.Linear(2, 1)
    data = [(torch.randn(3, 2), torch.randn(3, 1)) for _ in range(3)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[EveryEpochEnd(whole[:2] + [decoy] + whole[2:]), StopInEpoch(2),
                           stopper])
    loop.fit(10)
    assert loop.state.epoch == 2 and (stopper.best, stopper.wait) == (0.9, 0)
    loop.fit(10)  # continues epoch 2, then 3 and 4
    epochs, best, wait = seed_patience_loop(whole, patience=3)
    assert (epochs, best, wait) == (5, 0.9, 3)
    assert loop.state.epoch + 1 == epochs
    assert (stopper.best, stopper.wait, stopper.best_epoch) == (best, wait, 1)


def test_a_train_loss_of_a_cut_short_first_epoch_is_not_counted() -> None:
    stopper = EarlyStopping("train_loss", patience=3)
    model = nn.Linear(2, 1)
    data = [(torch.randn(3, 2), torch.randn(3, 1)) for _ in range(3)]
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
         loss_fn=nn.functional.mse_loss, device="cpu",
         callbacks=[StopInEpoch(0), stopper]).fit(3)
    assert (stopper.best, stopper.wait, stopper.best_epoch) == (math.inf, 0, -1)
