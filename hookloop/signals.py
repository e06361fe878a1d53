"""SIGTERM during ``fit``: save like Ctrl-C does, then exit with the conventional status.

Cluster schedulers (Slurm, Kubernetes) and spot-instance reclaimers send SIGTERM some
seconds before they kill a job, and ``torchrun`` forwards it to its workers. Python's
default is to die at once, without running ``finally`` blocks or ``on_exception``. Inside
`terminate_on_sigterm` the first SIGTERM instead raises `hookloop.errors.Terminated` in
the main thread, so ``fit`` runs its exception path (``on_exception``, where `Checkpoint`
saves the last completed step, then every ``on_fit_end``) and the process exits with
status 143 (128 + 15), as if SIGTERM had ended it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from hookloop.errors import Terminated

__all__ = ["terminate_on_sigterm"]


@contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread instead of killing.

    Installed only where it can and should be: in the main thread (Python runs signal
    handlers there only), and only over the default handler, so a handler the program set
    itself (or ``SIG_IGN``) is left alone; nested blocks (``fit`` inside ``fit``) install it
    once. The previous handler is restored when the block exits, however it exits.

    The first SIGTERM raises `Terminated` (a `SystemExit` with code 143) at the line the
    main thread is running; later ones, while the exception path saves, are noted and
    ignored, so the save completes (the scheduler's SIGKILL still ends a save that takes
    too long). A thread blocked in C code (a collective waiting for a dead rank) sees the
    exception when it returns to Python.

    Example:
        >>> import os, signal
        >>> from hookloop.errors import Terminated
        >>> try:
        ...     with terminate_on_sigterm():
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ...         for _ in range(10**6):  # the handler runs at the next bytecode
        ...             pass
        ... except Terminated as stop:
        ...     print(stop.code)
        143
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    received = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        if received:
            print("hookloop: SIGTERM received again; still saving before exiting.",
                  file=sys.stderr, flush=True)
            return
        received = True
        print("hookloop: SIGTERM received: stopping fit (on_exception and on_fit_end run, "
              "Checkpoint saves the last completed step), then exiting with status 143.",
              file=sys.stderr, flush=True)
        raise Terminated("SIGTERM received during fit: training stopped so that the run can "
                         "be resumed (exit status 143)")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
