"""Metrics a callback writes in ``on_epoch_end`` (declared in ``produces()``) reach the
epoch's history row, CSVLogger's rows and the progress display, validated epochs too."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, CSVLogger, ProgressBar

from builders import make_loop


class EpochScore(Callback):
    """Writes ``score`` (10 x the epoch) and ``val_extra`` at every epoch end."""

    def produces(self, loop: Loop) -> tuple[str, ...]:
        return ("score", "val_extra")

    def on_epoch_end(self, loop: Loop) -> None:
        loop.state.metrics["score"] = 10.0 * (loop.state.epoch + 1)
        loop.state.metrics["val_extra"] = 0.5 + loop.state.epoch


class HistorySeen(Callback):
    """What the history row of the epoch holds when this callback's on_epoch_end runs."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_epoch_end(self, loop: Loop) -> None:
        self.rows.append(dict(loop.state.history[-1]))


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "no-validation"])
def test_epoch_end_metrics_are_in_history_csv_rows_and_the_progress_lines(
        tmp_path: Path, validate: bool) -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    seen = HistorySeen()
    loop = make_loop(val=slice(0, 2) if validate else None, callbacks=[
        EpochScore(), seen, CSVLogger(tmp_path / "log.csv"), ProgressBar(console=console),
        Checkpoint(tmp_path / "ckpt")])
    state = loop.fit(2)
    expected = [(10.0, 0.5), (20.0, 1.5)]
    assert [(row["score"], row["val_extra"]) for row in state.history] == expected
    assert [(row["score"], row["val_extra"]) for row in seen.rows] == expected
    assert len(state.history) == 2 and ("val_loss" in state.history[0]) == validate
    with open(tmp_path / "log.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["kind"] == "history"]
    assert [(float(row["score"]), float(row["val_extra"])) for row in rows] == expected
    lines = console.file.getvalue().splitlines()
    assert [line for line in lines if "score 10" in line and "val_extra 0.5" in line]
    assert [line for line in lines if "score 20" in line and "val_extra 1.5" in line]
    saved = torch.load(sorted((tmp_path / "ckpt").glob("epoch=0001-*.pt"))[0],
                       weights_only=True)
    assert [(row["score"], row["val_extra"]) for row in saved["loop"]["history"]] == expected


def test_a_producer_after_the_loggers_still_fills_the_history() -> None:
    seen = HistorySeen()
    state = make_loop(val=slice(0, 2), callbacks=[seen, EpochScore()]).fit(2)
    assert [row["score"] for row in state.history] == [10.0, 20.0]
    assert "score" not in seen.rows[0]  # it ran before the producer, at the same event
