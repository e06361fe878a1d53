"""CSVLogger: the file read back with pandas equals loop.state.history and the losses the loop
computed; rows are neither lost nor repeated across a crash and a resume."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, CSVLogger, Metrics

from builders import (Crash, RaiseAfterStep, StepRecorder, accuracy, classification_batches,
                      two_layers)
from builders import make_loop as build_loop


def make_loop(callbacks, *, val: bool = True) -> Loop:
    return build_loop(callbacks, model=lambda: two_layers(5, 8, 3, torch.nn.ReLU()),
                      train=classification_batches(5, seed=1), val=slice(2) if val else None,
                      loss_fn=F.cross_entropy)


def test_rows_read_back_equal_history_and_step_losses(tmp_path: Path) -> None:
    path, recorder = tmp_path / "logs" / "run.csv", StepRecorder()
    loop = make_loop([Metrics(acc=accuracy), CSVLogger(path, every_n_steps=3), recorder])
    history = loop.fit(3).history
    frame = pd.read_csv(path)
    assert list(frame.columns[:5]) == ["kind", "epoch", "step", "loss", "lr"]
    rows = frame[frame.kind == "history"][["epoch", "step", "train_loss", "val_loss", "val_acc"]]
    expected = pd.DataFrame(history)[["epoch", "step", "train_loss", "val_loss", "val_acc"]]
    pd.testing.assert_frame_equal(rows.reset_index(drop=True), expected, check_exact=True)
    steps = frame[frame.kind == "step"]
    assert list(steps.step) == [3, 6, 9, 12, 15]
    assert list(steps.loss) == [recorder.loss[step] for step in steps.step]  # exact: repr floats
    assert (steps.lr == 0.1).all() and steps.val_loss.isna().all()


def test_without_validation_a_row_per_epoch_and_a_new_run_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    make_loop([CSVLogger(path)], val=False).fit(2)
    make_loop([CSVLogger(path)], val=False).fit(2)  # a new run: the file starts again
    frame = pd.read_csv(path)
    assert list(frame.kind) == ["history", "history"] and list(frame.step) == [5, 10]


def test_fit_again_on_the_same_loop_appends(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    loop = make_loop([CSVLogger(path, every_n_steps=5)])
    loop.fit(1)
    loop.fit(3)
    frame = pd.read_csv(path)
    assert list(frame.step) == [5, 5, 10, 10, 15, 15]


@pytest.mark.parametrize(("every", "crash_step"), [(3, 8), (5, 7), (5, 11)])
def test_crash_after_a_checkpoint_then_resume_repeats_no_row(tmp_path: Path, every: int,
                                                            crash_step: int) -> None:
    reference = tmp_path / "reference.csv"
    make_loop([Metrics(acc=accuracy), CSVLogger(reference, every_n_steps=2)]).fit(3)

    path, checkpoints = tmp_path / "run.csv", tmp_path / "checkpoints"
    with pytest.raises(Crash):
        make_loop([Metrics(acc=accuracy), CSVLogger(path, every_n_steps=2),
                   Checkpoint(checkpoints, every_n_steps=every), RaiseAfterStep(crash_step)]).fit(3)
    make_loop([Metrics(acc=accuracy), CSVLogger(path, every_n_steps=2),
               Checkpoint(checkpoints, every_n_steps=every, resume=True)]).fit(3)
    pd.testing.assert_frame_equal(pd.read_csv(path), pd.read_csv(reference), check_exact=True)


def test_bad_interval() -> None:
    with pytest.raises(ConfigurationError, match="every_n_steps"):
        CSVLogger("x.csv", every_n_steps=0)


def test_step_validation_values_appear_once_each(tmp_path: Path) -> None:
    """Validation every 3 steps, 7 batches an epoch: each val_loss sits in the row of its
    validation; the epoch-end rows (steps 7, 14) hold train_loss only, never a stale copy."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(7)]
    path = tmp_path / "log.csv"
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:2],
         loss_fn=F.cross_entropy, device="cpu", val_every_n_epochs=None, val_every_n_steps=3,
         sanity_val_batches=0, callbacks=[CSVLogger(path)]).fit(2)
    history = pd.read_csv(path)
    history = history[history.kind == "history"]
    assert list(history.dropna(subset=["val_loss"]).step) == [3, 6, 9, 12]
    assert list(history.dropna(subset=["train_loss"]).step) == [7, 14]
