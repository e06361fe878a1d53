"""The quickstart's "train the newest run longer" says what a longer relaunch does: the
schedule is stretched, and EarlyStopping's restored patience, or a fresh one with
--restart-patience (issue 19, items 9 and 10)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env


def quickstart(*args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"),
                             "--device", "cpu", "--no-progress", *args], cwd=cwd,
                            env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_a_longer_relaunch_says_what_it_does(tmp_path: Path) -> None:
    first = quickstart("--epochs", "1", cwd=tmp_path)
    assert "LRScheduler:" not in first and "EarlyStopping:" not in first
    longer = quickstart("--epochs", "2", "--resume", "--restart-patience", cwd=tmp_path)
    assert "resuming the newest run" in longer
    steps = 23  # 1,437 training digits in batches of 64
    assert (f"LRScheduler: the factory's schedule was built for {steps} optimizer steps in all, "
            f"and this fit's total is {2 * steps}: it is rebuilt for {2 * steps} and continues "
            f"where the run is ({steps} steps in)") in longer
    assert ("EarlyStopping: resumed with val_acc not improved for 0 validation(s)"
            in longer and "restart_patience_on_resume=True: the patience counts from 0 again, "
            "5 validation(s) without improvement." in longer)
    assert "last epoch: epoch 2/2" in longer
