"""``Loop(val_at_start=True)`` (issue 28, item 4): a validation before the first training
step that counts, as nanoGPT's and timm's iteration-0 evaluation. Its metrics are the
history's first row (checked against the initial model by hand), EarlyStopping and the best
checkpoint start from it, and neither a resume nor ``fit()`` again repeats it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hookloop import ConfigurationError, load_checkpoint
from hookloop.callbacks import Checkpoint, EarlyStopping

from builders import Crash, RaiseAtBatch, ValidationSteps, dropout_loop, make_loop, sgd


def _val_loss_by_hand(model: torch.nn.Module, batches: list) -> float:
    """The sample-weighted mean loss over the validation batches, model in eval mode."""
    model.eval()
    with torch.no_grad():
        total = sum(F.mse_loss(model(inputs), targets, reduction="sum").item()
                    for inputs, targets in batches)
    return total / sum(len(targets) for _, targets in batches)


def test_the_first_history_row_is_the_initial_model_s_validation_at_step_0() -> None:
    recorder = ValidationSteps()
    loop = make_loop([recorder], val=slice(0, 2), val_at_start=True)
    initial = {key: value.clone() for key, value in loop.model.state_dict().items()}
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(initial)
    expected = _val_loss_by_hand(reference, loop.val_data)
    loop.fit(2)
    assert recorder.steps == [0, 4, 8]  # the start, then every epoch end
    first = loop.state.history[0]
    assert (first["epoch"], first["step"]) == (0, 0)
    assert first["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert [row["step"] for row in loop.state.history] == [0, 4, 8]
    without = make_loop([ValidationSteps()], val=slice(0, 2))
    without.fit(2)
    assert [row["step"] for row in without.state.history] == [4, 8]  # off by default


def test_early_stopping_and_the_best_checkpoint_start_from_it(tmp_path: Path) -> None:
    """With lr=0 every validation equals the first: EarlyStopping(patience=2) counts the
    start as its best, so it stops one epoch earlier than without it, and best.pt holds
    the step-0 weights (no later value beats it)."""
    def run(val_at_start: bool, directory: Path) -> tuple:
        stopping = EarlyStopping(monitor="val_loss", patience=2)
        checkpoint = Checkpoint(directory, monitor="val_loss")
        loop = make_loop([stopping, checkpoint], val=slice(0, 2), optimizer=sgd(0.0),
                         val_at_start=val_at_start)
        loop.fit(10)
        return loop, stopping, checkpoint

    loop, stopping, checkpoint = run(True, tmp_path / "start")
    baseline, _, _ = run(False, tmp_path / "plain")
    assert loop.state.epoch == 1 and baseline.state.epoch == 2  # 2 epochs against 3
    assert stopping.best == loop.state.history[0]["val_loss"]
    assert checkpoint.top_k[0]["step"] == 0 and checkpoint.top_k[0]["epoch"] == 0
    model = torch.nn.Linear(3, 1)
    load_checkpoint(checkpoint.best_path, model)
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 torch.nn.Linear(3, 1).state_dict().values()))


def test_a_resume_does_not_repeat_it_and_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted_steps = ValidationSteps()
    uninterrupted = dropout_loop([uninterrupted_steps], val_at_start=True)
    uninterrupted.fit(3)
    first_steps = ValidationSteps()
    first = dropout_loop([first_steps, Checkpoint(tmp_path)], val_at_start=True)
    first.fit(1)
    second_steps = ValidationSteps()
    second = dropout_loop([second_steps, Checkpoint(tmp_path, resume=True)], val_at_start=True)
    second.fit(3)
    assert first_steps.steps == [0, 4] and second_steps.steps == [8, 12]
    assert uninterrupted_steps.steps == [0, 4, 8, 12]
    assert second.state.history == uninterrupted.state.history
    for key, value in uninterrupted.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[key], value), key


def test_fit_again_after_an_exception_does_not_repeat_it() -> None:
    steps = ValidationSteps()
    reference = dropout_loop([ValidationSteps()], val_at_start=True)
    reference.fit(1)
    loop = dropout_loop([steps, RaiseAtBatch(0, 0)], val_at_start=True)  # before step 1
    with pytest.raises(Crash):
        loop.fit(1)
    loop.fit(1)
    assert steps.steps == [0, 4]
    assert loop.state.history == reference.state.history
    for key, value in reference.model.state_dict().items():
        assert torch.equal(loop.model.state_dict()[key], value), key


def test_without_validation_data_it_is_refused_when_the_loop_is_built() -> None:
    with pytest.raises(ConfigurationError, match="val_at_start=True.*no val_data"):
        make_loop(val_at_start=True)
    with pytest.raises(ConfigurationError, match="val_at_start"):
        make_loop(val=slice(0, 2), val_at_start=1)
