"""Fault tolerance's plan of a step: which replica group trains which shard, and the ledger.

A step of a run of ``groups`` replica groups trains one global batch, cut into ``groups``
shards: shard ``k`` is what replica group ``k`` trains when every group is alive (torch's
``DistributedSampler`` with ``num_replicas=groups, rank=k``, as plain DDP cuts it). When
groups are missing from a step's quorum, `assign` hands each missing shard to one present
group, so the step still trains the whole global batch, each shard once. The `Ledger`
records, per committed step, which group trained each shard; `shard_indices` turns an
entry back into sample indices. Everything here is plain Python: the callback
(`hookloop.callbacks.fault_tolerance`) imports torchft, this module does not.

The names of the environment variables, timeouts and ports of a fault-tolerant run live
here, in one place, for the callback, the ``hookloop run`` command and the docs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ENV_GROUP", "ENV_GROUPS", "ENV_LIGHTHOUSE", "ENV_RUN_DIR", "DEFAULT_TIMEOUT_S",
           "DEFAULT_QUORUM_TIMEOUT_S", "DEFAULT_HEARTBEAT_TIMEOUT_MS", "DEFAULT_JOIN_TIMEOUT_MS",
           "DEFAULT_LIGHTHOUSE_PORT", "DEFAULT_RUN_DIR", "DEFAULT_MAX_RESTARTS",
           "DEFAULT_RESTART_DELAY_S", "Ledger", "assign", "shard_indices"]

#: This process's replica group, ``0 .. groups-1`` (set by ``hookloop run --groups``).
ENV_GROUP = "HOOKLOOP_FT_GROUP"
#: How many replica groups the run has (the global batch has that many shards).
ENV_GROUPS = "HOOKLOOP_FT_GROUPS"
#: The lighthouse's address, ``http://host:port`` (torchft's own variable).
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
#: A directory every group can write, where each records its last committed step.
ENV_RUN_DIR = "HOOKLOOP_FT_RUN_DIR"
#: Seconds a collective, a commit vote or a transfer from a peer may take before it fails:
#: the time to detect a peer that hangs (a dead one breaks the collective at once).
DEFAULT_TIMEOUT_S = 30.0
#: Seconds to wait for a quorum, and at a new run's start for every group to join.
DEFAULT_QUORUM_TIMEOUT_S = 60.0
#: How long the lighthouse waits for a silent group's heartbeat before it drops it from the
#: quorum: the time to detect a group that died between steps. 1 s suits steps of seconds
#: (torchft's default is 5 s; a group's manager beats every 100 ms).
DEFAULT_HEARTBEAT_TIMEOUT_MS = 1000
#: How long the lighthouse waits for groups that beat but have not asked to join yet.
DEFAULT_JOIN_TIMEOUT_MS = 1000
#: The lighthouse's port when ``hookloop run`` is not told another (torchft's own default).
DEFAULT_LIGHTHOUSE_PORT = 29510
#: Where ``hookloop run`` has each group record its last committed step.
DEFAULT_RUN_DIR = "ft-run"
#: How many group restarts ``hookloop run`` allows in all before it gives up.
DEFAULT_MAX_RESTARTS = 100
#: Seconds ``hookloop run`` waits before it starts a dead group again.
DEFAULT_RESTART_DELAY_S = 1.0


def assign(present: Sequence[int], groups: int) -> list[int]:
    """Which group trains each shard of a step: ``result[k]`` is shard ``k``'s group.

    A present group trains its own shard; the missing groups' shards go round the present
    groups in order (the first missing shard to the first present group, and so on), so
    every group that is present computes the same plan from the same set.

    Example:
        >>> assign([0, 2], 4)
        [0, 0, 2, 2]
        >>> assign([1], 2)
        [1, 1]
    """
    alive = sorted(set(present))
    if not alive:
        raise ValueError("a step needs at least one replica group present")
    missing = [shard for shard in range(groups) if shard not in alive]
    plan = list(range(groups))
    for turn, shard in enumerate(missing):
        plan[shard] = alive[turn % len(alive)]
    return plan


def shard_indices(dataset_size: int, groups: int, shard: int, *, epoch: int, batch: int,
                  batch_size: int, shuffle: bool, seed: int) -> list[int]:
    """The sample indices of ``shard`` in batch ``batch`` of ``epoch``.

    The same order as torch's ``DistributedSampler(num_replicas=groups, rank=shard,
    shuffle=shuffle, seed=seed, drop_last=False)`` after ``set_epoch(epoch)``, read in
    batches of ``batch_size``: the indices plain data parallelism gives that rank.

    Example:
        >>> shard_indices(8, 2, 1, epoch=0, batch=1, batch_size=2, shuffle=False, seed=0)
        [5, 7]
    """
    if shuffle:
        import torch  # here: the launcher and the CLI read this module's names without torch

        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(dataset_size, generator=generator).tolist()
    else:
        order = list(range(dataset_size))
    per_group = -(-dataset_size // groups)  # padded, as DistributedSampler pads
    padding = per_group * groups - dataset_size
    if padding:
        order += (order * (-(-padding // len(order))))[:padding]
    mine = order[shard::groups]
    return mine[batch * batch_size:(batch + 1) * batch_size]


class Ledger:
    """Per committed step: the epoch, the batch and which group trained each shard.

    Kept in the run's state (so a group healed from a peer, or resumed from disk, has the
    entries of the steps before), as plain lists: ``[step, epoch, batch, group of shard 0,
    group of shard 1, ...]``.
    """

    def __init__(self) -> None:
        self.entries: list[list[int]] = []

    def record(self, step: int, epoch: int, batch: int, plan: Iterable[int]) -> None:
        """Add the committed ``step``: ``plan[k]`` trained shard ``k`` of ``batch``."""
        self.entries.append([step, epoch, batch, *plan])

    def state_dict(self) -> dict[str, Any]:
        """The entries, as a list of int lists."""
        return {"entries": [list(entry) for entry in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`."""
        self.entries = [[int(value) for value in entry] for entry in state.get("entries", [])]
