"""`RemoteLease`: one running job per run URL, as `DirectoryLock` is one per directory.

An object store has no ``flock``, and a SIGKILLed holder releases nothing. So the lock is
a lease: the object ``.hookloop.lease`` in the run holds the holder (pid and host), a
token and an expiry. The holder renews it in a thread (every quarter of its duration); a
lease whose expiry has passed is stale and taken over, and so is one whose holder is a
process of this host that no longer exists (a relaunch after a kill need not wait for the
expiry). Taking a lease writes it and reads it back: two launches racing for a free lease
both read, the later write wins, and the one whose token is not read back is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

__all__ = ["LEASE_NAME", "RemoteLease"]

#: The lease object in a held run.
LEASE_NAME = ".hookloop.lease"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


class RemoteLease:
    """Hold the run of a `hookloop.runfile.remote_store.RemoteStore`, or say who holds it.

    Args:
        store: The run's store.
        seconds: How long a lease lasts without renewal (the wait for a stale one of a
            process on another host).
    """

    def __init__(self, store: Any, seconds: float = 60.0) -> None:
        self.store, self.seconds = store, seconds
        self.token = uuid.uuid4().hex
        self.lost: str | None = None  # who took the lease over, once renewal saw it
        self._stop: threading.Event | None = None

    def _read(self) -> dict[str, Any] | None:
        try:
            with self.store.fs.open(self.store.path(LEASE_NAME), "rb") as handle:
                lease = json.loads(handle.read().decode("utf-8"))
        except FileNotFoundError:
            return None
        except ValueError:  # a lease cut short (a kill while writing it): nobody's
            return None
        return lease if isinstance(lease, dict) else None

    def _write(self) -> None:
        lease = {"holder": f"pid {os.getpid()} on host {socket.gethostname()}",
                 "pid": os.getpid(), "host": socket.gethostname(), "token": self.token,
                 "expires": time.time() + self.seconds}
        with self.store.fs.open(self.store.path(LEASE_NAME), "wb") as handle:
            handle.write(json.dumps(lease).encode("utf-8"))

    @staticmethod
    def stale(lease: dict[str, Any]) -> bool:
        """Whether a lease may be taken over: expired, or its holder here is gone."""
        if not isinstance(lease.get("expires"), (int, float)) or lease["expires"] < time.time():
            return True
        pid = lease.get("pid")
        return (lease.get("host") == socket.gethostname() and isinstance(pid, int)
                and not _alive(pid))

    def acquire(self) -> str | None:
        """Take the lease and renew it in a thread; None, or the live holder's line."""
        held = self._read()
        if held is not None and held.get("token") != self.token and not self.stale(held):
            return str(held.get("holder", "another process"))
        self._write()
        time.sleep(0.05)  # a racing launch's write lands before the read back
        held = self._read()
        if held is None or held.get("token") != self.token:
            return str((held or {}).get("holder", "another process starting at once"))
        self._stop = threading.Event()
        threading.Thread(target=self._renew, args=(self._stop,), daemon=True,
                         name="hookloop-lease").start()
        return None

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self.seconds / 4):
            with contextlib.suppress(Exception):  # a failed renewal is tried again
                held = self._read()
                if held is not None and held.get("token") != self.token:
                    self.lost = str(held.get("holder", "another process"))
                    return
                self._write()

    def release(self) -> None:
        """Stop renewing and delete the lease (if it is still this holder's)."""
        if self._stop is None:
            return
        self._stop.set()
        self._stop = None
        held = self._read()
        if held is not None and held.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.store.fs.rm(self.store.path(LEASE_NAME))
