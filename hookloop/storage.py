"""Checkpoint files: atomic writes, validated reads, and `load_checkpoint`.

`Checkpoint` decides when to save and what to keep; this module does the file work.
"""

from __future__ import annotations

import errno
import os
import tempfile
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from contextlib import suppress
from typing import Any

import torch
from torch import nn

from hookloop import distributed
from hookloop.errors import CheckpointError, CheckpointWriteError, ConfigurationError, with_article
from hookloop.modules import unwrap
from hookloop.sharded import (
    is_distributed_module,
    is_sharded_tensor,
    load_full_model_state,
    load_full_optimizer_state,
)

__all__ = ["FORMAT", "TEMP_PREFIX", "TEMP_SUFFIX", "is_temporary", "find_unplain", "write_atomic",
           "write_text_atomic", "link_atomic", "fsync_directory",
           "read_payload", "load_model_weights", "weight_differences", "load_optimizer_state",
           "load_checkpoint",
           "load_weights", "SHARDS_KEY",
           "all_finite", "describe_os_error", "prepare_directory", "regular_checkpoint_files",
           "verify_archive", "check_payload", "expect_field", "check_weight_dtypes"]

#: Version of the file layout written by `Checkpoint`.
FORMAT = 2
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".part"
#: The key under which a payload read from a sharded checkpoint directory carries the
#: object that reads its tensors (`hookloop.shard_files.Shards`).
SHARDS_KEY = "shards"
_PRIMITIVES = (int, float, bool, str, bytes, complex, type(None))
_LEAVES = (torch.dtype, torch.device, torch.Size)


def is_temporary(file_name: str) -> bool:
    """True for the name of a temporary file a save in progress (or killed) left."""
    return file_name.startswith(TEMP_PREFIX) and file_name.endswith(TEMP_SUFFIX)

def find_unplain(value: Any, where: str) -> str | None:
    """Where ``value`` holds something ``torch.load(weights_only=True)`` would refuse."""
    if type(value) in _PRIMITIVES or isinstance(value, (torch.Tensor, *_LEAVES)):
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in _PRIMITIVES:
                return f"{where} has a key of type {type(key).__name__}"
            found = find_unplain(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple, set, frozenset):
        for index, item in enumerate(value):
            found = find_unplain(item, f"{where}[{index}]")
            if found:
                return found
        return None
    return f"{where} is {with_article(f'{type(value).__module__}.{type(value).__qualname__}')}"


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
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            if self.error is None:
                self.error = error
            raise

    def flush(self) -> None:
        self._handle.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _write_error(path: str, error: BaseException, doing: str) -> CheckpointWriteError:
    cause = describe_os_error(error) if isinstance(error, OSError) else (
        f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
    failure = CheckpointWriteError(
        f"Cannot write the checkpoint {path}: {doing} failed: {cause}. Nothing was written "
        "under that name; the earlier checkpoint files are intact and no temporary file is "
        "left. Fix the cause (free space, permissions, the directory) and run again; "
        "Checkpoint(..., resume=True) continues from the newest file.")
    failure.errno = getattr(error, "errno", None)
    return failure


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
    directory = os.path.dirname(path) or "."
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX,
                                                 dir=directory)
    except OSError as error:
        raise _write_error(path, error, f"creating a temporary file in {directory}") from error
    doing = "writing"
    writer: _RecordingWriter | None = None
    try:
        with suppress(OSError):  # file systems without modes (some network mounts)
            os.fchmod(descriptor, _file_mode())
        with os.fdopen(descriptor, "wb") as handle:
            writer = _RecordingWriter(handle)
            torch.save(payload, writer)
            doing = "flushing"
            handle.flush()
            doing = "syncing to disk (fsync)"
            os.fsync(handle.fileno())
            doing = "closing"
        doing = f"renaming {os.path.basename(temporary)} to it"
        os.replace(temporary, path)
    except BaseException as error:
        with suppress(OSError):
            os.unlink(temporary)
        recorded = writer.error if writer is not None else None
        if recorded is not None:
            raise _write_error(path, recorded, "writing") from recorded
        if isinstance(error, OSError):
            raise _write_error(path, error, doing) from error
        if isinstance(error, RuntimeError) and "inline_container" in str(error):
            raise _write_error(path, error, "writing") from error
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
    directory = os.path.dirname(path) or "."
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX,
                                                 dir=directory)
    except OSError as error:
        raise _write_error(path, error, f"creating a temporary file in {directory}") from error
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise _write_error(path, error, "writing") from error
        raise
    fsync_directory(directory)


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
    root = os.path.realpath(directory)
    found = []
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            target = os.path.realpath(path)
            if os.path.dirname(target) != root and not target.startswith(root + os.sep):
                warnings.warn(
                    f"Checkpoint: skipping {path}: it is a symbolic link to {target}, outside "
                    f"{directory}; resume=True only reads files inside the checkpoint "
                    "directory. Copy the file in, or pass Checkpoint(resume=path) to resume "
                    "from it on purpose.", RuntimeWarning, stacklevel=2)
                continue
            if not os.path.isfile(target):
                continue
        elif not os.path.isfile(path):
            continue
        found.append(path)
    return found

def link_atomic(source: str, path: str) -> None:
    """Make ``path`` the same complete file as ``source``, atomically (no second write).

    A hard link under a temporary name, renamed over ``path`` with ``os.replace``; where the
    file system has no hard links, a copy written the same atomic way. ``source`` stays.
    """
    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, f"{TEMP_PREFIX}{os.getpid()}-link{TEMP_SUFFIX}")
    with suppress(FileNotFoundError):
        os.unlink(temporary)
    try:
        try:
            os.link(source, temporary)
        except OSError:  # no hard links here (some network and FAT file systems): copy
            with open(source, "rb") as reader, open(temporary, "wb") as writer:
                while chunk := reader.read(1 << 20):
                    writer.write(chunk)
                writer.flush()
                os.fsync(writer.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise _write_error(path, error, f"linking {os.path.basename(source)} to it") from error
        raise
    fsync_directory(directory)


def _default_location(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


_COMPRESSION_NAMES = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
                      zipfile.ZIP_LZMA: "lzma"}


def verify_archive(path: str) -> None:
    """Refuse a damaged checkpoint archive before ``torch.load`` reads it.

    ``torch.save`` writes a zip archive of stored (uncompressed) records, each with a
    CRC-32 of its bytes, but ``torch.load`` never checks those CRCs: a flipped byte in
    tensor data loads silently as a wrong weight. This reads every record once and checks
    its CRC (reading the file a second time: about as long as the load itself, from the
    page cache). A compressed or encrypted record (which ``torch.save`` never writes) is
    refused before anything is inflated, so a small crafted file cannot fill the memory.

    Raises:
        CheckpointError: naming the file, the record and what is wrong.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "x.pt")
        >>> torch.save({"w": torch.ones(3)}, path)
        >>> verify_archive(path)  # intact: returns None
    """
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            for info in records:
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
            for info in records:
                with archive.open(info) as record:
                    while record.read(1 << 22):
                        pass
    except CheckpointError:
        raise
    except zipfile.BadZipFile as error:
        detail = str(error)
        if "CRC" in detail:
            raise CheckpointError(
                f"{path}: the file is damaged: {detail} (the bytes of that record changed "
                "after the file was written: a disk, memory or copy error). Delete it to "
                "resume from an older checkpoint, or copy it again from its source.") from None
        raise CheckpointError(f"{path}: the file is truncated or corrupt ({detail}).") from None
    except (OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as error:
        raise CheckpointError(
            f"{path}: the file is truncated or corrupt ({type(error).__name__}: {error}).") from None


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"of shape {tuple(value.shape)}"
    return f"({text[:60]}{'...' if len(text) > 60 else ''})"


def check_payload(path: str, payload: Mapping[str, Any]) -> None:
    """Check the layout of a loaded hookloop checkpoint; name the first wrong field.

    A well-formed archive can still hold the wrong thing: a format this hookloop does not
    know, a training checkpoint without its optimizer or loop position, fields of the wrong
    type. Each is a `CheckpointError` naming the file and the field, instead of a raw
    KeyError/TypeError deep inside the resume.

    Rules checked here, for the fields this module writes: ``hookloop`` is a dict with an
    int ``format`` (1 up to `FORMAT`) and a ``kind`` of ``"resume"`` or ``"best"``, and
    where present an int ``world_size`` >= 1, ints ``epoch`` and ``step`` >= 0 (also at the
    top level), str ``monitor`` and ``version``, and a number ``value``;
    ``model`` is a mapping of names to tensors; optional ``callbacks`` and ``metrics`` are
    dicts and ``ranks`` a list; a ``"resume"`` file also has ``optimizer`` (with ``state``
    and ``param_groups``). The loop's part (``loop``, each rank's part) is checked by its
    owner, `hookloop.run_state.check_run_fields`.

    Raises:
        CheckpointError: naming ``path`` and the field.

    Example:
        >>> check_payload("x.pt", {"hookloop": {"format": 1, "kind": "best"}, "model": {}})
        >>> check_payload("x.pt", {"hookloop": {"format": 9, "kind": "best"}, "model": {}})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: written by a newer hookloop (format 9; this one reads up to 2); upgrade hookloop to read it.
    """
    meta = payload["hookloop"]
    version = meta.get("format")
    expect_field(path, "hookloop.format", version, _is_int(version), "an int")
    if version > FORMAT:
        raise CheckpointError(
            f"{path}: written by a newer hookloop (format {version}; this one reads up to "
            f"{FORMAT}); upgrade hookloop to read it.")
    if version < 1:
        raise CheckpointError(f"{path}: unknown checkpoint format {version} (valid: 1 to {FORMAT}).")
    kind = meta.get("kind")
    expect_field(path, "hookloop.kind", kind, kind in ("resume", "best"), "'resume' or 'best'")
    for where, holder, field in (("hookloop.epoch", meta, "epoch"), ("hookloop.step", meta, "step"),
                                 ("epoch", payload, "epoch"), ("step", payload, "step")):
        if holder.get(field) is not None:
            value = holder[field]
            expect_field(path, where, value, _is_int(value) and value >= 0, "an int >= 0")
    world = meta.get("world_size")
    if world is not None:
        expect_field(path, "hookloop.world_size", world, _is_int(world) and world >= 1,
                     "an int >= 1")
    for field in ("monitor", "version"):
        if meta.get(field) is not None:
            expect_field(path, f"hookloop.{field}", meta[field], isinstance(meta[field], str),
                         "a str or None")
    if meta.get("value") is not None:
        value = meta["value"]
        expect_field(path, "hookloop.value", value, isinstance(value, (int, float))
                     and not isinstance(value, bool), "a number or None")
    model = payload.get("model")
    expect_field(path, "model", model, isinstance(model, Mapping), "a mapping of weights")
    for name, value in model.items():
        expect_field(path, "model (a key)", name, isinstance(name, str), "a str")
        if not name.endswith("_extra_state"):
            expect_field(path, f"model.{name}", value, isinstance(value, torch.Tensor), "a tensor")
    for field in ("callbacks", "metrics"):
        if field in payload:
            expect_field(path, field, payload[field], isinstance(payload[field], Mapping), "a dict")
    if "ranks" in payload:
        expect_field(path, "ranks", payload["ranks"], isinstance(payload["ranks"], list), "a list")
    if kind != "resume":
        return
    optimizer = payload.get("optimizer")
    if "optimizer" not in payload:
        raise CheckpointError(
            f"{path}: a training checkpoint without its 'optimizer' field; it cannot be "
            "resumed (hookloop.load_checkpoint(path, model) still loads the weights).")
    expect_field(path, "optimizer", optimizer, isinstance(optimizer, Mapping), "a dict")
    for field, kind_of in (("state", Mapping), ("param_groups", list)):
        value = optimizer.get(field)
        expect_field(path, f"optimizer.{field}", value, isinstance(value, kind_of),
                "a dict" if kind_of is Mapping else "a list")
    # The loop's part (position, history, each rank's generators) is the run state's.
    from hookloop.run_state import check_run_fields  # run_state imports this module

    check_run_fields(path, payload)


def read_payload(path: str | os.PathLike[str], map_location: Any) -> dict[str, Any]:
    """Load a hookloop checkpoint safely, or raise `CheckpointError` saying what is wrong.

    The archive's CRCs are checked first (`verify_archive`), then it is loaded with
    ``torch.load(weights_only=True)`` and its layout checked (`check_payload`).
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file.") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({describe_os_error(error)}).") from None
    if size == 0:
        raise CheckpointError(
            f"{path}: the file is empty (0 bytes), not a checkpoint. It was not written by "
            "hookloop, which never leaves a partial file under a final name; delete it.")
    try:
        is_zip = zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        is_zip = False
    if head.startswith(b"PK") and not is_zip:
        raise CheckpointError(
            f"{path}: the file is truncated or corrupt ({size} bytes; its zip archive has no "
            "central directory, so its end is missing). Delete it to resume from an older "
            "checkpoint.")
    if not head.startswith(b"PK") and not head.startswith(b"\x80"):
        raise CheckpointError(
            f"{path}: not a checkpoint (it is not a file written by torch.save; it starts "
            f"with {head!r}).")
    if head.startswith(b"PK"):
        verify_archive(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear error
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "weights_only" in str(error) or "Weights only" in str(error):
            raise CheckpointError(
                f"{path}: holds objects that torch.load(weights_only=True) refuses ({text}), so "
                "it was not written by hookloop. hookloop never falls back to unsafe pickle "
                "loading; if you trust the file, load it yourself with "
                "torch.load(path, weights_only=False).") from None
        raise CheckpointError(f"{path}: the file is corrupt or not a checkpoint "
                              f"({type(error).__name__}: {text}).") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("hookloop"), dict):
        keys = (f"top-level keys: {', '.join(map(str, list(payload)[:8]))}"
                if isinstance(payload, dict)
                else f"it holds {with_article(type(payload).__name__)}")
        raise CheckpointError(
            f"{path}: not a hookloop checkpoint ({keys}; no 'hookloop' entry). Load it with "
            "torch.load, or use a file written by hookloop.callbacks.Checkpoint.")
    if not isinstance(payload.get("model"), Mapping):
        raise CheckpointError(f"{path}: the checkpoint has no model weights ('model' entry).")
    check_payload(path, payload)
    return payload


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def check_weight_dtypes(path: str, model: nn.Module, weights: Mapping[str, Any]) -> None:
    """Refuse saved weights of another kind than the model's; say when floats are converted.

    ``load_state_dict`` copies whatever it is given into the model's tensors, converting
    silently: int64 weights (an edited file) load into a float model as rounded values,
    and a float ``num_batches_tracked`` into an int buffer. A saved tensor whose kind
    (bool, integer, floating-point, complex) differs from the model's entry is refused.

    Another floating-point dtype of the same entry (float64 or bfloat16 saved, a float32
    model; float32 saved into a half model for inference) is converted, as torch does, with
    a `RuntimeWarning` naming the entries: each value keeps its meaning and only its
    precision changes, and loading full-precision weights into a half or bfloat16 model is
    a common, deliberate use. A resumed run with converted weights does not continue bit
    for bit, which the warning says.

    Raises:
        CheckpointError: naming ``path``, the field and both dtypes.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> check_weight_dtypes("x.pt", model, {"weight": torch.ones(1, 2, dtype=torch.int64)})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: the checkpoint's field 'model.weight' holds torch.int64 values, but the model's weight is torch.float32: an integer tensor does not load into a floating-point one without changing what it holds (torch would convert it silently). The file was edited or written for another model; resume from another file.
    """
    entries = model.state_dict()
    converted: list[str] = []
    for name, saved in weights.items():
        ours = entries.get(name)
        if not isinstance(saved, torch.Tensor) or not isinstance(ours, torch.Tensor) \
                or saved.dtype == ours.dtype:
            continue
        theirs, kind = _dtype_kind(saved.dtype), _dtype_kind(ours.dtype)
        if theirs != kind:
            raise CheckpointError(
                f"{path}: the checkpoint's field 'model.{name}' holds {saved.dtype} values, but "
                f"the model's {name} is {ours.dtype}: {with_article(theirs)} tensor does not "
                f"load into {with_article(kind)} one without changing what it holds (torch "
                "would convert it silently). The file was edited or written for another "
                "model; resume from another file.")
        converted.append(f"'model.{name}' ({saved.dtype} into {ours.dtype})")
    if converted:
        more = f" and {len(converted) - 3} more" if len(converted) > 3 else ""
        warnings.warn(
            f"{path}: {len(converted)} weight(s) were saved in another floating-point dtype than "
            f"the model's and are converted to the model's: {', '.join(converted[:3])}{more}. "
            "Values lose precision where the model's dtype is narrower, and a resumed run "
            "does not continue bit for bit; cast the model to the saved dtype first to load "
            "them as they are.", RuntimeWarning, stacklevel=3)


def weight_differences(model: nn.Module, weights: Mapping[str, Any]) -> list[str]:
    """Each tensor where ``weights`` and ``model`` differ, in the model's order, then the
    file's: a shape, a name only one side has.

    Example:
        >>> weight_differences(nn.Linear(3, 8), nn.Linear(3, 4).state_dict())
        ["'weight': saved (4, 3), the model's (8, 3)", "'bias': saved (4,), the model's (8,)"]
    """
    own = model.state_dict()
    found = []
    for name, tensor in own.items():
        saved = weights.get(name)
        if name not in weights:
            found.append(f"{name!r}: in the model, not in the file")
        elif isinstance(saved, torch.Tensor) and isinstance(tensor, torch.Tensor) and \
                saved.shape != tensor.shape:
            found.append(f"{name!r}: saved {tuple(saved.shape)}, the model's {tuple(tensor.shape)}")
    found += [f"{name!r}: in the file, not in the model" for name in weights if name not in own]
    return found


def load_model_weights(path: str, model: nn.Module, weights: Mapping[str, Any], *,
                       strict: bool = True) -> None:
    """``model.load_state_dict(weights)``, refusing another kind of dtype
    (`check_weight_dtypes`) and naming ``path``, the first tensor that differs and the way
    to load anyway when the weights do not fit. ``strict=False`` loads the tensors whose
    names and shapes match, and warns which it left as they were."""
    check_weight_dtypes(path, model, weights)
    if not strict:
        own = model.state_dict()
        fitting = {name: value for name, value in weights.items() if name in own and (
            not isinstance(value, torch.Tensor) or value.shape == own[name].shape)}
        skipped = weight_differences(model, weights)
        model.load_state_dict(fitting, strict=False)
        if skipped:
            warnings.warn(f"{path}: loaded {len(fitting)} of the model's {len(own)} tensors "
                          f"(strict=False); left as they were: {'; '.join(skipped[:5])}"
                          f"{'...' if len(skipped) > 5 else ''}.", RuntimeWarning, stacklevel=3)
        return
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        differences = weight_differences(model, weights)
        if not differences:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise CheckpointError(f"{path}: the weights do not fit the model (wrong "
                                  f"architecture): {' '.join(lines)[:600]}") from None
        others = f" ({len(differences) - 1} more differ)" if len(differences) > 1 else ""
        raise CheckpointError(
            f"{path}: the weights do not fit the model (wrong architecture): the first tensor "
            f"that differs is {differences[0]}{others}. A run resumes only into the model "
            "that saved it: build that model again. To start a new run from these weights "
            "in the changed model (a new Checkpoint dirpath, or resume=False), load what fits "
            "with hookloop.load_checkpoint(path, model, strict=False): it loads the tensors "
            "whose names and shapes match and leaves the others as initialized.") from None


def load_optimizer_state(path: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    try:
        optimizer.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as error:
        raise CheckpointError(
            f"{path}: the optimizer state does not fit this optimizer ({error}). Create the "
            "same optimizer over the same parameters as the run that saved it.") from None


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *,
                    map_location: Any = None, strict: bool = True) -> dict[str, Any]:
    """Load the weights of a hookloop checkpoint into ``model`` (inference, fine-tuning).

    Reads rotating checkpoints and ``best.pt`` alike, with ``torch.load(weights_only=True)``
    (never an unsafe fallback). Tensors go to ``map_location``, by default the device the
    model is on, never the device recorded in the file.

    Args:
        path: The checkpoint file, or a sharded checkpoint directory (``.dcp``).
        model: The module to load into (unwrapped from DDP and compile wrappers), sharded
            by FSDP or not: a file written by ``FSDP(state_dict="full")`` loads into an
            unsharded model for inference, and a directory of shards into either.
        optimizer: Also restore this optimizer (rotating checkpoints only).
        map_location: Where to put the loaded tensors; default: the model's device.
        strict: False loads into a changed model (fine-tuning with another head): the
            tensors whose names and shapes match are loaded, the others keep their values,
            and a ``RuntimeWarning`` names them. A file into an unsharded model only.

    Returns:
        The checkpoint's contents (``metrics``, ``loop`` counters, ``callbacks`` states...).

    Raises:
        CheckpointError: the file is missing, empty, truncated, damaged (a CRC-32 fails),
            not a hookloop checkpoint, or does not fit the model (wrong architecture) or
            the optimizer; a directory's file is missing, added, truncated, flipped or of
            another save (its save id and SHA-256 digests), or its ``.metadata`` holds
            more than DCP's metadata classes (`hookloop.integrity`).

    Example:
        >>> import os, tempfile, torch
        >>> import hookloop
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import Checkpoint
        >>> directory = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1))]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[Checkpoint(directory)])
        >>> _ = loop.fit(1)
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        >>> fresh = torch.nn.Linear(3, 1)
        >>> contents = hookloop.load_checkpoint(os.path.join(directory, "epoch=0000-step=00000001.pt"), fresh)
        >>> torch.equal(fresh.weight, model.weight)
        True
    """
    model = unwrap(model)
    path = os.fspath(path)
    location = _default_location(model) if map_location is None else map_location
    if os.path.isdir(path):
        from hookloop.shard_files import read_directory  # it builds on this module

        payload = read_directory(path, location)
    else:
        payload = read_payload(path, location)
    if optimizer is not None and "optimizer" not in payload:
        raise CheckpointError(
            f"{path}: holds no optimizer state (best.pt keeps only the validated weights); "
            "load a rotating checkpoint to restore the optimizer.")
    if not strict and (payload.get(SHARDS_KEY) is not None or is_distributed_module(model)):
        raise ConfigurationError(
            f"load_checkpoint(strict=False) loads a checkpoint file into an unsharded model; "
            f"{path} is sharded or the model is: load it strictly, or write the run with "
            "FSDP(state_dict='full') and load that file into an unsharded model.")
    load_weights(path, model, optimizer, payload, strict=strict)
    return payload


def load_weights(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 payload: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load the weights (and the optimizer's state) of a checkpoint's ``payload`` into
    ``model``, whatever the pair: a file or a directory of shards, into a sharded (FSDP) or
    an unsharded model.

    A file's full tensors go into a sharded model each rank keeping its shards; a
    directory's shards are read by DCP, re-sharded to this run's ranks (or read whole for
    an unsharded model). A file into an unsharded model is ``load_state_dict``.

    Raises:
        CheckpointError: the weights or the optimizer state do not fit, naming ``path``.
    """
    shards = payload.get(SHARDS_KEY)
    if shards is not None:
        groups = payload["optimizer"].get("param_groups") if optimizer is not None else None
        shards.load(model, optimizer, groups)
        return
    if not is_distributed_module(model):
        load_model_weights(path, model, payload["model"], strict=strict)
        if optimizer is not None:
            load_optimizer_state(path, optimizer, payload["optimizer"])
        return
    try:
        load_full_model_state(model, payload["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        detail = " ".join(str(error).split())[:600]
        raise CheckpointError(
            f"{path}: the weights do not fit the model (wrong architecture): {detail}") from None
    if optimizer is not None:
        try:
            load_full_optimizer_state(model, optimizer, payload["optimizer"])
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as error:
            raise CheckpointError(
                f"{path}: the optimizer state does not fit this optimizer ({error}). Create "
                "the same optimizer over the same parameters as the run that saved it.") from None


def all_finite(weights: Mapping[str, Any], *, agree: bool = False) -> bool:
    """True when every floating tensor of ``weights`` is finite.

    Shards (FSDP's DTensors) are checked on this rank and the answer is agreed by every
    rank, as it is with ``agree`` (a collective then: every rank must call it; rank 0 may
    hold the gathered weights while the others hold none).

    Example:
        >>> all_finite({"w": torch.tensor([1.0, float("nan")])})
        False
    """
    tensors = [value for value in weights.values() if isinstance(value, torch.Tensor)]
    checks = [torch.isfinite(value.to_local() if is_sharded_tensor(value) else value).all()
              for value in tensors if value.is_floating_point()]
    finite = bool(torch.stack([check.cpu() for check in checks]).all()) if checks else True
    if agree or any(is_sharded_tensor(value) for value in tensors):
        finite = not distributed.any_true(not finite)
    return finite
