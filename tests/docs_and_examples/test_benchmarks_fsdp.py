"""benchmarks/fsdp_gpu_check.py runs (tiny, on the CPU, a group of one process): its memory
numbers are for a GPU and read by people; here the two runs must agree."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env


@pytest.mark.slow
def test_fsdp_gpu_check_runs_on_the_cpu_and_the_two_runs_agree() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fsdp_gpu_check.py"), "--device", "cpu",
         "--width", "32", "--depth", "2", "--steps", "2"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for kind in ("DDP", "FSDP"):
        assert re.search(rf"^rank 0 {kind}\s+peak n/a\s+held n/a\s+predicted state", result.stdout,
                         re.MULTILINE), result.stdout
    difference = re.search(r"largest weight difference FSDP - DDP: (\S+)", result.stdout)
    assert difference and float(difference.group(1)) < 1e-6, result.stdout


@pytest.mark.slow
def test_fsdp_gpu_check_runs_every_layout_on_the_cpu() -> None:
    """HSDP, TP (FSDP + TensorParallel) and FSDP with activation checkpointing next to DDP
    (on one process each is a group of one: the layouts' code paths, not their memory)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fsdp_gpu_check.py"), "--device", "cpu",
         "--width", "32", "--depth", "2", "--steps", "2", "--layouts", "all"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = dict(re.findall(r"^rank 0 (\S+)\s+peak n/a\s+held n/a\s+predicted state\s+\S+ GiB"
                             r"\s+train_loss (\S+)$", result.stdout, re.MULTILINE))
    assert list(losses) == ["DDP", "FSDP", "HSDP", "TP", "FSDP+AC"], result.stdout
    assert len(set(losses.values())) == 1, losses  # one rank: every layout trains the same
    for kind in ("FSDP", "HSDP", "FSDP+AC"):
        difference = re.search(rf"largest weight difference {re.escape(kind)} - DDP: (\S+)",
                               result.stdout)
        assert difference and float(difference.group(1)) < 1e-6, result.stdout
