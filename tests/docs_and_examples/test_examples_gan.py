"""examples/gan.py: two models and two optimizers with AMP and Checkpoint. A SIGKILL in the
middle of training and a relaunch with --resume end on the same generator, discriminator
and discriminator optimizer as the uninterrupted run (torch.equal, issue 16 item 15)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "examples" / "gan.py"
ARGS = ("--epochs", "3", "--device", "cpu", "--every-n-steps", "10")


def _start(directory: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), *ARGS, "--dir", str(directory), *extra],
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _final(directory: Path) -> dict:
    newest = sorted(directory.glob("epoch=*-step=*.pt"))[-1]
    return torch.load(newest, weights_only=True)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


@pytest.mark.slow
def test_a_killed_gan_run_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    reference = _start(tmp_path / "reference")
    out, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err
    assert re.search(r"^step 84 ", out, re.MULTILINE), out

    killed = _start(tmp_path / "killed")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and killed.poll() is None:
        steps = [int(match.group(1)) for path in (tmp_path / "killed").glob("*.pt")
                 if (match := re.search(r"step=(\d+)", path.name))]
        if steps and max(steps) >= 30:
            os.kill(killed.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"

    resumed = _start(tmp_path / "killed", "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "Checkpoint: resumed from" in out + err
    expected, got = _final(tmp_path / "reference"), _final(tmp_path / "killed")
    assert got["hookloop"]["step"] == expected["hookloop"]["step"] == 84
    for part in ("model", "optimizer", "state"):
        pairs = list(zip(_tensors(expected[part]), _tensors(got[part]), strict=True))
        assert pairs and all(torch.equal(a, b) for a, b in pairs), part
    assert set(got["state"]) == {"discriminator", "opt_d"}
