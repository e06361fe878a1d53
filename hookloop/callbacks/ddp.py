"""Distributed data parallel training on torch.distributed, launched with torchrun."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from hookloop import distributed, slurm, suspension
from hookloop.callback import Callback
from hookloop.checks import check_flag, check_int, check_name
from hookloop.data import length_of
from hookloop.errors import ConfigurationError
from hookloop.suspension import carry_on_gradients

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["DDP", "UnpaddedDistributedSampler", "check_equal_batches"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_groups_created = 0  # process groups this module created in this process


def _init_process_group(backend: str) -> None:
    """``init_process_group`` from torchrun's environment, also after an earlier destroy.

    torch names the default group's keys in the rendezvous store the same way each time
    (its counter restarts when the group is destroyed), so a second init on one rank could
    read the other ranks' addresses of the first group and fail to connect. Later groups
    therefore get keys of their own, in the same order on every rank.
    """
    global _groups_created
    if _groups_created == 0:
        dist.init_process_group(backend=backend)
    else:
        store, rank, world_size = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"hookloop.ddp/{_groups_created}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    _groups_created += 1


def launched_by_torchrun() -> bool:
    """True when torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) is set."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


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


def _loader_parts(loader: DataLoader) -> tuple[Sampler[Any], int | None, bool]:
    """The index sampler, batch size and drop_last of a DataLoader, batch sampler unwrapped."""
    if loader.batch_size is None and loader.batch_sampler is not None:
        if type(loader.batch_sampler) is not BatchSampler:
            raise ConfigurationError(
                f"DDP cannot shard a DataLoader with a custom batch_sampler "
                f"({type(loader.batch_sampler).__name__}). Give it a sampler that shards by "
                "rank yourself (DDP then leaves the loader as it is) or use batch_size=.")
        batch_sampler = loader.batch_sampler
        return batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    return loader.sampler, loader.batch_size, loader.drop_last


def _shuffles(sampler: Sampler[Any], which: str) -> bool:
    if type(sampler) is SequentialSampler:
        return False
    # num_samples is len(data_source) unless the user asked for another count.
    if type(sampler) is RandomSampler and not sampler.replacement and \
            sampler.num_samples == len(sampler.data_source):
        return True
    raise ConfigurationError(
        f"DDP cannot shard the {which} DataLoader: its sampler {type(sampler).__name__} is "
        "neither sequential (shuffle=False) nor a plain shuffle (shuffle=True). Build the "
        "loader with a DistributedSampler (or another sampler that shards by rank) yourself; "
        "DDP leaves such loaders as they are.")


def _sampler_seed(loader: DataLoader, sampler: Sampler[Any]) -> int:
    """The user's seed for the order: the loader's generator, else torch's default one."""
    generator = getattr(sampler, "generator", None) or loader.generator
    seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    return int(distributed.broadcast_object(seed % 2**62))


def _rebuild(loader: DataLoader, sampler: Sampler[int], batch_size: int | None,
             drop_last: bool) -> DataLoader:
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
            f"DDP could not rebuild the {type(loader).__name__} with a distributed sampler "
            f"({error}). Build it with a DistributedSampler yourself; DDP then leaves it as "
            "it is.") from error


def _shard(loader: Any, *, training: bool) -> Any:
    """``loader`` rebuilt to read this rank's share of the data, or ``loader`` itself.

    Training uses ``DistributedSampler`` (padded, so every rank runs the same number of
    batches and no gradient all-reduce waits forever); validation uses
    `UnpaddedDistributedSampler` so that every real sample counts exactly once.
    """
    which = "training" if training else "validation"
    if not isinstance(loader, DataLoader):
        warnings.warn(
            f"DDP: the {which} data is a {type(loader).__name__}, not a DataLoader, so every "
            "rank reads all of it. Pass a DataLoader to have it sharded across ranks.",
            stacklevel=5)
        return loader
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            f"DDP: the {which} data is an IterableDataset, which a sampler cannot shard; it is "
            "left as it is. Make it yield a different share on each rank "
            "(hookloop.distributed.rank(), world_size()); in training every rank must yield "
            "the same number of batches.", stacklevel=5)
        return loader
    sampler, batch_size, drop_last = _loader_parts(loader)
    if training and isinstance(sampler, UnpaddedDistributedSampler):
        raise ConfigurationError(
            "DDP: the training DataLoader uses UnpaddedDistributedSampler, which gives ranks "
            "different numbers of samples; in training every rank must run the same number "
            "of batches, or the gradient all-reduce of the longer rank waits forever (or "
            "averages unrelated data). Use torch's DistributedSampler for training data (or "
            "pass the DataLoader unsharded and let DDP shard it); keep "
            "UnpaddedDistributedSampler for validation.")
    if isinstance(sampler, (DistributedSampler, UnpaddedDistributedSampler)):
        return loader  # the user sharded it already
    shuffle = _shuffles(sampler, which)
    seed = _sampler_seed(loader, sampler) if shuffle else 0
    world, rank = distributed.world_size(), distributed.rank()
    new_sampler: Sampler[int]
    if training:
        new_sampler = DistributedSampler(loader.dataset, num_replicas=world, rank=rank,
                                         shuffle=shuffle, seed=seed, drop_last=False)
    else:
        new_sampler = UnpaddedDistributedSampler(loader.dataset, num_replicas=world, rank=rank,
                                                 shuffle=shuffle, seed=seed)
    return _rebuild(loader, new_sampler, batch_size, drop_last)


def check_equal_batches(train_data: Any) -> None:
    """Every rank must run the same number of training batches: check it before the first.

    A collective (every rank calls it, in ``DDP.setup``): the ranks exchange
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
            f"DDP: the training data has no length on some rank ({listing}), so hookloop "
            "cannot make sure that every rank runs the same number of batches; a rank with "
            "more batches would wait forever in the gradient all-reduce. Give the data a "
            "length: a map-style Dataset in a DataLoader (DDP shards it evenly), or an "
            "IterableDataset with __len__ that yields exactly that many samples on every rank.")
    raise ConfigurationError(
        f"DDP: the ranks have different numbers of training batches ({listing}). Every "
        "rank must run the same number, or the gradient all-reduce of the longer rank waits "
        "forever or averages unrelated data. Let DDP shard a DataLoader over the whole "
        "dataset (DistributedSampler pads to equal lengths), or make your own sharding give "
        "every rank the same number of batches (e.g. drop the remainder).")


def _carry_vote(model: DistributedDataParallel) -> None:
    """Let the gradient all-reduce carry the ranks' vote on ending the launch
    (`hookloop.suspension.carry_on_gradients`), unless the program registered a
    communication hook of its own (DDP takes one only): the vote then runs an all-reduce
    of its own at each step boundary."""
    try:
        model.register_comm_hook(None, carry_on_gradients)
    except RuntimeError as error:
        if "only be called once" not in str(error):
            raise


def _set_epoch(loader: Any, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
        if callable(getattr(candidate, "set_epoch", None)):
            candidate.set_epoch(epoch)
            return


class DDP(Callback):
    """Data-parallel training over processes and machines, launched with ``torchrun``.

    Under torchrun (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set) ``setup``:

    * initialises the default process group unless one exists (``nccl`` on CUDA, ``gloo``
      on CPU), and on CUDA selects ``cuda:LOCAL_RANK`` for ``loop.device``;
    * wraps the model in ``DistributedDataParallel`` (``loop.model`` is the wrapper,
      ``loop.unwrapped_model`` the user's module);
    * rebuilds the training and validation DataLoaders with the same settings and a
      distributed sampler. Training: ``DistributedSampler`` (padded so all ranks run the
      same number of batches); a shuffling loader keeps shuffling through it, seeded by the
      loader's generator (else ``torch.initial_seed()``) as rank 0 has it; a sequential
      one keeps its order. Validation: `UnpaddedDistributedSampler`, so the reduced
      ``val_loss`` and metrics count each real sample exactly once.

    Every epoch the samplers get ``set_epoch``. Micro-batches inside a gradient
    accumulation window run forward and backward under ``no_sync()``, so gradients are
    all-reduced once per optimizer step. Validation calls the unwrapped module (no DDP
    forward, hence no collective that unequal validation batch counts could hang). At the
    end of a fit that ended cleanly, the process group is destroyed if this callback
    created it (the model and loaders are put back, so a later ``fit`` sets up again).
    Before that, the buffers (BatchNorm statistics) are broadcast from rank 0: DDP syncs them
    at the start of each forward, so the last forward leaves them different on each rank, and
    every rank should end the fit with the same model. ``validate()``, ``evaluate()`` or
    ``predict()`` called outside a fit while no process group exists run on each rank over
    the whole data (every rank gets the same values, and no group is left behind).
    After an exception nothing collective is called: the process exits with the traceback
    and torchrun stops the other ranks.

    Started by SLURM's ``srun`` without torchrun (`hookloop.slurm.srun_task`: one task per
    process), it reads the rank, world size and local rank from SLURM's variables, the
    group's address from the first node of the host list and its port from the job id, sets
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT`` unless
    set) for the rest of the script, and starts the same way. Rank 0 says which launcher
    it found (``launcher``). The step's gradient all-reduce carries the ranks' vote on
    ending the launch (`hookloop.suspension.carry_on_gradients`), unless the program
    registers a communication hook of its own.

    Outside torchrun and srun it does nothing and says so once, so one script runs both
    ways.

    Args:
        backend: Process group backend; None means ``nccl`` on CUDA, else ``gloo``.
        find_unused_parameters: Passed to ``DistributedDataParallel``, for models whose
            forward does not use every parameter.
        requeue: In a SLURM job, when SIGUSR1 (``#SBATCH --signal=USR1@90``) ends the
            launch, rank 0 runs ``scontrol requeue`` (``ARRAYJOBID_TASKID`` for an array
            task) once the checkpoint is written; ``scontrol`` missing from PATH is a
            `ConfigurationError` at setup. Outside a SLURM job it does nothing.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import DDP
        >>> model = torch.nn.Linear(3, 1)
        >>> data = torch.utils.data.DataLoader(
        ...     torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
        ...     batch_size=4)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, callbacks=[DDP()], device="cpu")
        >>> # python train.py: one process; torchrun --nproc_per_node=2 train.py: two.
    """

    unique: ClassVar[bool] = True
    roles: ClassVar[tuple[str, ...]] = ("distributed",)

    def __init__(self, *, backend: str | None = None, find_unused_parameters: bool = False,
                 requeue: bool = False) -> None:
        self.backend = check_name("DDP backend", backend,
                                  hint="A backend name is e.g. 'nccl' or 'gloo'; None picks "
                                       "nccl on CUDA, gloo on CPU.")
        self.find_unused_parameters = check_flag("DDP find_unused_parameters",
                                                 find_unused_parameters)
        self.requeue = check_flag("DDP requeue", requeue)
        #: The launcher this callback found at its last setup: "torchrun", "srun" or None.
        self.launcher: str | None = None
        self._active = False
        self._noted = False
        self._created_group = False
        self._failed = False
        self._originals: tuple[Any, Any] = (None, None)
        self._sharded: tuple[Any, Any] = (None, None)
        self._unhooked: DistributedDataParallel | None = None  # to carry the vote (below)

    def __repr__(self) -> str:
        return (f"DDP(backend={self.backend!r}, "
                f"find_unused_parameters={self.find_unused_parameters!r}, "
                f"requeue={self.requeue!r})")

    # ------------------------------------------------------------------- setup
    def setup(self, loop: Loop) -> None:
        self._failed = False
        task = None if launched_by_torchrun() else slurm.adopt_srun_task()
        if task is not None or launched_by_torchrun():
            self.launcher = "srun" if task is not None else "torchrun"
        self._active = distributed.is_initialized() or self.launcher is not None
        vote = suspension.current()
        if self.requeue and loop.fitting and vote is not None:  # before any collective
            action = slurm.requeue_on_sigusr1("DDP", main=distributed.is_main())
            if action is not None:
                vote.at_end(action)
        if not self._active:
            if not self._noted:
                self._noted = True
                warnings.warn(
                    "DDP: not launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK unset) nor "
                    "by srun (no SLURM task), so training runs in this one process. Launch "
                    "with `torchrun --nproc_per_node=N script.py` (or `srun` with N tasks) to "
                    "train on N processes.",
                    stacklevel=4)  # the user's fit() or validate() call
            return
        if loop.device.type == "cuda":
            loop.device = torch.device("cuda", distributed.local_rank())
            torch.cuda.set_device(loop.device)
        if not loop.fitting and not distributed.is_initialized():
            # validate()/evaluate()/predict() outside a fit: each rank runs the whole data
            # itself (every rank holds the same model, so every rank gets the same values),
            # rather than setting up a process group that nothing would tear down (its
            # threads can abort the process at exit).
            self._active = False
            return
        if not distributed.is_initialized():
            backend = self.backend or ("nccl" if loop.device.type == "cuda" else "gloo")
            _init_process_group(backend)
            self._created_group = True
            if distributed.is_main():
                where = (f" (SLURM job {task.job_id})" if task is not None else "")
                group = (f", group at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                         if task is not None else "")
                print(f"DDP: launched by {self.launcher}{where}: rank 0 of "
                      f"{distributed.world_size()}{group}", flush=True)
        if not isinstance(loop.model, DistributedDataParallel):
            module = loop.model.to(loop.device)
            device_ids = [loop.device.index] if loop.device.type == "cuda" else None
            loop.model = DistributedDataParallel(
                module, device_ids=device_ids,
                find_unused_parameters=self.find_unused_parameters)
            self._unhooked = loop.model
        sharded_train, sharded_val = self._sharded
        original_train, original_val = self._originals
        if loop.train_data is not sharded_train:
            original_train, sharded_train = loop.train_data, _shard(loop.train_data, training=True)
            loop.train_data = sharded_train
        if loop.val_data is not None and loop.val_data is not sharded_val:
            original_val, sharded_val = loop.val_data, _shard(loop.val_data, training=False)
            loop.val_data = sharded_val
        self._originals = (original_train, original_val)
        self._sharded = (sharded_train, sharded_val)
        check_equal_batches(loop.train_data)

    # ------------------------------------------------------------------ events
    def on_epoch_start(self, loop: Loop) -> None:
        if self._active:
            _set_epoch(loop.train_data, loop.state.epoch)
            if loop.val_data is not None:
                _set_epoch(loop.val_data, loop.state.epoch)

    def train_step_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        model = loop.model
        if not isinstance(model, DistributedDataParallel):
            return None
        if model is self._unhooked:  # the first training batch of the wrapper setup made
            self._unhooked = None
            _carry_vote(model)
        # Forward and backward both inside no_sync: DDP decides in forward whether the
        # coming backward all-reduces.
        return None if loop.state.step_boundary else model.no_sync()

    def validation_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        if not isinstance(loop.model, DistributedDataParallel):
            return None
        return self._unwrapped_for_validation(loop)

    @contextmanager
    def _unwrapped_for_validation(self, loop: Loop) -> Iterator[None]:
        # DDP's forward may broadcast buffers on the first call after training: a collective
        # that a rank with fewer (or no) validation batches would never join.
        wrapper = loop.model
        loop.model = wrapper.module
        try:
            yield
        finally:
            loop.model = wrapper

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self._failed = True

    def on_fit_end(self, loop: Loop) -> None:
        if not self._active or self._failed or not self._created_group:
            return  # on the error path: no collective; the process exits with the traceback
        self._teardown(loop)

    def _teardown(self, loop: Loop) -> None:
        """Share rank 0's buffers, unwrap the model, put back the user's loaders, and
        destroy the group this callback created."""
        for buffer in loop.unwrapped_model.buffers():
            dist.broadcast(buffer.data, src=0)
        if isinstance(loop.model, DistributedDataParallel):
            loop.model = loop.model.module
        self._unhooked = None
        # Put back the user's loaders, so that a later fit shards them for its new group.
        if loop.train_data is self._sharded[0]:
            loop.train_data = self._originals[0]
        if loop.val_data is not None and loop.val_data is self._sharded[1]:
            loop.val_data = self._originals[1]
        self._originals = self._sharded = (None, None)
        if distributed.is_initialized():
            dist.destroy_process_group()
        self._created_group = False
