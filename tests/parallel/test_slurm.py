"""hookloop/parallel/slurm.py: SLURM's host lists, the task srun describes, the port every task of a
job derives, and the requeue (a stand-in scontrol on PATH records what it was asked)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hookloop import ConfigurationError
from hookloop.parallel import slurm
from hookloop.parallel.slurm import (
    SlurmTask,
    adopt_srun_task,
    check_scontrol,
    expand_hostlist,
    first_host,
    port_for_job,
    requeue,
    requeue_id,
    srun_task,
)

from conftest import stand_in_scontrol

SRUN = {"SLURM_JOB_ID": "5123", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
        "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[007-010,012]"}


@pytest.mark.parametrize(("text", "hosts"), [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-11],b3", ["a8", "a9", "a10", "a11", "b3"]),
    ("gpu-[098-100]x", ["gpu-098x", "gpu-099x", "gpu-100x"]),
    ("r[1-2]-n[5,7]", ["r1-n5", "r1-n7", "r2-n5", "r2-n7"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    # Separated by spaces (issue 25, item 12): three hosts, the first is the address.
    ("alpha beta gamma", ["alpha", "beta", "gamma"]),
    ("n[1-2] gpu[3, 5],x", ["n1", "n2", "gpu3", "gpu5", "x"]),
])
def test_host_lists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text", ["node[1-3", "node[a-c]"])
def test_a_malformed_host_list_is_named(text: str) -> None:
    with pytest.raises(ConfigurationError, match="SLURM host list"):
        expand_hostlist(text)


def test_an_srun_task_is_read_from_its_variables() -> None:
    assert srun_task(SRUN) == SlurmTask(3, 8, 1, "gpu007", 15000 + 5123, "5123")
    step = {**SRUN, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "gpu[009-010]"}
    assert srun_task(step)[1:4] == (4, 1, "gpu009")  # the step's own tasks and nodes
    chosen = {**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    assert srun_task(chosen)[3:5] == ("head", 29500)


def test_a_node_list_separated_by_spaces_gives_the_first_node_as_address() -> None:
    task = srun_task({**SRUN, "SLURM_JOB_NODELIST": "alpha beta gamma"})
    assert task is not None and task.address == "alpha"


def test_an_adopted_task_is_still_srun_s_at_a_second_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first fit describes the task in torchrun's variables; the second, which finds
    them set, still knows the task (so `Launch.launcher` says srun, not torchrun)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so the teardown removes what adopt sets
        monkeypatch.delenv(name)
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm, "_adopted", None)
    task = SlurmTask(3, 8, 1, "gpu007", 15000 + 5123, "5123")
    assert adopt_srun_task() == task
    described = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])
    assert described == ("3", "8", "1")
    assert adopt_srun_task() == task  # the variables are set now: srun_task() is None
    monkeypatch.setenv("RANK", "5")  # other variables (torchrun's own workers): not the task
    assert adopt_srun_task() is None


@pytest.mark.parametrize("change", [
    {"SLURM_STEP_ID": None},                          # a batch script's own shell
    {"SLURM_STEP_ID": "4294967294"},                  # the batch step
    {"SLURM_PROCID": None},
    {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"},  # srun torchrun: torchrun's workers
])
def test_processes_srun_did_not_start_as_tasks_are_not_taken_for_them(change: dict) -> None:
    environ = {**SRUN, **{key: value for key, value in change.items() if value is not None}}
    for key, value in change.items():
        if value is None:
            environ.pop(key)
    assert srun_task(environ) is None


def test_every_task_of_a_job_derives_the_same_port_and_jobs_differ() -> None:
    assert port_for_job("5123") == port_for_job("5123") == 20123
    assert port_for_job("5124") != port_for_job("5123")
    assert 15000 <= port_for_job("987654321") < 35000


def test_an_array_task_is_requeued_under_its_array_id() -> None:
    assert requeue_id({"SLURM_JOB_ID": "5130", "SLURM_ARRAY_JOB_ID": "5123",
                       "SLURM_ARRAY_TASK_ID": "7"}) == "5123_7"
    assert requeue_id({"SLURM_JOB_ID": "5130"}) == "5130"
    assert requeue_id({}) is None


def _stand_in(directory: Path, status: int = 0) -> Path:
    calls = directory / "calls.txt"
    stand_in_scontrol(directory, calls, status)
    return calls


@pytest.mark.slow
def test_requeue_calls_scontrol_with_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    calls = _stand_in(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert check_scontrol("DDP") == str(tmp_path / "scontrol")
    assert requeue("5123_7") is None
    assert calls.read_text() == "requeue 5123_7\n"


@pytest.mark.slow
def test_a_failed_requeue_is_said_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    _stand_in(tmp_path, status=1)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert requeue("5123") == "scontrol requeue 5123 failed with status 1: boom"


def test_a_missing_scontrol_is_an_error_naming_it(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no scontrol
    with pytest.raises(ConfigurationError, match=r"DDP\(requeue=True\): scontrol is not on PATH"):
        check_scontrol("DDP")
    assert "scontrol is not on PATH" in (requeue("5123") or "")
