"""`RemoteStore`: the checkpoints of one run on an object store (any fsspec URL).

A save on the store is its objects plus a manifest written last: ``<name>.manifest.json``
beside them, holding a save id and each object's size and content digest (under a key
naming its algorithm: `hookloop.runfile.digests`; earlier versions wrote SHA-256). An
object store
has no rename, so the manifest is what makes a save visible: `saves` lists only the names
that have one, a reader checks every object against it (`download`), and objects of a
checkpoint name without a manifest are a save a kill interrupted (`partial`), deleted by
the holder of the run's lease. A save is deleted manifest first, so no manifest ever names
objects that are gone; a name replaced (``best.pt``) loses its manifest before its objects
are overwritten, so the old manifest never vouches for new bytes.

fsspec (and the store's package, s3fs or gcsfs) is imported only here, and only when a URL
is used: ``import hookloop`` never imports them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.runfile.digests import ALGORITHM, check_algorithm, file_digest, new_digest

__all__ = ["MANIFEST_SUFFIX", "OBJECTS", "RemoteStore", "fetched", "is_url"]

#: The manifest of the save ``name`` is the object ``name + MANIFEST_SUFFIX``.
MANIFEST_SUFFIX = ".manifest.json"
_FORMAT = "hookloop-remote-save"
# The manifest's keys (its own words: not the run file's, which other modules own).
_TAG, _ID, OBJECTS = "manifest", "save", "objects"
#: An object's digest is under ``_DIGEST + its algorithm`` (earlier: ``digest_sha256``).
_DIGEST = "digest_"
_CHUNK = 8 << 20  # bytes per read and write: a bounded buffer for any checkpoint size


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL with a protocol (``s3://``, ``memory://``...)."""
    return isinstance(path, str) and "://" in path


def is_checkpoint_name(name: str) -> bool:
    """Whether a top-level entry of the run is a checkpoint (a ``.pt`` file or ``.dcp``)."""
    return name.endswith((".pt", ".dcp")) and not name.startswith(".")


def _recorded(entry: dict[str, Any], where: str) -> tuple[str, Any]:
    """``(algorithm, digest)`` a manifest's entry records (its key names the algorithm).

    Raises:
        CheckpointError: the entry records no digest, or one of an algorithm hookloop does
            not know.
    """
    keys = [key for key in entry if key.startswith(_DIGEST)]
    if len(keys) != 1:
        raise CheckpointError(f"{where}: an entry records {len(keys)} digests ({keys}), not "
                              "one: not a hookloop manifest; the save is refused.")
    return check_algorithm(keys[0][len(_DIGEST):], where), entry[keys[0]]


def _digest_copy(source: Any, target: Any, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """Copy the open ``source`` into ``target``; its size and digest, in the same pass."""
    digest, size = new_digest(algorithm), 0
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
        target.write(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


class RemoteStore:
    """The run at ``url``: list, upload, download (verified) and delete its saves.

    Args:
        url: Any fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://run``).
        storage_options: Passed to the fsspec filesystem (an endpoint, a profile...);
            credentials come from the environment as the filesystem's package reads them.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:  # pragma: no cover - fsspec comes with torch's extras usually
            raise ConfigurationError(
                f"Checkpoint: {url} is a URL; hookloop reads and writes URLs through fsspec, "
                "which is not installed: pip install 'hookloop[s3]' (or [gcs]).") from None
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ImportError, ValueError) as error:
            raise ConfigurationError(
                f"Checkpoint: no fsspec filesystem for {url} ({error}); install its package "
                "(pip install 'hookloop[s3]' for s3://, 'hookloop[gcs]' for gs://).") from None
        self.root = self.root.rstrip("/")

    def path(self, name: str) -> str:
        """The store's path of ``name`` (an entry, or a file inside one) in the run."""
        return f"{self.root}/{name}"

    def where(self, name: str) -> str:
        """``name`` as a URL, for messages."""
        return f"{self.url}/{name}"

    # ---------------------------------------------------------------- listing
    def objects(self) -> list[str]:
        """Every object of the run, relative to it (a fresh listing, never a cached one)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        start = len(self.root) + 1
        return sorted(path[start:] for path in found if path.startswith(self.root + "/"))

    def saves(self, objects: list[str] | None = None) -> list[str]:
        """The names of the complete saves: those with a manifest."""
        objects = self.objects() if objects is None else objects
        return sorted(name[:-len(MANIFEST_SUFFIX)] for name in objects
                      if "/" not in name and name.endswith(MANIFEST_SUFFIX))

    def partial(self, objects: list[str] | None = None) -> dict[str, list[str]]:
        """Checkpoint names with objects but no manifest: ``{name: [objects]}``."""
        objects = self.objects() if objects is None else objects
        complete = set(self.saves(objects))
        found: dict[str, list[str]] = {}
        for name in objects:
            top = name.split("/", 1)[0]
            if is_checkpoint_name(top) and top not in complete:
                found.setdefault(top, []).append(name)
        return found

    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest of the save ``name``, checked.

        Raises:
            CheckpointError: it is missing, not JSON, not hookloop's, or names an object
                outside the save.
        """
        where = self.where(name + MANIFEST_SUFFIX)
        try:
            with self.fs.open(self.path(name + MANIFEST_SUFFIX), "rb") as handle:
                manifest = json.loads(handle.read().decode("utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{self.where(name)}: no such complete save (its manifest "
                                  f"{where} is missing).") from None
        except (UnicodeDecodeError, ValueError) as error:
            raise CheckpointError(f"{where}: not a hookloop manifest ({error}); the save "
                                  f"{self.where(name)} is refused.") from None
        files = manifest.get(OBJECTS) if isinstance(manifest, dict) else None
        if not isinstance(manifest, dict) or manifest.get(_TAG) != _FORMAT or \
                manifest.get("name") != name or not isinstance(files, dict) or not files:
            raise CheckpointError(f"{where}: not the manifest of a hookloop save named {name!r}"
                                  f"; the save {self.where(name)} is refused.")
        for key, entry in files.items():
            inside = key == name or key.startswith(name + "/")
            if not inside or ".." in key.split("/") or not isinstance(entry, dict):
                raise CheckpointError(f"{where}: names {key!r}, which is not an object of the "
                                      f"save {name}; refused.")
            _recorded(entry, where)  # an unknown digest algorithm is refused by name
        return manifest

    # -------------------------------------------------------------- uploading
    def upload(self, local: str, name: str) -> None:
        """Upload the local entry ``local`` (a file or a directory, which must not change
        meanwhile: `hookloop.runfile.remote_mirror` uploads a snapshot of links) as
        ``name``: its files, digested while they are sent, then its manifest."""
        if name in self.saves():
            self.fs.rm(self.path(name + MANIFEST_SUFFIX))  # never vouch for new bytes
        files: dict[str, dict[str, Any]] = {}
        if os.path.isdir(local):
            for folder, _, names in os.walk(local):
                for file in sorted(names):
                    path = os.path.join(folder, file)
                    key = f"{name}/{os.path.relpath(path, local).replace(os.sep, '/')}"
                    files[key] = self._put(path, key)
        else:
            files[name] = self._put(local, name)
        if not files:
            raise CheckpointError(f"{local}: an empty checkpoint directory; not uploaded.")
        manifest = {_TAG: _FORMAT, "name": name, _ID: uuid.uuid4().hex, OBJECTS: files}
        with self.fs.open(self.path(name + MANIFEST_SUFFIX), "wb") as handle:
            handle.write(json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))

    def _put(self, local: str, key: str) -> dict[str, Any]:
        with open(local, "rb") as source, self.fs.open(self.path(key), "wb") as target:
            size, digest = _digest_copy(source, target)
        return {"size": size, _DIGEST + ALGORITHM: digest}

    def delete(self, name: str) -> None:
        """Delete the save ``name``: its manifest first, then its objects."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name + MANIFEST_SUFFIX))
        self.delete_objects([name])

    def delete_objects(self, names: list[str]) -> None:
        """Delete objects (or entries of objects), ignoring those gone already."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(name), recursive=True)

    # ------------------------------------------------------------ downloading
    def download(self, name: str, local: str) -> None:
        """Download the complete save ``name`` to ``local`` (replaced only once every
        object matches the manifest's size and digest).

        Raises:
            CheckpointError: naming the object that is missing, truncated, damaged or
                another save's; ``local`` is left as it was.
        """
        manifest = self.manifest(name)
        folder = os.path.dirname(os.path.abspath(local))
        holder = tempfile.mkdtemp(prefix=".tmp-fetch-", suffix=".part", dir=folder)
        try:
            staged = os.path.join(holder, name)
            for key, entry in sorted(manifest[OBJECTS].items()):
                target = staged if key == name else os.path.join(staged, *key.split("/")[1:])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                self._get(key, target, entry)
            if os.path.isdir(local) and not os.path.islink(local):
                shutil.rmtree(local)
            elif os.path.lexists(local):
                os.unlink(local)
            os.replace(staged, local)
        finally:
            shutil.rmtree(holder, ignore_errors=True)

    def _get(self, key: str, target: str, entry: dict[str, Any]) -> None:
        where = self.where(key)
        algorithm, recorded = _recorded(entry, where)
        try:
            with self.fs.open(self.path(key), "rb") as source, open(target, "wb") as out:
                size, digest = _digest_copy(source, out, algorithm)
        except FileNotFoundError:
            raise CheckpointError(f"{where}: missing, though the save's manifest names it; "
                                  "the save is refused.") from None
        if size != entry.get("size"):
            raise CheckpointError(
                f"{where}: {size} bytes, the manifest says {entry.get('size')}: the object is "
                "truncated or another save's; refused (delete the save or pick another).")
        if digest != recorded:
            raise CheckpointError(
                f"{where}: its {algorithm} digest is not the one the manifest holds: the "
                "object is damaged or another save's; refused (delete the save or pick "
                "another).")


def same_file(local: str, entry: dict[str, Any]) -> bool:
    """Whether the local file has the size and digest of a manifest's entry.

    Raises:
        CheckpointError: the entry names an algorithm hookloop does not know.
    """
    algorithm, recorded = _recorded(entry, local)
    try:
        if os.path.getsize(local) != entry.get("size"):
            return False
        return file_digest(local, algorithm) == recorded
    except OSError:
        return False


@contextlib.contextmanager
def fetched(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[str]:
    """The complete save at ``url`` (``<run URL>/<name>``) downloaded and verified into a
    temporary folder, removed after; yields its local path (`load_checkpoint` of a URL)."""
    run, _, name = url.rstrip("/").rpartition("/")
    store = RemoteStore(run, storage_options)
    folder = tempfile.mkdtemp(prefix="hookloop-fetch-")
    try:
        local = os.path.join(folder, name)
        store.download(name, local)
        yield local
    finally:
        shutil.rmtree(folder, ignore_errors=True)
