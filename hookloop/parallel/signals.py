"""Signals during ``fit``: SIGTERM, SIGUSR1, and SIGINT under a batch scheduler end this
launch at the next step boundary; the run goes on.

Cluster schedulers (Slurm, Kubernetes, LSF) and spot-instance reclaimers send SIGTERM some
seconds before they kill a job; SLURM's ``--signal=USR1@90`` sends SIGUSR1 that long before
the time limit; LSF's ``bkill`` starts with SIGINT; ``torchrun`` forwards the signals listed
in its ``--signals-to-handle``. Python's default is to die at once (or, for SIGINT, to raise
``KeyboardInterrupt`` at the line running). Inside `handled` the signal only asks the fit
to end the launch (`hookloop.parallel.suspension`): every rank agrees at the next step boundary, the
checkpoint is written there, every ``on_fit_end`` runs, and ``fit`` raises
`hookloop.errors.Suspended` with the signal's status (143 for SIGTERM, 138 for SIGUSR1, 130
for SIGINT: 128 + the signal's number, as a shell reports a process that signal ended).

SIGINT is Ctrl-C too: outside a batch scheduler's job (no ``SLURM_JOB_ID``, ``LSB_JOBID``
or ``PBS_JOBID``) it keeps Python's meaning, a ``KeyboardInterrupt`` at once (the exception
path, where `Checkpoint` saves the last completed step). Inside one, a second SIGINT while
the end is pending raises ``KeyboardInterrupt`` at once. A second SIGTERM or SIGUSR1 changes
nothing: the end is under way (the scheduler's SIGKILL still ends a save that takes too
long).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader

from hookloop import distributed
from hookloop.parallel.suspension import SIGINT, SIGTERM, SIGUSR1, Cause, current

__all__ = ["handled", "quiet_until_exit", "sparing_workers", "scheduler_job", "SIGNALS"]

#: The signals `handled` takes over, with the cause each one asks for and its reason.
SIGNALS: tuple[tuple[str, Cause, str], ...] = (
    ("SIGTERM", SIGTERM, "SIGTERM received (the scheduler or launcher is ending the job)"),
    ("SIGUSR1", SIGUSR1, "SIGUSR1 received (SLURM's --signal: the time limit is near)"),
    ("SIGINT", SIGINT, "SIGINT received from the batch scheduler"),
)


def scheduler_job() -> str | None:
    """The batch scheduler's job id of this process (SLURM, LSF or PBS), or None.

    Example:
        >>> import os
        >>> scheduler_job() == (os.environ.get("SLURM_JOB_ID") or os.environ.get("LSB_JOBID")
        ...                     or os.environ.get("PBS_JOBID") or None)
        True
    """
    for name in ("SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def _say(text: str) -> None:
    # os.write, not print: a handler may run while the main thread is inside a print, and a
    # buffered stream entered twice raises.
    rank = f" (rank {distributed.rank()})" if distributed.world_size() > 1 else ""
    os.write(2, f"hookloop{rank}: {text}\n".encode())


def _handler(name: str, cause: Cause, reason: str) -> Any:
    def handle(signum: int, frame: FrameType | None) -> None:
        vote = current()
        if vote is None:  # pragma: no cover - only installed while a fit runs
            return
        if not vote.ask(cause, reason):
            if cause is SIGINT:  # Ctrl-C twice: stop at once, through the exception path
                raise KeyboardInterrupt
            _say(f"{name} received again; the launch still ends at the next step boundary.")
            return
        again = " Press Ctrl-C again to stop at once." if cause is SIGINT else ""
        _say(f"{name} received: ending this launch at the next step boundary (every rank "
             f"stops there, Checkpoint saves that step, on_fit_end runs), then exiting with "
             f"status {cause.status}; relaunch the same command to continue.{again}")

    return handle


_fitting: Any = None  # shared with the DataLoader workers: how many fits run in this process
_ended: Any = None  # ... and when the last one ended (time.monotonic(), the same clock)
_exiting_now: Any = None  # ... and whether the interpreter is exiting (1 once it is)
#: Seconds after a fit's end during which a worker still ignores the signals: a signal sent
#: during the fit may reach a worker's handler only once the main process has left it.
GRACE = 5.0


def _shared() -> tuple[Any, Any, Any]:
    """The values shared with the workers: the running fits, the last fit's end, whether
    the interpreter is exiting."""
    global _fitting, _ended, _exiting_now
    if _fitting is None:
        import atexit
        import multiprocessing  # only for a loop whose loaders have workers
        import multiprocessing.util  # registers its exit handler (terminate, then join)

        _fitting = multiprocessing.RawValue("i", 0)
        _ended = multiprocessing.RawValue("d", float("-inf"))
        _exiting_now = multiprocessing.RawValue("b", 0)
        # atexit runs its handlers last registered first: this one before multiprocessing's,
        # which terminates the (persistent) workers and joins them without a timeout. A
        # worker still in the grace after a fit would ignore that SIGTERM and the join
        # would wait forever; at the exit there is no fit whose signal it could be.
        atexit.register(_exiting)
    return _fitting, _ended, _exiting_now


def _exiting() -> None:
    """At the interpreter's exit: the grace ends, the workers end on the next signal, with
    status 0 (see `_SparingWorkerInit._handle`)."""
    if _exiting_now is not None:
        _exiting_now.value = 1


class _SparingWorkerInit:
    """A DataLoader's ``worker_init_fn``: the worker ignores ``numbers`` while its main
    process is inside a fit, then calls the loader's own ``worker_init_fn``."""

    def __init__(self, numbers: tuple[int, ...], previous: Any, fitting: Any, ended: Any,
                 exiting: Any) -> None:
        self.numbers, self.previous = numbers, previous
        self.fitting, self.ended, self.exiting = fitting, ended, exiting

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.exiting.value:
            # The main process is exiting: multiprocessing's exit handler terminates the
            # (persistent) workers. Torch's own handler, which ours replaced, ends a worker
            # its parent signals with status 0; ended by the signal instead, the worker
            # would make torch's SIGCHLD handler in the main process print "DataLoader
            # worker (pid N) is killed by signal: Terminated." at every such exit.
            os._exit(0)
        if self.fitting.value > 0 or time.monotonic() - self.ended.value < GRACE:
            return  # the main process ends the launch at a step boundary, then stops us
        signal.signal(signum, signal.SIG_DFL)  # after the fit and its grace: end as asked
        os.kill(os.getpid(), signum)

    def __call__(self, worker_id: int) -> None:
        for number in self.numbers:
            signal.signal(number, self._handle)
        if self.previous is not None:
            self.previous(worker_id)


@contextmanager
def sparing_workers(loaders: tuple[Any, ...], numbers: list[int]) -> Iterator[None]:
    """Within the block (a fit), the worker processes of these DataLoaders ignore the
    signals `handled` took.

    A scheduler signals every process of the job, DataLoader workers too; a worker that
    SIGTERM ends makes the next fetch (torch checks on SIGCHLD) raise "DataLoader worker ...
    is killed by signal" in the main process, at any line, and the launch would end on the
    exception path instead of at a step boundary. The main process decides when to stop.
    Outside the block the signals end the workers as before, from `GRACE` seconds after the
    fit's end (a worker busy in a C call runs its handler late, and a signal of the fit must
    not end it then), and at once when the interpreter exits: multiprocessing's exit handler
    terminates the workers a ``persistent_workers=True`` loader keeps, then waits for them.
    Wraps ``worker_init_fn`` of the loaders with workers (once), for the workers started
    from now on (``DDP`` rebuilds its loaders with it).
    """
    spared = [loader for loader in loaders if isinstance(loader, DataLoader)
              and loader.num_workers > 0]
    if not numbers or not spared:
        yield
        return
    fitting, ended, exiting = _shared()
    for loader in spared:
        if not isinstance(loader.worker_init_fn, _SparingWorkerInit):
            loader.worker_init_fn = _SparingWorkerInit(tuple(numbers), loader.worker_init_fn,
                                                       fitting, ended, exiting)
    fitting.value += 1
    try:
        yield
    finally:
        ended.value = time.monotonic()
        fitting.value -= 1


_ignoring: set[int] = set()  # signals quiet_until_exit set to SIG_IGN


def quiet_until_exit(numbers: list[int]) -> None:
    """After a launch ended under torchrun: these signals (`handled` took them) are ignored
    until the process exits with the launch's status. torchrun sends SIGTERM to every
    worker still alive once one exits with a status other than 0; the others, whose work
    is done too, then exit with the same status instead of being reported as killed.
    (``SIG_IGN``, not a Python handler: Python drops its handlers while the interpreter
    shuts down.) A later ``fit`` in this process takes them over again."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    for number in numbers:
        signal.signal(number, signal.SIG_IGN)
        _ignoring.add(number)


@contextmanager
def handled() -> Iterator[list[int]]:
    """Within the block, SIGTERM, SIGUSR1 (and SIGINT in a scheduler's job) ask the running
    fit (`hookloop.parallel.suspension.current`) to end the launch at the next step boundary.

    Installed only where it can and should be: in the main thread (Python runs signal
    handlers there only), and only over the default handler, so a handler the program set
    itself (or ``SIG_IGN``) is left alone; nested blocks install nothing more (the handler
    asks the innermost fit). The previous handlers are put back when the block exits,
    however it exits. Yields the numbers of the signals it took over.

    Example:
        >>> import os, signal
        >>> from hookloop.parallel.suspension import Vote, published
        >>> with published(Vote()) as vote, handled():
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     for _ in range(10**6):  # the handler runs at the next bytecode
        ...         pass
        >>> vote.agree().status
        143
    """
    installed: list[tuple[int, Any]] = []
    if threading.current_thread() is threading.main_thread():
        for name, cause, reason in SIGNALS:
            number = getattr(signal, name, None)
            if number is None or (cause is SIGINT and scheduler_job() is None):
                continue  # no SIGUSR1 on Windows; Ctrl-C outside a job stays KeyboardInterrupt
            default = signal.default_int_handler if cause is SIGINT else signal.SIG_DFL
            ours = number in _ignoring and signal.getsignal(number) is signal.SIG_IGN
            if signal.getsignal(number) is not default and not ours:
                continue
            _ignoring.discard(number)  # an earlier launch's quiet exit did not happen
            signal.signal(number, _handler(name, cause, reason))
            installed.append((number, default))
    try:
        yield [number for number, _ in installed]
    finally:
        for number, previous in reversed(installed):
            signal.signal(number, previous)
