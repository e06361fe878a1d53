"""Process-group helpers with single-process fallbacks, so callbacks never branch on DDP.

Every function works without ``torch.distributed`` being initialised: ranks are 0, the
world has one process, and reductions return their input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "collective_device",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "is_main",
    "all_reduce_sum",
    "all_reduce_max",
    "any_true",
    "broadcast_object",
    "all_gather_object",
    "all_reduce_sums",
    "data_parallel_size",
    "data_parallel_sum",
    "set_data_parallel_group",
]

T = TypeVar("T")


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _launcher_rank() -> int:
    """torchrun's ``RANK`` (a launcher's rank for this process), else 0."""
    try:
        return max(0, int(os.environ.get("RANK", "0")))
    except ValueError:
        return 0


def rank() -> int:
    """Global rank of this process.

    From the process group when one exists; otherwise from torchrun's ``RANK`` variable
    (0 when unset). So after ``fit`` destroyed the group, ``if is_main(): save(...)`` still
    runs on one process only, not on every rank. `world_size` stays 1 without a group,
    since no collective can run then.

    Example:
        >>> rank()  # one process, not under torchrun
        0
    """
    return dist.get_rank() if is_initialized() else _launcher_rank()


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    """Rank of this process on its machine, from torchrun's ``LOCAL_RANK`` (else 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """True on global rank 0: the process that writes files and prints.

    Also without a process group under torchrun (before or after ``fit``): see `rank`.
    """
    return rank() == 0


def _reduce(tensor: torch.Tensor, op: Any) -> torch.Tensor:
    if world_size() == 1:
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=op)
    return tensor


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks (a new tensor; the input itself without DDP)."""
    return _reduce(tensor, dist.ReduceOp.SUM if dist.is_available() else None)


#: The ranks a data sum runs over (`data_parallel_sum`): None, all of them; ``"alone"``,
#: none (one data-parallel replica: every rank read all the data); or a process group.
_data_parallel: Any = None


def set_data_parallel_group(group: Any) -> None:
    """Where `data_parallel_sum` sums: None (every rank: plain data parallelism),
    ``"alone"`` (no other rank read other data) or the process group of the ranks that
    read different data (`hookloop.parallel.mesh.Mesh` sets it when tensor-parallel ranks read the
    same batches). Reset to None when the default group is destroyed."""
    global _data_parallel
    _data_parallel = group


def data_parallel_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over the ranks that read different data: all ranks under DDP and
    FSDP; under tensor parallelism only one rank of each tensor-parallel group counts (the
    others saw the same samples), so a sum of losses or of correct predictions counts every
    sample once.

    Example:
        >>> data_parallel_sum(torch.tensor([2.0, 3.0]))
        tensor([2., 3.])
    """
    if world_size() == 1 or _data_parallel is None:
        return all_reduce_sum(tensor)
    if _data_parallel == "alone":
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_data_parallel)
    return tensor


def data_parallel_size() -> int:
    """How many ranks read different data (the ranks `data_parallel_sum` counts): all of
    them under DDP and FSDP; under tensor parallelism one per tensor-parallel group, whose
    ranks read the same samples (a rate of samples times this counts each sample once).

    Example:
        >>> data_parallel_size()
        1
    """
    world = world_size()
    if world == 1 or _data_parallel is None:
        return world
    if _data_parallel == "alone":
        return 1
    return dist.get_world_size(_data_parallel)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over all ranks."""
    return _reduce(tensor, dist.ReduceOp.MAX if dist.is_available() else None)


def collective_device() -> torch.device:
    """Where tensors for a collective live: the current CUDA device under nccl, else the CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_true(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one: a collective decision."""
    if world_size() == 1:
        return bool(flag)
    tensor = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    return bool(all_reduce_max(tensor).item() > 0)


def broadcast_object(obj: T, src: int = 0, group: Any = None) -> T:
    """``obj`` as rank ``src`` has it, on every rank (picklable objects); over ``group``
    (a CPU group of its own: a background checkpoint write) instead of the default one."""
    if world_size() == 1:
        return obj
    holder = [obj]
    device = collective_device() if group is None else torch.device("cpu")
    dist.broadcast_object_list(holder, src=src, group=group, device=device)
    return holder[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (a one-element list in a single process)."""
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_sums(sums: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Sum each value of ``sums`` over all ranks with one all-reduce; floats come back.

    Made for per-epoch metric sums (``{"correct": ..., "samples": ...}``): the keys must be
    the same on every rank, else a `ValueError` names the keys of each rank (a mismatch
    would otherwise hang or add unrelated values together). Costs one host sync.

    Example:
        >>> all_reduce_sums({"correct": 3.0, "samples": 4})
        {'correct': 3.0, 'samples': 4.0}
    """
    keys = sorted(sums)
    if world_size() > 1:
        every_rank = all_gather_object(keys)
        if any(other != keys for other in every_rank):
            listing = "; ".join(f"rank {index}: {other}" for index, other in enumerate(every_rank))
            raise ValueError(
                f"all_reduce_sums needs the same keys on every rank, got {listing}. "
                "Write every metric on every rank, also on a rank that saw no batch.")
    if not keys:
        return {}
    device = collective_device()
    values = torch.stack([torch.as_tensor(sums[key], dtype=torch.float64, device=device)
                          .reshape(()) for key in keys])
    return dict(zip(keys, all_reduce_sum(values).tolist()))
