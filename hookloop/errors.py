"""Exceptions hookloop raises (each one a class users can catch), and `with_article`, which
every message naming a type or class uses."""

from __future__ import annotations

import re
from typing import Any


from hookloop.base.os_errors import write_failure

__all__ = ["HookloopError", "CallbackOrderError", "CheckpointError", "CheckpointWriteError",
           "LogWriteError",
           "NonFiniteError",
           "ConfigurationError", "Suspended", "Terminated", "HookloopDeprecationWarning",
           "with_article"]

# Words spelt with a vowel that start with a consonant sound ("a unit", "a one-shot"), and
# the reverse ("an hour").
_VOWEL_SPELT_CONSONANT = re.compile(r"^([Uu](ni|se|su|sa|ti|re)|[Ee]u|[Oo]n(e|ce)(?![a-z]))")
# ... and names read from a first letter that is not a vowel ("an hour", "an ndarray").
_VOWEL_SOUND = re.compile(r"^([Hh](our|onest|onou?r|eir)|nd)")
# Letters whose English name starts with a vowel sound: "an SGD", "an LBFGS", "an MSE".
_VOWEL_NAMED_LETTERS = frozenset("AEFHILMNORSX")


def with_article(word: str) -> str:
    """``word`` after the indefinite article its sound takes: "an Adam", "a DataLoader".

    Generated messages name classes and types they do not know in advance ("Create an Adam
    as in the saved run"), so the article is chosen by the name's first sound. A name that
    starts with two capitals (``SGD``, ``LBFGS``, ``RMSprop``, ``DDP``) is read letter by
    letter; a dotted name by its first part.

    Example:
        >>> [with_article(name) for name in ("Adam", "SGD", "RMSprop", "DataLoader", "int")]
        ['an Adam', 'an SGD', 'an RMSprop', 'a DataLoader', 'an int']
        >>> [with_article(name) for name in ("OneCycleLR", "UnitNorm", "ndarray", "list")]
        ['a OneCycleLR', 'a UnitNorm', 'an ndarray', 'a list']
    """
    head = word.lstrip("_'\"`(")
    initialism = bool(head) and head[0].isupper() and (
        len(head) == 1 or head[1].isupper() or head[1].isdigit())
    if not head:
        vowel = False
    elif initialism:
        vowel = head[0] in _VOWEL_NAMED_LETTERS
    elif _VOWEL_SPELT_CONSONANT.match(head):
        vowel = False
    elif _VOWEL_SOUND.match(head):
        vowel = True
    else:
        vowel = head[0].lower() in "aeiou"
    return f"{'an' if vowel else 'a'} {word}"


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


class LogWriteError(HookloopError, OSError):
    """A view (``TensorBoard``, ``CSVLogger``) could not write its file: a full disk, a
    directory that is gone, no permission.

    The message names the view, the file and the cause in words; ``errno`` is the operating
    system's error number and ``filename`` the file. It is also an `OSError`. Training stops
    there (the views are part of the run's record): ``on_exception`` still runs, so a
    ``Checkpoint`` in the stack writes the last completed step, and a relaunch with
    ``resume=True`` continues. The rows ``CSVLogger`` could not write are kept in that
    checkpoint and written by the relaunch.

    Example:
        >>> import errno
        >>> error = LogWriteError.of("CSVLogger", "logs/run.csv",
        ...                          OSError(errno.ENOSPC, "No space left on device"))
        >>> str(error).split(". ")[0]
        'CSVLogger could not write logs/run.csv: no space left on the device (the disk is full) [errno 28]'
        >>> error.errno, isinstance(error, OSError)
        (28, True)
    """

    @classmethod
    def of(cls, view: str, path: str, error: BaseException) -> LogWriteError:
        """The error for ``view`` failing to write ``path`` because of ``error``."""
        return write_failure(cls, error, lambda cause: (
            f"{view} could not write {path}: {cause}. Training stops here; a Checkpoint in "
            "the stack saves the last completed step on the way out. Free space (or fix the "
            "directory) and run again: with Checkpoint(..., resume=True) the run continues "
            "where it stopped."), filename=path)

    def __str__(self) -> str:
        # OSError would show "[Errno 28] None: 'path'" once errno and filename are set.
        return str(self.args[0]) if self.args else super().__str__()


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


class HookloopDeprecationWarning(DeprecationWarning, FutureWarning):
    """A deprecated hookloop name was used: the message gives the new one and the release
    that removes the old one.

    Both a ``DeprecationWarning`` (what tools and ``pytest.deprecated_call`` look for) and a
    ``FutureWarning``; ``import hookloop`` adds a filter that shows it once per place (unless
    ``-W`` or ``PYTHONWARNINGS`` set filters), where Python would hide a plain
    ``DeprecationWarning`` raised outside ``__main__``. Silence it
    with ``warnings.filterwarnings("ignore", category=HookloopDeprecationWarning)``, or turn
    it into an error in a test suite with ``"error"``.
    """


# ----------------------------------------- a checkpoint's field of the wrong type (internal)
def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    # A tensor by its shape (its repr may be huge), known without importing torch: this
    # module loads before torch does (the CLI's usage errors come before torch's import).
    shape = getattr(value, "shape", None) if type(value).__module__.startswith("torch") else None
    text = repr(value) if shape is None else f"of shape {tuple(shape)}"
    return f"({text[:60]}{'...' if len(text) > 60 else ''})"


def expect_field(path: str, field: str, value: Any, ok: bool, expected: str) -> None:
    """Raise `CheckpointError` naming ``path`` and ``field`` unless ``ok``: the one message
    form for a field of the wrong type in a checkpoint file.

    Example:
        >>> expect_field("x.pt", "loop.step", "3", False, "an int >= 0")
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: the checkpoint's field 'loop.step' is str ('3'), expected an int >= 0. The file was not written by this version of hookloop or was edited; resume from another file.
    """
    if not ok:
        raise CheckpointError(
            f"{path}: the checkpoint's field {field!r} is {_type_name(value)} "
            f"{_short(value)}, expected {expected}. The file was not written by this version "
            "of hookloop or was edited; resume from another file.")


def expect_int(path: str, where: str, value: Any, minimum: int | None = 0, *,
               optional: bool = False) -> None:
    """`expect_field` for an int (>= ``minimum`` unless None; None too if ``optional``)."""
    if optional and value is None:
        return
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    expect_field(path, where, value, is_int(value) and (minimum is None or value >= minimum),
                 expected + (" or None" if optional else ""))
