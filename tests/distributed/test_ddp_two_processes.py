"""DDP: real 2-process runs under torchrun (gloo, CPU) checked against hand-written loops.

Each launch runs a script of tests/distributed/scripts/ with a timeout (launch.py); a hang
kills the whole process group and fails the test. Launches are shared by module-scoped
fixtures, so the file costs a handful of torchrun starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from builders import accuracy, assert_close_weights
from conftest import ROOT, subprocess_env
from launch import SCRIPTS, TIMEOUT, read, run_ok, torchrun

sys.path.insert(0, str(SCRIPTS))
import common  # noqa: E402  (the scripts' data and models, for the oracles)


# ------------------------------------------------------------------ hand-written oracles
def hand_train(model: nn.Module, train: TensorDataset, loss_fn: Any, *, seed: int, epochs: int,
               val: TensorDataset | None = None, metric: Any = None,
               global_batch: int = 6) -> list[dict[str, float]]:
    """One process, batches of 2 ranks x 3 samples taken in DistributedSampler's order.

    DistributedSampler(shuffle=True) permutes with ``seed + epoch`` and gives rank r the
    positions r, r + 2, ...; so batch k of both ranks together is ``order[6k:6k+6]``.
    Returns the epoch metrics the loop should report (sample-weighted means).
    """
    optimizer = common.make_optimizer(model)
    inputs, targets = train.tensors
    size = len(targets)
    history = []
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        loss_total = metric_total = 0.0
        for start in range(0, size, global_batch):
            batch = order[start:start + global_batch]
            outputs = model(inputs[batch])
            loss = loss_fn(outputs, targets[batch])
            if metric is not None:
                metric_total += metric(outputs, targets[batch]).item() * len(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_total += loss.item() * len(batch)
        record = {"train_loss": loss_total / size}
        if metric is not None:
            record["train_acc"] = metric_total / size
        if val is not None:
            with torch.no_grad():
                outputs = model(val.tensors[0])
                record["val_loss"] = loss_fn(outputs, val.tensors[1]).item()
                if metric is not None:
                    record["val_acc"] = metric(outputs, val.tensors[1]).item()
        history.append(record)
    return history


def hand_accumulation(epochs: int = 2) -> tuple[dict[str, torch.Tensor], int]:
    """One process, micro-batches of 6 in order, windows of 2, 2, 1 averaged by real size."""
    inputs, targets = common.regression_data(30, seed=5).tensors
    model = common.make_model(seed=4)
    optimizer = common.make_optimizer(model)
    steps = 0
    for _ in range(epochs):
        micro = [slice(start, start + 6) for start in range(0, 30, 6)]
        for window in (micro[0:2], micro[2:4], micro[4:5]):
            optimizer.zero_grad()
            for part in window:
                loss = nn.functional.mse_loss(model(inputs[part]), targets[part]) / len(window)
                loss.backward()
            optimizer.step()
            steps += 1
    return model.state_dict(), steps


# ------------------------------------------------------------ launch 1: scripts/train.py
@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_train")
    run_ok(SCRIPTS / "train.py", str(out))
    return out


def test_two_ranks_batch_b_equal_one_process_batch_2b(train_run: Path) -> None:
    model = common.make_model(seed=1)
    history = hand_train(model, common.regression_data(24, seed=2), nn.functional.mse_loss,
                         seed=7, epochs=2, val=common.regression_data(11, seed=3))
    for rank in (0, 1):
        assert_close_weights(read(train_run, "parity", rank), model.state_dict())
        log = read(train_run, "parity_log", rank)
        assert log["step"] == 8  # 24 samples / 2 ranks / batch 3 = 4 steps per epoch
        # 11 validation samples over 2 ranks: each counted once, none padded in.
        for reported, expected in zip(log["metrics"], history, strict=True):
            assert reported == pytest.approx(expected, rel=1e-5)


def test_rank_zero_only_callbacks_run_on_rank_zero_only(train_run: Path) -> None:
    assert read(train_run, "parity_log", 0)["recorded"] == ["on_fit_start"] + ["after_step"] * 8
    assert read(train_run, "parity_log", 1)["recorded"] == []


def test_accumulation_all_reduces_once_per_optimizer_step(train_run: Path) -> None:
    expected, steps = hand_accumulation()
    for rank in (0, 1):
        log = read(train_run, "accumulation_log", rank)
        assert log["batches"] == 5  # per rank and epoch: 10 micro-batches in all
        assert log["step"] == steps == 6
        assert log["rounds"] == 6, "gradients must be all-reduced at step boundaries only"
        assert log["scheduler_total_steps"] == [6]  # LRScheduler counts the sharded loader
        assert_close_weights(read(train_run, "accumulation", rank), expected)


def test_validation_with_an_empty_shard_and_buffers_does_not_hang(train_run: Path) -> None:
    logs = [read(train_run, "buffers_log", rank) for rank in (0, 1)]
    assert [log["val_batches"] for log in logs] == [1, 0]
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model.load_state_dict(read(train_run, "buffers", 0))
    model.eval()
    inputs, labels = common.classification_data(1, seed=8).tensors
    with torch.no_grad():
        outputs = model(inputs)
    expected = {"val_loss": nn.functional.cross_entropy(outputs, labels).item(),
                "val_acc": float(outputs.argmax(-1).item() == labels.item()),
                "val_prob": outputs.softmax(-1)[0, labels.item()].item(),
                "val_count": 1.0}  # the object's own all-reduce, joined by rank 1 too
    for log in logs:
        # Metrics in the stack: rank 1, with no validation batch, still joins the reduction;
        # both ranks report the value of the one sample (nothing divided by a local zero).
        assert log["metrics"][0] == pytest.approx({"train_loss": log["metrics"][0]["train_loss"],
                                                   **expected}, rel=1e-5)
        # validate() after fit (no process group left): every rank runs all the data with
        # the same model and gets the same values.
        assert log["validate"] == pytest.approx(expected, rel=1e-5)


def test_distributed_helpers_reduce_over_two_ranks(train_run: Path) -> None:
    for rank in (0, 1):
        results = read(train_run, "buffers_log", rank)["helpers"]
        assert results["sums"] == {"n": 2.0, "x": 3.0}  # (0 + 1) + (1 + 1)
        assert results["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert results["any"] == [True, False]
        # Different keys on the ranks: the same clear error on both, no hang.
        assert "rank 0: ['key0']; rank 1: ['key1']" in results["mismatch"]


# ---------------------------------------------------- launches 2-3: scripts/integration.py
@pytest.fixture(scope="module")
def integration_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_integration")
    run_ok(SCRIPTS / "integration.py", str(out), "first")
    return out


def test_metrics_and_losses_equal_single_process_values(integration_run: Path) -> None:
    model = common.make_model(seed=21, outputs=3)
    history = hand_train(model, common.classification_data(24, seed=22),
                         nn.functional.cross_entropy, seed=23, epochs=2,
                         val=common.classification_data(11, seed=24), metric=accuracy)
    for rank in (0, 1):
        assert_close_weights(read(integration_run, "metrics", rank), model.state_dict())
        reported = read(integration_run, "metrics_log", rank)["metrics"]
        for got, expected in zip(reported, history, strict=True):
            assert got == pytest.approx(expected, rel=1e-5)
    # 11 validation samples: an accuracy of k/11 shows no sample was counted twice.
    assert [round(epoch["val_acc"] * 11, 6) % 1 for epoch in reported] == [0, 0]


def test_ranks_with_different_local_val_losses_stop_at_the_same_epoch(integration_run: Path
                                                                      ) -> None:
    logs = [read(integration_run, "early_stopping_log", rank) for rank in (0, 1)]
    assert logs[0] == logs[1], logs
    # Rank 0's values decide (best 0.8 at epoch 2, patience 2): 5 epochs, not rank 1's 3.
    assert logs[0]["epochs_run"] == 5 and "EarlyStopping" in logs[0]["reason"]


def test_resume_of_a_two_process_run_continues_exactly(integration_run: Path) -> None:
    checkpoints = sorted(path.name for path in (integration_run / "interrupted").iterdir())
    assert checkpoints == ["epoch=0001-step=00000006.pt"]  # stopped mid-epoch 1
    saved = torch.load(integration_run / "interrupted" / checkpoints[0], weights_only=True)
    assert isinstance(saved, dict)
    # Each rank's own loss sums of the interrupted epoch (2 batches of 3 so far), gathered
    # at this collective save: the ranks' shards differ, so the sums do too.
    interrupted = [read(integration_run, "interrupted_log", rank)["losses"] for rank in (0, 1)]
    for rank in (0, 1):
        done = [(loss, size) for epoch, _, loss, size in interrupted[rank] if epoch == 1]
        assert saved["ranks"][rank]["train_samples"] == 6 == sum(size for _, size in done)
        assert saved["ranks"][rank]["train_loss_sum"].item() == pytest.approx(
            sum(loss * size for loss, size in done), rel=1e-6)
    # The exception path (both ranks raised after step 6) has no collective: rank 0 alone
    # writes, and drops the partial sums rather than give them to every rank.
    crashed = torch.load(integration_run / "crashed" / "epoch=0001-step=00000006.pt",
                         weights_only=True)
    assert (crashed["loop"]["batch_idx"], crashed["loop"]["step"]) == (2, 6)
    assert len(crashed["ranks"]) == 1  # rank 0's own part only
    assert crashed["ranks"][0]["train_loss_sum"] is None
    assert crashed["ranks"][0]["train_samples"] == 0

    run_ok(SCRIPTS / "integration.py", str(integration_run), "resume")
    uninterrupted = read(integration_run, "uninterrupted", 0)
    for rank in (0, 1):
        assert read(integration_run, "resumed_log", rank) == {"start_step": 6, "step": 12}
        # Bitwise, dropout included: same samples, same per-rank random numbers.
        assert_close_weights(read(integration_run, "resumed", rank), uninterrupted, atol=0)
    assert_close_weights(read(integration_run, "uninterrupted", 1), uninterrupted, atol=0)

    # train_loss of the resumed epoch: each rank continued its own sums, so it is the
    # uninterrupted run's value, and the sample-weighted mean of the 8 batch losses of that
    # epoch (2 per rank before the interruption, 2 per rank after), counted once each.
    resumed = [read(integration_run, "resumed_epochs", rank) for rank in (0, 1)]
    epoch_one = [(loss, size) for rank in (0, 1)
                 for epoch, _, loss, size in interrupted[rank] + resumed[rank]["losses"]
                 if epoch == 1]
    assert len(epoch_one) == 8
    by_hand = sum(loss * size for loss, size in epoch_one) / sum(size for _, size in epoch_one)
    reference = read(integration_run, "uninterrupted_log", 0)["metrics"]
    for rank in (0, 1):
        assert [epoch["train_loss"] for epoch in resumed[rank]["metrics"]] == pytest.approx(
            [epoch["train_loss"] for epoch in reference[1:]], rel=1e-12)
        assert resumed[rank]["metrics"][0]["train_loss"] == pytest.approx(by_hand, rel=1e-6)

    # Resumed from the exception-path file: the epoch's train_loss covers the batches after
    # the resume point (2 per rank), each counted once.
    after_crash = [read(integration_run, "crash_resumed", rank) for rank in (0, 1)]
    rest = [(loss, size) for log in after_crash for epoch, _, loss, size in log["losses"]
            if epoch == 1]
    assert len(rest) == 4
    by_hand = sum(loss * size for loss, size in rest) / sum(size for _, size in rest)
    for log in after_crash:
        assert log["start_step"] == 6
        assert log["metrics"][0]["train_loss"] == pytest.approx(by_hand, rel=1e-6)


# ------------------------------------------------------------- the example
def test_example_runs_in_one_process_and_under_torchrun(tmp_path: Path) -> None:
    example = ROOT / "examples" / "ddp.py"
    plain = subprocess.run([sys.executable, str(example), "--epochs", "1", "--max-steps", "3"],
                           cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert plain.returncode == 0, plain.stderr[-4000:]
    assert "training on 1 process(es)" in plain.stdout
    assert "not launched by torchrun" in plain.stderr
    output = run_ok(example, "--epochs", "1", "--accumulate", "2",
                    "--checkpoint-dir", str(tmp_path / "checkpoints"))
    assert output.count("training on 2 process(es), device cpu") == 1  # rank 0 prints
    assert "epoch 1/1  step 12" in output  # 23 batches per rank, windows of 2
    assert "val_acc" in output
    assert len(list((tmp_path / "checkpoints").glob("epoch=*.pt"))) == 1
    # Why training ended: one line, from rank 0 only.
    assert output.count("hookloop: training ended at epoch 1/1, step 12: its 1 epoch is "
                        "done.") == 1


# ------------------------------------------------------------- launch: an exception on one rank
def test_an_exception_on_one_rank_ends_both_processes_with_the_error(tmp_path: Path) -> None:
    result = torchrun(SCRIPTS / "fail.py", str(tmp_path), timeout=120)  # a hang times out
    assert result.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in result.stdout
    assert "raised in callback FailOnRankOne at event on_batch_start" in result.stdout
    assert "unreachable" not in result.stdout
