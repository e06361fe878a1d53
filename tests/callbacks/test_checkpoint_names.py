"""Checkpoint's names and messages use one numbering (issue 28, item 14): a resume from
``epoch=0001-...`` says "epoch 1", and a finished run's directory keeps no
``dropped-at-step=`` file that nothing needs; one that a kept file needs is explained at
the run's end."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, Loop, load_checkpoint
from hookloop.callbacks import Checkpoint

from builders import Crash, RaiseAfterStep, ScriptedMetric

SCORES = [0.9, 0.8, 0.7, 0.6]  # val_score per epoch, better each time (mode "min")


class TopAtStart(Callback):
    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint, self.values = checkpoint, []

    def on_fit_start(self, loop: Loop) -> None:
        self.values = [entry["value"] for entry in self.checkpoint.top_k]


def run(directory: Path, epochs: int, *extra: Callback, resume: bool | str = False,
        keep_last: int = 1, monitor: bool = True) -> tuple[Loop, Checkpoint]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    checkpoint = Checkpoint(directory, monitor="val_score" if monitor else None,
                            mode="min" if monitor else "auto", resume=resume,
                            keep_last=keep_last)
    scores = [ScriptedMetric(SCORES, "val_score")] if monitor else []
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=F.mse_loss, device="cpu",
                callbacks=[*scores, *extra, checkpoint, TopAtStart(checkpoint)])
    loop.fit(epochs)
    return loop, checkpoint


def resumed_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if "resumed from" in line]


def test_a_resume_names_the_epoch_as_the_file_does(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, 2, monitor=False)  # 4 steps an epoch: the last file is epoch 1's end
    path = tmp_path / "epoch=0001-step=00000008.pt"
    assert sorted(os.listdir(tmp_path)) == [path.name]
    capsys.readouterr()
    run(tmp_path, 3, resume=True, monitor=False)
    lines = resumed_lines(capsys)
    assert lines == [f"Checkpoint: resumed from {path} (epoch 1 complete, step 8)."]
    named = re.search(r"epoch=(\d+)", lines[0]).group(1)
    said = re.search(r"\(epoch (\d+)", lines[0]).group(1)
    assert int(named) == int(said) == 1


def test_a_resume_mid_epoch_names_that_epoch(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(Crash):  # after step 6: epoch 1, its second batch; saved on the way out
        run(tmp_path, 3, RaiseAfterStep(6), monitor=False)
    path = tmp_path / "epoch=0001-step=00000006.pt"
    assert path.name in os.listdir(tmp_path)
    capsys.readouterr()
    run(tmp_path, 3, resume=True, monitor=False)
    assert resumed_lines(capsys) == [f"Checkpoint: resumed from {path} (epoch 1, step 6)."]


def test_a_finished_run_keeps_no_set_aside_file_nothing_needs(tmp_path: Path) -> None:
    """best.pt is replaced at every validation; the file it held was set aside for the
    rotating file of its step, which keep_last=1 then deleted: the last file, written after
    the last validation, does not rank it."""
    loop, _ = run(tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch=0001-step=00000008.pt"]
    loop, checkpoint = run(tmp_path, 3, resume=True)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "epoch=0002-step=00000012.pt"]
    assert checkpoint.best == 0.7
    best = torch.nn.Linear(3, 1)
    load_checkpoint(tmp_path / "best.pt", best)  # the last validation's weights: the best
    assert all(torch.equal(p, q) for p, q in zip(best.parameters(), loop.model.parameters()))


def test_a_set_aside_file_that_a_kept_file_needs_is_explained_at_the_run_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, 2, keep_last=2)
    aside = "dropped-at-step=00000008-best-val_score=0.9-step=00000004.pt"
    assert sorted(os.listdir(tmp_path)) == ["best.pt", aside, "epoch=0000-step=00000004.pt",
                                            "epoch=0001-step=00000008.pt"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [
        f"Checkpoint: kept {aside}: the weights validated at step 4, out of the top k since "
        "step 8, for a rollback to epoch=0000-step=00000004.pt (resume= that file ranks them "
        "again); deleted with it.",
        "hookloop: training ended at epoch 2/2, step 8: all 2 epochs are done."]
    # The rollback it is kept for: the older file ranks those weights again.
    with pytest.warns(RuntimeWarning, match="abandons"):
        loop, checkpoint = run(tmp_path, 1, resume=str(tmp_path / "epoch=0000-step=00000004.pt"),
                               keep_last=2)
    assert loop.callbacks[-1].values == [0.9]  # step 4's score, its weights set aside
    assert checkpoint.best == 0.9
