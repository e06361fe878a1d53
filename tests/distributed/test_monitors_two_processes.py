"""MemoryMonitor and ThroughputMonitor on 2 ranks (torchrun, gloo): the peak memory is the
largest rank's, the same on both; ``validate()`` is measured on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import SCRIPTS, read, run_ok


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("monitors")
    run_ok(SCRIPTS / "monitors.py", str(out))
    return [read(out, "result", rank) for rank in (0, 1)]


def test_the_peak_memory_is_the_maximum_over_ranks(results: list[dict]) -> None:
    zero, one = results[0]["rows"], results[1]["rows"]
    assert len(zero) == len(one) == 2
    for mine, other in zip(zero, one):
        assert mine["metric"] == other["metric"]  # the same value on every rank
        largest = max(mine["own"], other["own"])
        assert largest - 1.0 <= mine["metric"] <= largest  # read just before "own" (MiB)
        assert mine["metric"] >= mine["own"] + 200  # rank 1's 256 MiB more, not rank 0's


def test_validate_is_measured_on_every_rank(results: list[dict]) -> None:
    for result in results:
        assert result["validate"] == ["val_batches_per_s", "val_loss", "val_samples_per_s"]
        assert result["val_samples_per_s"] > 0
