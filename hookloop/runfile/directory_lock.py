"""`DirectoryLock`: one running job per checkpoint directory, held with the OS's ``flock``.

A job launched twice (a scheduler retry while the first still runs, two shells) would
train twice into one directory: each deletes the other's temporary files at its start and
overwrites the other's checkpoints. The lock is an ``fcntl.flock`` on a file in the
directory. The operating system releases it when the holder exits, however it exits
(SIGKILL, an out-of-memory kill, a crash), so a lock can never be left stale.
"""

from __future__ import annotations

import os
import socket
import stat
from contextlib import suppress

from hookloop.errors import CheckpointError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, no lock
    fcntl = None  # type: ignore[assignment]

__all__ = ["DirectoryLock", "LOCK_NAME"]

#: The lock file in a held directory; it holds the holder's pid and host, for messages.
LOCK_NAME = ".hookloop.lock"

# Directory (real path) -> [descriptor, holders] for the locks this process holds: two
# Checkpoints of one loop may share a directory, and flock would refuse the second
# descriptor of one process like another process's.
_HELD: dict[str, list[int]] = {}


def _open_lock_file(path: str) -> int:
    """Open (or create) the lock file without following a symbolic link: the directory is
    input anyone may have planted files in, and the holder's line is written into the
    file, which must never be another file the link names.

    Raises:
        CheckpointError: ``path`` is a symbolic link or not a regular file (left untouched).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as error:
        if not os.path.islink(path) and not os.path.isdir(path):
            raise  # the directory's own trouble (permissions, space): prepare names it
        what = "a symbolic link" if os.path.islink(path) else "a directory"
        raise CheckpointError(
            f"{path}: the directory's lock file is {what}; hookloop creates it as a plain "
            "file and never follows a link there (its target was not touched). Remove it "
            f"({error.strerror or error}) and start again.") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(descriptor)
        what = ("a hard link to another file" if stat.S_ISREG(info.st_mode)
                else "not a regular file (a FIFO, a device...)")
        raise CheckpointError(
            f"{path}: the directory's lock file is {what}; hookloop creates it as a plain "
            "file of its own and writes into it. Remove it and start again.")
    return descriptor


class DirectoryLock:
    """Hold ``directory`` for this process, or say which process holds it.

    The lock file is removed on `release`; after a SIGKILL it stays, unlocked, and the
    next holder takes it over.

    Args:
        directory: An existing directory.

    Example:
        >>> import os, tempfile
        >>> directory = tempfile.mkdtemp()
        >>> lock = DirectoryLock(directory)
        >>> lock.acquire() is None, os.listdir(directory)
        (True, ['.hookloop.lock'])
        >>> lock.release()
        >>> os.listdir(directory)
        []
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._held: str | None = None

    def acquire(self) -> str | None:
        """Take the lock (again, if this object holds it already: that is one hold).

        Returns:
            None once held (also where the file system has no ``flock``: nothing to
            hold), else the holder: ``"pid 4242 on host node-3"``.
        """
        if self._held is not None or fcntl is None:
            return None
        key = os.path.realpath(self.directory)
        if key in _HELD:
            _HELD[key][1] += 1
            self._held = key
            return None
        path = os.path.join(key, LOCK_NAME)
        while True:
            descriptor = _open_lock_file(path)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                with suppress(OSError):
                    holder = os.pread(descriptor, 200, 0).decode("utf-8", "replace").strip()
                os.close(descriptor)
                return holder or "a process that has not written its pid yet"
            except OSError:  # pragma: no cover - a file system without flock (some NFS)
                os.close(descriptor)
                return None
            # A holder releasing the lock removes the file; a lock taken on a file already
            # removed would not exclude anyone: open the new one and try again.
            with suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(descriptor), os.stat(path)):
                    break
            os.close(descriptor)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        _HELD[key] = [descriptor, 1]
        self._held = key
        return None

    def release(self) -> None:
        """Give the lock back (the last hold of this process removes the file)."""
        key, self._held = self._held, None
        if key is None or key not in _HELD:
            return
        held = _HELD[key]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            with suppress(OSError):  # before unlocking: a waiter sees the file is gone
                os.unlink(os.path.join(key, LOCK_NAME))
            os.close(held[0])
