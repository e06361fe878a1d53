"""A background save that fails on one rank is a named error on every rank at the same step
(issue 36 item 5), and the launch exits non-zero: scripts/background_failure.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from launch import SCRIPTS, read, torchrun


@pytest.mark.slow
def test_a_background_save_failed_on_rank_0_is_a_named_error_on_every_rank_at_one_step(
        tmp_path: Path) -> None:
    """2 ranks (torchrun, gloo, DDP): rank 0's background write of step 3 fails; both ranks
    raise at the boundary of step 4 (before, rank 1 went on training alone and waited in
    the next all-reduce), rank 0 its own error, rank 1 one naming rank 0 and the cause,
    and the launch exits non-zero without a hang."""
    result = torchrun(SCRIPTS / "background_failure.py", str(tmp_path), timeout=150)
    assert result.returncode != 0, result.stdout[-4000:]
    errors = [read(tmp_path, "error", rank) for rank in (0, 1)]
    assert all(error is not None for error in errors), result.stdout[-4000:]
    for error in errors:
        assert error["class"] == "CheckpointWriteError", error
        assert "epoch=0000-step=00000003.pt" in error["message"], error
        assert "input/output error" in error["message"], error
        assert error["step"] == 4, error
    assert "failed on rank 0" in errors[1]["message"]


@pytest.mark.slow
def test_at_a_resume_on_two_ranks_each_file_is_hashed_by_one_rank(tmp_path: Path) -> None:
    """Each file of the newest directory hashed once in all (before: once per rank), the
    resumed weights those the run saved, and a bit flipped in a file rank 1 hashes refused
    by name on both ranks with the same message."""
    from launch import run_ok

    run_ok(SCRIPTS / "digest_split.py", str(tmp_path))
    seen = [read(tmp_path, "hashed", rank) for rank in (0, 1)]
    newest = seen[0]["newest"]
    files = sorted(name for name in os.listdir(tmp_path / "ckpt" / newest)
                   if name != "hookloop.pt")
    hashed = [sorted(item for item in part["files"] if item.startswith(newest))
              for part in seen]
    assert sorted(hashed[0] + hashed[1]) == [f"{newest}/{name}" for name in files]
    assert not set(hashed[0]) & set(hashed[1]) and hashed[0] and hashed[1]
    damaged = [read(tmp_path, "damaged", rank) for rank in (0, 1)]
    assert damaged[0]["error"] is not None and damaged[0]["error"] == damaged[1]["error"]
    assert damaged[0]["file"] in damaged[0]["error"]
    assert "other bytes than the save wrote" in damaged[0]["error"]
    assert f"damaged/{damaged[0]['file']}" in str(damaged[1]["hashed"])  # rank 1's turn
    # hookloop.load_checkpoint on both ranks (into an unsharded model): each file hashed by
    # one rank as at a resume (before: every file on every rank), into the saved weights;
    # the damaged file refused on both ranks with the resume's message.
    loads = [read(tmp_path, "load_hashed", rank)["files"] for rank in (0, 1)]
    assert sorted(loads[0] + loads[1]) == [f"{newest}/{name}" for name in files], loads
    assert not set(loads[0]) & set(loads[1]) and loads[0] and loads[1]
    saved = read(tmp_path, "weights", 0)
    for rank in (0, 1):
        loaded = read(tmp_path, "loaded", rank)
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    refused = [read(tmp_path, "load_damaged", rank)["error"] for rank in (0, 1)]
    assert refused[0] is not None and refused[0] == refused[1], refused
    assert damaged[0]["file"] in refused[0] and "other bytes than the save wrote" in refused[0]
