"""Distributed faults under real torchrun (2 processes, gloo): clear errors on every rank,
no hang, ranks told apart after the group is gone, SIGTERM leaves a resumable checkpoint."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launch import SCRIPTS, TIMEOUT, kill_job, read, run_ok, start


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_faults")
    run_ok(SCRIPTS / "faults.py", str(out))
    return out


def test_after_fit_ranks_are_told_apart_without_a_group(faults_run: Path) -> None:
    for rank in (0, 1):
        assert read(faults_run, "after", rank) == {"initialized": False, "rank": rank,
                                                   "is_main": rank == 0}


def test_unequal_batch_counts_fail_on_every_rank_before_the_first_batch(faults_run: Path
                                                                       ) -> None:
    for rank in (0, 1):
        result = read(faults_run, "unequal", rank)
        assert result["batches"] == 0
        assert "different numbers of training batches (rank 0: 3, rank 1: 2)" in result["error"]


def test_data_without_length_is_refused_on_every_rank(faults_run: Path) -> None:
    for rank in (0, 1):
        result = read(faults_run, "unsized", rank)
        assert result["batches"] == 0
        assert "no length on some rank (rank 0: no length, rank 1: no length)" in result["error"]


def test_unpadded_sampler_is_refused_for_training(faults_run: Path) -> None:
    for rank in (0, 1):
        result = read(faults_run, "unpadded", rank)
        assert result["batches"] == 0 and "UnpaddedDistributedSampler" in result["error"]
        assert "DistributedSampler for training" in result["error"]


def _launch(*args: str) -> subprocess.Popen[str]:
    return start(SCRIPTS / "preempted.py", *args)


def test_sigterm_to_torchrun_leaves_a_resumable_checkpoint(tmp_path: Path) -> None:
    directory, ready = tmp_path / "ckpt", tmp_path / "ready"
    process = _launch(str(directory), str(ready), "50")
    deadline = time.monotonic() + TIMEOUT
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), process.communicate(timeout=5)[0][-4000:]
    process.send_signal(signal.SIGTERM)  # what a scheduler does to the launcher
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_job(process)
        pytest.fail(f"preempted run hung:\n{process.communicate()[0][-4000:]}")
    assert process.returncode != 0
    assert "SIGTERM received" in output, output[-4000:]
    files = sorted(path.name for path in directory.iterdir())
    assert len(files) == 1 and files[0].startswith("epoch=0000-step="), (files, output[-3000:])
    saved = torch.load(directory / files[0], weights_only=True)
    assert saved["loop"]["step"] >= 3
    # Relaunched with the same command (fewer epochs to stay short): resumes and finishes.
    relaunch = _launch(str(directory), str(tmp_path / "ready2"), "2")
    output, _ = relaunch.communicate(timeout=TIMEOUT)
    assert relaunch.returncode == 0, output[-4000:]
    assert f"resumed from {directory / files[0]}" in output
    assert "rank 0 finished at step 16" in output and "rank 1 finished at step 16" in output
