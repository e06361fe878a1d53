"""Tensor parallelism: a layer's weights split over the ranks of a tensor-parallel group
(torch's ``parallelize_module`` and its styles), launched with torchrun."""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

from torch import nn

from hookloop.base.checks import check_choice, check_name, check_that
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError
from hookloop.launcher import Launch, destroy_at_exit
from hookloop.parallel.mesh import Mesh
from hookloop.runfile import sharded

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["TensorParallel"]

_parallelized: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _is_style(value: Any) -> bool:
    """A torch ``ParallelStyle`` (by class name: no 3 s import of torch's tensor parallel
    package before a run needs it)."""
    return any(kind.__name__ == "ParallelStyle" for kind in type(value).__mro__)


def _resolves(module: nn.Module, path: str) -> bool:
    """Whether ``path`` names a submodule of ``module`` as ``parallelize_module`` reads it:
    dot-separated names, each matched with ``fnmatch`` against the children's names."""
    if path == "":
        return True
    token, _, rest = path.partition(".")
    return any(_resolves(child, rest) for name, child in module.named_children()
               if fnmatch.fnmatch(name, token))


def _check_plan_names(plan: Mapping[str, Any], module: nn.Module) -> None:
    """Every key of a dict plan names a submodule; checked in one process too (where the
    plan is not applied), so a typo is found before the job goes to the cluster."""
    unmatched = [key for key in plan if not _resolves(module, key)]
    if unmatched:
        names = [name for name, _ in module.named_modules()][1:12]
        raise ConfigurationError(
            f"TensorParallel plan names {unmatched} but {type(module).__name__} has no such "
            f"submodule (torch would skip {'them' if len(unmatched) > 1 else 'it'} and split "
            f"nothing there). Its submodules are {names}{'...' if len(names) == 11 else ''}: "
            "write the keys as named_modules() names them ('blocks.*.up' matches every "
            "block's 'up').")


class TensorParallel(Callback):
    """Split layers' weights over the ranks of a tensor-parallel group with the user's plan
    (torch's ``parallelize_module``), launched with ``torchrun``.

    Under torchrun (or srun), ``setup`` starts the process group as `DDP` and `FSDP` do,
    builds the mesh (`hookloop.parallel.mesh.Mesh`; the whole world is one tensor-parallel group
    when none is given), then:

    * applies the plan on the mesh's ``tp`` dimension: a dict of submodule names (as
      ``named_modules`` gives them; torch's wildcards such as ``"blocks.*.up"`` work) to
      torch's styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
      ``PrepareModuleInput``), passed to ``parallelize_module``; or a function
      ``plan(model, tp_mesh)`` that parallelizes the model itself;
    * re-points ``loop.optimizer`` at the split parameters (as `FSDP` does, with the same
      refusals: an optimizer holding other tensors, or one that stepped);
    * shards the data by the data-parallel coordinate: every rank of a tensor-parallel
      group reads the same batches (they compute one model together), and the groups read
      different shares; validation losses and metrics are summed over the data-parallel
      ranks only, so each sample counts once.

    With data parallelism too (``Mesh(dp_shard=2, tp=2)``), put `FSDP` after this callback
    with the same mesh: FSDP shards the split weights over the data-parallel ranks (2-D
    DTensors). Without FSDP every rank must be in one tensor-parallel group (the gradients
    of different data-parallel groups would never be averaged): refused at setup.

    `GradClip` clips by the global norm over every mesh (the norms of each mesh's
    gradients combined); checkpoints are written as `FSDP`'s are (``state_dict="full"``:
    gathered to rank 0, one file that loads into the plain model; ``"sharded"``: DCP
    directories), and resume on another layout: a file of a ``(dp=2, tp=2)`` run resumes
    on 4 ranks with ``tp=1``, or in one process.

    Order: after `ActivationCheckpointing`, before `FSDP` and `Compile` (checked before the
    first batch).

    Args:
        plan: A dict ``{submodule name: ParallelStyle}`` or a callable
            ``plan(model, tp_mesh)``.
        mesh: The `hookloop.parallel.mesh.Mesh` (the same one as `FSDP`'s); None: all ranks in one
            tensor-parallel group.
        state_dict: ``"full"`` or ``"sharded"``: the checkpoint layout without `FSDP`
            (with it, FSDP's ``state_dict`` decides).
        backend: Process group backend; None means ``nccl`` on CUDA, else ``gloo``.

    Raises:
        ConfigurationError: a bad argument; at setup (in one process too), a plan key that
            names no submodule; under torchrun, a plan that splits no parameter, a
            mesh with several data-parallel ranks and no FSDP, an optimizer that cannot be
            re-pointed.

    Example:
        >>> import torch
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> from hookloop import Loop
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                             torch.nn.Linear(16, 8))
        >>> callback = TensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()})
        >>> # python train.py: one process (the plan is not applied);
        >>> # torchrun --nproc_per_node=2 train.py: each rank holds half of each weight.
    """

    unique: ClassVar[bool] = True
    roles: ClassVar[tuple[str, ...]] = ("distributed",)
    runs_after: ClassVar[dict[str, str]] = {
        "ActivationCheckpointing": "the checkpointed blocks are then split as they are; "
                                   "checkpointing after the split would recompute outside "
                                   "the tensor-parallel hooks",
    }
    conflicts_with: ClassVar[dict[str, str]] = {
        "DDP": "DDP cannot average DTensor gradients; with data parallelism too, use "
               "FSDP(mesh=mesh) after TensorParallel(plan, mesh=mesh)",
    }

    def __init__(self, plan: Mapping[str, Any] | Callable[[nn.Module, Any], Any], *,
                 mesh: Mesh | None = None, state_dict: str = "full",
                 backend: str | None = None) -> None:
        self.plan = check_that(
            "TensorParallel plan", plan,
            callable(plan) or (isinstance(plan, Mapping) and bool(plan) and all(
                isinstance(key, str) and _is_style(style) for key, style in plan.items())),
            "a non-empty dict of submodule names to torch ParallelStyles, or a callable "
            "plan(model, tp_mesh)",
            hint="For example {'up': ColwiseParallel(), 'down': RowwiseParallel()}.")
        self.mesh = check_that("TensorParallel mesh", mesh, mesh is None or isinstance(mesh, Mesh),
                               "None or a hookloop.parallel.mesh.Mesh",
                               hint="For example Mesh(dp_shard='auto', tp=2).")
        self.state_dict_layout = check_choice(
            "TensorParallel state_dict", state_dict, sharded.LAYOUTS,
            hint="'full' writes one gathered file, 'sharded' a directory of every rank's shards.")
        self.backend = check_name("TensorParallel backend", backend,
                                  hint="A backend name is e.g. 'nccl' or 'gloo'; None picks "
                                       "nccl on CUDA, gloo on CPU.")
        self._launch = Launch("TensorParallel")

    def __repr__(self) -> str:
        return f"TensorParallel(mesh={self.mesh!r})"

    @property
    def layout(self) -> Mesh:
        """The mesh this callback places the model on."""
        if self.mesh is None:
            self.mesh = Mesh(dp_shard=1, tp="auto")
        return cast(Mesh, self.mesh)

    def setup(self, loop: Loop) -> None:
        if not callable(self.plan):
            _check_plan_names(self.plan, loop.unwrapped_model)
        if not self._launch.start(loop, self.backend):
            return
        mesh = self.layout
        replicas, _ = mesh.data_parallel()
        module = loop.unwrapped_model
        if module not in _parallelized:
            with_fsdp = any(type(callback).__name__ == "FSDP" for callback in loop.callbacks)
            if replicas > 1 and not with_fsdp:
                raise ConfigurationError(
                    f"TensorParallel: {mesh!r} has {replicas} data-parallel ranks, but no FSDP "
                    "averages their gradients. Add FSDP(mesh=mesh) after TensorParallel, or "
                    "make every rank part of one tensor-parallel group (Mesh(dp_shard=1, "
                    "tp='auto')).")
            names = sharded.check_optimizer_holds_model("TensorParallel", module, loop.optimizer)
            module.to(loop.device)
            tp_mesh = mesh.tp_mesh(loop.device.type)
            if callable(self.plan):
                self.plan(module, tp_mesh)
            else:
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(module, tp_mesh, dict(self.plan))
            if not any(sharded.is_sharded_tensor(param) for param in module.parameters()):
                raise ConfigurationError(
                    f"TensorParallel: the plan split no parameter of {type(module).__name__} "
                    f"(its submodules are {[name for name, _ in module.named_modules()][1:8]}"
                    "...). Name the Linear layers to split, e.g. {'up': ColwiseParallel(), "
                    "'down': RowwiseParallel()}.")
            sharded.repoint_optimizer(module, loop.optimizer, names)
            _parallelized.add(module)
            if self._launch.created_group:
                destroy_at_exit(self._launch)
        if sharded.layout_of(module) is None or not sharded.is_sharded_module(module):
            sharded.set_layout(module, self.state_dict_layout)
        self._launch.shard_data(loop, mesh)

    def on_epoch_start(self, loop: Loop) -> None:
        self._launch.set_epoch(loop)

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self._launch.failed()
