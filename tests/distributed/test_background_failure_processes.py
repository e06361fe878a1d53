"""A background save that fails on one rank is a named error on every rank at the same step
(issue 36 item 5), and the launch exits non-zero: scripts/background_failure.py."""

from __future__ import annotations

from pathlib import Path

import pytest
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
