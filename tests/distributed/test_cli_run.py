"""``hookloop run --nproc 2 script``: torchrun's standalone mode from hookloop's command, as a
real subprocess on 2 gloo processes: signals passed on, the workers' status returned."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, console_script, subprocess_env
from launch import SCRIPTS, TIMEOUT, kill_job


def _start(*args: str) -> subprocess.Popen[str]:
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.Popen([console_script(), "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(process: subprocess.Popen[str]) -> str:
    try:
        return process.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        kill_job(process)
        pytest.fail(f"hookloop run hung:\n{process.communicate()[0][-6000:]}")


def test_run_passes_sigterm_on_and_the_relaunch_finishes(tmp_path: Path) -> None:
    directory, ready = tmp_path / "ckpt", tmp_path / "ready"
    process = _start("--nproc", "2", str(SCRIPTS / "preempted.py"), str(directory), str(ready),
                     "4")
    deadline = time.monotonic() + TIMEOUT
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), _finish(process)
    os.kill(process.pid, signal.SIGTERM)  # to hookloop run alone, not to its workers
    output = _finish(process)
    assert process.returncode == 143, output  # 128 + SIGTERM, as the workers report it
    assert "SIGTERM" in output and "finished at step" not in output
    saved = sorted(path.name for path in directory.iterdir() if path.name.startswith("epoch="))
    assert saved, output  # both ranks stopped at an agreed boundary and rank 0 saved

    again = _start("--nproc", "2", str(SCRIPTS / "preempted.py"), str(directory), str(ready), "4")
    output = _finish(again)
    assert again.returncode == 0, output
    assert f"resumed from {directory / saved[-1]}" in output
    for rank in (0, 1):  # 48 samples, 2 ranks, batches of 3: 8 steps an epoch, 4 epochs
        assert f"rank {rank} finished at step 32" in output


def test_run_returns_the_first_failed_workers_status(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text(
        "import os, sys\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        # One write per line: both ranks share the pipe, unbuffered (print's pieces interleaved)
        "sys.stdout.write(f'rank {dist.get_rank()} of {dist.get_world_size()} {sys.argv[1:]}\\n')\n"
        "dist.destroy_process_group()\n"
        "sys.exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n")
    process = _start("--nproc", "2", str(script), "3", "--flag")
    output = _finish(process)
    assert process.returncode == 3, output
    assert "rank 0 of 2 ['3', '--flag']" in output and "rank 1 of 2 ['3', '--flag']" in output
    assert "worker 1 of 2" in output and "status 3" in output
