"""The instruction mode of ``benchmarks/overhead.py`` as a regression guard: instructions
per batch counted by callgrind (not seconds, which a loaded machine moves), on a short
region of the tiny workload. The bounds are the targets of the project (issue 38) with a
small margin for the short region: hookloop bare within 1.01x the hand-written loop, the
standard stack with its views within 1.01x the same stack by hand without views, at most
3k instructions per listening callback per batch, and a worker's generator stamp within
0.1x of making a cheap batch; every variant ends on its reference's weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

VARIANTS = "hand,hookloop,hookloop+listen10,hand+stack,hookloop+stack+views"
MARGIN = 0.005  # the short region's ratios move by a few thousandths against the full run's


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_instruction_ratios_stay_within_the_targets(tmp_path: Path) -> None:
    saved = tmp_path / "counts.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--instructions",
         "--variants", VARIANTS, "--warmup", "20", "--count", "40", "--json", str(saved)],
        env=subprocess_env(), capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(saved.read_text())
    per_batch = found["per_batch"]
    assert set(per_batch) == set(VARIANTS.split(","))
    assert all(found["same"].values()), found["same"]
    assert "| hookloop | hand |" in result.stdout and "worker stamp:" in result.stdout
    assert per_batch["hookloop"] / per_batch["hand"] <= 1.01 + MARGIN, per_batch
    assert per_batch["hookloop+stack+views"] / per_batch["hand+stack"] <= 1.01 + MARGIN, \
        per_batch
    per_listener = (per_batch["hookloop+listen10"] - per_batch["hookloop"]) / 10
    assert per_listener <= 3000, per_listener
    assert found["stamp"] / found["batch"] <= 0.1, (found["stamp"], found["batch"])
