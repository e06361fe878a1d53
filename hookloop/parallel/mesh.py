"""The layout of a multi-process run: how the ranks split into data-parallel replicas,
data-parallel shards and tensor-parallel groups (`Mesh`), built once as torch's named
``DeviceMesh`` and shared by the callbacks that place the model on it (`FSDP`,
`TensorParallel`) and by the data sharding (every tensor-parallel rank of a group reads
the same batch)."""

from __future__ import annotations

import math
from typing import Any

from hookloop import distributed
from hookloop.errors import ConfigurationError

__all__ = ["DIMENSIONS", "Mesh"]

#: The mesh's dimension names, outermost first: ranks ``r`` of a ``(R, S, T)`` mesh are
#: laid out as ``r = (replica * S + shard) * T + tp``, so a tensor-parallel group is
#: consecutive ranks (one machine, the fast link) and the replicas are farthest apart.
DIMENSIONS = ("dp_replicate", "dp_shard", "tp")


def _check_size(name: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"Mesh {name} must be a positive int or 'auto', got {value!r}.")
    return value


class Mesh:
    """A device mesh described by its dimensions: ``dp_replicate`` x ``dp_shard`` x ``tp``
    ranks.

    * ``dp_replicate``: data-parallel replicas, each holding the whole (sharded) model;
      with ``dp_shard`` > 1 too, `FSDP` shards within a replica and all-reduces across
      replicas (HSDP: the all-gathers stay inside a replica, on the fast link).
    * ``dp_shard``: the ranks `FSDP` shards the model over (within a replica).
    * ``tp``: the ranks of a tensor-parallel group (`TensorParallel`), which split a
      layer's weights and all see the same batch.

    One dimension may be ``"auto"``: the world size divided by the others. The torch
    ``DeviceMesh`` (``init_device_mesh`` with the names of `DIMENSIONS`) is built once, at
    the first `build` (in the first callback's ``setup``), and shared: pass the same `Mesh`
    to `FSDP` and `TensorParallel`.

    Args:
        dp_replicate: Replicas (default 1).
        dp_shard: Shards per replica (default ``"auto"``: what is left).
        tp: Tensor-parallel ranks per group (default 1).

    Raises:
        ConfigurationError: a size that is not a positive int or ``"auto"``, more than one
            ``"auto"``; at `sizes`, sizes whose product is not the world size.

    Example:
        >>> mesh = Mesh(dp_shard=2, tp=2)
        >>> mesh.sizes(4)
        {'dp_replicate': 1, 'dp_shard': 2, 'tp': 2}
        >>> mesh.data_parallel(world=4, rank=3)  # (replicas of the data, this rank's one)
        (2, 1)
    """

    def __init__(self, *, dp_replicate: int | str = 1, dp_shard: int | str = "auto",
                 tp: int | str = 1) -> None:
        self.requested = {"dp_replicate": _check_size("dp_replicate", dp_replicate),
                          "dp_shard": _check_size("dp_shard", dp_shard),
                          "tp": _check_size("tp", tp)}
        autos = [name for name, size in self.requested.items() if size == "auto"]
        if len(autos) > 1:
            raise ConfigurationError(
                f"Mesh: at most one dimension can be 'auto', got {autos}; give the others "
                "as numbers, e.g. Mesh(dp_replicate=2, dp_shard='auto', tp=2).")
        self._built: tuple[Any, Any, Any] | None = None  # (world group, DeviceMesh, data group)

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={size!r}" for name, size in self.requested.items())
        return f"Mesh({settings})"

    def sizes(self, world: int) -> dict[str, int]:
        """The size of every dimension for ``world`` processes ("auto" worked out)."""
        fixed = math.prod(size for size in self.requested.values() if isinstance(size, int))
        sizes: dict[str, int] = {}
        for name, size in self.requested.items():
            sizes[name] = size if isinstance(size, int) else world // fixed  # else "auto"
        if math.prod(sizes.values()) != world or min(sizes.values()) < 1:
            raise ConfigurationError(
                f"{self!r} does not fit {world} process(es): dp_replicate x dp_shard x tp "
                f"must equal the number of processes, and {sizes} does not. Launch "
                f"{math.prod(s for s in self.requested.values() if s != 'auto')} x k "
                "processes, or change the sizes (one of them may be 'auto').")
        return sizes

    def data_parallel(self, world: int | None = None, rank: int | None = None
                      ) -> tuple[int, int]:
        """``(replicas, index)``: how many ranks read different data (dp_replicate x
        dp_shard) and which of them this rank is (every rank of a tensor-parallel group
        gets the same index: they read the same batches)."""
        world = distributed.world_size() if world is None else world
        rank = distributed.rank() if rank is None else rank
        sizes = self.sizes(world)
        return sizes["dp_replicate"] * sizes["dp_shard"], rank // sizes["tp"]

    def build(self, device_type: str) -> Any:
        """The torch ``DeviceMesh`` over all ranks, named by `DIMENSIONS`; built at the first
        call in a process group, the same object after (a collective the first time)."""
        import torch.distributed as dist

        world_group = dist.group.WORLD
        if self._built is not None and self._built[0] is world_group:
            return self._built[1]
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes(distributed.world_size())
        device_mesh = init_device_mesh(device_type, tuple(sizes[name] for name in DIMENSIONS),
                                       mesh_dim_names=DIMENSIONS)
        # The data-parallel sums (validation loss, metrics) run over the ranks that read
        # different data: one group per tensor-parallel position.
        replicas = sizes["dp_replicate"] * sizes["dp_shard"]
        tp = sizes["tp"]
        if tp > 1 and replicas > 1:
            group, _ = dist.new_subgroups_by_enumeration(
                [[index * tp + position for index in range(replicas)] for position in range(tp)])
        elif tp > 1:
            group = "alone"  # one replica: each rank's sums are the data's sums already
        else:
            group = None
        self._built = (world_group, device_mesh, group)
        return device_mesh

    def data_parallel_group(self, device_type: str) -> Any:
        """Where the data sums of this layout run (`hookloop.distributed.set_data_parallel_group`):
        None (all ranks), ``"alone"`` (one replica) or the group of this rank's
        tensor-parallel position. Builds the mesh if it is not yet."""
        self.build(device_type)
        return self._built[2]  # type: ignore[index]

    def fsdp_mesh(self, device_type: str) -> Any:
        """The sub-mesh `FSDP` shards over: ``dp_shard`` (1-D), or ``(dp_replicate,
        dp_shard)`` (2-D: HSDP) when there are replicas."""
        device_mesh = self.build(device_type)
        if self.sizes(distributed.world_size())["dp_replicate"] > 1:
            return device_mesh["dp_replicate", "dp_shard"]
        return device_mesh["dp_shard"]

    def tp_mesh(self, device_type: str) -> Any:
        """The sub-mesh `TensorParallel` splits the layers over (``tp``, 1-D)."""
        return self.build(device_type)["tp"]
