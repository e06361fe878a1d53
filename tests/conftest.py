"""Shared test helpers: tiny models and data that make a fit take milliseconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture
def root() -> Path:
    return ROOT


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the checkout importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable
