"""The cause of an `OSError` in words, for the errors that name a file hookloop could not
write or read (checkpoints, logs). Imports nothing of hookloop: `hookloop.errors` and the
file layer both use it."""

from __future__ import annotations

import errno

__all__ = ["describe_os_error"]

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

