"""hookloop.engine.samplers: the data of a multi-process run sharded over the ranks (every sample
once in validation, the loader's settings kept, loaders that cannot be sharded reported or
left alone). Moved here with the code from the DDP callback's tests."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from conftest import ROOT
from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from hookloop import ConfigurationError, distributed
from hookloop.engine import samplers
from hookloop.engine.samplers import UnpaddedDistributedSampler

sys.path.insert(0, str(ROOT / "tests" / "distributed" / "scripts"))
import common


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
        sharded = samplers.shard_loader(loader, training=True)
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
    sharded_val = samplers.shard_loader(ordered, training=False)
    assert isinstance(sharded_val.sampler, UnpaddedDistributedSampler)
    assert not sharded_val.sampler.shuffle
    assert [index for batch in sharded_val.batch_sampler for index in batch] == [1, 3, 5, 7, 9]
    sharded_train = samplers.shard_loader(ordered, training=True)
    assert not sharded_train.sampler.shuffle  # a loader that does not shuffle keeps its order
    assert list(sharded_train.sampler) == [1, 3, 5, 7, 9]


def test_loaders_ddp_cannot_shard_are_reported_or_left_alone(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    _pretend_rank(monkeypatch, rank=0, world=2)
    dataset = common.regression_data(8, seed=0)
    weighted = DataLoader(dataset, sampler=WeightedRandomSampler([1.0] * 8, 8), batch_size=2)
    with pytest.raises(ConfigurationError, match="DistributedSampler"):
        samplers.shard_loader(weighted, training=True)
    replacing = DataLoader(dataset, sampler=RandomSampler(dataset, replacement=True))
    with pytest.raises(ConfigurationError, match="WeightedRandomSampler|RandomSampler"):
        samplers.shard_loader(replacing, training=True)
    mine = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert samplers.shard_loader(mine, training=True) is mine
    batches = [(torch.randn(2, 4), torch.randn(2, 1))]
    with pytest.warns(UserWarning, match="not a DataLoader"):
        assert samplers.shard_loader(batches, training=True) is batches
