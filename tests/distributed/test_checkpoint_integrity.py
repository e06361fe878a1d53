"""Sharded checkpoints on 2 ranks (torchrun, gloo, FSDP): a full disk during a save, sync
and async, is hookloop's CheckpointWriteError naming the directory on every rank, leaves
the earlier checkpoints byte for byte, and the relaunch ends on the uninterrupted run's
weights; a hostile .metadata runs no code and is refused by name on every rank. One launch
(scripts/integrity.py) serves every test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import SCRIPTS, read, run_ok


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("integrity")
    run_ok(SCRIPTS / "integrity.py", str(directory))
    return directory


@pytest.mark.parametrize("label", ["sync", "async"])
def test_a_full_disk_during_a_sharded_save_is_named_on_every_rank_and_loses_nothing(
        out: Path, label: str) -> None:
    for rank in (0, 1):  # only rank 1's write failed; both ranks say so, the same way
        seen: dict[str, Any] = read(out, f"{label}-seen", rank)
        error = seen["error"]
        assert error is not None and error["class"] == "CheckpointWriteError", error
        assert f"{out / label}/epoch=0000-step=00000004.dcp" in error["message"]
        assert "no space left on the device (the disk is full)" in error["message"]
        assert "CheckpointException" not in error["trace"], error["trace"]
        # The earlier checkpoint, byte for byte; nothing else left behind.
        assert seen["before"] and seen["after"] == seen["before"]
        assert sorted(seen["before"]) == sorted(
            f"epoch=0000-step=00000002.dcp/{name}" for name in
            (".metadata", "__0_0.distcp", "__1_0.distcp", "hookloop.pt"))
    reference, resumed = read(out, "reference-weights", 0), read(out, f"{label}-weights", 0)
    assert reference.keys() == resumed.keys()
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name


def test_a_hostile_metadata_runs_no_code_on_two_ranks_and_is_refused_by_name(out: Path) -> None:
    for rank in (0, 1):
        found = read(out, "hostile", rank)
        assert found["marker"] is False  # the pickle's open() never ran
        for how in ("resume", "load_checkpoint"):
            assert found[how] is not None and "epoch=0001-step=00000008.dcp/.metadata" in \
                found[how], (how, found[how])
