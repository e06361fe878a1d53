"""The benchmarks run (small settings); their numbers are read by people, never asserted
here: what is checked is the table's shape, that every variant did the same work (same
optimizer steps, the same weights as its hand-written reference), and that a GPU check
on a machine without CUDA says so and exits cleanly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env

ROW = re.compile(r"^\| (?P<variant>[\w+-]+) \| (?P<steps>\d+) \| (?P<median>[\d.]+) \| "
                 r"[\d.]+-[\d.]+ \| (?P<ratio>[\d.]+) \| [\d.]+ \| (?P<over>\(reference\)|"
                 r"[+-][\d.]+ us) \| [\d.]+ \| (?P<same>yes|NO.*) \|$", re.MULTILINE)
OURS = ["hand", "hookloop", "hand+clip-accum-cos", "hookloop+clip-accum-cos", "hand+stack",
        "hookloop+stack", "hookloop+stack+views"]


@pytest.mark.slow
def test_overhead_quick_prints_the_table_with_every_variant(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick", "--no-peers",
         "--json", str(results)],
        env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = re.split(r"^### ", result.stdout, flags=re.MULTILINE)
    tables = {section.splitlines()[0].split(":")[0]: section for section in sections[1:]}
    assert set(tables) == {"tiny", "small", "import (whole process, median)"}
    for workload, batches in (("tiny", 200), ("small", 12)):
        rows = {match["variant"]: match for match in ROW.finditer(tables[workload])}
        assert list(rows) == OURS, tables[workload]
        for name, row in rows.items():
            window = 1 if name in ("hand", "hookloop") else 2
            assert int(row["steps"]) == batches // window
            assert row["same"] == "yes"
            assert (row["over"] == "(reference)") == name.startswith("hand")
    assert re.search(r"^import torch: \d+ ms; over it: hookloop [+-]\d+ ms",
                     tables["import (whole process, median)"], re.MULTILINE)
    saved = json.loads(results.read_text())
    assert saved["rounds"] == 2 and set(saved["workloads"]) == {"tiny", "small"}
    assert set(saved["imports"]) >= {"torch", "hookloop"}


@pytest.mark.slow
def test_the_gpu_check_says_when_there_is_no_gpu() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if torch.cuda.is_available():  # a GPU machine runs the real check, elsewhere
        return
    assert result.returncode == 0, result.stderr
    assert "no CUDA device" in result.stdout


@pytest.mark.slow
def test_async_save_benchmark_runs_and_reports_both_ways() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "async_save.py"), "--width", "64",
         "--saves", "2", "--every", "2", "--rounds", "1"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("sync", "async"):
        assert re.search(rf"^{name}\s+step waits median\s+\d+\.\d ms", result.stdout, re.MULTILINE)
    assert re.search(r"^async/sync blocking ratio \d+\.\d+", result.stdout, re.MULTILINE)


@pytest.mark.slow
def test_checkpoint_digest_benchmark_runs_and_reports_the_cost_per_gb() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint_digests.py"), "--mb", "4",
         "--rounds", "1"], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^digest cost per GB: save [-+]\d+\.\d+ s, load [-+]\d+\.\d+ s",
                     result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^hashlib sha256\s+\d+\.\d+ GB/s", result.stdout, re.MULTILINE)
    assert re.search(r"^xxhash  xxh3_128\s+\d+\.\d+ GB/s", result.stdout, re.MULTILINE)


@pytest.mark.slow
def test_save_speed_benchmark_prints_every_ratio_of_issue_36() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "save_speed.py"), "--mb", "4", "--rounds",
         "1"], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ratio = r"\d+\.\d+x"
    for pattern in (rf"^blocked: state .* one host copy .*: {ratio}$",
                    rf"^blocked: step .* while one is written: {ratio}$",
                    rf"^file verified/plain: save {ratio}  load {ratio}$",
                    rf"^file verified/plain\+fsync: save {ratio}$",
                    rf"^sharded verified/plain: save {ratio}  load {ratio}$"):
        assert re.search(pattern, result.stdout, re.MULTILINE), (pattern, result.stdout)


@pytest.mark.slow
def test_resume_benchmark_prints_a_row_for_every_kind_and_the_snapshot_cost() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "resume.py"), "--samples", "320",
         "--cost-ms", "0.1", "--batch", "16", "--workers", "0", "2", "--kinds", "sampler",
         "replay", "--rounds", "1"],
        env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\| (sampler|replay) \| (\d) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                      result.stdout, re.MULTILINE)
    assert rows == [("sampler", "0"), ("sampler", "2"), ("replay", "0"), ("replay", "2")]
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [+-][\d.]+ \|$", result.stdout, re.MULTILINE)
