"""The cause of an `OSError` in words, for the errors that name a file hookloop could not
write or read (checkpoints, logs), and the one builder of a write-failure error
(`write_failure`). Imports nothing of hookloop: `hookloop.errors` and the file layer both
use it."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

__all__ = ["describe_os_error", "cause_in_words", "write_failure"]

_Failure = TypeVar("_Failure", bound=OSError)

_CAUSES = {
    errno.ENOSPC: "no space left on the device (the disk is full)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
    errno.ENOENT: "the directory no longer exists (deleted or unmounted during the run)",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "an input/output error of the device",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "a directory is in the way",
    errno.EFBIG: "the file is larger than the file system allows",
    errno.ENAMETOOLONG: "the file name is too long",
}


def describe_os_error(error: OSError) -> str:
    """The cause of ``error`` in words, e.g. "no space left on the device (the disk is full)".

    Example:
        >>> import errno
        >>> describe_os_error(OSError(errno.ENOSPC, "No space left on device"))
        'no space left on the device (the disk is full) [errno 28]'
    """
    cause = _CAUSES.get(error.errno) if error.errno is not None else None
    if cause is None:
        cause = error.strerror or str(error) or type(error).__name__
    return f"{cause} [errno {error.errno}]" if error.errno is not None else cause


def cause_in_words(error: BaseException) -> str:
    """An `OSError`'s cause in words (`describe_os_error`), any other error's type and first
    line."""
    if isinstance(error, OSError):
        return describe_os_error(error)
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def write_failure(kind: type[_Failure], error: BaseException, say: Callable[[str], str], *,
                  cause: str | None = None, code: int | None = None,
                  filename: str | None = None) -> _Failure:
    """The one builder of the error for a write that failed (a checkpoint, a directory of
    shards, a log): ``say(cause)`` words the message around the cause in words (``cause``,
    else `cause_in_words`); the error carries the cause's errno (``code``, else
    ``error.errno``) and the file's name, so callers can branch on a full disk.

    Example:
        >>> import errno
        >>> failure = write_failure(OSError, OSError(errno.ENOSPC, "x"), "it failed: {}".format)
        >>> str(failure.args[0]), failure.errno == errno.ENOSPC
        ('it failed: no space left on the device (the disk is full) [errno 28]', True)
    """
    failure = kind(say(cause if cause is not None else cause_in_words(error)))
    failure.errno = code if code is not None else getattr(error, "errno", None)
    if filename is not None:
        failure.filename = filename
    return failure
