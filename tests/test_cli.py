"""The `hookloop` console command, run as a real subprocess."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import hookloop
from hookloop.events import Event

from conftest import subprocess_env


def _run(*args: str) -> subprocess.CompletedProcess:
    command = shutil.which("hookloop")
    assert command, "the hookloop console script is not installed: pip install -e ."
    return subprocess.run([command, *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())


def test_version_prints_hookloop_and_torch_versions() -> None:
    result = _run("version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hookloop {hookloop.__version__} (torch {torch.__version__})"


def test_events_prints_every_event_in_firing_order() -> None:
    result = _run("events")
    assert result.returncode == 0, result.stderr
    positions = [result.stdout.index(event.value) for event in Event]
    assert positions == sorted(positions)


@pytest.mark.parametrize("args", [(), ("nonsense",)])
def test_bad_usage_exits_non_zero_with_usage(args) -> None:
    result = _run(*args)
    assert result.returncode == 2
    assert "usage: hookloop" in result.stderr
