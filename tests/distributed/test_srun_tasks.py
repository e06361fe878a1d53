"""Two processes started as `srun` starts them (SLURM's variables set by the test, no
torchrun): DDP forms the group from them and trains; SIGUSR1 to one task ends the launch on
both at one step with status 138, and rank 0 requeues the job through the `scontrol` on
PATH (a stand-in that records its arguments), under the array form for an array task."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hookloop.parallel.slurm import port_for_job

from conftest import stand_in_scontrol, subprocess_env
from launch import SCRIPTS, TIMEOUT


def _free_job_id() -> int:
    """A job id whose derived port (`port_for_job`) is free on this machine now."""
    for _ in range(200):
        job = random.randrange(10**5, 10**6)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port_for_job(str(job))))
            except OSError:
                continue
        return job
    pytest.skip("no free port in 15000-34999")


def _run_step(out: Path, array: tuple[str, str] | None) -> tuple[list[dict], list[str], str]:
    stand_in = stand_in_scontrol(out / "bin", out / "scontrol.txt")
    job = str(_free_job_id())
    processes = []
    for task in (0, 1):
        env = subprocess_env()
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])
        env["PATH"] = f"{stand_in.parent}{os.pathsep}{env['PATH']}"
        env.update(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(task),
                   SLURM_NTASKS="2", SLURM_LOCALID=str(task),
                   SLURM_JOB_NODELIST="127.0.0.[1-2]")  # a compressed list; task 0's node first
        if array is not None:
            env.update(SLURM_ARRAY_JOB_ID=array[0], SLURM_ARRAY_TASK_ID=array[1])
        processes.append(subprocess.Popen(
            [sys.executable, str(SCRIPTS / "srun_task.py"), str(out)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((out / f"ready.task{task}.json").exists() for task in (0, 1)):
            assert all(process.poll() is None for process in processes), \
                [process.communicate()[0][-3000:] for process in processes]
            assert time.monotonic() < deadline, "the tasks never trained"
            time.sleep(0.05)
        pid = json.loads((out / "pid.task1.json").read_text())["pid"]
        os.kill(pid, signal.SIGUSR1)  # SLURM's --signal, to one task only
        outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert [process.returncode for process in processes] == [138, 138], outputs
    stopped = [json.loads((out / f"stopped.task{task}.json").read_text()) for task in (0, 1)]
    calls = (out / "scontrol.txt").read_text().splitlines()
    return stopped, calls, outputs[0] + outputs[1]


@pytest.mark.parametrize("array", [None, ("4100", "7")], ids=["job", "array task"])
def test_srun_tasks_form_the_group_and_sigusr1_requeues_the_job(
        tmp_path: Path, array: tuple[str, str] | None) -> None:
    stopped, calls, output = _run_step(tmp_path, array)
    assert [entry["world"] for entry in stopped] == [2, 2]  # one group of both tasks
    assert [entry["rank"] for entry in stopped] == ["0", "1"]
    assert stopped[0]["step"] == stopped[1]["step"] > 2
    job = f"{array[0]}_{array[1]}" if array else output.split("SLURM job ")[1].split(")")[0]
    assert calls == [f"requeue {job}"], output[-3000:]  # once, by rank 0
    assert "DDP: launched by srun (SLURM job" in output and "group at 127.0.0.1:" in output
    assert f"requeued SLURM job {job}" in output
    assert len(list((tmp_path / "ckpt").glob(f"*-step={stopped[0]['step']:08d}.pt"))) == 1
