"""Issue 16, item 10: a rollback (resume="older file") continues a branch whose best files
are those an uninterrupted run of that branch has, even when the abandoned branch had
pruned them; and a kill while the rollback moves files into retired-after-step=... leaves
the retirement complete or absent, never half done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "best_files.py"
# val_score (mode min) of epochs 0..7; 4 optimizer steps per epoch.
ABANDONED = [0.9, 0.5, 0.7, 0.45, 0.8, 0.85, 0.3, 0.9]  # 0.3 (step 28) pushed 0.45/0.5 out
BRANCH = [0.9, 0.5, 0.7, 0.45, 0.8, 0.6, 0.6, 0.6]  # after epoch 4 the branch scores worse
ROLLBACK_FILE = "epoch=0004-step=00000020.pt"


def launch(out: Path, values: list[float], *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(SCRIPT), str(out), "--values",
                             ",".join(map(str, values)), "--keep-last", "none", *args],
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if result.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(result.stdout[-2000:] + result.stderr[-4000:])
    return result


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)


def assert_like_the_uninterrupted_branch(branch: Path, whole: Path) -> None:
    resumed = torch.load(branch / "result.pt", weights_only=True)
    expected = torch.load(whole / "result.pt", weights_only=True)
    assert resumed["history"] == expected["history"]
    assert resumed["top_k"] == expected["top_k"]
    assert same(resumed["weights"], expected["weights"])
    mine = sorted(name for name in os.listdir(branch / "ckpt") if not name.startswith("retired"))
    assert mine == sorted(os.listdir(whole / "ckpt"))
    for name in mine:  # best.pt and each top-k file hold the weights of their validation
        assert same(weights_of(branch / "ckpt" / name), weights_of(whole / "ckpt" / name)), name


@pytest.mark.parametrize("k", ["1", "2"])
def test_a_rollback_keeps_the_best_files_of_the_branch(tmp_path: Path, k: str) -> None:
    whole = tmp_path / "whole"
    launch(whole, BRANCH, "--k", k)
    expected = torch.load(whole / "result.pt", weights_only=True)
    # By hand: the branch's best is 0.45 (epoch 3, step 16), then 0.5 (epoch 1, step 8).
    assert [(e["value"], e["step"]) for e in expected["top_k"]] == [(0.45, 16), (0.5, 8)][:int(k)]
    branch = tmp_path / "branch"
    launch(branch, ABANDONED, "--k", k)
    launch(branch, BRANCH, "--k", k, "--resume-from", str(branch / "ckpt" / ROLLBACK_FILE))
    assert_like_the_uninterrupted_branch(branch, whole)
    retired = sorted(os.listdir(branch / "ckpt" / "retired-after-step=00000020"))
    assert "best.pt" in retired and "epoch=0007-step=00000032.pt" in retired


@pytest.mark.parametrize("moves", [1, 3])
def test_a_kill_during_the_rollback_s_moves_is_finished_at_the_next_start(
        tmp_path: Path, moves: int) -> None:
    whole = tmp_path / "whole"
    launch(whole, BRANCH, "--k", "2")
    branch = tmp_path / "branch"
    launch(branch, ABANDONED, "--k", "2")
    killed = launch(branch, BRANCH, "--k", "2", "--kill-after-moves", str(moves),
                    "--resume-from", str(branch / "ckpt" / ROLLBACK_FILE))
    assert killed.returncode == -signal.SIGKILL
    # The job is relaunched as it is configured to be: resume=True.
    again = launch(branch, BRANCH, "--k", "2", "--resume")
    assert again.returncode == 0 and ROLLBACK_FILE in again.stdout
    assert_like_the_uninterrupted_branch(branch, whole)
    # One retired folder, with every file the abandoned branch had after step 20.
    folders = [name for name in os.listdir(branch / "ckpt") if name.startswith("retired")]
    assert folders == ["retired-after-step=00000020"]
    assert sorted(os.listdir(branch / "ckpt" / folders[0])) == [
        "best-val_score=0.3-step=00000028.pt", "best.pt", "epoch=0005-step=00000024.pt",
        "epoch=0006-step=00000028.pt", "epoch=0007-step=00000032.pt"]
