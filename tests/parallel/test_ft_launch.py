"""``hookloop run --groups 2`` as a subprocess: its own lighthouse, two replica groups, one
of them SIGKILLed mid-run and restarted by the launcher; the run ends with every sample
trained once and the two groups' weights equal."""

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
from hookloop.parallel import ft_plan

SCRIPT = ROOT / "tests" / "parallel" / "ft_train.py"


@pytest.mark.slow
def test_hookloop_run_groups_restarts_a_killed_group_and_the_run_finishes(
        tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    from test_fault_tolerance_processes import _check_every_sample_once

    # 72 steps, the kill after about 8: the survivor trains on for longer than the victim's
    # restart takes on a loaded machine (at 6 epochs it once finished the run alone first).
    epochs = 12
    env = dict(subprocess_env(), FT_TEST_EPOCHS=str(epochs))
    output = tmp_path / "launch.log"
    with open(output, "w") as log:
        launch = subprocess.Popen(
            [sys.executable, "-m", "hookloop.cli", "run", "--groups", "2", "--port", "0",
             "--run-dir", str(tmp_path / "run"), "--restart-delay", "0.5", str(SCRIPT), "ft",
             str(tmp_path), "--step-sleep", "0.1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while output.read_text().count("should_commit completed should_commit=true") < 16:
            assert launch.poll() is None and time.monotonic() < deadline, \
                output.read_text()[-3000:]
            time.sleep(0.1)
        pids = re.findall(r"replica group 1 of 2 started \(pid (\d+)\)", output.read_text())
        os.kill(int(pids[-1]), signal.SIGKILL)
        assert launch.wait(timeout=300) == 0, output.read_text()[-5000:]
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
    text = output.read_text()
    assert "replica group 1 exited with status -9; restarting it" in text, text[-3000:]
    assert len(re.findall(r"replica group 1 of 2 started", text)) == 2
    assert len(re.findall(r"replica group 0 of 2 started", text)) == 1  # never restarted
    results = [torch.load(tmp_path / f"result_{group}.pt") for group in (0, 1)]
    for result in results:
        _check_every_sample_once(result["ledger"], epochs=epochs)
    for key, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][key], value), key
    assert "FaultTolerance goodput of replica group 0" in text


def test_the_slurm_example_uses_the_names_and_defaults_of_ft_plan() -> None:
    """docs/clusters.md's SLURM script cannot run here; its names must still be the ones
    FaultTolerance and hookloop run read (named in one place: ft_plan)."""
    page = (ROOT / "docs" / "clusters.md").read_text(encoding="utf-8")
    block = page.split("### Fault tolerance", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    for name in (ft_plan.ENV_LIGHTHOUSE, ft_plan.ENV_GROUPS, ft_plan.ENV_RUN_DIR,
                 ft_plan.ENV_GROUP):
        assert f"{name}=" in block, name
    assert f":{ft_plan.DEFAULT_LIGHTHOUSE_PORT}" in block
    assert f"--heartbeat_timeout_ms {ft_plan.DEFAULT_HEARTBEAT_TIMEOUT_MS} " in block
    assert f"--join_timeout_ms {ft_plan.DEFAULT_JOIN_TIMEOUT_MS}" in block


@pytest.mark.parametrize("argv, message", [
    (["run", "--groups", "0", "x.py"], "--groups must be a number of replica groups"),
    (["run", "--groups", "2", "--nproc", "2", "x.py"], "drop --nproc"),
])
def test_bad_groups_are_usage_errors_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hookloop.cli import main

    with pytest.raises(SystemExit) as end:
        main(argv)
    assert end.value.code == 2 and message in capsys.readouterr().err
