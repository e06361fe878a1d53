"""Sharding the data over the ranks of a data-parallel run (`DDP`, `FSDP`).

Training loaders get torch's ``DistributedSampler`` (padded, so every rank runs the same
number of batches and no gradient collective waits forever); validation loaders get
`UnpaddedDistributedSampler`, so every real sample counts exactly once in the reduced
metrics. A loader is rebuilt with every other setting as the user gave it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from hookloop import distributed
from hookloop.base.checks import check_int
from hookloop.engine.data import length_of
from hookloop.errors import ConfigurationError, with_article

__all__ = ["UnpaddedDistributedSampler", "check_equal_batches", "set_epoch", "shard_loader"]


class UnpaddedDistributedSampler(Sampler[int]):
    """Shards a dataset over ranks without padding: every sample is seen exactly once.

    ``DistributedSampler`` pads the dataset with repeated samples so that every rank gets
    the same number of them, which counts those samples twice in validation metrics. This
    sampler gives rank ``r`` the indices ``r, r + world, r + 2 * world, ...`` (of a
    permutation when ``shuffle``), so ranks may get one sample less than others. Use it only
    where no per-batch collective runs, as in hookloop's validation pass.

    Args:
        dataset: A sized dataset.
        num_replicas: Number of ranks (default: the world size).
        rank: This rank (default: the current rank).
        shuffle: Permute the indices, the same way on every rank, per ``set_epoch``.
        seed: Seed of the permutation; must be the same on every rank.

    Example:
        >>> sampler = UnpaddedDistributedSampler(range(5), num_replicas=2, rank=1)
        >>> list(sampler), len(sampler)
        ([1, 3], 2)
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = False, seed: int = 0) -> None:
        self.dataset = dataset
        self.num_replicas = check_int("UnpaddedDistributedSampler num_replicas",
                                      distributed.world_size() if num_replicas is None
                                      else num_replicas)
        self.rank = check_int("UnpaddedDistributedSampler rank",
                              distributed.rank() if rank is None else rank, minimum=0)
        if self.rank >= self.num_replicas:
            raise ConfigurationError(
                f"UnpaddedDistributedSampler rank must be an int < num_replicas "
                f"({self.num_replicas}), got {self.rank}.")
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (only matters with ``shuffle``)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(size, generator=generator).tolist()
        else:
            indices = list(range(size))
        return iter(indices[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return max(0, math.ceil((len(self.dataset) - self.rank) / self.num_replicas))


def _loader_parts(loader: DataLoader, owner: str) -> tuple[Any, int | None, bool]:
    """The index sampler, batch size and drop_last of a DataLoader, batch sampler unwrapped."""
    if loader.batch_size is None and loader.batch_sampler is not None:
        if type(loader.batch_sampler) is not BatchSampler:
            raise ConfigurationError(
                f"{owner} cannot shard a DataLoader with a custom batch_sampler "
                f"({type(loader.batch_sampler).__name__}). Give it a sampler that shards by "
                f"rank yourself ({owner} then leaves the loader as it is) or use batch_size=.")
        batch_sampler = loader.batch_sampler
        return batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    return loader.sampler, loader.batch_size, loader.drop_last


def _shuffles(sampler: Sampler[Any], which: str, owner: str) -> bool:
    if type(sampler) is SequentialSampler:
        return False
    # num_samples is len(data_source) unless the user asked for another count.
    if type(sampler) is RandomSampler and not sampler.replacement and \
            sampler.num_samples == len(sampler.data_source):
        return True
    raise ConfigurationError(
        f"{owner} cannot shard the {which} DataLoader: its sampler {type(sampler).__name__} is "
        "neither sequential (shuffle=False) nor a plain shuffle (shuffle=True). Build the "
        "loader with a DistributedSampler (or another sampler that shards by rank) yourself; "
        f"{owner} leaves such loaders as they are.")


def _sampler_seed(loader: DataLoader, sampler: Sampler[Any]) -> int:
    """The user's seed for the order: the loader's generator, else torch's default one."""
    generator = getattr(sampler, "generator", None) or loader.generator
    seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    return int(distributed.broadcast_object(seed % 2**62))


def _rebuild(loader: DataLoader, sampler: Sampler[int], batch_size: int | None,
             drop_last: bool, owner: str) -> DataLoader:
    """A DataLoader like ``loader`` in every setting, drawing its indices from ``sampler``."""
    settings: dict[str, Any] = {
        "batch_size": batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    try:
        return type(loader)(loader.dataset, **settings)
    except TypeError as error:
        raise ConfigurationError(
            f"{owner} could not rebuild the {type(loader).__name__} with a distributed sampler "
            f"({error}). Build it with a DistributedSampler yourself; {owner} then leaves it "
            "as it is.") from error


def shard_loader(loader: Any, *, training: bool, owner: str = "DDP",
                 replicas: tuple[int, int] | None = None, reshard: bool = False) -> Any:
    """``loader`` rebuilt to read this rank's share of the data, or ``loader`` itself.

    Training uses ``DistributedSampler`` (padded, so every rank runs the same number of
    batches and no gradient all-reduce waits forever); validation uses
    `UnpaddedDistributedSampler` so that every real sample counts exactly once. A loader
    already sharded by the user, data that is not a DataLoader, and an IterableDataset are
    left as they are (the last two with a warning).

    Args:
        loader: The training or validation data.
        training: Which of the two it is.
        owner: The callback sharding it, named in errors and warnings.
        replicas: ``(count, index)``: shard over ``count`` data-parallel replicas, this
            rank reading replica ``index``'s share (tensor-parallel ranks of one group
            share a replica); None: over all ranks, by rank.
        reshard: A loader sharded already by a ``DistributedSampler`` (`FSDP`'s, inside a
            `FaultTolerance` replica group) is sharded again over ``replicas``, with the
            same shuffle and seed, instead of being left as it is.

    Raises:
        ConfigurationError: a sampler or batch sampler that cannot be sharded, or an
            unpadded sampler for training data.

    Example:
        >>> data = DataLoader(list(range(6)), batch_size=2)
        >>> type(shard_loader(data, training=False).sampler).__name__
        'UnpaddedDistributedSampler'
    """
    which = "training" if training else "validation"
    if not isinstance(loader, DataLoader):
        warnings.warn(
            f"{owner}: the {which} data is {with_article(type(loader).__name__)}, not a "
            "DataLoader, so every rank reads all of it. Pass a DataLoader to have it sharded across ranks.",
            stacklevel=6)
        return loader
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            f"{owner}: the {which} data is an IterableDataset, which a sampler cannot shard; it is "
            "left as it is. Make it yield a different share on each rank "
            "(hookloop.distributed.rank(), world_size()); in training every rank must yield "
            "the same number of batches.", stacklevel=6)
        return loader
    sampler, batch_size, drop_last = _loader_parts(loader, owner)
    if training and isinstance(sampler, UnpaddedDistributedSampler):
        raise ConfigurationError(
            f"{owner}: the training DataLoader uses UnpaddedDistributedSampler, which gives ranks "
            "different numbers of samples; in training every rank must run the same number "
            "of batches, or the gradient all-reduce of the longer rank waits forever (or "
            "averages unrelated data). Use torch's DistributedSampler for training data (or "
            f"pass the DataLoader unsharded and let {owner} shard it); keep "
            "UnpaddedDistributedSampler for validation.")
    if reshard and type(sampler) is DistributedSampler:
        shuffle, seed = bool(sampler.shuffle), int(sampler.seed)
    elif isinstance(sampler, (DistributedSampler, UnpaddedDistributedSampler)):
        return loader  # the user sharded it already
    else:
        shuffle = _shuffles(sampler, which, owner)
        seed = _sampler_seed(loader, sampler) if shuffle else 0
    world, rank = replicas or (distributed.world_size(), distributed.rank())
    new_sampler: Sampler[int]
    if training:
        new_sampler = DistributedSampler(loader.dataset, num_replicas=world, rank=rank,
                                         shuffle=shuffle, seed=seed, drop_last=False)
    else:
        new_sampler = UnpaddedDistributedSampler(loader.dataset, num_replicas=world, rank=rank,
                                                 shuffle=shuffle, seed=seed)
    return _rebuild(loader, new_sampler, batch_size, drop_last, owner)


def check_equal_batches(train_data: Any, owner: str = "DDP") -> None:
    """Every rank must run the same number of training batches: check it before the first.

    A collective (every rank calls it, in ``DDP.setup`` and ``FSDP.setup``): the ranks exchange
    ``len(train_data)``. With different lengths the gradient all-reduce of the last batches
    would find no partner (a gloo abort "Received data size doesn't match", an NCCL hang)
    or average gradients of unrelated steps. Data without a length cannot be checked, and
    hookloop does not use DDP's ``join`` for uneven inputs, so it is refused too.

    Raises:
        ConfigurationError: on every rank, listing each rank's number of batches.

    Example:
        >>> check_equal_batches([1, 2, 3])  # one process: nothing to compare
    """
    if distributed.world_size() == 1:
        return
    length = length_of(train_data)
    lengths = distributed.all_gather_object(length)
    if all(count == lengths[0] for count in lengths) and lengths[0] is not None:
        return
    listing = ", ".join(f"rank {index}: {'no length' if count is None else count}"
                        for index, count in enumerate(lengths))
    if any(count is None for count in lengths):
        raise ConfigurationError(
            f"{owner}: the training data has no length on some rank ({listing}), so hookloop "
            "cannot make sure that every rank runs the same number of batches; a rank with "
            "more batches would wait forever in the gradient all-reduce. Give the data a "
            f"length: a map-style Dataset in a DataLoader ({owner} shards it evenly), or an "
            "IterableDataset with __len__ that yields exactly that many samples on every rank.")
    raise ConfigurationError(
        f"{owner}: the ranks have different numbers of training batches ({listing}). Every "
        "rank must run the same number, or the gradient all-reduce of the longer rank waits "
        f"forever or averages unrelated data. Let {owner} shard a DataLoader over the whole "
        "dataset (DistributedSampler pads to equal lengths), or make your own sharding give "
        "every rank the same number of batches (e.g. drop the remainder).")


def set_epoch(loader: Any, epoch: int) -> None:
    """Give the sampler of ``loader`` (or of its batch sampler) the epoch, where it takes one.

    Example:
        >>> sampler = UnpaddedDistributedSampler(range(4), num_replicas=1, rank=0, shuffle=True)
        >>> set_epoch(DataLoader(range(4), sampler=sampler), 3)
        >>> sampler.epoch
        3
    """
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidate: Any
    for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
        if callable(getattr(candidate, "set_epoch", None)):
            candidate.set_epoch(epoch)
            return
