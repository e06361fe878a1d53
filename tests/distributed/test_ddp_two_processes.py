"""DDP: real 2-process runs under torchrun (gloo, CPU) checked against hand-written loops.

Each launch runs a script of tests/distributed/scripts/ with a timeout; a hang kills the whole
process group and fails the test. Launches are shared by module-scoped fixtures, so the
file costs a handful of torchrun starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from conftest import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "tests" / "distributed" / "scripts"))
import common  # noqa: E402  (the scripts' data and models, for the oracles)

from hookloop import ConfigurationError, Loop, distributed  # noqa: E402
from hookloop.callbacks import DDP  # noqa: E402
from hookloop.callbacks import ddp as ddp_module  # noqa: E402
from hookloop.callbacks.ddp import UnpaddedDistributedSampler  # noqa: E402

SCRIPTS = ROOT / "tests" / "distributed" / "scripts"
TIMEOUT = 150  # seconds per launch; a healthy one takes ~10 s on 2 busy cores


def torchrun(script: Path, *args: str, timeout: float = TIMEOUT
             ) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on 2 processes; kill the whole process group if it overruns."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(script), *args]
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])
    env.pop("RANK", None)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script.name} hung: killed after {timeout} s\n{output[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def run_ok(script: Path, *args: str) -> str:
    result = torchrun(script, *args)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-8000:]}"
    return result.stdout


def read(out: Path, name: str, rank: int) -> Any:
    tensors = out / f"{name}.rank{rank}.pt"
    if tensors.exists():
        return torch.load(tensors, weights_only=True)
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


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


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


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


# ------------------------------------------------------------- launch 1: tests/distributed/scripts/train.py
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


def test_distributed_helpers_fall_back_in_one_process() -> None:
    assert distributed.all_reduce_sums({"b": torch.tensor(2), "a": 1.5}) == {"a": 1.5, "b": 2.0}
    assert distributed.all_reduce_sums({}) == {}
    assert distributed.all_gather_object("x") == ["x"]


# ------------------------------------------------ launches 2-3: tests/distributed/scripts/integration.py
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


# ------------------------------------------------------------- launch: an exception on one rank
def test_an_exception_on_one_rank_ends_both_processes_with_the_error(tmp_path: Path) -> None:
    started = time.monotonic()
    result = torchrun(SCRIPTS / "fail.py", str(tmp_path), timeout=120)
    assert result.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in result.stdout
    assert "raised in callback FailOnRankOne at event on_batch_start" in result.stdout
    assert "unreachable" not in result.stdout
    assert time.monotonic() - started < 120


# --------------------------------------------------------------- in-process: no torchrun
def _plain_loop(callbacks: list[Any]) -> tuple[Loop, nn.Module, DataLoader]:
    model = common.make_model(seed=1)
    data = DataLoader(common.regression_data(12, seed=2), batch_size=4)
    loop = Loop(model, common.make_optimizer(model), data, loss_fn=nn.functional.mse_loss,
                callbacks=callbacks, device="cpu")
    return loop, model, data


def test_outside_torchrun_ddp_does_nothing_and_says_so_once(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    loop, model, data = _plain_loop([DDP()])
    with pytest.warns(UserWarning, match="not launched by torchrun") as record:
        loop.fit(1)
        loop.fit(2)
    assert len([w for w in record if "torchrun" in str(w.message)]) == 1
    assert loop.model is model and loop.train_data is data
    # The same training as a hand loop over the same batches.
    expected = common.make_model(seed=1)
    optimizer = common.make_optimizer(expected)
    inputs, targets = common.regression_data(12, seed=2).tensors
    for _ in range(2):
        for start in range(0, 12, 4):
            optimizer.zero_grad()
            nn.functional.mse_loss(expected(inputs[start:start + 4]),
                                   targets[start:start + 4]).backward()
            optimizer.step()
    assert_close_weights(model.state_dict(), expected.state_dict(), atol=0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", [0, 1, 5, 6, 7])
@pytest.mark.parametrize("shuffle", [False, True])
def test_unpadded_sampler_counts_every_sample_once(world: int, size: int, shuffle: bool) -> None:
    shards = [UnpaddedDistributedSampler(range(size), num_replicas=world, rank=rank,
                                         shuffle=shuffle, seed=3) for rank in range(world)]
    for shard in shards:
        shard.set_epoch(1)
    seen = [list(shard) for shard in shards]
    assert [len(indices) for indices in seen] == [len(shard) for shard in shards]
    assert sorted(index for indices in seen for index in indices) == list(range(size))
    assert max(map(len, seen)) - min(map(len, seen)) <= 1
    if shuffle and size == 7:
        order = torch.randperm(7, generator=torch.Generator().manual_seed(3 + 1)).tolist()
        assert seen[0] == order[0::world]


def _pretend_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setattr(distributed, "rank", lambda: rank)
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, src=0: obj)


def _collate(batch: list[Any]) -> Any:
    return torch.utils.data.default_collate(batch)


def _init_worker(worker_id: int) -> None:
    pass


def test_loaders_are_rebuilt_with_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_rank(monkeypatch, rank=1, world=2)
    dataset = common.regression_data(10, seed=0)
    generator = torch.Generator().manual_seed(123)
    loader = DataLoader(dataset, batch_size=3, shuffle=True, num_workers=2, collate_fn=_collate,
                        pin_memory=True, drop_last=True, timeout=5.0,
                        worker_init_fn=_init_worker, generator=generator,
                        persistent_workers=True, prefetch_factor=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator
        sharded = ddp_module._shard(loader, training=True)
    sampler = sharded.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed) == (2, 1, True, 123)
    assert not sampler.drop_last  # padded: every rank runs the same number of batches
    for setting in ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last",
                    "timeout", "worker_init_fn", "generator", "persistent_workers",
                    "prefetch_factor", "dataset"):
        assert getattr(sharded, setting) == getattr(loader, setting), setting
    assert len(sharded) == 1  # 5 samples on this rank, batches of 3, drop_last

    ordered = DataLoader(dataset, batch_size=2)
    sharded_val = ddp_module._shard(ordered, training=False)
    assert isinstance(sharded_val.sampler, UnpaddedDistributedSampler)
    assert not sharded_val.sampler.shuffle
    assert [index for batch in sharded_val.batch_sampler for index in batch] == [1, 3, 5, 7, 9]
    sharded_train = ddp_module._shard(ordered, training=True)
    assert not sharded_train.sampler.shuffle  # a loader that does not shuffle keeps its order
    assert list(sharded_train.sampler) == [1, 3, 5, 7, 9]


def test_loaders_ddp_cannot_shard_are_reported_or_left_alone(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    _pretend_rank(monkeypatch, rank=0, world=2)
    dataset = common.regression_data(8, seed=0)
    weighted = DataLoader(dataset, sampler=WeightedRandomSampler([1.0] * 8, 8), batch_size=2)
    with pytest.raises(ConfigurationError, match="DistributedSampler"):
        ddp_module._shard(weighted, training=True)
    replacing = DataLoader(dataset, sampler=RandomSampler(dataset, replacement=True))
    with pytest.raises(ConfigurationError, match="WeightedRandomSampler|RandomSampler"):
        ddp_module._shard(replacing, training=True)
    mine = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert ddp_module._shard(mine, training=True) is mine
    batches = [(torch.randn(2, 4), torch.randn(2, 1))]
    with pytest.warns(UserWarning, match="not a DataLoader"):
        assert ddp_module._shard(batches, training=True) is batches


def test_train_step_context_is_no_sync_inside_a_window_only() -> None:
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self) -> None:  # no process group needed to test the choice
            nn.Module.__init__(self)

        def no_sync(self) -> str:  # type: ignore[override]
            return "no_sync"

    loop, _, _ = _plain_loop([])
    loop.model = FakeDDP()
    callback = DDP()
    loop.state.step_boundary = False
    assert callback.train_step_context(loop) == "no_sync"
    loop.state.step_boundary = True
    assert callback.train_step_context(loop) is None
