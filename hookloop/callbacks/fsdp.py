"""Fully sharded data parallel training on torch's ``fully_shard`` (FSDP2), launched with
torchrun: the weights, gradients and optimizer state of a model too large for one GPU are
split over the ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from hookloop import distributed
from hookloop.base.checks import check_choice, check_flag, check_name, check_that
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError
from hookloop.launcher import Launch, destroy_at_exit
from hookloop.parallel.blocks import MIN_SHARE, check_wrap, chosen_blocks, default_blocks
from hookloop.parallel.mesh import Mesh
from hookloop.runfile import sharded

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["FSDP", "MIN_SHARE", "default_blocks"]  # the last two: hookloop.parallel.blocks

_MIXED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class FSDP(Callback):
    """Shard the model, its gradients and its optimizer state over processes and machines
    (torch's ``fully_shard``), launched with ``torchrun``.

    Under torchrun (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set), or as a task of
    SLURM's ``srun``, ``setup`` starts the process group as `DDP` does (the same rules:
    ``nccl`` on CUDA, ``gloo`` on CPU, ``cuda:LOCAL_RANK``; the same message when launched
    by neither, where it does nothing, so one script runs both ways), then:

    * applies ``fully_shard`` to each block (``wrap``) and to the root, on a one-dimensional
      device mesh over all ranks (or the ``mesh`` given: HSDP, FSDP + tensor parallel):
      each rank keeps ``1/world`` of every parameter (a DTensor) and gathers a block's
      parameters just for its forward and backward;
    * re-points ``loop.optimizer`` at the sharded parameters, keeping its class,
      hyper-parameters and param groups (an optimizer built over the unsharded parameters
      would otherwise step nothing, silently), and refuses an optimizer that holds tensors
      the model does not, or that has stepped already;
    * shards the training and validation data as `DDP` does.

    The other callbacks work unchanged: `GradAccumulation` skips the reduce-scatter of every
    micro-batch but the last of a window (``set_requires_gradient_sync``); `GradClip` clips
    by the global norm over all shards (``loop.state.grad_norm`` is that norm); `AMP`
    computes in bfloat16 by autocast (or pass ``mixed_precision``) and float16 with a
    sharded GradScaler (the skip decision agreed by all ranks); `EMA` averages each rank's
    shards (exact, no gathering); `Metrics`, `EarlyStopping` and `Checkpoint`'s best decide
    as under DDP.

    Validation forwards gather the parameters too, so every rank must run as many of them:
    when the ranks' validation shards have the same number of batches they run sharded;
    otherwise (a validation set that does not split evenly, ``evaluate(data)``,
    ``predict(data)``) the whole model is gathered for the pass (each rank holds every
    parameter, in the compute dtype, until the pass ends) and each rank runs its own batches.

    Checkpoints (`Checkpoint` and ``Loop.state_dict()``), by ``state_dict``:

    * ``"full"``: the model and optimizer state gathered to rank 0 on the CPU and written as
      one file in the usual format: ``hookloop.load_checkpoint`` loads it into an unsharded
      model (inference), and it resumes under FSDP on any number of ranks, or without FSDP;
    * ``"sharded"``: a directory per checkpoint (``epoch=...-step=....dcp``) into which every
      rank writes its own shards (``torch.distributed.checkpoint``), complete or absent;
      it resumes on the same or another number of ranks (DCP re-shards), and
      ``load_checkpoint`` reads it into a sharded or an unsharded model.

    After the fit the model stays sharded and the process group stays (the model's shards
    live on it), so ``validate()``, ``evaluate()`` and ``predict()`` work after ``fit``; the
    group is destroyed when the process exits cleanly.

    Args:
        wrap: The blocks to shard one by one: a set of module classes, or a callable
            ``module -> bool`` asked for every submodule. None: every direct child
            holding at least 2% of the parameters (`default_blocks`). The root is always
            sharded too, holding whatever no block holds.
        mixed_precision: None (compute in the parameters' dtype), a dtype (``torch.bfloat16``:
            parameters gathered and computed in it, gradients reduced in float32), or a
            ``torch.distributed.fsdp.MixedPrecisionPolicy``.
        reshard_after_forward: Free each block's gathered parameters after its forward
            (gathered again for its backward): less memory, one more all-gather per block.
        cpu_offload: Keep the sharded parameters, gradients and optimizer state in host
            memory (``CPUOffloadPolicy``), on CUDA; on a CPU run they are there already and
            this is ignored, with a warning.
        state_dict: ``"full"`` or ``"sharded"``: the checkpoint layout (above).
        backend: Process group backend; None means ``nccl`` on CUDA, else ``gloo``.
        requeue: In a SLURM job, requeue it with ``scontrol`` when SIGUSR1 ends the launch,
            as ``DDP(requeue=True)`` does.
        mesh: None (shard over all ranks, a 1-D mesh), or a `hookloop.parallel.mesh.Mesh`: FSDP
            shards over its ``dp_shard`` ranks, and with ``dp_replicate`` > 1 replicates
            across them (HSDP: a 2-D ``(replicate, shard)`` mesh; gradients reduce-scattered
            within a replica, all-reduced across replicas); with ``tp`` > 1, pass the same
            Mesh to `TensorParallel`, which comes before FSDP. The data is sharded over the
            data-parallel ranks (dp_replicate x dp_shard).

    Raises:
        ConfigurationError: a bad argument; at setup, an optimizer holding tensors the
            model does not, or one that stepped before the model was sharded.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import FSDP
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 1))
        >>> data = torch.utils.data.DataLoader(
        ...     torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 1)),
        ...     batch_size=4)
        >>> loop = Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[FSDP(state_dict="sharded")])
        >>> # python train.py: one process; torchrun --nproc_per_node=2 train.py: sharded on two.
    """

    unique: ClassVar[bool] = True
    roles: ClassVar[tuple[str, ...]] = ("distributed",)
    runs_after: ClassVar[dict[str, str]] = {
        "ActivationCheckpointing": "the checkpointed blocks are sharded as they are: "
                                   "checkpointing a block FSDP gathers already would recompute "
                                   "outside FSDP's hooks",
        "TensorParallel": "FSDP shards the tensor-parallel weights over the data-parallel "
                          "ranks; tensor parallel cannot split weights that are sharded "
                          "already",
    }
    conflicts_with: ClassVar[dict[str, str]] = {
        "DDP": "both distribute the model (DDP keeps a whole copy on every rank, FSDP shards "
               "it); keep FSDP for a model that does not fit on one GPU, DDP otherwise",
    }

    def __init__(self, *, wrap: Iterable[type[nn.Module]] | Callable[[nn.Module], bool]
                 | None = None, mixed_precision: Any = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, state_dict: str = "full",
                 backend: str | None = None, requeue: bool = False,
                 mesh: Mesh | None = None) -> None:
        wrap = check_wrap("FSDP", wrap)
        self.wrap = wrap
        self.mixed_precision = mixed_precision
        self._policy = self._mixed_precision_policy(mixed_precision)
        self.reshard_after_forward = check_flag("FSDP reshard_after_forward",
                                                reshard_after_forward)
        self.cpu_offload = check_flag("FSDP cpu_offload", cpu_offload)
        self.state_dict_layout = check_choice(
            "FSDP state_dict", state_dict, sharded.LAYOUTS,
            hint="'full' writes one gathered file, 'sharded' a directory of every rank's shards.")
        self.backend = check_name("FSDP backend", backend,
                                  hint="A backend name is e.g. 'nccl' or 'gloo'; None picks "
                                       "nccl on CUDA, gloo on CPU.")
        self.requeue = check_flag("FSDP requeue", requeue)
        self.mesh = check_that("FSDP mesh", mesh, mesh is None or isinstance(mesh, Mesh),
                               "None or a hookloop.parallel.mesh.Mesh",
                               hint="For example Mesh(dp_replicate=2, dp_shard='auto') (HSDP).")
        self._launch = Launch("FSDP", requeue=self.requeue)
        self._syncing = True  # gradients reduce-scattered at the coming backward
        self._warned_offload = False

    @staticmethod
    def _mixed_precision_policy(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, torch.dtype):
            check_choice("FSDP mixed_precision", value, _MIXED_DTYPES,
                         hint="Or a torch.distributed.fsdp.MixedPrecisionPolicy.")
            from torch.distributed.fsdp import MixedPrecisionPolicy

            return MixedPrecisionPolicy(param_dtype=value, reduce_dtype=torch.float32)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return check_that("FSDP mixed_precision", value, isinstance(value, MixedPrecisionPolicy),
                          "None, a dtype or a torch.distributed.fsdp.MixedPrecisionPolicy",
                          hint="For example torch.bfloat16.")

    def __repr__(self) -> str:
        extra = "" if self.mixed_precision is None else f", mixed_precision={self.mixed_precision}"
        extra += "" if self.mesh is None else f", mesh={self.mesh!r}"
        return f"FSDP(state_dict={self.state_dict_layout!r}{extra})"

    # ------------------------------------------------------------------- setup
    def setup(self, loop: Loop) -> None:
        if not self._launch.start(loop, self.backend):
            return
        module = loop.unwrapped_model
        if not sharded.is_sharded_module(module):
            self._shard(loop, module)
            if self._launch.created_group:
                destroy_at_exit(self._launch)
        # A window an exception cut short is over.
        cast(Any, module).set_requires_gradient_sync(True)
        self._syncing = True
        sharded.set_layout(module, self.state_dict_layout)
        self._launch.shard_data(loop, self.mesh)

    def _shard(self, loop: Loop, module: nn.Module) -> None:
        """``fully_shard`` the blocks, then the root; re-point the optimizer."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        optimizer = loop.optimizer
        names = sharded.check_optimizer_holds_model("FSDP", module, optimizer)
        module.to(loop.device)
        if self.mesh is not None:
            device_mesh = self.mesh.fsdp_mesh(loop.device.type)
        elif any(sharded.is_sharded_tensor(param) for param in module.parameters()):
            raise ConfigurationError(
                "FSDP: the model holds DTensor parameters (split by TensorParallel) but FSDP "
                "was given no mesh, so it would shard over a mesh of its own that the "
                "tensor-parallel one is not part of. Pass the same hookloop.parallel.mesh.Mesh to both: "
                "mesh = Mesh(dp_shard='auto', tp=2); [TensorParallel(plan, mesh=mesh), "
                "FSDP(mesh=mesh)].")
        else:
            device_mesh = init_device_mesh(loop.device.type, (distributed.world_size(),))
        options: dict[str, Any] = {"mesh": device_mesh}
        if self._policy is not None:
            options["mp_policy"] = self._policy
        if self.cpu_offload:
            if loop.device.type == "cpu":
                if not self._warned_offload:
                    self._warned_offload = True
                    warnings.warn("FSDP cpu_offload=True is ignored on a CPU run: the shards are "
                                  "in host memory already.", RuntimeWarning, stacklevel=4)
            else:
                options["offload_policy"] = CPUOffloadPolicy()
        for block in chosen_blocks(module, self.wrap):
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(module, **options)  # the root: torch keeps it gathered from forward to backward
        sharded.repoint_optimizer(module, optimizer, names)

    # ------------------------------------------------------------------ events
    def on_epoch_start(self, loop: Loop) -> None:
        self._launch.set_epoch(loop)

    def train_step_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        # Inside an accumulation window the gradients stay unsharded and accumulate on each
        # rank; the window's last backward reduce-scatters their sum once. (DDP's no_sync()
        # does nothing under FSDP.)
        boundary = loop.state.step_boundary
        if boundary != self._syncing and sharded.is_sharded_module(loop.unwrapped_model):
            cast(Any, loop.unwrapped_model).set_requires_gradient_sync(boundary)
            self._syncing = boundary
        return None

    def validation_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        module = loop.unwrapped_model
        if not sharded.is_sharded_module(module) or self._runs_sharded(loop):
            return None
        return self._gathered(module)

    def _runs_sharded(self, loop: Loop) -> bool:
        """Whether every rank runs the same number of validation forwards (asked once per
        loader, of all ranks): then they run sharded, without gathering the model."""
        # Phase's values are its names as strings: "validate", "sanity_check" (no import).
        if loop.phase not in ("validate", "sanity_check") or loop.val_data is None:
            return False  # evaluate(data), predict(data): data this callback cannot see
        return self._launch.even_batches(loop.val_data)

    @contextmanager
    def _gathered(self, module: nn.Module) -> Iterator[None]:
        """The whole model gathered on every rank for one pass: no collective per forward, so
        the ranks may run different numbers of batches."""
        sharded.gather(module)
        try:
            yield
        finally:
            sharded.release(module, self.reshard_after_forward)

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self._launch.failed()
