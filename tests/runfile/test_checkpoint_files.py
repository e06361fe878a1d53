"""CheckpointFiles: names, listing, pruning and a rollback's retirement, on a real directory."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from hookloop.runfile.checkpoint_files import CheckpointFiles


def touch_rotating(files: CheckpointFiles, epoch: int, step: int) -> str:
    return files.write_resume({"model": {"w": torch.full((1,), float(step))}, "loop": {}},
                              epoch, step, {})


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_names_listing_and_pruning(tmp_path: Path) -> None:
    files = CheckpointFiles(str(tmp_path), "run-", "val_acc")
    files.prepare()
    for epoch, step in ((1, 20), (0, 10), (2, 30)):
        touch_rotating(files, epoch, step)
    (tmp_path / ".tmp-x.part").write_bytes(b"PK")  # a killed save's leftover
    (tmp_path / "epoch=0003-step=00000040.pt").write_bytes(b"")  # another name's file
    assert [os.path.basename(path) for path in files.rotating()] == [
        "run-epoch=0000-step=00000010.pt", "run-epoch=0001-step=00000020.pt",
        "run-epoch=0002-step=00000030.pt"]
    files.write_best({"w": torch.ones(1)}, 0.75, 2, 30, {"val_acc": 0.75},
                     files.scored_name(0.75, 30))
    assert files.scored() == [(0.75, 30, files.path("run-best-val_acc=0.75-step=00000030.pt"))]
    files.prune_rotating(files.path("run-epoch=0002-step=00000030.pt"), keep_last=2)
    assert [os.path.basename(path) for path in files.rotating()] == [
        "run-epoch=0001-step=00000020.pt", "run-epoch=0002-step=00000030.pt"]
    files.prepare()  # a new start: the temporary file goes, nothing else
    assert ".tmp-x.part" not in names(tmp_path)
    assert "epoch=0003-step=00000040.pt" in names(tmp_path)


def test_retire_after_moves_the_later_files_and_keeps_the_resumed_one(tmp_path: Path) -> None:
    files = CheckpointFiles(str(tmp_path), "", "val_loss")
    paths = {step: touch_rotating(files, step // 10 - 1, step) for step in (10, 20, 30)}
    for value, step in ((0.5, 10), (0.3, 30)):
        files.write_best({"w": torch.ones(1)}, value, step // 10 - 1, step, {},
                         files.scored_name(value, step))
    files.link_best(files.scored_name(0.3, 30))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files.retire_after({"hookloop": {"step": 10}}, paths[10])
    assert "abandons 4 later file(s)" in str(caught[0].message)
    assert sorted(os.listdir(tmp_path / "retired-after-step=00000010")) == [
        "best-val_loss=0.3-step=00000030.pt", "best.pt", "epoch=0001-step=00000020.pt",
        "epoch=0002-step=00000030.pt"]
    assert names(tmp_path) == ["best-val_loss=0.5-step=00000010.pt",  # and no marker left
                               "epoch=0000-step=00000010.pt", "retired-after-step=00000010"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files.retire_after({"hookloop": {"step": 10}}, paths[10])  # nothing later any more: nothing moves
    assert not caught and len(names(tmp_path)) == 3
