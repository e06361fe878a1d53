"""Issue 16, item 13: one checkpoint directory, one running job. A second launch on the
directory of a running one is refused at setup, naming the first (pid and host); the lock
is the operating system's, so a SIGKILLed holder leaves none behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import Checkpoint

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "best_files.py"
VALUES = "0.9,0.5,0.7,0.45"


def start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--values", VALUES,
                             "--epochs", "4", "--resume", *args], env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the first launch never started training"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_launch_on_a_running_job_s_directory_is_refused(tmp_path: Path) -> None:
    first = start(tmp_path, "--hold")
    try:
        wait_for(tmp_path / "started", first)
        temporary = tmp_path / "ckpt" / ".tmp-first-save.part"  # a save of the first in flight
        temporary.write_bytes(b"PK")
        second = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "other"),
                                 "--values", VALUES, "--epochs", "4", "--resume"],
                                env=subprocess_env(), capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 0  # another directory: no conflict
        refused = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--values",
                                  VALUES, "--epochs", "4", "--resume"], env=subprocess_env(),
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1
        (message,) = [line for line in refused.stderr.splitlines()
                      if line.startswith("hookloop.errors.ConfigurationError")]
        for part in (str(tmp_path / "ckpt"), f"pid {first.pid}", socket.gethostname()):
            assert part in message, (part, message)
        assert temporary.exists()  # the refused launch deleted nothing of the first
        assert not (tmp_path / "result.pt").exists()
    finally:
        (tmp_path / "release").write_text("")
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-4000:]
    assert torch.load(tmp_path / "result.pt", weights_only=True)["history"]


@pytest.mark.slow
def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    first = start(tmp_path, "--hold")
    wait_for(tmp_path / "started", first)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    again = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--values", VALUES,
                            "--epochs", "4", "--resume"], env=subprocess_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert torch.load(tmp_path / "result.pt", weights_only=True)["history"]


def make_loop(callbacks: list) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks)


def test_one_process_may_hold_its_directory_more_than_once(tmp_path: Path) -> None:
    """Two named Checkpoints of one loop share a directory; later fits take it again."""
    loop = make_loop([Checkpoint(tmp_path, name="a"), Checkpoint(tmp_path, name="b")])
    loop.fit(1)
    loop.fit(2)
    assert sorted(os.listdir(tmp_path)) == [  # and the lock file is gone after the fit
        "a-epoch=0001-step=00000004.pt", "b-epoch=0001-step=00000004.pt"]


RESUME_THERE = """
import sys, torch
from hookloop import Loop
from hookloop.callbacks import Checkpoint
model = torch.nn.Linear(3, 1)
data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=torch.nn.functional.mse_loss,
     device="cpu", callbacks=[Checkpoint(sys.argv[1], resume=True)]).fit(2)
"""


@pytest.mark.slow
def test_a_fit_that_fails_releases_the_directory(tmp_path: Path) -> None:
    make_loop([Checkpoint(tmp_path)]).fit(1)
    refused = make_loop([Checkpoint(tmp_path)])  # resume=False over the run of the first
    with pytest.raises(ConfigurationError, match="earlier run"):
        refused.fit(1)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0000-step=00000002.pt"]
    other = subprocess.run([sys.executable, "-c", RESUME_THERE, str(tmp_path)],
                           env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr[-4000:]
    assert sorted(os.listdir(tmp_path)) == ["epoch=0001-step=00000004.pt"]
