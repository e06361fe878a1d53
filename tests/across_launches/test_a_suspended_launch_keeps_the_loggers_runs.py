"""TensorBoard and CSVLogger across a launch that a resumable stop ended: the relaunch
appends to the same event files and CSV file, each step exactly once and with the values of
the uninterrupted run; TensorBoard's hyper-parameters are written once, at the first launch's
start, and the session is marked finished at the run's end, not at the end of the launch
that left the run unfinished."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from hookloop import Callback, Loop, Suspended
from hookloop.callbacks import Checkpoint, CSVLogger, TensorBoard

from builders import StopAt, classification_batches, make_loop, two_layers

EPOCHS = 3


def _loop(directory: Path, *extra: Callback) -> Loop:
    return make_loop([TensorBoard(directory / "tb", every_n_steps=1),
                      CSVLogger(directory / "log.csv", every_n_steps=1), *extra,
                      Checkpoint(directory / "ckpt", resume=True)],
                     model=lambda: two_layers(5, 8, 3, torch.nn.ReLU()),
                     train=classification_batches(7, seed=1), val=slice(3),
                     loss_fn=F.cross_entropy)


def _hparams_sessions(log_dir: Path, tag: str = "_hparams_/session_start_info") -> int:
    return sum(1 for path in log_dir.glob("events.out.tfevents.*")
               for event in EventFileLoader(str(path)).Load()
               for value in event.summary.value if value.tag == tag)


ENDS = "_hparams_/session_end_info"


def test_the_relaunch_continues_the_loggers_runs_and_writes_hparams_once(tmp_path: Path) -> None:
    _loop(tmp_path / "plain").fit(EPOCHS)
    with pytest.raises(Suspended):
        _loop(tmp_path / "run", StopAt(10, resumable=True)).fit(EPOCHS)
    assert _hparams_sessions(tmp_path / "run" / "tb") == 1  # at fit start: a crash keeps it
    assert _hparams_sessions(tmp_path / "run" / "tb", ENDS) == 0  # the run is not over
    _loop(tmp_path / "run").fit(EPOCHS)

    expected, got = (EventAccumulator(str(tmp_path / name / "tb"), size_guidance={"scalars": 0})
                     for name in ("plain", "run"))
    expected.Reload()
    got.Reload()
    for tag in ("step/loss", "metrics/train_loss", "metrics/val_loss"):
        assert [(e.step, e.value) for e in got.Scalars(tag)] == \
            [(e.step, e.value) for e in expected.Scalars(tag)], tag
    assert _hparams_sessions(tmp_path / "run" / "tb") == 1  # the relaunch continued it
    assert _hparams_sessions(tmp_path / "run" / "tb", ENDS) == 1
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "run" / "log.csv"),
                                  pd.read_csv(tmp_path / "plain" / "log.csv"))
