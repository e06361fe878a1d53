"""The benchmarks run (tiny settings); their numbers are read by people, never asserted here."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT, subprocess_env


def test_loop_overhead_benchmark_runs_and_reports_ratios() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop_overhead.py"), "--rounds", "2",
         "--batches", "5", "--device", "cpu"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("hand-written", "hookloop", "hookloop\\+6 listeners", "hookloop\\+observers"):
        assert re.search(rf"^{name}\s+median .* ratio \d+\.\d+ \(IQR", result.stdout, re.MULTILINE)


def test_async_save_benchmark_runs_and_reports_both_ways() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "async_save.py"), "--width", "64",
         "--saves", "2", "--every", "2", "--rounds", "1"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("sync", "async"):
        assert re.search(rf"^{name}\s+step waits median\s+\d+\.\d ms", result.stdout, re.MULTILINE)
    assert re.search(r"^async/sync blocking ratio \d+\.\d+", result.stdout, re.MULTILINE)
