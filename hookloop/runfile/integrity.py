"""What makes the files of a checkpoint trustworthy before anything reads them.

Every storage path goes through here, so a guarantee is written once:

* a file is read only after it was verified: a single ``.pt`` file by the CRC-32 of each
  of its records (`hookloop.runfile.storage.verify_archive`) and ``torch.load(weights_only=True)``;
  a directory of shards (``.dcp``) by the save id and the content digest of each of its
  files, recorded in its ``hookloop.pt`` (itself a ``.pt`` file, verified as above);
* DCP's ``.metadata`` is unpickled only by `read_metadata`, which admits DCP's metadata
  classes and nothing else, and the shards' non-tensor entries only by
  ``torch.load(weights_only=True)`` (DCP's own reader uses plain ``pickle`` for both);
* every failure of a DCP read or write, torch's ``CheckpointException`` included (it
  derives from ``BaseException``, which ``except Exception`` misses), becomes hookloop's
  `CheckpointError` / `CheckpointWriteError` naming the file or directory and the cause.
  A ``KeyboardInterrupt`` or ``SystemExit`` (on any rank) stays what it is: a stop, not a
  damaged file.

The digest is XXH3-128 (`hookloop.runfile.digests.ALGORITHM`), named in each file's record;
a record naming none (hookloop 0.1's) is SHA-256. benchmarks/checkpoint_digests.py measures
the cost per GB of each.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import stat
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from hookloop import distributed
from hookloop.base.os_errors import describe_os_error, write_failure
from hookloop.errors import CheckpointError, CheckpointWriteError
from hookloop.runfile.digests import (ALGORITHM, LEGACY, check_algorithm, file_digest,
                                      recording_file_system)
from hookloop.runfile.storage import link_out_of, link_target

__all__ = ["DIGEST", "KEYS", "FILES_KEY", "SAVE_ID_KEY", "cause_of", "check_files", "control_flow",
           "file_digest", "new_save_id", "read_error", "read_metadata", "record_files",
           "refuse_links",
           "safe_planner", "verified_reader", "write_error", "writer", "writer_record"]

#: Keys of the ``hookloop`` entry of a directory's plain part, written, checked and read
#: here: the save's id, and each file's ``{"bytes": size, "algorithm": name, "digest":
#: hex}`` (hookloop 0.1 wrote ``{"bytes": size, "sha256": hex}``, still read).
SAVE_ID, FILES = "save_id", "files"
BYTES, ALGORITHM_KEY, DIGEST = "bytes", "algorithm", "digest"  # of each entry of FILES
SHA256 = LEGACY  # the key of a hookloop 0.1 entry's digest
KEYS = (SAVE_ID, FILES, BYTES, ALGORITHM_KEY, DIGEST, SHA256)
#: Keys that are also ordinary words elsewhere.
SHARED_WORDS = frozenset((FILES, BYTES, ALGORITHM_KEY, DIGEST))
SAVE_ID_KEY, FILES_KEY = SAVE_ID, FILES
# What DCP's .metadata holds (torch 2.4 to 2.13): its dataclasses, torch's sizes, dtypes and
# layouts, and the checkpoint's path. Nothing here runs code of the file's choosing.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    torch.__name__: {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


def new_save_id() -> str:
    """A fresh id for one save (every file of it is recorded under it)."""
    return uuid.uuid4().hex


def record_files(directory: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "algorithm": ..., "digest": hex}}`` of the files ``names``
    in ``directory``."""
    return {name: {BYTES: os.path.getsize(os.path.join(directory, name)),
                   ALGORITHM_KEY: ALGORITHM, DIGEST: file_digest(os.path.join(directory, name))}
            for name in names}


def _recorded_digest(entry: Any, where: str) -> tuple[str, str] | None:
    """``(algorithm, hex digest)`` of one file's record, None where it is not one; a record
    naming no algorithm is hookloop 0.1's SHA-256.

    Raises:
        CheckpointError: the record names an algorithm hookloop does not know.
    """
    if not isinstance(entry, Mapping) or not isinstance(entry.get(BYTES), int):
        return None
    if ALGORITHM_KEY not in entry:
        return (LEGACY, entry[SHA256]) if isinstance(entry.get(SHA256), str) else None
    algorithm = check_algorithm(entry[ALGORITHM_KEY], where)
    return (algorithm, entry[DIGEST]) if isinstance(entry.get(DIGEST), str) else None


def _recorded(directory: str, plain: str) -> set[str]:
    """The files of ``directory`` a save records: every one but its plain part."""
    return {name for name in os.listdir(directory)
            if name != plain and os.path.isfile(os.path.join(directory, name))}


def check_files(directory: str, meta: Mapping[str, Any], plain: str, *,
                every_rank: bool = False) -> None:
    """Check that the files of the sharded checkpoint ``directory`` are the ones its plain
    part ``plain`` (whose ``hookloop`` entry is ``meta``) recorded: none missing, none
    added, each of the recorded size and digest (of the algorithm its record names).

    ``every_rank``: every rank checks the same directory now (a resume): each file is
    hashed by one rank (they take turns over the sorted names) and what differs is
    gathered, so every rank raises the same error (a collective then).

    Raises:
        CheckpointError: naming the file and what differs; when no file matches, naming
            ``plain`` as the part that belongs to another save; naming a digest algorithm
            the record names and hookloop does not know.
    """
    record, save_id = meta.get(FILES_KEY), meta.get(SAVE_ID_KEY)
    where = os.path.join(directory, plain)
    if not isinstance(record, Mapping) or not isinstance(save_id, str) or not all(
            _recorded_digest(entry, where) is not None for entry in record.values()):
        raise CheckpointError(
            f"{where}: records no save id and file digests (fields 'hookloop.{SAVE_ID_KEY}' "
            f"and 'hookloop.{FILES_KEY}'), so nothing proves that the shards beside it belong "
            "to the same save. It was edited, or written by a development version of hookloop "
            "before 0.1.0's digests; resume from another checkpoint.")
    refuse_links(directory)  # before a size or digest of a foreign file is taken
    present = _recorded(directory, plain)
    differ: list[tuple[str, str]] = []
    ranks = distributed.world_size() if every_rank else 1  # 1 without a process group
    rank = distributed.rank() if ranks > 1 else 0
    for index, name in enumerate(sorted(record)):
        if name not in present:
            differ.append((name, "is missing"))
            continue
        what = _difference(os.path.join(directory, name), record[name],
                           hashed=index % ranks == rank)
        if what is not None:
            differ.append((name, what))
    if ranks > 1:  # each rank hashed its turns: every rank learns what differs
        differ = sorted({item for part in distributed.all_gather_object(differ)
                         for item in part})
    for name in sorted(present - set(record)):
        differ.append((name, f"is not a file of save {save_id}"))
    if not differ:
        return
    if record and not set(record) - {name for name, _ in differ}:  # not one file matches
        raise CheckpointError(
            f"{where}: belongs to another save than the files beside it: none of the "
            f"{len(record)} files it records for save {save_id} matches ({differ[0][0]} "
            f"{differ[0][1]}). Its shards and its hookloop.pt come from different saves "
            "(copied together by mistake); resume from another checkpoint.")
    name, what = differ[0]
    more = f" (and {len(differ) - 1} more file(s) differ)" if len(differ) > 1 else ""
    raise CheckpointError(
        f"{os.path.join(directory, name)}: {what}{more}; {plain} records save {save_id}. "
        "The directory's files do not belong together, so it is refused before anything "
        "is read. Resume from another checkpoint, or copy this one again from its source.")


def _difference(path: str, entry: Mapping[str, Any], *, hashed: bool) -> str | None:
    """How the file ``path`` differs from its record ``entry`` (its digest compared only
    where ``hashed``: this rank's turn), or None."""
    info = os.lstat(path)
    size = info.st_size
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a link or a device): refused unread"
    if size != entry[BYTES]:
        how = "truncated, or another file" if size < entry[BYTES] else "another file"
        return f"is {size} bytes where the save wrote {entry[BYTES]} ({how})"
    algorithm, recorded = _recorded_digest(entry, path) or (LEGACY, "")
    if hashed and _digest_or_none(path, algorithm) != recorded:
        return (f"has other bytes than the save wrote (its {algorithm} digest differs from "
                "the recorded one: flipped bits, or the file of another save)")
    return None


def _digest_or_none(path: str, algorithm: str) -> str | None:
    try:
        return file_digest(path, algorithm)
    except OSError:  # replaced by a link (or removed) since it was listed
        return None


# The classes whose fresh instances DCP's .metadata fills in (pickle's BUILD opcode).
_FILLED = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
    "ChunkStorageMetadata", "MetadataIndex", "StorageMeta")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be checked
    """Admits only `_METADATA_CLASSES` (and torch's dtypes), and fills in (BUILD) only
    instances of DCP's dataclasses: a BUILD on a class, a function or a shared enum member
    would set attributes on it for the whole process (``Metadata.__eq__ = ...``), a file
    refused or not; C's ``pickle.Unpickler`` offers no hook to stop it."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == torch.__name__ and _is_dtype(name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never "
                                     "holds")

    def load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) > 1 else None  # type: ignore[attr-defined]
        kind = type(target)
        if isinstance(target, type) or (kind.__module__, kind.__qualname__) not in _FILLED:
            raise pickle.UnpicklingError(
                f"it sets the attributes of {kind.__module__}.{kind.__qualname__} "
                f"{getattr(target, '__qualname__', '')}".rstrip() + ", which DCP's metadata "
                "never does")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]  # this class's BUILD


def _is_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata(path: str) -> Any:
    """DCP's ``Metadata`` of the directory ``path``, unpickled admitting only DCP's metadata
    classes (and torch's sizes, dtypes and layouts): a hostile file runs no code.

    Raises:
        CheckpointError: naming the ``.metadata`` file and what is wrong.
    """
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    where = os.path.join(path, ".metadata")
    refuse_links(path)
    try:
        with open(os.open(where, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as handle:
            metadata = _MetadataUnpickler(io.BytesIO(handle.read())).load()
    except OSError as error:
        raise CheckpointError(f"{where}: cannot be read ({cause_of(error)}).") from None
    except Exception as error:  # the Python unpickler's: struct.error on a truncated file...
        raise CheckpointError(
            f"{where}: refused: {_unpickling_cause(error)} (a truncated, damaged or crafted "
            "file). hookloop never unpickles it with plain pickle; resume from another "
            "checkpoint.") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds {type(metadata).__name__}, not DCP's Metadata.")
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    for item in storage.values():  # DCP opens each shard as the directory / relative_path
        name = getattr(item, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise CheckpointError(
                f"{where}: names the shard file {name!r}, which is not a file of its own "
                "directory (the digests cover only those): a crafted or damaged file, "
                "refused; resume from another checkpoint.")
        if getattr(item, "transform_descriptors", None):  # torch >= 2.8's stream extensions
            raise CheckpointError(
                f"{where}: asks DCP to transform the bytes of {name} "
                f"({', '.join(map(str, item.transform_descriptors))}) as it reads them; "
                "hookloop never writes a transform, and one (a decompression) could inflate "
                "a small file without bound. Refused before anything is read; resume from "
                "another checkpoint.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _unpickling_cause(error: Exception) -> str:
    """What an error of the Python unpickler says, in words (its ``KeyError`` of an unknown
    opcode says only the byte's value)."""
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        return f"byte 0x{error.args[0]:02x} is no pickle opcode: the file is not a pickle"
    return f"{type(error).__name__}: {error}"


def refuse_links(directory: str) -> None:
    """Refuse the sharded checkpoint ``directory`` when one of its entries is a symbolic
    link leading out of the folder that holds it (the rule `resume=True` applies to the
    checkpoints of a directory, here for each file DCP or hookloop would read). The target
    is named, never opened or measured.

    Raises:
        CheckpointError: naming the link and its target.
    """
    try:
        linked = link_out_of(directory)
    except OSError:
        return  # the read that follows names the cause
    if linked is not None:
        path, target = linked
        raise CheckpointError(
            f"{path}: is {link_target(target, os.path.dirname(os.path.abspath(directory)))}; "
            "hookloop reads only files inside the checkpoint directory. Copy the file in (or "
            "the checkpoint out of that directory) to use it.")


def verified_reader(path: str) -> Any:
    """A DCP ``FileSystemReader`` of ``path`` that reads ``.metadata`` with `read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(path)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(path)


def safe_planner() -> Any:
    """DCP's default load planner, reading non-tensor entries with
    ``torch.load(weights_only=True)`` (DCP's own uses ``weights_only=False``)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # weights_only refuses any pickle naming more than tensors and plain values;
            # what it admits, torch's own load of the same bytes builds the same way.
            torch.load(io.BytesIO(value.getvalue()), weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafePlanner()


def writer(path: str, save_id: str) -> Any:
    """A DCP ``FileSystemWriter`` of ``path`` whose ``.metadata`` records ``save_id``, and
    which digests each file as it writes it (`writer_record`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            self.save_id = save_id

    recording = RecordingWriter(path)
    recording.save_id = save_id
    # Each file's size and digest, taken as DCP writes it (`writer_record`): no read-back.
    recording.fs = recording_file_system()
    return recording


def writer_record(storage_writer: Any) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "algorithm": ..., "digest": hex}}`` of the files `writer`'s
    ``storage_writer`` wrote (this rank's shards; ``.metadata`` on the rank that wrote it)."""
    storage_writer.fs.close()
    return {name: {BYTES: size, ALGORITHM_KEY: ALGORITHM, DIGEST: digest}
            for name, (size, digest) in storage_writer.fs.record.items()}


def _failures(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps: each rank's failure of a ``CheckpointException`` (lowest
    rank first), causes and contexts."""
    found: list[BaseException] = []
    pending = [error]
    while pending and len(found) < 32:
        current = pending.pop(0)
        if current in found:
            continue
        found.append(current)
        failures = getattr(current, "failures", None)
        if isinstance(failures, Mapping):
            for rank in sorted(failures):
                item = failures[rank]
                item = item[0] if isinstance(item, tuple) else item
                if isinstance(item, BaseException):
                    pending.append(item)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    return found


def control_flow(error: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt``/``SystemExit`` inside ``error`` (a Ctrl-C on some rank during
    a DCP call): raised as it is, never turned into a checkpoint error."""
    for item in _failures(error):
        if isinstance(item, (KeyboardInterrupt, SystemExit)):
            return item
    return None


def cause_of(error: BaseException) -> str:
    """The cause of a failed read or write in words: the first `OSError` inside ``error``
    (``"no space left on the device (the disk is full) [errno 28]"``), else its first line.
    The same on every rank for a ``CheckpointException`` (it carries every rank's failure).
    """
    failures = _failures(error)
    for item in failures:
        if isinstance(item, OSError) and item.errno is not None:
            return describe_os_error(item)
    for item in failures:
        if isinstance(item, FileNotFoundError) or "No such file" in str(item):
            return f"a file is missing ({_first_line(item)})"
    deepest = next((item for item in failures[1:] if not hasattr(item, "failures")), error)
    return f"{type(deepest).__name__}: {_first_line(deepest)}"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__


def _errno(error: BaseException) -> int | None:
    return next((item.errno for item in _failures(error)
                 if isinstance(item, OSError) and item.errno is not None), None)


def write_error(path: str, error: BaseException, doing: str) -> CheckpointWriteError:
    """`CheckpointWriteError` for a failed write of the sharded checkpoint ``path``."""
    return write_failure(CheckpointWriteError, error, lambda cause: (
        f"Cannot write the sharded checkpoint {path}: {doing} failed: {cause}. "
        "Nothing was written under that name; the earlier checkpoints are intact. Fix the "
        "cause (free space, permissions, a directory every rank can reach) and run again; "
        "Checkpoint(..., resume=True) continues from the newest complete one."),
        cause=cause_of(error), code=_errno(error))


def read_error(path: str, error: BaseException) -> CheckpointError:
    """`CheckpointError` for a failed DCP read of the sharded checkpoint ``path``."""
    missing = _errno(error) == errno.ENOENT
    hint = ("a file of it is missing" if missing else
            "it was written for another model or optimizer, or its files are damaged")
    return CheckpointError(f"{path}: the sharded checkpoint cannot be read into this run "
                           f"({cause_of(error)}): {hint}. Resume from another checkpoint.")
