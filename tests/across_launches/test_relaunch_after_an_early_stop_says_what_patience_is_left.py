"""After an early stop, a relaunch with more epochs says what the restored patience will do
and how to train on anyway (issue 19, item 9). Each launch is a fresh process, as a user's
script relaunched; the messages are read from its output."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "relaunch.py"


def launch(directory: Path, *args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), str(directory), *args], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run of 6 epochs that EarlyStopping (patience 2) ended after its third."""
    directory = tmp_path_factory.mktemp("stopped") / "ckpt"
    output = launch(directory, "--epochs", "6")
    assert "result: epoch 3 step 12" in output and "stopped: EarlyStopping" in output
    assert "EarlyStopping: resumed" not in output  # a new run has nothing to say
    return directory, output


def copy_of(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def test_the_relaunch_says_no_patience_is_left_and_stops_as_it_says(
        stopped: tuple[Path, str], tmp_path: Path) -> None:
    output = launch(copy_of(stopped[0], tmp_path), "--epochs", "12")
    line = next(line for line in output.splitlines() if line.startswith("EarlyStopping:"))
    assert line.startswith("EarlyStopping: resumed with val_score not improved for 2 "
                           "validation(s) (best 1 at epoch 1), patience 2: none left, so this "
                           "run stops after its next validation unless val_score improves.")
    assert "a larger patience= or restart_patience_on_resume=True" in line
    assert "result: epoch 4 step 16" in output  # one epoch, then the stop it announced


def test_restart_patience_on_resume_trains_on_with_fresh_patience(
        stopped: tuple[Path, str], tmp_path: Path) -> None:
    output = launch(copy_of(stopped[0], tmp_path), "--epochs", "12", "--restart-patience")
    assert ("EarlyStopping: resumed with val_score not improved for 2 validation(s) (best 1 at "
            "epoch 1); restart_patience_on_resume=True: the patience counts from 0 again, 2 "
            "validation(s) without improvement.") in output
    assert "result: epoch 5 step 20" in output  # two validations without improvement more


def test_nothing_is_said_when_the_relaunch_trains_nothing(stopped: tuple[Path, str],
                                                         tmp_path: Path) -> None:
    output = launch(copy_of(stopped[0], tmp_path), "--epochs", "6")
    assert "already ended" in output and "EarlyStopping: resumed" not in output
