"""Issue 28's options on two ranks (torchrun, gloo, DDP), in one launch: a checkpoint every
N seconds is saved at the same step on every rank although only rank 0's clock runs, and a
stop held by ``min_epochs`` ends both ranks at the same epoch, after the validation before
the first step that both ranks see alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import SCRIPTS, read, run_ok


@pytest.fixture(scope="module")
def day_one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("day_one")
    run_ok(SCRIPTS / "day_one.py", str(out))
    return out


def test_every_n_seconds_saves_at_the_same_steps_on_both_ranks(day_one: Path) -> None:
    zero, one = read(day_one, "timed", 0), read(day_one, "timed", 1)
    # Rank 0 finds the time up at steps 2, 6, 10, 14 (20 s after the last save); its request
    # rides on the next step's gradient all-reduce and every rank saves at the boundary
    # after that: 4, 8, 12, 16. Rank 1's clock never moves, and it saves there too. The
    # last epoch's end saves once more (the position after the epoch, at step 16).
    assert zero["saves"] == one["saves"] == [4, 8, 12, 16, 16]
    assert zero["files"] == [f"epoch={epoch:04d}-step={step:08d}.pt"
                             for epoch, step in ((0, 4), (0, 8), (1, 12), (1, 16))]


def test_a_stop_held_by_min_epochs_ends_both_ranks_together(day_one: Path) -> None:
    zero, one = read(day_one, "held", 0), read(day_one, "held", 1)
    assert zero == one
    assert (zero["epoch"], zero["step"]) == (3, 32)  # 4 epochs of 8 steps, then the stop
    assert "held until min_epochs=4 was reached" in zero["reason"]
    assert zero["steps"] == [0, 8, 16, 24, 32]  # the validation before the first step first
