"""Checkpoint files on disk: atomic writes, links, the directory's probe and listing, and the
archive's CRCs.

`Checkpoint` decides when to save and what to keep; `hookloop.runfile.format` lays out, checks and
reads what a file holds; this module does the file work under both.
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import struct
import tempfile
import uuid
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from typing import Any

import torch

from hookloop.base.os_errors import describe_os_error, write_failure
from hookloop.errors import CheckpointError, CheckpointWriteError, ConfigurationError

__all__ = ["TEMP_PREFIX", "TEMP_SUFFIX", "is_temporary", "remove_entry", "write_atomic",
           "write_text_atomic", "link_atomic", "fsync_directory", "describe_os_error",
           "prepare_directory", "regular_checkpoint_files", "verify_archive",
           "entry_problem", "link_outside", "read_own_text",
           "checkpoint_directories", "link_out_of", "link_target", "snapshot"]

TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".part"


def is_temporary(file_name: str) -> bool:
    """True for the name of a temporary file a save in progress (or killed) left."""
    return file_name.startswith(TEMP_PREFIX) and file_name.endswith(TEMP_SUFFIX)


def entry_problem(name: object) -> str | None:
    """Why ``name`` is not the plain name of an entry of a directory, or None.

    A file of the run directory that names other files (a rollback's journal) is input an
    attacker may have planted: each name it holds must stay inside the directory.

    Example:
        >>> entry_problem("epoch=0001-step=00000010.pt") is None
        True
        >>> entry_problem("../secret.txt")
        "'../secret.txt' holds a path separator"
    """
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    if "\0" in name or os.sep in name or (os.altsep and os.altsep in name):
        return f"{name!r} holds a path separator"
    if name in (".", "..") or os.path.isabs(name):
        return f"{name!r} is not an entry of the directory"
    return None


def link_outside(path: str, root: str) -> str | None:
    """The target of ``path`` when it is a symbolic link leading outside ``root`` (or to
    nothing), else None: what the run directory may not follow."""
    if not os.path.islink(path):
        return None
    target, base = os.path.realpath(path), os.path.realpath(root)
    if not os.path.lexists(target) or (target != base and not target.startswith(base + os.sep)):
        return target
    return None


def read_own_text(path: str, limit: int = 1 << 20) -> str:
    """The text of the regular file ``path``, opened without following a symbolic link and
    without blocking on a FIFO; at most ``limit`` bytes.

    Raises:
        FileNotFoundError: there is no such entry.
        OSError: it is a symbolic link (``ELOOP``), not a regular file, or larger.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    descriptor = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(f"not a regular file of at most {limit} bytes")
        return handle.read(limit).decode("utf-8")


def fsync_directory(directory: str) -> None:
    """Make the renames in ``directory`` durable (POSIX); a no-op where it cannot be opened.

    Example:
        >>> import tempfile
        >>> fsync_directory(tempfile.gettempdir())
    """
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(descriptor)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(descriptor)



def remove_entry(path: str) -> None:
    """Delete a checkpoint file or directory; a directory is first renamed to a temporary
    name, so a kill in the middle never leaves a partial checkpoint under its name."""
    if not os.path.isdir(path) or os.path.islink(path):
        os.unlink(path)
        return
    doomed = os.path.join(os.path.dirname(path) or ".",
                          f"{TEMP_PREFIX}{uuid.uuid4().hex}{TEMP_SUFFIX}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0o666 less the process umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # the only portable way to read it is to set it
    os.umask(mask)
    return 0o666 & ~mask


class _RecordingWriter:
    """Passes writes to ``handle`` and keeps the first `OSError`.

    torch.save turns a failed write into a RuntimeError ("[enforce fail at
    inline_container.cc] unexpected pos ..."); the OSError kept here says why it failed.
    """

    def __init__(self, handle: Any) -> None:
        self._handle, self.flush = handle, handle.flush
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            if self.error is None:
                self.error = error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _write_error(path: str, error: BaseException, doing: str) -> CheckpointWriteError:
    return write_failure(CheckpointWriteError, error, lambda cause: (
        f"Cannot write the checkpoint {path}: {doing} failed: {cause}. Nothing was written "
        "under that name; the earlier checkpoint files are intact and no temporary file is "
        "left. Fix the cause (free space, permissions, the directory) and run again; "
        "Checkpoint(..., resume=True) continues from the newest file."))


def write_atomic(payload: Mapping[str, Any], path: str) -> None:
    """Write to a temporary file in the same directory, flush, fsync, then ``os.replace``.

    Whatever interrupts the write (an exception, a second Ctrl-C, SIGKILL) leaves the final
    name untouched: at worst a ``.tmp-*.part`` file, which is never taken for a checkpoint
    (and is deleted here whenever Python still runs). The file gets the permissions a plain
    ``torch.save`` gives (0o666 less the umask: 0o644 under the usual umask 022).

    Raises:
        CheckpointWriteError: any failure of the file system (a full disk, a deleted
            directory, permissions), naming ``path`` and the cause in words; a
            `CheckpointError` and an `OSError`. Other exceptions (a KeyboardInterrupt
            during the write) propagate as they are.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "weights.pt")
        >>> write_atomic({"w": torch.ones(2)}, path)
        >>> torch.load(path, weights_only=True)["w"]
        tensor([1., 1.])
    """
    recording: list[_RecordingWriter] = []

    def fill(descriptor: int, temporary: str, doing: list[str]) -> None:
        with suppress(OSError):  # file systems without modes (some network mounts)
            os.fchmod(descriptor, _file_mode())
        with os.fdopen(descriptor, "wb") as handle:
            recording.append(_RecordingWriter(handle))
            torch.save(payload, recording[0])
            doing[0] = "flushing"
            handle.flush()
            doing[0] = "syncing to disk (fsync)"
            os.fsync(handle.fileno())
            doing[0] = "closing"

    def failure(error: BaseException) -> BaseException | None:
        recorded = recording[0].error if recording else None
        if recorded is not None:
            return _write_error(path, recorded, "writing")
        if isinstance(error, RuntimeError) and "inline_container" in str(error):
            return _write_error(path, error, "writing")
        return None

    _replace_atomically(path, fill, failure)


def _replace_atomically(path: str, fill: Callable[[int, str, list[str]], None],
                        failure: Callable[[BaseException], BaseException | None] | None = None,
                        ) -> None:
    """The one atomic write: ``fill(descriptor, temporary, doing)`` writes and syncs a temporary file in
    the directory of ``path`` (and closes it), which is renamed over ``path``; the directory
    is synced. On any failure the temporary file goes; ``failure(error)`` may translate the
    error, else an `OSError` becomes a `CheckpointWriteError` naming the step (``doing``)."""
    directory = os.path.dirname(path) or "."
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX,
                                                 dir=directory)
    except OSError as error:
        raise _write_error(path, error, f"creating a temporary file in {directory}") from error
    doing = ["writing"]
    try:
        fill(descriptor, temporary, doing)
        doing[0] = f"renaming {os.path.basename(temporary)} to it"
        os.replace(temporary, path)
    except BaseException as error:
        with suppress(OSError):
            os.unlink(temporary)
        translated = failure(error) if failure is not None else None
        if translated is None and isinstance(error, OSError):
            translated = _write_error(path, error, doing[0])
        if translated is not None:
            raise translated from error
        raise
    fsync_directory(directory)


def write_text_atomic(text: str, path: str) -> None:
    """Write a small text file the way `write_atomic` writes a checkpoint: complete or absent.

    Raises:
        CheckpointWriteError: naming ``path`` and the cause.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "note.json")
        >>> write_text_atomic("{}", path)
        >>> open(path).read()
        '{}'
    """
    def fill(descriptor: int, temporary: str, doing: list[str]) -> None:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    _replace_atomically(path, fill)


def prepare_directory(path: str | os.PathLike[str]) -> str:
    """Create the checkpoint directory if needed and prove it can be written, before training.

    A path that is a file, a directory that cannot be created, and one where a file cannot
    be written (a probe file is created, written, synced and deleted) are errors now rather
    than after the first epoch.

    Args:
        path: The directory.

    Returns:
        The path, as a string.

    Raises:
        ConfigurationError: naming the directory, the cause and the fix.

    Example:
        >>> import os, tempfile
        >>> directory = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> prepare_directory(directory) == directory and os.listdir(directory)
        []
    """
    path = os.fspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        what = "a broken symbolic link" if os.path.islink(path) else "a file"
        raise ConfigurationError(
            f"Checkpoint directory {path} is {what}, not a directory. Give a directory path "
            "(it is created when missing), or move that file away.")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ConfigurationError(
            f"Checkpoint directory {path} cannot be created: {describe_os_error(error)}. "
            "Give a directory you can write to, or create it yourself.") from error
    try:
        descriptor, probe = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=path)
    except OSError as error:
        raise ConfigurationError(
            f"Checkpoint directory {path} is not writable: creating a file in it failed: "
            f"{describe_os_error(error)}. Fix its permissions or give another directory.") from error
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(b"hookloop write probe")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise ConfigurationError(
            f"Checkpoint directory {path} is not writable: writing a probe file failed: "
            f"{describe_os_error(error)}. Free space or give another directory.") from error
    finally:
        with suppress(OSError):
            os.unlink(probe)
    return path


def regular_checkpoint_files(dirpath: str | os.PathLike[str], names: Iterable[str]) -> list[str]:
    """The paths of ``names`` (entries of ``dirpath``) that are regular files inside it.

    What ``resume=True`` may pick from. A symbolic link whose target lies outside
    ``dirpath`` (or is missing) is skipped with a `RuntimeWarning`: resuming must not read a
    file that another run or user controls. Directories and other non-regular entries are
    skipped silently. The order of ``names`` is kept.

    Example:
        >>> import os, tempfile
        >>> directory = tempfile.mkdtemp()
        >>> open(os.path.join(directory, "a.pt"), "wb").close()
        >>> os.mkdir(os.path.join(directory, "b.pt"))
        >>> [os.path.basename(p) for p in regular_checkpoint_files(directory, ["a.pt", "b.pt"])]
        ['a.pt']
    """
    directory = os.fspath(dirpath)
    found = []
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            target = link_outside(path, directory)
            if target is not None:
                _warn_outside(path, target, directory)
                continue
            if not os.path.isfile(os.path.realpath(path)):
                continue
        elif not os.path.isfile(path):
            continue
        found.append(path)
    return found


def checkpoint_directories(dirpath: str, names: Iterable[str]) -> set[str]:
    """The ``names`` that are directories of shards ``resume=True`` may pick: real
    directories (not links), none of whose files is a symbolic link leading out of
    ``dirpath`` (skipped with the `RuntimeWarning` of `regular_checkpoint_files`)."""
    found = set()
    for name in names:
        path = os.path.join(dirpath, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        with suppress(OSError):  # an entry that cannot be listed is not picked
            linked = link_out_of(path)
            if linked is None:
                found.add(name)
            else:
                _warn_outside(*linked, dirpath)
    return found


def link_out_of(directory: str) -> tuple[str, str] | None:
    """``(path, target)`` of the first entry of the checkpoint ``directory`` (a ``.dcp``)
    that is a symbolic link leading out of the folder holding it, else None: the one rule
    for a rotating file (`regular_checkpoint_files`) applied to each file inside.

    Raises:
        OSError: ``directory`` cannot be listed.
    """
    root = os.path.dirname(os.path.abspath(directory))
    for name in sorted(os.listdir(directory)):
        target = link_outside(os.path.join(directory, name), root)
        if target is not None:
            return os.path.join(directory, name), target
    return None


def link_target(target: str, directory: str) -> str:
    """How a message names where a link out of ``directory`` leads."""
    where = f"outside {directory}" if os.path.lexists(target) else "which does not exist"
    return f"a symbolic link to {target}, {where}"


def _warn_outside(path: str, target: str, directory: str) -> None:
    warnings.warn(
        f"Checkpoint: skipping {path}: it is {link_target(target, directory)}; resume=True "
        "only reads files inside the checkpoint directory. Copy the file in, or pass "
        "Checkpoint(resume=path) to resume from it on purpose.", RuntimeWarning, stacklevel=4)


def link_atomic(source: str, path: str) -> None:
    """Make ``path`` the same complete file as ``source``, atomically (no second write).

    A hard link under a temporary name, renamed over ``path`` with ``os.replace``; where the
    file system has no hard links, a copy written the same atomic way. ``source`` stays.
    """
    def fill(descriptor: int, temporary: str, doing: list[str]) -> None:
        doing[0] = f"linking {os.path.basename(source)} to it"
        os.close(descriptor)
        os.unlink(temporary)  # the name is this write's: a hard link takes it
        try:
            os.link(source, temporary)
        except OSError:  # no hard links here (some network and FAT file systems): copy
            with open(source, "rb") as reader, open(temporary, "wb") as writer:
                while chunk := reader.read(1 << 20):
                    writer.write(chunk)
                writer.flush()
                os.fsync(writer.fileno())

    _replace_atomically(path, fill)


# A zip local file header: its signature, then (after 22 bytes) the lengths of the name and
# of the extra field that precede the record's bytes.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_COMPRESSION_NAMES = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
                      zipfile.ZIP_LZMA: "lzma"}


def verify_archive(path: str) -> None:
    """Refuse a damaged checkpoint archive before ``torch.load`` reads it.

    ``torch.save`` writes a zip archive of stored (uncompressed) records, each with a
    CRC-32 of its bytes, but ``torch.load`` never checks those CRCs: a flipped byte in
    tensor data loads silently as a wrong weight. This maps the file and checks each
    record's CRC over the mapped bytes: the one read of the file, whose pages
    ``torch.load(mmap=True)`` then maps again (`hookloop.runfile.format.read_payload`), so
    the load makes no second pass over it. A compressed or encrypted record (which
    ``torch.save`` never writes) is refused before anything is inflated, so a small crafted
    file cannot fill the memory.

    Raises:
        CheckpointError: naming the file, the record and what is wrong.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "x.pt")
        >>> torch.save({"w": torch.ones(3)}, path)
        >>> verify_archive(path)  # intact: returns None
    """
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ
                                                   ) as mapped, memoryview(mapped) as view:
            with zipfile.ZipFile(handle) as archive:  # its central directory only
                records = archive.infolist()
            for info in records:  # its bytes follow its local header, as zip readers find them
                if info.flag_bits & 0x1:
                    raise CheckpointError(
                        f"{path}: record {info.filename!r} is encrypted; torch.save never "
                        "writes encrypted records, so this is not a checkpoint. Refused.")
                if info.compress_type != zipfile.ZIP_STORED:
                    method = _COMPRESSION_NAMES.get(info.compress_type, f"method {info.compress_type}")
                    raise CheckpointError(
                        f"{path}: record {info.filename!r} is compressed ({method}, "
                        f"{info.compress_size} bytes claiming {info.file_size}); torch.save "
                        "never compresses records, so the file was repacked or crafted. "
                        "Refused without inflating it; load it with torch.load yourself if "
                        "you trust it.")
                if info.compress_size != info.file_size:
                    raise CheckpointError(
                        f"{path}: record {info.filename!r} is damaged (its stored size "
                        f"{info.compress_size} differs from its size {info.file_size}).")
                magic, name, extra = _LOCAL_HEADER.unpack_from(view, info.header_offset)
                begin = info.header_offset + _LOCAL_HEADER.size + name + extra
                # Released before the unmap. A damaged header or a cut-off record reads
                # other (or fewer) bytes: its CRC fails.
                with view[begin:begin + info.file_size] as data:
                    if magic != b"PK\x03\x04" or zlib.crc32(data) != info.CRC:
                        raise CheckpointError(
                            f"{path}: the file is damaged: Bad CRC-32 for file {info.filename!r}"
                            " (its bytes changed after it was written: a disk, memory or copy "
                            "error). Delete it to resume from an older one, or copy it again.")
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, struct.error) as error:
        raise CheckpointError(f"{path}: the file is truncated or corrupt ({error}).") from None
    except (OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as error:
        raise CheckpointError(
            f"{path}: the file is truncated or corrupt ({type(error).__name__}: {error}).") from None


def snapshot(source: str, target: str) -> None:
    """Make ``target`` the file or directory of files ``source`` by hard links (a copy where a
    link cannot be made: another file system), so that deleting or replacing ``source``
    leaves ``target`` whole. A ``source`` that vanishes raises `FileNotFoundError`."""

    def link(origin: str, destination: str) -> None:
        try:
            os.link(origin, destination)
        except FileNotFoundError:
            raise
        except OSError:
            shutil.copy2(origin, destination)

    if os.path.isdir(source):
        shutil.copytree(source, target, copy_function=link)
    else:
        link(source, target)
