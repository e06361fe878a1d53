"""Starting a multi-process run: the process group from the launcher's environment, the
data sharded over the ranks, and tearing it down.

`DDP` and `FSDP` both start through a `Launch`: the same rules (torchrun's ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``, or the task SLURM's ``srun`` describes, `hookloop.parallel.slurm`;
``nccl`` on CUDA, ``gloo`` on CPU; ``cuda:LOCAL_RANK``), the same message when the script
was launched by neither, the same SLURM requeue on SIGUSR1, the same sharding of the
training and validation data, and the same teardown (only the group a launch created, only
after a fit that ended cleanly: on the error path nothing collective is called).
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hookloop import distributed
from hookloop.engine.data import length_of
from hookloop.engine.samplers import check_equal_batches, set_epoch, shard_loader
from hookloop.parallel import slurm, suspension
from hookloop.parallel.mesh import Mesh

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Launch", "destroy_at_exit", "init_process_group", "launched_by_torchrun"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_groups_created = 0  # process groups hookloop created in this process


def launched_by_torchrun() -> bool:
    """True when torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) is set.

    Example:
        >>> import os
        >>> launched_by_torchrun() == all(name in os.environ
        ...                               for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        True
    """
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def init_process_group(backend: str) -> None:
    """``init_process_group`` from torchrun's environment, also after an earlier destroy.

    torch names the default group's keys in the rendezvous store the same way each time
    (its counter restarts when the group is destroyed), so a second init on one rank could
    read the other ranks' addresses of the first group and fail to connect. Later groups
    therefore get keys of their own, in the same order on every rank.

    Args:
        backend: ``"gloo"``, ``"nccl"``...
    """
    global _groups_created
    if _groups_created == 0:
        dist.init_process_group(backend=backend)
    else:
        store, rank, world_size = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"hookloop.ddp/{_groups_created}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    _groups_created += 1


class Launch:
    """One callback's share in the process group and the sharded data, across its fits.

    The callback calls `start` in its ``setup``, wraps or shards the model, then calls
    `shard_data`; `set_epoch` at every epoch start and `failed` from ``on_exception``
    (`even_batches` where a pass needs as many forwards on every rank). In
    ``on_fit_end``, when `finishing_cleanly`, it undoes its wrapping, then calls
    `restore_data` and `destroy_group`.

    Args:
        owner: The callback's name (``"DDP"``, ``"FSDP"``), in messages.
        requeue: In a SLURM job, requeue it when SIGUSR1 ends the launch
            (`hookloop.parallel.slurm.requeue_on_sigusr1`).

    Example:
        >>> launch = Launch("DDP")
        >>> launch.active, launch.created_group, launch.launcher
        (False, False, None)
    """

    def __init__(self, owner: str, *, requeue: bool = False) -> None:
        self.owner = owner
        self.requeue = requeue
        #: The launcher the last `start` found: ``"torchrun"``, ``"srun"`` or None.
        self.launcher: str | None = None
        #: True between a `start` that found a launcher and the end of the fit.
        self.active = False
        #: True when `start` created the default process group (`finish` destroys it).
        self.created_group = False
        self._noted = False
        self._failed = False
        self._originals: tuple[Any, Any] = (None, None)
        self._sharded: tuple[Any, Any] = (None, None)
        self._even: dict[int, bool] = {}  # a loader -> the same batch count on every rank

    def start(self, loop: Loop, backend: str | None) -> bool:
        """Join or create the process group and pick the device; True when distributed.

        Outside torchrun (and without a group) it returns False and says so once. For
        ``validate()``/``evaluate()``/``predict()`` outside a fit with no group, it returns
        False too: each rank then runs the whole data itself (every rank holds the same
        model), rather than setting up a group that nothing would tear down.
        """
        self._failed = False
        task = slurm.adopt_srun_task()  # None under torchrun: its variables, no srun task
        self.launcher = "srun" if task is not None else (
            "torchrun" if launched_by_torchrun() else None)
        self.active = distributed.is_initialized() or self.launcher is not None
        vote = suspension.current()
        if self.requeue and loop.fitting and vote is not None:  # before any collective
            action = slurm.requeue_on_sigusr1(self.owner, main=distributed.is_main())
            if action is not None:
                vote.at_end(action)
        if not self.active:
            if not self._noted:
                self._noted = True
                warnings.warn(
                    f"{self.owner}: not launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK "
                    "unset) nor by srun (no SLURM task), so training runs in this one "
                    "process. Launch with `torchrun --nproc_per_node=N script.py` (or `srun` "
                    "with N tasks) to train on N processes.",
                    stacklevel=5)  # the user's fit() or validate() call
            return False
        if loop.device.type == "cuda":
            loop.device = torch.device("cuda", distributed.local_rank())
            torch.cuda.set_device(loop.device)
        if not loop.fitting and not distributed.is_initialized():
            self.active = False
            return False
        if not distributed.is_initialized():
            init_process_group(backend or ("nccl" if loop.device.type == "cuda" else "gloo"))
            self.created_group = True
            if distributed.is_main():
                found = (f"srun (SLURM job {task.job_id})" if task is not None else "torchrun")
                group = (f", group at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                         if task is not None else "")
                print(f"{self.owner}: launched by {found}: rank 0 of "
                      f"{distributed.world_size()}{group}", flush=True)
        return True

    def shard_data(self, loop: Loop, mesh: Mesh | None = None) -> None:
        """Give ``loop.train_data`` and ``loop.val_data`` distributed samplers (once per
        loader), then check that every rank runs the same number of training batches.

        ``mesh``: shard over its data-parallel ranks (the tensor-parallel ranks of a group
        read the same batches), and sum the data's losses and metrics over them
        (`hookloop.distributed.data_parallel_sum`); None: every rank reads its own share,
        and sums run over all ranks."""
        replicas = None if mesh is None else mesh.data_parallel()
        distributed.set_data_parallel_group(
            None if mesh is None else mesh.data_parallel_group(loop.device.type))
        sharded_train, sharded_val = self._sharded
        original_train, original_val = self._originals
        if loop.train_data is not sharded_train:
            original_train = loop.train_data
            sharded_train = shard_loader(loop.train_data, training=True, owner=self.owner,
                                         replicas=replicas)
            loop.train_data = sharded_train
        if loop.val_data is not None and loop.val_data is not sharded_val:
            original_val = loop.val_data
            sharded_val = shard_loader(loop.val_data, training=False, owner=self.owner,
                                       replicas=replicas)
            loop.val_data = sharded_val
        self._originals = (original_train, original_val)
        self._sharded = (sharded_train, sharded_val)
        check_equal_batches(loop.train_data, self.owner)

    def even_batches(self, data: Any) -> bool:
        """Whether every rank has as many batches of ``data`` as the others: asked of all
        ranks (a collective) once per loader; data without a length is uneven."""
        key = id(data)
        if key not in self._even:
            counts = distributed.all_gather_object(length_of(data))
            self._even[key] = None not in counts and len(set(counts)) == 1
        return self._even[key]

    def set_epoch(self, loop: Loop) -> None:
        """At every epoch start: the samplers draw that epoch's order."""
        if self.active:
            set_epoch(loop.train_data, loop.state.epoch)
            if loop.val_data is not None:
                set_epoch(loop.val_data, loop.state.epoch)

    def failed(self) -> None:
        """From ``on_exception``: the fit is on the error path; `finish` calls nothing
        collective (the process exits with its traceback and torchrun stops the others)."""
        self._failed = True

    @property
    def finishing_cleanly(self) -> bool:
        """True in ``on_fit_end`` of a fit that ended cleanly in a group this launch made."""
        return self.active and not self._failed and self.created_group

    def restore_data(self, loop: Loop) -> None:
        """Put back the user's loaders, so that a later fit shards them for its new group."""
        if loop.train_data is self._sharded[0]:
            loop.train_data = self._originals[0]
        if loop.val_data is not None and loop.val_data is self._sharded[1]:
            loop.val_data = self._originals[1]
        self._originals = self._sharded = (None, None)

    def destroy_group(self) -> None:
        """Destroy the default group this launch created (a collective: clean exits only)."""
        if distributed.is_initialized():
            distributed.set_data_parallel_group(None)
            dist.destroy_process_group()
        self.created_group = False


def destroy_at_exit(launch: Launch) -> None:
    """At a clean exit of the process, destroy the group ``launch`` created (for callbacks
    whose model lives on the group after the fit: `FSDP`, `TensorParallel`). A collective,
    so not after an uncaught exception, where the other ranks may be gone."""
    atexit.register(_destroy_if_clean, launch)


def _destroy_if_clean(launch: Launch) -> None:
    if getattr(sys, "last_value", None) is None and launch.finishing_cleanly:
        launch.destroy_group()
