"""Issue 16, item 9: a SIGKILL after a validation that entered the top k, before the epoch's
rotating file; the relaunch (resume=True) replays that validation. Its best files, its
top-k list and its weights must be those of the uninterrupted run, not the validation
counted twice (a kept file deleted, the saved list naming a file that is gone)."""

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
VALUES = [0.9, 0.5, 0.7, 0.45, 0.8, 0.6, 0.3, 0.9]  # val_score of epochs 0..7, mode min
STEPS = 4  # optimizer steps per epoch


def launch(out: Path, *args: str) -> int:
    result = subprocess.run([sys.executable, str(SCRIPT), str(out), "--values",
                             ",".join(map(str, VALUES)), *args], env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    if result.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(result.stdout[-2000:] + result.stderr[-4000:])
    return result.returncode


def hand_top_k(k: int | None) -> list[tuple[float, int, int]]:
    """(value, epoch, step) of the kept validations, best first; ties keep the earlier."""
    ranked = sorted(range(len(VALUES)), key=lambda epoch: (VALUES[epoch], epoch))
    return [(VALUES[e], e, STEPS * (e + 1)) for e in (ranked if k is None else ranked[:k])]


_REFERENCES: dict[str, Path] = {}


def reference(tmp_path_factory: pytest.TempPathFactory, k: str) -> Path:
    if k not in _REFERENCES:
        out = tmp_path_factory.mktemp(f"reference-k{k}")
        assert launch(out, "--k", k) == 0
        _REFERENCES[k] = out
    return _REFERENCES[k]


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)


@pytest.mark.parametrize(("k", "kill_epoch"), [
    ("2", 3),  # 0.45 entered as the best: the replay counted it twice, 0.5's file deleted
    ("2", 6),  # 0.3 entered as the best and pushed 0.5 out
    ("3", 2),  # 0.7 entered third, not the best
    ("1", 3),  # best.pt replaced by 0.45
])
def test_a_kill_after_a_ranked_validation_keeps_the_uninterrupted_top_k(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, k: str, kill_epoch: int) -> None:
    whole = reference(tmp_path_factory, k)
    assert launch(tmp_path, "--k", k, "--resume", "--kill-at-validation", str(kill_epoch)) \
        == -signal.SIGKILL
    assert launch(tmp_path, "--k", k, "--resume") == 0
    resumed = torch.load(tmp_path / "result.pt", weights_only=True)
    expected = torch.load(whole / "result.pt", weights_only=True)
    hand = hand_top_k(int(k))
    assert [(e["value"], e["epoch"], e["step"]) for e in expected["top_k"]] == hand
    assert resumed["top_k"] == expected["top_k"]
    assert same(resumed["weights"], expected["weights"])  # the resume itself was exact
    # The same files, each holding the weights of its own validation.
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(os.listdir(whole / "ckpt"))
    for name in os.listdir(whole / "ckpt"):
        assert same(weights_of(tmp_path / "ckpt" / name), weights_of(whole / "ckpt" / name)), name
    # The list saved in the newest rotating file names files that exist.
    (newest,) = [name for name in os.listdir(tmp_path / "ckpt") if name.startswith("epoch=")]
    saved = torch.load(tmp_path / "ckpt" / newest, weights_only=True)["callbacks"]["Checkpoint"]
    assert saved["top_k"] == expected["top_k"]
    for entry in saved["top_k"]:
        assert entry["file"] is None or (tmp_path / "ckpt" / entry["file"]).is_file()
