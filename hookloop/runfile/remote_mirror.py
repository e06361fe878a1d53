"""`RemoteMirror`: a local staging directory kept in step with a run on an object store.

`hookloop.callbacks.Checkpoint` writes every save of a URL exactly as it writes a local
one (atomic, verified, pruned) into a staging directory; the mirror makes the store follow
that directory in a background thread: each complete entry (a ``.pt`` file or a ``.dcp``
directory of shards, found under its final name, where hookloop renames it only once
complete) is uploaded with its manifest last (`hookloop.runfile.remote_store`), and a
save the directory no longer holds (pruned by keep-last or top-k, retired by a rollback)
is deleted on the store, after the new ones are up. At a fit's start, the mirror takes the
run's lease (`hookloop.runfile.remote_lease`), deletes the objects a killed upload left,
and makes the staging directory hold the store's complete saves, each verified against
its manifest (what is verified locally already is not downloaded again), and nothing else:
the store is the truth, so ``resume=True`` resumes from its newest complete save.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hookloop.errors import CheckpointError
from hookloop.runfile.remote_lease import RemoteLease
from hookloop.runfile.remote_store import OBJECTS, RemoteStore, is_checkpoint_name, same_file
from hookloop.runfile.storage import is_temporary, snapshot

__all__ = ["RemoteMirror", "default_staging"]


def default_staging(url: str) -> str:
    """The staging directory of ``url`` when none is given: one per URL under the system's
    temporary directory (``$TMPDIR``), so two runs never share one."""
    key = hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "hookloop-staging", key)


def _key(path: str) -> Any:
    """What changes when hookloop replaces an entry (it writes new files, never in place)."""
    def one(file: str) -> tuple[int, int, int]:
        info = os.stat(file)
        return info.st_size, info.st_mtime_ns, info.st_ino

    if not os.path.isdir(path):
        return one(path)
    return tuple(sorted((os.path.relpath(os.path.join(folder, name), path), one(
        os.path.join(folder, name))) for folder, _, names in os.walk(path) for name in names))


def _newest(names: list[str]) -> str | None:
    """The save of the latest step (the step its name ends with), or None."""
    stepped = [(int(match.group(1)), name) for name in names
               if (match := re.search(r"step=(\d+)\.\w+$", name))]
    return max(stepped)[1] if stepped else None


class RemoteMirror:
    """Mirror ``staging`` to the run at ``url`` (rank 0's; the other ranks never call it).

    Args:
        url: The run's fsspec URL.
        staging: The local directory `Checkpoint` writes to.
        storage_options: For fsspec (`hookloop.runfile.remote_store.RemoteStore`).
        lease_seconds: How long the run's lease lasts without renewal.
    """

    def __init__(self, url: str, staging: str, storage_options: dict[str, Any] | None = None,
                 lease_seconds: float = 60.0) -> None:
        self.url, self.staging = url.rstrip("/"), staging
        self._options = storage_options
        self._store: RemoteStore | None = None  # fsspec is imported at the first fit
        self._lease: RemoteLease | None = None
        self.lease_seconds = lease_seconds
        self._uploaded: dict[str, Any] = {}  # name -> the local key its upload had
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        #: Names deleted on the store as partial saves at the last start (for messages).
        self.cleaned: list[str] = []

    @property
    def store(self) -> RemoteStore:
        """The run's store, opened once."""
        if self._store is None:
            self._store = RemoteStore(self.url, self._options)
        return self._store

    # ------------------------------------------------------------------ start
    def start(self, *, replicate: bool, resume: bool) -> str | None:
        """At a fit's setup: take the lease, clean partial saves and (``replicate``: the
        first fit) make the staging directory hold the store's complete saves.

        Returns:
            None, or why the run cannot start: another job holds the URL, or the URL holds
            an earlier run's saves and ``resume`` is False.

        Raises:
            CheckpointError: a save on the store is damaged (by name).
        """
        self._lease = RemoteLease(self.store, self.lease_seconds)
        if (holder := self._lease.acquire()) is not None:
            self._lease = None
            return (f"Checkpoint: {self.url} is in use by another running job ({holder}); two "
                    "jobs saving to one run overwrite and delete each other's saves. Wait for "
                    "it to end or stop it (a killed job's lease goes stale after "
                    f"{self.lease_seconds:g} s, at once on its own host), or use another URL.")
        try:
            objects = self.store.objects()
            partial = self.store.partial(objects)
            self.store.delete_objects([key for keys in partial.values() for key in keys])
            self.cleaned = sorted(partial)
            if partial:
                warnings.warn(f"Checkpoint: deleted the partial saves a killed upload left in "
                              f"{self.url}: {', '.join(sorted(partial))}.", RuntimeWarning,
                              stacklevel=3)
            saves = self.store.saves(objects)
            if saves and not resume:
                self.release()
                return (f"Checkpoint: {self.url} holds an earlier run's saves ("
                        f"{', '.join(saves[:3])}{'...' if len(saves) > 3 else ''}); resume=False "
                        "would overwrite and mix with them. Pass resume=True to continue it, or "
                        "use another URL (or delete them).")
            if replicate:
                self._replicate(saves)
        except BaseException:
            self.release()
            raise
        return None

    def _replicate(self, saves: list[str]) -> None:
        os.makedirs(self.staging, exist_ok=True)
        for name in os.listdir(self.staging):
            path = os.path.join(self.staging, name)
            if (is_checkpoint_name(name) or is_temporary(name)) and name not in saves:
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) \
                    else os.unlink(path)  # not on the store: never uploaded complete
        self._uploaded = {}
        for name in saves:
            local = os.path.join(self.staging, name)
            if not self._verified_here(name, local):
                self.store.download(name, local)
            self._uploaded[name] = _key(local)

    def _verified_here(self, name: str, local: str) -> bool:
        files = self.store.manifest(name)[OBJECTS]
        if not os.path.lexists(local) or os.path.islink(local):
            return False
        if os.path.isdir(local):
            here = {f"{name}/{os.path.relpath(os.path.join(folder, file), local)}"
                    for folder, _, names in os.walk(local) for file in names}
            if here != set(files):
                return False
            return all(same_file(os.path.join(local, *key.split("/")[1:]), entry)
                       for key, entry in files.items())
        return set(files) == {name} and same_file(local, files[name])

    # ---------------------------------------------------------------- syncing
    def _local(self) -> dict[str, Any]:
        found = {}
        try:
            names = os.listdir(self.staging)
        except FileNotFoundError:
            return {}
        for name in names:
            if is_checkpoint_name(name) and not is_temporary(name):
                try:
                    found[name] = _key(os.path.join(self.staging, name))
                except FileNotFoundError:
                    continue  # pruned while listed
        return found

    def sync(self) -> None:
        """Upload what is new in the staging directory, oldest name first; after each
        upload, delete on the store the saves the directory no longer holds (but the one
        just uploaded, so the store always keeps its newest complete save); then the
        objects of abandoned uploads. The store holds at most one save beyond the
        directory's (keep-last and top-k hold on it as on the disk, plus the newest).

        The saves pruned before this sync go first, but for the store's newest: a relaunch
        replicates the store's saves, the one beyond keep-last among them, and a kill
        after each next upload would otherwise leave one more there every time."""
        self._prune(keep=_newest(self.store.saves()))
        last = None
        for name, key in sorted(self._local().items()):
            path = os.path.join(self.staging, name)
            if self._uploaded.get(name) == key or self._changed(path, key):
                continue  # up already, or pruned (or replaced) since the listing
            snapshot = self._snapshot(path)
            if snapshot is None:
                continue  # pruned while linked
            try:  # published even if pruned meanwhile: newer than what the store holds
                self.store.upload(snapshot, name)
            finally:
                shutil.rmtree(os.path.dirname(snapshot), ignore_errors=True)
            self._uploaded[name], last = key, name
            self._prune(keep=last)
        self._prune(keep=last)
        partial = self.store.partial(self.store.objects())
        self.store.delete_objects([key for keys in partial.values() for key in keys])

    def _prune(self, keep: str | None) -> None:
        local = self._local()
        for name in self.store.saves():
            if name not in local and name != keep:
                self.store.delete(name)
                self._uploaded.pop(name, None)

    def _snapshot(self, path: str) -> str | None:
        """Hard links (copies where links fail) of the entry ``path`` in a temporary
        holder of the staging directory (never listed; a killed job's is deleted at the
        next start), so pruning the entry cannot cut its upload short; None: gone."""
        holder = tempfile.mkdtemp(prefix=".tmp-mirror-", suffix=".part", dir=self.staging)
        target = os.path.join(holder, os.path.basename(path))
        try:
            snapshot(path, target)
        except (FileNotFoundError, shutil.Error):
            shutil.rmtree(holder, ignore_errors=True)
            return None
        return target

    @staticmethod
    def _changed(path: str, key: Any) -> bool:
        try:
            return _key(path) != key
        except FileNotFoundError:
            return True

    def poll(self) -> None:
        """At a step boundary: raise a failed upload (naming it); start a sync when the
        staging directory changed and none runs."""
        failure = self.check()
        if failure is not None:
            raise failure

    def check(self) -> CheckpointError | None:
        """`poll`, returning the failure (a failed upload, a lost lease) instead of raising
        it: on several ranks, every rank raises it at the same step (`hookloop.
        checkpoint_remote`)."""
        failure = self._take_failure()
        if failure is not None or self._lease is None:
            return failure  # not started: not a fit, or not rank 0
        if self._lease.lost is not None:
            return CheckpointError(
                f"Checkpoint: the lease on {self.url} was taken over by {self._lease.lost} "
                "(this job could not renew it in time); two jobs must not save to one run, "
                "so this one stops. Its saves are complete in the staging directory "
                f"{self.staging}.")
        if self._future is not None:
            return None
        if all(self._uploaded.get(name) == key for name, key in self._local().items()) and \
                set(self._uploaded) <= set(self._local()):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hookloop-mirror")
        self._future = self._pool.submit(self.sync)
        return None

    def flush(self) -> CheckpointError | None:
        """At the training's end (every rank still there): wait for the sync in flight,
        then upload what is left; the failure returned (as `check`), the lease kept."""
        try:
            failure = self._take_failure(wait=True)
            if failure is None and self._lease is not None:
                self.sync()
        except Exception as error:  # the last sync's: named as a background one is
            return self._failure(error)
        return failure

    def _take_failure(self, *, wait: bool = False) -> CheckpointError | None:
        future = self._future
        if future is None or not (wait or future.done()):
            return None
        self._future = None
        error = future.exception()
        return None if error is None else self._failure(error)

    def _failure(self, error: BaseException) -> CheckpointError:
        failure = CheckpointError(
            f"Checkpoint: uploading the saves of {self.staging} to {self.url} failed: "
            f"{type(error).__name__}: {error}. The saves are complete locally; the store "
            "keeps its previous complete saves (and no partial one shows: it has no "
            "manifest). Fix the store (credentials, endpoint, space) and resume.")
        failure.__cause__ = error
        return failure

    def close(self, *, raising: bool = True) -> None:
        """At a fit's end: wait for the sync in flight, sync what is left, give the lease
        back. ``raising=False`` (the exception path) warns instead of raising."""
        try:
            if (failure := self._take_failure(wait=True)) is not None:
                raise failure
            if self._lease is not None:
                self.sync()
        except Exception as error:
            if raising:
                raise
            warnings.warn(f"Checkpoint: the last saves were not uploaded to {self.url}: "
                          f"{error}", RuntimeWarning, stacklevel=2)
        finally:
            self.release()

    def release(self) -> None:
        """Give the lease back and stop the mirror's thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._future = None, None
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.release()
