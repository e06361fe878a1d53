"""benchmarks/activation_memory.py runs (tiny), and its kept bytes are those computed by hand
from the model's shapes; every run's gradients equal the run without checkpointing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

ROW = re.compile(r"^\| (none|full|selective) \| (\d+) \| [\d.]+ \| (yes|NO) \|$", re.MULTILINE)


@pytest.mark.slow
def test_activation_memory_benchmark_counts_what_the_shapes_say() -> None:
    width, depth, batch = 32, 2, 8
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "activation_memory.py"), "--width", str(width),
         "--depth", str(depth), "--batch", str(batch)],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    rows = {kind: (int(kept), equal) for kind, kept, equal in ROW.findall(result.stdout)}
    assert list(rows) == ["none", "full", "selective"], result.stdout
    assert all(equal == "yes" for _, equal in rows.values()), result.stdout
    floats = 4
    # full: every block keeps its input, the head its input, the loss its two operands
    full = (depth + 1) * batch * width * floats + 2 * batch * floats
    # selective: and the outputs of the two matrix products of each block (4w and w wide)
    selective = full + depth * batch * (4 * width + width) * floats
    assert rows["full"][0] == full
    assert rows["selective"][0] == selective
    assert rows["none"][0] > 2 * selective  # norms, GELU, dropout masks: kept without it
