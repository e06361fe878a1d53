"""DDP(sync_batchnorm=True) under torchrun (issue 19, item 5): refused on CPU by name,
before the first batch (2 ranks, gloo); on CUDA the model trains with its BatchNorm layers
converted (one rank per GPU, NCCL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import SCRIPTS, read, torchrun

SCRIPT = SCRIPTS / "sync_batchnorm.py"


def test_refused_on_cpu_under_torchrun_by_name(tmp_path: Path) -> None:
    result = torchrun(SCRIPT, str(tmp_path), "cpu", "sync")
    assert result.returncode != 0
    message = "DDP(sync_batchnorm=True) needs CUDA, but this run trains on cpu"
    # Each rank refuses on its own, before any process group exists (so none waits for
    # the other); torchrun stops the other rank once the first exits, so it may not print.
    assert result.stdout.count(message) >= 1, result.stdout[-6000:]
    assert "Timeout" not in result.stdout and "timed out" not in result.stdout
    assert "ConfigurationError" in result.stdout
    assert not list(tmp_path.glob("result.*"))  # refused before training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SyncBatchNorm trains only on CUDA")
def test_on_cuda_the_model_trains_with_its_batchnorm_converted(tmp_path: Path) -> None:
    """One rank per GPU (NCCL): the layers train as SyncBatchNorm; with one rank they compute
    what BatchNorm computes, so the weights equal those of the same run without the option."""
    runs = {}
    for mode in ("sync", "plain"):
        out = tmp_path / mode
        result = torchrun(SCRIPT, str(out), "cuda", mode, processes=1)
        assert result.returncode == 0, result.stdout[-8000:]
        runs[mode] = (read(out, "result", 0), read(out, "weights", 0))
    (synced, synced_weights), (plain, plain_weights) = runs["sync"], runs["plain"]
    assert synced["types"] == ["SyncBatchNorm"] and plain["types"] == ["BatchNorm1d"]
    assert synced["step"] == plain["step"] == 2 * 8
    for key, value in plain_weights.items():
        torch.testing.assert_close(synced_weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert synced["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-5)
