"""The examples run as a user runs them: as scripts, in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from conftest import ROOT, subprocess_env


def _run(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=cwd,
                            env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def test_quickstart_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    first = _run("quickstart.py", "--epochs", "2", "--checkpoint-dir", str(checkpoints),
                 "--device", "cpu", cwd=tmp_path)
    epochs = re.findall(r"^epoch\s+(\d+)/2\s+step\s+(\d+).*val_acc (\d\.\d+)$", first, re.MULTILINE)
    assert [int(epoch) for epoch, _, _ in epochs] == [1, 2]
    assert [int(step) for _, step, _ in epochs] == [23, 46]  # 1437 training images / 64 per batch
    assert float(epochs[-1][2]) > 0.5  # digits are easy: far above chance (0.1) after 2 epochs
    best = torch.load(checkpoints / "best.pt", weights_only=True)
    assert best["hookloop"]["monitor"] == "val_acc" and "model" in best
    rotating = sorted(path.name for path in checkpoints.glob("epoch=*.pt"))
    assert rotating == ["epoch=0001-step=00000046.pt"]  # 0-based epoch; keep_last=1
    assert {"model", "optimizer", "loop", "callbacks"} <= set(
        torch.load(checkpoints / rotating[0], weights_only=True))
    assert re.search(r"^best checkpoint: val_acc \d\.\d+$", first, re.MULTILINE)

    resumed = _run("quickstart.py", "--epochs", "3", "--resume", "--checkpoint-dir",
                   str(checkpoints), "--device", "cpu", cwd=tmp_path)
    assert re.findall(r"^epoch\s+(\d+)/3\s+step\s+(\d+)", resumed, re.MULTILINE) == [("3", "69")]
