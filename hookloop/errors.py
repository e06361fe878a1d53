"""Exceptions hookloop raises. Each one is a class users can catch."""

from __future__ import annotations

__all__ = ["HookloopError", "CallbackOrderError", "CheckpointError", "CheckpointWriteError",
           "NonFiniteError",
           "ConfigurationError", "Suspended", "Terminated"]


class HookloopError(Exception):
    """Base class of every error hookloop raises on purpose."""


class ConfigurationError(HookloopError, ValueError):
    """The loop or a callback was given input it cannot use (detected before training)."""


class CallbackOrderError(ConfigurationError):
    """The callback stack breaks a constraint: wrong order, a missing metric, a clash.

    Raised at fit start, before the first batch. The message names the callbacks involved
    and says how to fix the stack.
    """


class CheckpointError(HookloopError):
    """A checkpoint file cannot be read or does not fit the model being trained."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written: the disk is full, the directory is gone...

    Its message names the target file and the cause in words; ``errno`` is the operating
    system's error number when there is one. It is also an `OSError`, so code that catches
    file-system errors keeps working. Nothing was written under the target name and the
    earlier files are intact.
    """


class NonFiniteError(HookloopError, ArithmeticError):
    """Training met a NaN or infinite loss or gradient (``TerminateOnNaN(raise_error=True)``).

    The step that met it was skipped: the model holds the parameters of the last good step,
    and a ``Checkpoint`` in the stack saved them on the way out.
    """


class Suspended(SystemExit):
    """This launch ended at a step boundary and the run goes on: relaunch the same command.

    ``fit`` raises it after every ``on_fit_end`` ran, when the launch was ended resumably
    (``loop.stop(reason, resumable=True)``, `hookloop.callbacks.TimeLimit`, SIGTERM,
    SIGUSR1, or SIGINT under a batch scheduler). Every rank agreed on the step boundary and
    `Checkpoint` wrote that step there, so a relaunch with the same command continues the
    run exactly. It is a `SystemExit`: left uncaught, the process exits with ``code``
    without a traceback (``except Exception`` does not swallow it; the ``finally`` blocks
    of the script still run). ``code`` is 143 for SIGTERM, 138 for SIGUSR1, 130 for
    SIGINT and 75 (``EX_TEMPFAIL``: "try again") for a time limit or a callback.

    Example:
        >>> from hookloop.errors import Suspended
        >>> Suspended("TimeLimit: 10 minutes").code
        75
    """

    def __init__(self, message: str | None = None, code: int = 75) -> None:
        super().__init__(code)
        self.message = message or "this launch ended; the run goes on"

    def __str__(self) -> str:
        return self.message


class Terminated(Suspended):
    """The launch ended because the process received SIGTERM during ``fit``.

    SIGTERM is what schedulers (Slurm, Kubernetes) and spot reclaimers send before they kill
    a job. ``fit`` ends the launch at the next step boundary, as every `Suspended` launch
    ends, and raises this `Suspended` with code 143 (128 + SIGTERM's 15, the status a shell
    reports for a process that SIGTERM ended). Catch it (or `SystemExit`) to do something
    else, e.g. in a notebook.

    Example:
        >>> from hookloop.errors import Terminated
        >>> Terminated().code
        143
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or "SIGTERM received during fit", 143)
