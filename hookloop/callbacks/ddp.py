"""Distributed data parallel training on torch.distributed, launched with torchrun or srun."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hookloop import distributed
from hookloop.base.checks import check_flag, check_name
from hookloop.callback import Callback
from hookloop.engine.samplers import UnpaddedDistributedSampler, check_equal_batches
from hookloop.errors import ConfigurationError
from hookloop.launcher import Launch, launched_by_torchrun
from hookloop.parallel import slurm
from hookloop.parallel.suspension import carry_on_gradients

if TYPE_CHECKING:
    from hookloop.loop import Loop

# The samplers live in the core (FSDP shards data the same way); they stay importable here.
__all__ = ["DDP", "UnpaddedDistributedSampler", "check_equal_batches", "sync_batchnorm"]

_PLAIN_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d,
                    nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


def sync_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` with its BatchNorm layers replaced by torch's ``SyncBatchNorm``.

    torch's ``SyncBatchNorm.convert_sync_batchnorm``: each new layer holds the same
    parameter and buffer tensors as the one it replaces (the optimizer keeps working and the
    state dict keeps its keys), and the layers already synchronised are left as they are.
    The conversion works anywhere; training with the converted layers needs CUDA (in train
    mode under a process group of several ranks torch refuses CPU tensors), while in eval
    mode, or without a process group, they compute what BatchNorm computes.

    Returns:
        The converted module: ``module`` itself unless it is a BatchNorm layer.

    Example:
        >>> from torch import nn
        >>> model = sync_batchnorm(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)))
        >>> type(model[1]).__name__
        'SyncBatchNorm'
    """
    plain = any(isinstance(layer, _PLAIN_BATCHNORM) for layer in module.modules())
    return nn.SyncBatchNorm.convert_sync_batchnorm(module) if plain else module


def _carry_vote(model: DistributedDataParallel) -> None:
    """Let the gradient all-reduce carry the ranks' vote on ending the launch
    (`hookloop.parallel.suspension.carry_on_gradients`), unless the program registered a
    communication hook of its own (DDP takes one only): the vote then runs an all-reduce
    of its own at each step boundary."""
    try:
        model.register_comm_hook(None, carry_on_gradients)
    except RuntimeError as error:
        if "only be called once" not in str(error):
            raise


class DDP(Callback):
    """Data-parallel training over processes and machines, launched with ``torchrun`` or
    ``srun``.

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

    Started by SLURM's ``srun`` without torchrun (one task per process), it reads the
    rank, world size and local rank from SLURM's variables, the group's address from the
    first node of the host list and its port from the job id (`hookloop.parallel.slurm`), and starts
    the same way; rank 0 says which launcher it found (``launcher``). The step's gradient
    all-reduce carries the ranks' vote on ending the launch
    (`hookloop.parallel.suspension.carry_on_gradients`), unless the program registers a
    communication hook of its own.

    Outside torchrun and srun it does nothing and says so once, so one script runs both
    ways.

    Args:
        backend: Process group backend; None means ``nccl`` on CUDA, else ``gloo``.
        find_unused_parameters: Passed to ``DistributedDataParallel``, for models whose
            forward does not use every parameter.
        sync_batchnorm: Convert the model's BatchNorm layers to torch's ``SyncBatchNorm``
            (`sync_batchnorm`) before wrapping, so that training normalises with the
            statistics of the global batch. CUDA only: torch's SyncBatchNorm refuses CPU
            tensors in training, so on CPU it is refused at setup, before the first batch.
            Without it each rank normalises with its own batch's statistics
            (docs/distributed.md says what that changes).
        requeue: In a SLURM job, when SIGUSR1 (``#SBATCH --signal=USR1@90``) ends the
            launch, rank 0 runs ``scontrol requeue`` (``ARRAYJOBID_TASKID`` for an array
            task) once the checkpoint is written; ``scontrol`` missing from PATH is a
            `ConfigurationError` at setup. Outside a SLURM job it does nothing.

    Raises:
        ConfigurationError: under torchrun, ``sync_batchnorm=True`` on a device that is not
            CUDA (at setup, on every rank, before any process group is created).

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
                 sync_batchnorm: bool = False, requeue: bool = False) -> None:
        self.backend = check_name("DDP backend", backend,
                                  hint="A backend name is e.g. 'nccl' or 'gloo'; None picks "
                                       "nccl on CUDA, gloo on CPU.")
        self.find_unused_parameters = check_flag("DDP find_unused_parameters",
                                                 find_unused_parameters)
        self.sync_batchnorm = check_flag("DDP sync_batchnorm", sync_batchnorm)
        self.requeue = check_flag("DDP requeue", requeue)
        self._launch = Launch("DDP", requeue=self.requeue)
        self._unhooked: DistributedDataParallel | None = None  # to carry the vote (below)

    def __repr__(self) -> str:
        return (f"DDP(backend={self.backend!r}, "
                f"find_unused_parameters={self.find_unused_parameters!r}, "
                + ("sync_batchnorm=True, " if self.sync_batchnorm else "")
                + f"requeue={self.requeue!r})")

    @property
    def launcher(self) -> str | None:
        """The launcher the last setup found: ``"torchrun"``, ``"srun"`` or None."""
        return self._launch.launcher

    # ------------------------------------------------------------------- setup
    def setup(self, loop: Loop) -> None:
        distributed_run = (distributed.is_initialized() or launched_by_torchrun()
                           or slurm.srun_task() is not None)
        if self.sync_batchnorm and distributed_run and loop.device.type != "cuda":
            raise ConfigurationError(
                f"DDP(sync_batchnorm=True) needs CUDA, but this run trains on {loop.device}: "
                "torch's SyncBatchNorm synchronises batch statistics only for GPU tensors "
                "(in training it raises 'SyncBatchNorm expected input tensor to be on GPU'), "
                "and hookloop has no CPU replacement. Train on CUDA GPUs, or drop "
                "sync_batchnorm=True: each rank's BatchNorm then normalises with its own "
                "batch's statistics (see docs/distributed.md).")
        if not self._launch.start(loop, self.backend):
            return
        if not isinstance(loop.model, DistributedDataParallel):
            module = loop.model.to(loop.device)
            if self.sync_batchnorm:  # before wrapping: DDP registers the layers it holds
                module = sync_batchnorm(module)
            device_ids = [loop.device.index] if loop.device.type == "cuda" else None
            loop.model = DistributedDataParallel(
                module, device_ids=device_ids,
                find_unused_parameters=self.find_unused_parameters)
            self._unhooked = loop.model
        self._launch.shard_data(loop)

    # ------------------------------------------------------------------ events
    def on_epoch_start(self, loop: Loop) -> None:
        self._launch.set_epoch(loop)

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
        loop.model = cast(nn.Module, wrapper.module)
        try:
            yield
        finally:
            loop.model = wrapper

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self._launch.failed()

    def on_fit_end(self, loop: Loop) -> None:
        if not self._launch.finishing_cleanly:
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
        self._launch.restore_data(loop)
        self._launch.destroy_group()
