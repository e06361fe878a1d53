"""When this process started, on the ``time.monotonic()`` clock: the scheduler's clock of
a job's wall time starts there, not when a callback was created.

On Linux the start is read from ``/proc/self/stat`` (``starttime``, in clock ticks since
boot) against the clock since boot; elsewhere, the time this module was first imported
(when hookloop's loop or a callback that times first loads it: after the interpreter's
start, which it misses).
"""

from __future__ import annotations

import os
import time

__all__ = ["process_start"]

_IMPORTED = time.monotonic()  # the fallback: hookloop's own import


def _age_from_proc() -> float | None:
    """Seconds since this process started, from /proc (Linux), or None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        ticks = int(fields[19])  # starttime: field 22, the 20th after the name
        per_second = os.sysconf("SC_CLK_TCK")
        if hasattr(time, "CLOCK_BOOTTIME"):  # the clock starttime counts on
            since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        else:  # pragma: no cover - Linux has CLOCK_BOOTTIME
            with open("/proc/uptime", encoding="ascii") as handle:
                since_boot = float(handle.read().split()[0])
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    age = since_boot - ticks / per_second
    return age if age >= 0 else None


def process_start() -> float:
    """This process's start as a ``time.monotonic()`` reading (to the kernel's clock tick,
    10 ms on most systems); where it cannot be read, when hookloop was first imported.

    Example:
        >>> import time
        >>> process_start() <= time.monotonic()
        True
    """
    age = _age_from_proc()
    now = time.monotonic()
    return min(now - age, _IMPORTED) if age is not None else _IMPORTED
