"""Checkpoint files: atomic writes, validated reads, and `load_checkpoint`.

`Checkpoint` decides when to save and what to keep; this module does the file work.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import torch
from torch import nn

from hookloop.errors import CheckpointError
from hookloop.modules import unwrap

__all__ = ["FORMAT", "TEMP_PREFIX", "TEMP_SUFFIX", "is_temporary", "find_unplain", "write_atomic",
           "link_atomic",
           "read_payload", "load_model_weights", "load_optimizer_state", "load_checkpoint",
           "all_finite"]

#: Version of the file layout written by `Checkpoint`.
FORMAT = 2
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".part"
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
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
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


def write_atomic(payload: Mapping[str, Any], path: str) -> None:
    """Write to a temporary file in the same directory, flush, fsync, then ``os.replace``.

    Whatever interrupts the write (an exception, a second Ctrl-C, SIGKILL) leaves the final
    name untouched: at worst a ``.tmp-*.part`` file, which is never taken for a checkpoint.
    """
    directory = os.path.dirname(path) or "."
    descriptor, temporary = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX,
                                             dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


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
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _default_location(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def read_payload(path: str | os.PathLike[str], map_location: Any) -> dict[str, Any]:
    """Load a hookloop checkpoint safely, or raise `CheckpointError` saying what is wrong."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file.") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error}).") from None
    if size == 0:
        raise CheckpointError(
            f"{path}: the file is empty (0 bytes), not a checkpoint. It was not written by "
            "hookloop, which never leaves a partial file under a final name; delete it.")
    if head.startswith(b"PK") and not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: the file is truncated or corrupt ({size} bytes; its zip archive has no "
            "central directory, so its end is missing). Delete it to resume from an older "
            "checkpoint.")
    if not head.startswith(b"PK") and not head.startswith(b"\x80"):
        raise CheckpointError(
            f"{path}: not a checkpoint (it is not a file written by torch.save; it starts "
            f"with {head!r}).")
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
                if isinstance(payload, dict) else f"it holds a {type(payload).__name__}")
        raise CheckpointError(
            f"{path}: not a hookloop checkpoint ({keys}; no 'hookloop' entry). Load it with "
            "torch.load, or use a file written by hookloop.callbacks.Checkpoint.")
    if not isinstance(payload.get("model"), Mapping):
        raise CheckpointError(f"{path}: the checkpoint has no model weights ('model' entry).")
    return payload


def load_model_weights(path: str, model: nn.Module, weights: Mapping[str, Any]) -> None:
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = " ".join(lines)[:600]
        raise CheckpointError(
            f"{path}: the weights do not fit the model (wrong architecture): {detail}") from None


def load_optimizer_state(path: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    try:
        optimizer.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as error:
        raise CheckpointError(
            f"{path}: the optimizer state does not fit this optimizer ({error}). Create the "
            "same optimizer over the same parameters as the run that saved it.") from None


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *,
                    map_location: Any = None) -> dict[str, Any]:
    """Load the weights of a hookloop checkpoint into ``model`` (inference, fine-tuning).

    Reads rotating checkpoints and ``best.pt`` alike, with ``torch.load(weights_only=True)``
    (never an unsafe fallback). Tensors go to ``map_location``, by default the device the
    model is on, never the device recorded in the file.

    Args:
        path: The checkpoint file.
        model: The module to load into; unwrap DDP/compile wrappers or pass the module.
        optimizer: Also restore this optimizer (rotating checkpoints only).
        map_location: Where to put the loaded tensors; default: the model's device.

    Returns:
        The checkpoint's contents (``metrics``, ``loop`` counters, ``callbacks`` states...).

    Raises:
        CheckpointError: the file is missing, empty, truncated, not a hookloop checkpoint,
            or does not fit the model (wrong architecture) or the optimizer.

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
        >>> fresh = torch.nn.Linear(3, 1)
        >>> contents = hookloop.load_checkpoint(os.path.join(directory, "epoch=0000-step=00000001.pt"), fresh)
        >>> torch.equal(fresh.weight, model.weight)
        True
    """
    model = unwrap(model)
    path = os.fspath(path)
    location = _default_location(model) if map_location is None else map_location
    payload = read_payload(path, location)
    load_model_weights(path, model, payload["model"])
    if optimizer is not None:
        if "optimizer" not in payload:
            raise CheckpointError(
                f"{path}: holds no optimizer state (best.pt keeps only the validated weights); "
                "load a rotating checkpoint to restore the optimizer.")
        load_optimizer_state(path, optimizer, payload["optimizer"])
    return payload


def all_finite(weights: Mapping[str, Any]) -> bool:
    checks = [torch.isfinite(value).all() for value in weights.values()
              if isinstance(value, torch.Tensor) and value.is_floating_point()]
    return bool(torch.stack([check.cpu() for check in checks]).all()) if checks else True
