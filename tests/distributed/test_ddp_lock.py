"""Issue 16, item 13 under DDP: rank 0 holds the checkpoint directory for its job; a second
2-process launch on it is refused on every rank at setup (none hangs in a collective)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from launch import SCRIPTS, TIMEOUT, kill_job, start


def launch(directory: Path, ready: Path, epochs: str) -> subprocess.Popen[str]:
    return start(SCRIPTS / "preempted.py", str(directory), str(ready), epochs)


def test_a_second_ddp_launch_on_a_running_job_s_directory_is_refused(tmp_path: Path) -> None:
    directory, ready = tmp_path / "ckpt", tmp_path / "ready"
    first = launch(directory, ready, "50")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), first.communicate(timeout=5)[0][-4000:]
        holder = (directory / ".hookloop.lock").read_text().split()[1]  # rank 0's pid
        second = launch(directory, tmp_path / "ready2", "50")
        try:
            output, _ = second.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_job(second)
            raise AssertionError(f"the refused launch hung:\n{second.communicate()[0][-4000:]}")
        assert second.returncode != 0 and not (tmp_path / "ready2").exists()
        # Rank 1, which never touches the files, raises rank 0's refusal instead of waiting
        # for it in a collective; it names the holder (the first job's rank 0).
        refusals = [line for line in output.splitlines() if line.startswith(
            "[rank1]: hookloop.errors.ConfigurationError") and "is in use by another" in line]
        assert refusals, output[-4000:]
        assert f"pid {holder} on host {socket.gethostname()}" in refusals[0]
        assert first.poll() is None  # the running job goes on
    finally:
        kill_job(first)
        first.communicate(timeout=60)
