"""The instruction mode of ``benchmarks/overhead.py`` as a regression guard: instructions
per batch counted by callgrind (not seconds, which a loaded machine moves), on a short
region of the tiny workload, every variant ending on its reference's weights.

Two of the project's targets (issue 38) are met and guarded as they are: at most 3k
instructions per listening callback per batch (2,570 to 2,750 measured), and a worker's
generator stamp within 0.1x of making a cheap batch (0.068x to 0.072x). Two are not met yet
and are guarded at the level reached, so that they do not get worse: hookloop bare over the
hand-written loop (target 1.01x; 1.036x to 1.040x: about 11,000 of its 36,000 to 40,000
instructions are the torch generator state recorded at every step boundary, kept on purpose,
see docs/performance.md), and the standard stack with its views over the same stack by hand
without views (target 1.01x; 1.027x to 1.034x, from 1.039x to 1.041x before the third round;
the 1.057x to 1.060x counted before that were partly a measuring error: tensorboard's writer
thread brought its earlier work into the region, see benchmarks/instructions.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

VARIANTS = "hand,hookloop,hookloop+listen50,hand+stack,hookloop+stack+views"
# Reached over these 100 batches after 20 (one machine): 1.037x to 1.040x bare, 1.027x to
# 1.033x with views; 1.036x and 1.027x over 200 batches after 50. The bare loop before the
# second round (1.050x to 1.053x here) fails its bound, and the stack with its views before
# the third (1.040x to 1.041x) fails its own.
BARE, VIEWS = 1.047, 1.038


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="valgrind (with callgrind_control) is not installed")
def test_instruction_ratios_stay_within_their_guards(tmp_path: Path) -> None:
    saved = tmp_path / "counts.json"
    # A session of its own: past the timeout, valgrind (a grandchild) goes with the script.
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--instructions",
         "--variants", VARIANTS, "--warmup", "20", "--count", "100", "--json", str(saved)],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(saved.read_text())
    per_batch = found["per_batch"]
    assert set(per_batch) == set(VARIANTS.split(","))
    assert all(found["same"].values()), found["same"]
    assert "| hookloop | hand |" in result.stdout and "worker stamp:" in result.stdout
    assert per_batch["hookloop"] / per_batch["hand"] <= BARE, per_batch
    assert per_batch["hookloop+stack+views"] / per_batch["hand+stack"] <= VIEWS, per_batch
    # 50 of them: a count of one variant moves by a few thousand instructions a batch
    # (allocator, interpreter caches), a tenth of what 10 listeners add.
    per_listener = (per_batch["hookloop+listen50"] - per_batch["hookloop"]) / 50
    assert per_listener <= 3000, per_listener
    assert found["stamp"] / found["batch"] <= 0.1, (found["stamp"], found["batch"])
