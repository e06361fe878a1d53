"""Launching the torchrun scripts of tests/distributed/scripts/: a timeout on every launch,
and the files the scripts write read back.

A launch that overruns its timeout is killed whole (`kill_job`) and fails the test: a hang
is a failure, never a stuck run.

torchrun starts each worker in a session of its own, so a signal to torchrun's process
group never reaches the workers: killed that way, they train on as orphans (and finish the
run a kill campaign meant to interrupt). `kill_job` signals every process of the launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, subprocess_env

__all__ = ["SCRIPTS", "TIMEOUT", "kill_job", "read", "run_ok", "start", "torchrun"]

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


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (children of each of its threads)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as file:
                children = [int(child) for child in file.read().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def kill_job(process: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the launch ``process`` and every process under it: torchrun, its
    workers (each in a session of its own) and theirs (data loader workers), workers first,
    so that torchrun never sees one die and starts a replacement."""
    own = os.getpgrp()
    workers = _descendants(process.pid)
    for pid in [*workers, process.pid]:
        try:
            group = os.getpgid(pid)
            os.killpg(group, sig) if group != own else os.kill(pid, sig)
        except ProcessLookupError:
            pass  # ended on its own meanwhile
    if sig != signal.SIGKILL:
        return
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in workers if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive, f"processes {alive} of the launch outlived a SIGKILL"


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def torchrun(script: Path, *args: str, timeout: float = TIMEOUT, processes: int = 2
             ) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on 2 processes (or ``processes``); kill the whole process group if it
    overruns."""
    process = start(script, *args, processes=processes)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(process)
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

