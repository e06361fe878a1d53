"""A relaunch with another training set (another len(train_data)): refused inside an
epoch, where the restored position would skip batches of other data; a warning at an
epoch end, where the run goes on with the new data. Real relaunches of a script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "other_data.py"


def _launch(directory: Path, batches: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(directory), str(batches), *extra],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)


def test_a_mid_epoch_resume_with_more_batches_is_refused(tmp_path: Path) -> None:
    killed = _launch(tmp_path, 5, "--kill-at-step", "8")  # saved at step 7: 2 of 5 batches
    assert killed.returncode == 9
    relaunched = _launch(tmp_path, 6)
    assert relaunched.returncode != 0
    assert "saved after 2 of 5 batches of epoch 2" in relaunched.stderr
    assert "train_data now has 6 batches per epoch" in relaunched.stderr
    assert "CheckpointError" in relaunched.stderr


def test_a_resume_at_an_epoch_end_with_more_batches_warns_and_continues(tmp_path: Path) -> None:
    killed = _launch(tmp_path, 5, "--kill-at-step", "6")  # saved at step 5: epoch 1 ends
    assert killed.returncode == 9
    relaunched = _launch(tmp_path, 6)
    assert relaunched.returncode == 0, relaunched.stderr
    assert "the run had 5 batches per epoch and train_data now has 6" in relaunched.stderr
    assert "step 17" in relaunched.stdout  # 5 + 2 epochs of 6


def test_the_same_data_resumes_without_a_word(tmp_path: Path) -> None:
    assert _launch(tmp_path, 5, "--kill-at-step", "8").returncode == 9
    relaunched = _launch(tmp_path, 5)
    assert relaunched.returncode == 0, relaunched.stderr
    assert "batches per epoch" not in relaunched.stderr
    assert "step 15" in relaunched.stdout
