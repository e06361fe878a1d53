"""Validation cadence: which steps validate, the history rows they leave, and a resume that
continues both."""

from __future__ import annotations

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import EarlyStopping

from builders import ValidationSteps
from builders import dropout_loop as make_loop


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


@pytest.mark.parametrize("kwargs", [dict(val_every_n_epochs=0), dict(val_every_n_steps=0),
                                    dict(val_every_n_steps=2.0)])
def test_bad_cadence(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        make_loop(**kwargs)


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
