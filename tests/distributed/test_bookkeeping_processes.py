"""What the loop counts and keeps under torchrun (2 ranks, gloo): ``loop.total_steps`` is one
value for a whole DDP fit, and a loss that is a DTensor (tensor parallel with torch's
``loss_parallel``) trains, is recorded and checkpoints as the plain loss does.

One launch of tests/distributed/scripts/bookkeeping.py, shared by every test (a
module-scoped fixture): a DDP fit, then three tensor-parallel fits (loss parallel with a
checkpoint every epoch; the oracle with the logits gathered into a plain loss; the first
resumed from its epoch-0 checkpoint).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch
from builders import assert_close_weights
from launch import SCRIPTS, read, torchrun

sys.path.insert(0, str(SCRIPTS))
import bookkeeping as script

SCRIPT = SCRIPTS / "bookkeeping.py"
RANKS = (0, 1)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bookkeeping")
    return {"out": out, "launch": torchrun(SCRIPT, str(out))}


def launched_cleanly(runs: dict[str, Any]) -> None:
    launch = runs["launch"]
    assert launch.returncode == 0, f"bookkeeping.py failed:\n{launch.stdout[-8000:]}"


def test_total_steps_is_one_value_for_a_whole_ddp_fit(runs: dict[str, Any]) -> None:
    # By hand: 96 samples over 2 ranks are 48 a rank, 12 batches of 4 an epoch, 2 epochs.
    # (The user's unsharded loader has 24 batches: 48 steps, what on_fit_end read before.)
    per_rank = math.ceil(script.DDP_SAMPLES / 2)
    hand = math.ceil(per_rank / script.DDP_BATCH) * script.DDP_EPOCHS
    assert hand == 24
    for rank in RANKS:
        ddp = read(runs["out"], "ddp", rank)
        assert [where for where, _ in ddp["seen"]] == [
            "on_fit_start", "on_epoch_start 0", "on_epoch_start 1", "on_fit_end"]
        assert [value for _, value in ddp["seen"]] == [hand] * 4, ddp["seen"]
        assert ddp["steps"] == hand  # the steps really taken


def test_a_loss_parallel_fit_equals_the_plain_loss_fit(runs: dict[str, Any]) -> None:
    launched_cleanly(runs)
    out = runs["out"]
    for rank in RANKS:
        parallel, plain = read(out, "parallel", rank), read(out, "plain", rank)
        # The loop keeps the DTensor loss as a plain tensor: state.loss, the epoch sums.
        assert parallel["kinds"] == plain["kinds"] == ["Tensor"]
        assert len(parallel["losses"]) == len(plain["losses"]) == 12
        for ours, oracle in zip(parallel["losses"], plain["losses"]):
            assert abs(ours - oracle) <= 1e-6
        assert len(parallel["history"]) == len(plain["history"]) == 2
        for row, oracle_row in zip(parallel["history"], plain["history"]):
            assert row.keys() == oracle_row.keys() >= {"train_loss", "val_loss"}
            for key, value in oracle_row.items():
                assert abs(row[key] - value) <= 1e-6, (key, row[key], value)
    assert_close_weights(read(out, "parallel-weights", 0), read(out, "plain-weights", 0),
                         atol=1e-6)


def test_a_loss_parallel_fit_saves_and_resumes(runs: dict[str, Any]) -> None:
    launched_cleanly(runs)
    out = runs["out"]
    saved = sorted(path.name for path in (out / "checkpoints").glob("epoch=*.pt"))
    assert saved == ["epoch=0000-step=00000006.pt", "epoch=0001-step=00000012.pt"]
    assert "Checkpoint: resumed from" in runs["launch"].stdout
    resumed, uninterrupted = read(out, "resumed-weights", 0), read(out, "parallel-weights", 0)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
    for rank in RANKS:
        resumed_run, parallel = read(out, "resumed", rank), read(out, "parallel", rank)
        assert resumed_run["losses"] == parallel["losses"][6:]  # the second epoch's batches
        assert resumed_run["history"] == parallel["history"]  # the first row from the file
