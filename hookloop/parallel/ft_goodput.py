"""The goodput ledger of a fault-tolerant run: where every second of its wall time went.

`Goodput` charges the wall time of a run, piece by piece, to one bucket each (`BUCKETS`):
a cursor (``mark``, a wall-clock time) moves forward at every charge, so no second is
counted twice or lost. Its state travels with the run's state: to a group healed from a
live peer (the time since the peer's snapshot is healing) and into disk checkpoints (the
time from the checkpoint's snapshot to a resumed launch is ``restart``: work lost and
redone, and the time no group was training). Plain Python; the wall clock
(``time.time``) is shared by the groups of one machine and, with NTP, of a cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["BUCKETS", "COUNTS", "Goodput"]

#: Where a second can go. ``training``: the loop's own work (forward, backward, the
#: all-reduce and optimizer step of a committed step, validation, logging); ``takeover``:
#: training the shards of missing groups; ``quorum``: waiting for a quorum with the same
#: groups; ``detection``: a quorum that dropped a dead group (its heartbeat timing out);
#: ``healing``: a quorum that brought a group back (sending it the state), or receiving the
#: state from a peer; ``redo``: a step attempt that failed (a peer died inside it) and was
#: redone; ``saving``: ``Checkpoint``'s saves; ``restart``: from the last snapshot a
#: resumed launch restored to its start (the work since that snapshot is trained again).
BUCKETS = ("training", "takeover", "quorum", "detection", "healing", "redo", "saving",
           "restart")
#: What is counted: groups dropped from a quorum, groups brought back, step attempts
#: redone, launches resumed from a disk checkpoint.
COUNTS = ("dropped", "joined", "retried", "resumed")


class Goodput:
    """Seconds per bucket of `BUCKETS` since the run's start, and counts of `COUNTS`.

    Args:
        clock: The wall clock (seconds since the epoch); the tests pass a fake one.

    Example:
        >>> ticks = iter([100.0, 103.0, 104.5])
        >>> goodput = Goodput(clock=lambda: next(ticks))
        >>> goodput.begin()
        >>> goodput.charge("training")
        >>> goodput.charge("quorum")
        >>> goodput.seconds["training"], goodput.seconds["quorum"], goodput.wall
        (3.0, 1.5, 4.5)
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.counts = dict.fromkeys(COUNTS, 0)
        self.start: float | None = None  # the run's start, on the wall clock
        self.mark: float | None = None  # every second before it is charged

    def begin(self) -> None:
        """Start a new run's clock (a run already under way keeps its own)."""
        if self.start is None:
            self.start = self.mark = self.clock()

    def charge(self, bucket: str, *, minus: float = 0.0, into: str = "saving") -> None:
        """Charge the seconds since the last charge to ``bucket``; ``minus`` of them (at
        most all) go to ``into`` instead."""
        if self.mark is None:
            self.begin()
            return
        now = self.clock()
        elapsed = max(0.0, now - self.mark)
        moved = min(max(0.0, minus), elapsed)
        self.seconds[bucket] += elapsed - moved
        self.seconds[into] += moved
        self.mark = now

    def count(self, name: str, number: int = 1) -> None:
        """Add ``number`` to the count ``name``."""
        self.counts[name] += number

    @property
    def wall(self) -> float:
        """Seconds from the run's start to the last charge."""
        return 0.0 if self.start is None or self.mark is None else self.mark - self.start

    def state_dict(self) -> dict[str, Any]:
        """The buckets, the counts and the clock's start and mark (the snapshot's time)."""
        return {"seconds": dict(self.seconds), "counts": dict(self.counts),
                "start": self.start, "mark": self.mark}

    def load_state_dict(self, state: dict[str, Any], *, gap: str) -> None:
        """Continue a snapshot's clock: the seconds since its mark are charged to ``gap``."""
        self.seconds = {**dict.fromkeys(BUCKETS, 0.0), **state.get("seconds", {})}
        self.counts = {**dict.fromkeys(COUNTS, 0), **state.get("counts", {})}
        self.start, self.mark = state.get("start"), state.get("mark")
        self.charge(gap)

    def table(self) -> str:
        """The buckets as a small text table: seconds and share of the wall time."""
        wall = self.wall or 1.0
        lines = [f"{'bucket':<10} {'seconds':>9} {'share':>7}"]
        for bucket in BUCKETS:
            seconds = self.seconds[bucket]
            lines.append(f"{bucket:<10} {seconds:>9.2f} {100 * seconds / wall:>6.1f}%")
        lines.append(f"{'wall':<10} {self.wall:>9.2f} {100.0:>6.1f}%")
        counts = ", ".join(f"{name} {value}" for name, value in self.counts.items())
        return "\n".join(lines) + f"\n({counts})"
