"""The run's state (hookloop/engine/run_state.py): what users change between launches, checked
against an uninterrupted run.

The resume cases run tests/scripts/run_state.py in fresh processes, as a user relaunches a
script; the in-process cases (fit() again after an exception, loop.state_dict() loaded into
a fresh loop) compare with torch.equal.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, CheckpointError, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, GradAccumulation
from hookloop.schedules import warmup_cosine

from builders import RaiseAtBatch, SeenSamples, same_weights, shuffled_run
from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "run_state.py"
STEPS_PER_EPOCH = 6


def launch(out: Path, *args: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return torch.load(out / "result.pt", weights_only=True), result.stdout


# ------------------------------------------------------------- 1. a longer run
@pytest.mark.slow
def test_a_onecycle_run_resumed_with_more_epochs_follows_the_longer_schedule(tmp_path: Path) -> None:
    launch(tmp_path, "--epochs", "2", "--schedule", "onecycle", "--resume")
    resumed, out = launch(tmp_path, "--epochs", "4", "--schedule", "onecycle", "--resume")
    assert "resumed from" in out
    # The schedule rebuilt for 4 epochs, continued at step 12: a OneCycleLR by hand.
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.01)
    by_hand = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05,
                                                  total_steps=4 * STEPS_PER_EPOCH)
    expected = {}
    for step in range(1, 4 * STEPS_PER_EPOCH + 1):
        expected[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        by_hand.step()
    assert [step for step, _ in resumed["steps"]] == list(range(13, 25))
    for step, rate in resumed["steps"]:
        assert rate == pytest.approx(expected[step], rel=1e-12)


@pytest.mark.slow
def test_a_smoke_run_with_max_steps_resumed_without_it_keeps_learning(tmp_path: Path) -> None:
    launch(tmp_path, "--epochs", "4", "--max-steps", "7", "--schedule", "cosine", "--resume")
    resumed, _ = launch(tmp_path, "--epochs", "4", "--schedule", "cosine", "--resume")
    total = 4 * STEPS_PER_EPOCH
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.01)
    by_hand = warmup_cosine(optimizer, total, warmup_steps=3)
    expected = {}
    for step in range(1, total + 1):
        expected[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        by_hand.step()
    assert [step for step, _ in resumed["steps"]] == list(range(8, total + 1))
    assert all(rate > 0 for _, rate in resumed["steps"][:-1])
    for step, rate in resumed["steps"]:
        assert rate == pytest.approx(expected[step], rel=1e-12)


# --------------------------------------------------------------- 2. a rollback
@pytest.mark.slow
def test_a_rollback_retires_the_abandoned_files_and_resume_continues_the_new_branch(
        tmp_path: Path) -> None:
    reference, _ = launch(tmp_path / "reference", "--epochs", "3")
    launch(tmp_path, "--epochs", "4")  # the abandoned branch: files of epochs 0..3
    first = tmp_path / "ckpt" / "epoch=0000-step=00000006.pt"
    launch(tmp_path, "--epochs", "2", "--resume-from", str(first))
    retired = sorted(path.name for path in (tmp_path / "ckpt").glob("retired-after-step=*/*"))
    assert retired == ["epoch=0001-step=00000012.pt", "epoch=0002-step=00000018.pt",
                       "epoch=0003-step=00000024.pt"]  # moved, not deleted
    branch = sorted(path.name for path in (tmp_path / "ckpt").glob("epoch=*.pt"))
    assert branch == ["epoch=0000-step=00000006.pt", "epoch=0001-step=00000012.pt"]
    continued, out = launch(tmp_path, "--epochs", "3", "--resume")
    assert "epoch=0001-step=00000012.pt" in out  # the new branch's newest file
    assert same_weights(continued["weights"], reference["weights"])


# ------------------------------------------------------ 3. a finished run relaunched
@pytest.mark.slow
def test_a_run_ended_by_early_stopping_stays_ended_when_relaunched(tmp_path: Path) -> None:
    first, _ = launch(tmp_path, "--epochs", "10", "--early-stopping", "--resume")
    assert first["step"] == 4 * STEPS_PER_EPOCH and "EarlyStopping" in first["stop_reason"]
    again, out = launch(tmp_path, "--epochs", "10", "--early-stopping", "--resume")
    assert again["steps"] == [] and again["step"] == first["step"]
    assert "already ended" in out and "EarlyStopping" in out
    assert same_weights(again["weights"], first["weights"])
    longer, _ = launch(tmp_path, "--epochs", "11", "--early-stopping", "--resume")
    assert longer["steps"] and longer["steps"][0][0] == first["step"] + 1


@pytest.mark.slow
def test_a_run_whose_epochs_are_done_trains_nothing_and_says_why(tmp_path: Path) -> None:
    first, _ = launch(tmp_path, "--epochs", "2", "--resume")
    again, out = launch(tmp_path, "--epochs", "2", "--resume")
    assert again["steps"] == [] and "all 2 epochs are done" in out
    assert same_weights(again["weights"], first["weights"])


# ------------------------------------------------ 4. fit() again after an exception
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [(0, 5), (1, 0), (1, 11)])
def test_fit_again_after_an_exception_equals_an_uninterrupted_run(exc: type[BaseException],
                                                                  at: tuple[int, int]) -> None:
    reference, loop = shuffled_run([SeenSamples()])
    loop.fit(2)
    model, loop = shuffled_run([SeenSamples(), RaiseAtBatch(*at, exc, event="after_forward")])
    with pytest.raises(exc):
        loop.fit(2)
    loop.fit(2)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
    # Every sample of the interrupted epoch trained once: none twice, none skipped.
    seen = torch.cat(loop.callbacks[0].batches)
    assert seen.numel() == 2 * 96
    epoch = seen[96:] if at[0] == 1 else seen[:96]
    assert len(set(epoch.tolist())) == 96


def test_fit_again_after_an_exception_inside_an_accumulation_window() -> None:
    reference, loop = shuffled_run([GradAccumulation(4)])
    loop.fit(2)
    interrupt = RaiseAtBatch(0, 6, KeyboardInterrupt, event="after_forward")
    model, loop = shuffled_run([GradAccumulation(4), interrupt])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(2)
    loop.fit(2)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)


# --------------------------------------------- 5. another optimizer class or layout
@pytest.mark.slow
def test_resuming_into_another_optimizer_class_names_both_before_the_first_batch(
        tmp_path: Path) -> None:
    launch(tmp_path, "--epochs", "1", "--optimizer", "adam")
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--epochs", "2",
                             "--optimizer", "sgd", "--resume"], env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "CheckpointError" in result.stderr and "Adam" in result.stderr and "SGD" in result.stderr
    assert "resumed from" not in result.stdout


def test_another_param_group_layout_is_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    model, loop = shuffled_run([Checkpoint(tmp_path)])
    loop.fit(1)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    before = {name: value.clone() for name, value in other.state_dict().items()}
    groups = [{"params": other[0].parameters()}, {"params": other[3].parameters(), "lr": 0.01}]
    seen = SeenSamples()
    fresh = Loop(other, torch.optim.SGD(groups, lr=0.1, momentum=0.9), loop.train_data,
                 loss_fn=F.cross_entropy, device="cpu",
                 callbacks=[seen, Checkpoint(tmp_path, resume=True)])
    with pytest.raises(CheckpointError, match=r"param groups of sizes \[4\].*\[2, 2\]"):
        fresh.fit(2)
    assert seen.batches == []
    assert all(torch.equal(value, before[name]) for name, value in other.state_dict().items())


# ------------------------------------------------------------- 7. callback state
def test_a_callback_with_state_dict_but_no_load_state_dict_is_refused_at_fit_start() -> None:
    class HalfStateful(Callback):
        def state_dict(self) -> dict:
            return {"n": 1}

    _, loop = shuffled_run([HalfStateful()])
    with pytest.raises(ConfigurationError, match="HalfStateful.*overrides state_dict but not "
                                                 "load_state_dict"):
        loop.fit(1)


def test_state_that_cannot_be_saved_is_named_at_fit_start() -> None:
    class Window(Callback):
        def __init__(self) -> None:
            self.recent: deque = deque(maxlen=3)

        def state_dict(self) -> dict:
            return {"recent": self.recent}

        def load_state_dict(self, state: dict) -> None:
            self.recent = deque(state["recent"], maxlen=3)

    seen = SeenSamples()
    _, loop = shuffled_run([seen, Window()])
    with pytest.raises(ConfigurationError, match=r"state key 'Window'.*\['recent'\].*deque"):
        loop.fit(1)
    assert seen.batches == []


# ------------------------------------------------- the loop's state_dict itself
def test_loop_state_dict_round_trip_continues_exactly() -> None:
    reference, loop = shuffled_run()
    loop.fit(3)
    model, loop = shuffled_run()
    loop.fit(3, max_steps=17)
    saved = loop.state_dict()
    assert saved["loop"]["step"] == 17 and saved["loop"]["ended"]["reason"].startswith("max_steps")
    fresh_model, fresh = shuffled_run()

    class SeesRestoredStep(Callback):
        def on_fit_start(self, loop: Loop) -> None:
            self.step = loop.state.step

    probe = SeesRestoredStep()
    fresh.callbacks.append(probe)
    fresh.load_state_dict(saved)
    fresh.fit(3)
    assert probe.step == 17  # applied after setup, before on_fit_start
    for ours, theirs in zip(fresh_model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)


def test_history_is_kept_and_returned() -> None:
    _, loop = shuffled_run()
    loop.val_data = list(loop.train_data)[:2]
    state = loop.fit(2)
    assert [(row["epoch"], row["step"]) for row in state.history] == [(0, 12), (1, 24)]
    assert all(math.isfinite(row["val_loss"]) and "train_loss" in row for row in state.history)


def test_a_restored_run_shows_the_epoch_and_step_an_uninterrupted_one_ends_with() -> None:
    _, whole = shuffled_run()
    whole.fit(2)
    _, restored = shuffled_run()
    restored.load_state_dict(whole.state_dict())
    state = restored.fit(2)  # nothing left to train
    assert (state.epoch, state.step) == (whole.state.epoch, whole.state.step) == (1, 24)
    assert state.metrics == whole.state.metrics  # the last history row
