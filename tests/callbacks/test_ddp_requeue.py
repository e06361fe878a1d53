"""DDP(requeue=True) in one process of a SLURM job (no srun task: the batch shell's own
python): SIGUSR1 ends the launch and requeues the job through the scontrol on PATH (a
stand-in recording its arguments); SIGTERM does not requeue; a missing scontrol is an error
at setup, before the first batch; outside a SLURM job nothing happens."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hookloop import ConfigurationError, Suspended
from hookloop.callbacks import DDP

from builders import BatchCounter, Signal, make_loop
from conftest import stand_in_scontrol


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A SLURM job's environment with a stand-in scontrol first on PATH; its record file."""
    calls = tmp_path / "calls.txt"
    stand_in = stand_in_scontrol(tmp_path / "bin", calls)
    monkeypatch.setenv("PATH", f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    for name in ("SLURM_STEP_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    return calls


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:DDP. not launched")
def test_sigusr1_requeues_the_job_once_the_launch_ended(job: Path) -> None:
    loop = make_loop([DDP(requeue=True), Signal(2, signal.SIGUSR1)])
    with pytest.raises(Suspended) as ended:
        loop.fit(3)
    assert ended.value.code == 138 and loop.state.step == 2
    assert job.read_text() == "requeue 777\n"


@pytest.mark.filterwarnings("ignore:DDP. not launched")
def test_sigterm_does_not_requeue(job: Path) -> None:
    loop = make_loop([DDP(requeue=True), Signal(2, signal.SIGTERM)])
    with pytest.raises(Suspended) as ended:
        loop.fit(3)
    assert ended.value.code == 143 and not job.exists()


@pytest.mark.filterwarnings("ignore:DDP. not launched")
def test_a_missing_scontrol_fails_before_the_first_batch(job: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    counter = BatchCounter()
    with pytest.raises(ConfigurationError, match=r"DDP\(requeue=True\): scontrol is not on PATH"):
        make_loop([DDP(requeue=True), counter]).fit(1)
    assert counter.batches == 0


@pytest.mark.filterwarnings("ignore:DDP. not launched")
def test_outside_a_slurm_job_requeue_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol needed
    loop = make_loop([DDP(requeue=True), Signal(2, signal.SIGUSR1)])
    with pytest.raises(Suspended):
        loop.fit(3)
