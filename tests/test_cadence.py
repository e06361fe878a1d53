"""Validation cadence, the sanity check, and device=None."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookloop.checks
from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import EarlyStopping, Metrics


class ValidationSteps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, loop: Loop) -> None:
        if not loop.sanity_checking:
            self.steps.append(loop.state.step)


def make_loop(callbacks: list[Callback] = (), batches: int = 4, **kwargs: object) -> Loop:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    inputs, targets = torch.randn(4 * batches, 3), torch.randn(4 * batches, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(7))
    val = DataLoader(TensorDataset(inputs[:8], targets[:8]), batch_size=4)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), loader, val_data=val,
                loss_fn=F.mse_loss, callbacks=list(callbacks), device="cpu", **kwargs)


CADENCES = [
    (dict(), [4, 8, 12, 16, 20]),
    (dict(val_every_n_epochs=2), [8, 16]),
    (dict(val_every_n_epochs=None, val_every_n_steps=3), [3, 6, 9, 12, 15, 18]),
    # steps and epoch ends; steps 12 and 20 are both: validated once
    (dict(val_every_n_steps=6), [4, 6, 8, 12, 16, 18, 20]),
]


@pytest.mark.parametrize(("kwargs", "steps"), CADENCES)
def test_validations_happen_at_the_right_steps(kwargs: dict[str, object], steps: list[int]) -> None:
    recorder = ValidationSteps()
    loop = make_loop([recorder], **kwargs)
    loop.fit(5)
    assert recorder.steps == steps


@pytest.mark.parametrize(("kwargs", "steps"), [
    pytest.param(*case) for case in CADENCES])
def test_history_has_one_row_per_validation_or_epoch_end(kwargs: dict[str, object],
                                                         steps: list[int]) -> None:
    loop = make_loop(**kwargs)
    loop.fit(5)
    rows = loop.state.history
    assert [row["step"] for row in rows if "val_loss" in row] == steps
    assert len({row["step"] for row in rows}) == len(rows)  # one row per step


def test_early_stopping_counts_validations_not_epochs() -> None:
    class Worse(Callback):
        """val_score gets worse at every validation after the first."""

        def __init__(self) -> None:
            self.count = 0

        def produces(self, loop: Loop) -> list[str]:
            return ["val_score"]

        def on_validation_end(self, loop: Loop) -> None:
            if not loop.sanity_checking:
                self.count += 1
                loop.state.metrics["val_score"] = float(self.count)

    stopper = EarlyStopping("val_score", mode="min", patience=2)
    loop = make_loop([Worse(), stopper], val_every_n_epochs=None, val_every_n_steps=2)
    loop.fit(10)
    # Validations at steps 2, 4, 6: the first is the best, patience runs out at the third.
    assert loop.state.step == 6 and stopper.wait == 2 and loop.state.epoch == 1


@pytest.mark.parametrize("kwargs", [dict(val_every_n_steps=3), dict(val_every_n_epochs=2),
                                    dict(val_every_n_epochs=None, val_every_n_steps=5)])
@pytest.mark.parametrize("stop_at", [5, 7, 8])
def test_resume_continues_the_cadence_and_the_history(kwargs: dict[str, object],
                                                      stop_at: int,
                                                      request: pytest.FixtureRequest) -> None:
    recorders = ValidationSteps(), ValidationSteps()
    whole = make_loop([recorders[0]], **kwargs)
    whole.fit(4)
    first = make_loop(**kwargs)
    first.fit(4, max_steps=stop_at)
    saved = first.state_dict()
    resumed = make_loop([recorders[1]], **kwargs)  # a fresh loop, as in a new process
    resumed.load_state_dict(saved)
    resumed.fit(4)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert recorders[1].steps == [step for step in recorders[0].steps if step > stop_at]
    assert resumed.state.history == whole.state.history


# ------------------------------------------------------------------- sanity check
class CountTrainingBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1


def test_a_metric_of_the_wrong_shape_fails_before_the_first_training_batch() -> None:
    counter = CountTrainingBatches()
    loop = make_loop([counter, Metrics(per_sample=lambda outputs, targets: outputs - targets)])
    with pytest.raises(ConfigurationError, match="shape"):
        loop.fit(3)
    assert counter.batches == 0 and loop.state.step == 0


def test_a_missing_target_fails_before_the_first_training_batch() -> None:
    counter = CountTrainingBatches()
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
    counter = CountTrainingBatches()
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


@pytest.mark.parametrize("kwargs", [dict(val_every_n_epochs=0), dict(val_every_n_steps=0),
                                    dict(val_every_n_steps=2.0)])
def test_bad_cadence(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        make_loop(**kwargs)


# ------------------------------------------------------------------- device=None
@pytest.mark.parametrize(("cuda", "mps", "expected"), [
    (True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_device_none_picks_cuda_then_mps_then_cpu(monkeypatch: pytest.MonkeyPatch, cuda: bool,
                                                  mps: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert hookloop.checks.default_device().type == expected
    model = nn.Linear(2, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.randn(1, 2),) * 2])
    assert loop.device.type == expected


def test_on_batch_end_after_a_step_validation_sees_the_training_batch() -> None:
    class Seen(Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[int, int, bool]] = []

        def on_batch_end(self, loop: Loop) -> None:
            self.rows.append((loop.state.step, loop.state.batch_idx, loop.state.training))

    seen = Seen()
    loop = make_loop([seen], val_every_n_epochs=None, val_every_n_steps=2)
    loop.fit(1)
    assert seen.rows == [(step + 1, step, True) for step in range(4)]
