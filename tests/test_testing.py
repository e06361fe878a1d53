"""hookloop.testing, the kit for callback and preset authors: it finds a planted bug in each
of its checks, and passes on correct callbacks (every built-in one: test_contract.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hookloop import Callback, distributed
from hookloop.testing import (
    KitFailure,
    check_callback,
    check_declarations,
    check_dispatch,
    check_ranks,
    check_resume,
    check_state,
)


class RemembersSteps(Callback):
    """Halves the gradients of every 2nd step; its count is in its state."""

    def __init__(self) -> None:
        self.steps = 0

    def before_step(self, loop) -> None:
        if self.steps % 2 == 1:
            for parameter in loop.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(0.5)

    def after_step(self, loop) -> None:
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


class ForgetsSteps(RemembersSteps):
    """The planted bug: its state forgets the count, so a resumed run halves other steps."""

    def state_dict(self) -> dict:
        return {"version": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


class LoadsHalf(RemembersSteps):
    """The planted bug: it saves two fields and loads one back."""

    def __init__(self) -> None:
        super().__init__()
        self.losses = 0

    def after_forward(self, loop) -> None:
        self.losses += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps, "losses": self.losses}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


class WrongProduces(Callback):
    """The planted bug: writes val_twice, declares val_double."""

    def produces(self, loop):
        return ["val_double"]

    def on_validation_end(self, loop) -> None:
        loop.state.metrics["val_twice"] = 2 * loop.state.metrics["val_loss"]


class TypoAfter(RemembersSteps):
    """The planted bug: a constraint on a class that does not exist (GradClp)."""

    runs_after = {"GradClp": "clip first"}


class PerRank(Callback):
    """The planted bug: rank 1 alone halves the learning rate of some steps."""

    def before_step(self, loop) -> None:
        if distributed.rank() == 1 and loop.state.step % 3 == 1:
            for group in loop.optimizer.param_groups:
                group["lr"] *= 0.5


def instance_event() -> Callback:
    callback = Callback()
    callback.on_batch_end = lambda loop: None  # never called: the table is built from classes
    return callback


@pytest.mark.slow
def test_a_correct_callback_passes_every_check_in_process_and_across_a_relaunch(tmp_path: Path) -> None:
    check_callback(RemembersSteps, tmp_path, relaunch=True)


@pytest.mark.slow
def test_a_callback_that_forgets_a_field_fails_the_resume_check(tmp_path: Path) -> None:
    with pytest.raises(KitFailure, match=r"ForgetsSteps.*stopped after step \d+ and resumed.*weights"):
        check_resume(ForgetsSteps, tmp_path / "in_process")
    with pytest.raises(KitFailure, match="relaunched from its checkpoint differs"):
        check_resume(ForgetsSteps, tmp_path / "relaunch", relaunch=True, step=5)


def test_a_field_not_loaded_back_fails_the_state_check(tmp_path: Path) -> None:
    with pytest.raises(KitFailure, match=r"LoadsHalf.*restored from the checkpoint.*'losses'\]: 0 vs"):
        check_state(LoadsHalf, tmp_path)


def test_a_wrong_produces_fails_the_declarations_check(tmp_path: Path) -> None:
    with pytest.raises(KitFailure, match=r"writes \['val_twice'\].*declares \['val_double'\]"):
        check_declarations(WrongProduces, tmp_path)
    with pytest.raises(KitFailure, match="runs_after names \\['GradClp'\\]"):
        check_declarations(TypoAfter, tmp_path / "typo")


def test_an_event_set_on_the_instance_fails_the_dispatch_check(tmp_path: Path) -> None:
    check_dispatch(RemembersSteps, tmp_path)
    with pytest.raises(KitFailure, match="on_batch_end is set on the instance"):
        check_dispatch(instance_event, tmp_path)


@pytest.mark.slow
def test_under_torchrun_a_decision_made_on_one_rank_fails_the_ranks_check(tmp_path: Path) -> None:
    check_ranks(RemembersSteps, tmp_path / "same", timeout=240)
    with pytest.raises(KitFailure, match="rank 1 decided differently from rank 0"):
        check_ranks(PerRank, tmp_path / "different", timeout=240)
