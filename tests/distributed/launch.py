"""Launching the torchrun scripts of tests/distributed/scripts/: a timeout on every launch,
and the files the scripts write read back.

A launch that overruns its timeout kills the whole process group (torchrun and its workers)
and fails the test: a hang is a failure, never a stuck run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, subprocess_env

__all__ = ["SCRIPTS", "TIMEOUT", "read", "run_ok", "start", "torchrun"]

SCRIPTS = ROOT / "tests" / "distributed" / "scripts"
TIMEOUT = 150  # seconds per launch; a healthy one takes ~10 s on 2 busy cores


def start(script: Path, *args: str, processes: int = 2) -> subprocess.Popen[str]:
    """Start ``script`` on 2 processes (or ``processes``) without waiting; its own process
    group, for a kill. Each process runs it through ``without_finalizing.py`` (why: there)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", str(SCRIPTS / "without_finalizing.py"), str(script),
               *args]
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])
    env.pop("RANK", None)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def torchrun(script: Path, *args: str, timeout: float = TIMEOUT, processes: int = 2
             ) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on 2 processes (or ``processes``); kill the whole process group if it
    overruns."""
    process = start(script, *args, processes=processes)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script.name} hung: killed after {timeout} s\n{output[-6000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


def run_ok(script: Path, *args: str, processes: int = 2) -> str:
    """`torchrun`, and fail the test unless every process exited 0; returns the output."""
    result = torchrun(script, *args, processes=processes)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-8000:]}"
    return result.stdout


def read(out: Path, name: str, rank: int) -> Any:
    """What rank ``rank`` saved as ``name`` with ``common.save``: tensors, or JSON."""
    tensors = out / f"{name}.rank{rank}.pt"
    if tensors.exists():
        return torch.load(tensors, weights_only=True)
    return json.loads((out / f"{name}.rank{rank}.json").read_text())

