"""The DDP callback in one process: a no-op outside torchrun, the samplers and loaders it builds
(every sample once, the loader's settings kept), and no_sync inside an accumulation window.
Two real processes under torchrun are in tests/distributed/."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from hookloop import ConfigurationError, Loop, distributed
from hookloop.callbacks import DDP
from hookloop.callbacks import ddp as ddp_module
from hookloop.callbacks.ddp import UnpaddedDistributedSampler

from builders import assert_close_weights, make_loop, sgd
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "distributed" / "scripts"))
import common  # noqa: E402  (the torchrun scripts' data and model, shared with their oracles)


def _plain_loop(callbacks: list[Any]) -> tuple[Loop, nn.Module, DataLoader]:
    data = DataLoader(common.regression_data(12, seed=2), batch_size=4)
    loop = make_loop(callbacks, model=common.make_model(seed=1), train=data,
                     optimizer=sgd(0.05, momentum=0.9), seed=None)  # common.make_optimizer's
    return loop, loop.model, data


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
