"""The run file's envelope: its version, its top-level keys and its own record (the
``hookloop`` entry), reading and writing the container, and the one message form for a
field of the wrong type.

A checkpoint is one ``.pt`` file (``torch.save`` of a dict) or a directory of shards whose
``hookloop.pt`` holds the same dict less the sharded tensors (`hookloop.runfile.shard_files`). The
dict, as `Loop.state_dict` and `Checkpoint` write it::

    hookloop      the file's record of itself: format, kind ("resume"/"best"), version,
                  world_size, epoch, step; a best file's monitor and value; a directory's
                  save_id and files (`hookloop.runfile.integrity`)
    model         the weights: names to tensors       } `hookloop.runfile.weights.Weights`
    optimizer     torch's optimizer state              }
    loop          the position and the run: each part of the run writes its own keys here
                  (`hookloop.engine.position_part`, `hookloop.engine.state`,
                  `hookloop.engine.run_end`, `hookloop.runfile.weights`)
    ranks         each rank's own part (`hookloop.engine.position_part.RankPart`)
    callbacks     each stateful callback's state by its state key
    state         the objects of ``Loop(state=...)`` by name; state_classes their classes
                  (`hookloop.engine.stateful`)
    metrics       the metrics at the save; epoch and step (a best file's, at the top)

The keys of this envelope are constants here (`KEYS`); each part's keys are constants of
the module of the part that writes, checks and reads them (its ``KEYS``). `FORMAT` is the
layout's version. A part's check of a file's fields is registered with `register_check`
(`read_payload` runs them on a resume file).
"""

from __future__ import annotations

import os
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookloop import distributed
from hookloop.base.os_errors import describe_os_error
from hookloop.errors import CheckpointError, expect_field, expect_int, is_int, with_article
from hookloop.runfile.storage import verify_archive

__all__ = ["FORMAT", "KEYS", "SHARED_WORDS", "SHARDS", "check_payload", "expect_field",
           "expect_int", "file_meta", "find_unplain", "read_payload",
           "register_check", "resume_payload", "best_payload", "best_score", "check_resumable",
           "saved_at"]

#: Version of the file layout written by `Checkpoint` (1 is read too).
FORMAT = 2

# The top level.
META, MODEL, OPTIMIZER, LOOP = "hookloop", "model", "optimizer", "loop"
CALLBACKS, STATE, METRICS = "callbacks", "state", "metrics"
EPOCH, STEP = "epoch", "step"
#: The key under which a payload read from a sharded directory carries the object that
#: reads its tensors (`hookloop.runfile.shard_files.Shards`); never written to a file.
SHARDS = "shards"
# ``hookloop``: the file's record of itself.
FORMAT_FIELD, KIND, VERSION, WORLD_SIZE = "format", "kind", "version", "world_size"
MONITOR, VALUE = "monitor", "value"
RESUME, BEST = "resume", "best"  # the kinds
# ``optimizer``: torch's layout, whose two fields the envelope checks.
PARAM_GROUPS, PARAMS = "param_groups", "params"

#: The envelope's key strings (the kinds are values, not keys).
KEYS = (META, MODEL, OPTIMIZER, LOOP, CALLBACKS, STATE, METRICS, EPOCH, STEP, SHARDS,
        FORMAT_FIELD, KIND, VERSION, WORLD_SIZE, MONITOR, VALUE, PARAM_GROUPS, PARAMS)
#: The keys that are also ordinary words with another meaning outside the run file (a
#: device type, a module's name, a log column, a message's word): a module that uses one
#: of them for that other meaning does not name the format.
SHARED_WORDS = frozenset((META, MODEL, OPTIMIZER, STATE, EPOCH, STEP, METRICS, KIND, VERSION,
                          WORLD_SIZE, VALUE, PARAM_GROUPS, PARAMS, CALLBACKS, MONITOR))

#: The parts' checks of a resume file's fields, ``check(path, payload)``: each part
#: registers its own (`register_check`) when its module is imported.
_CHECKS: list[Callable[[str, Mapping[str, Any]], None]] = []


def register_check(check: Callable[[str, Mapping[str, Any]], None]) -> None:
    """Have `read_payload` run ``check(path, payload)`` on every resume file it reads."""
    if check not in _CHECKS:
        _CHECKS.append(check)


# --------------------------------------------------------------------------- writing
def file_meta(kind: str) -> dict[str, Any]:
    """The ``hookloop`` entry of a file: version, `FORMAT`, ``kind`` and the world size.

    Example:
        >>> sorted(file_meta("best"))
        ['format', 'kind', 'version', 'world_size']
    """
    package = sys.modules.get(META)  # imported by now: this module is below it
    return {VERSION: getattr(package, "__version__", None), FORMAT_FIELD: FORMAT, KIND: kind,
            WORLD_SIZE: distributed.world_size()}


def resume_payload(run: Mapping[str, Any], epoch: int, step: int,
                   metrics: Mapping[str, float]) -> dict[str, Any]:
    """A rotating file's payload: ``run`` (`Loop.state_dict`) with its record and metrics."""
    return {META: {**file_meta(RESUME), EPOCH: epoch, STEP: step}, **run,
            METRICS: dict(metrics)}


def best_payload(weights: Mapping[str, Any], monitor: str | None, value: float, epoch: int,
                 step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """A best file's payload: validated ``weights`` scoring ``value`` for ``monitor``."""
    return {META: {**file_meta(BEST), MONITOR: monitor, VALUE: value}, MODEL: weights,
            EPOCH: epoch, STEP: step, METRICS: dict(metrics)}


# --------------------------------------------------------------------- the record
def saved_at(payload: Mapping[str, Any]) -> tuple[int, int]:
    """``(epoch, step)`` a read file records (-1 where it does not): a resume file's in its
    record, a best file's at the top."""
    meta = payload[META]
    holder = meta if meta.get(KIND) == RESUME else payload
    return int(holder.get(EPOCH, -1)), int(holder.get(STEP, -1))


def best_score(payload: Mapping[str, Any], monitor: str | None) -> float | None:
    """The value a best file records for ``monitor``; None: it records none (another monitor)."""
    meta = payload[META]
    if meta.get(MONITOR) != monitor or meta.get(VALUE) is None:
        return None
    return float(meta[VALUE])


def check_resumable(path: str, payload: Mapping[str, Any]) -> None:
    """A read file is a training state of this format (`FORMAT`), or a `CheckpointError`
    saying what it is and what to do instead."""
    meta = payload[META]
    if meta.get(KIND) != RESUME or LOOP not in payload:
        raise CheckpointError(
            f"{path}: holds only validated weights (a best.pt file), not a training state; "
            "resume from a rotating checkpoint (epoch=...-step=....pt), or load the weights "
            "with hookloop.load_checkpoint(path, model).")
    if int(meta.get(FORMAT_FIELD, 0)) != FORMAT:
        newer = int(meta.get(FORMAT_FIELD, 0)) > FORMAT
        raise CheckpointError(
            f"{path}: written by {'a newer' if newer else 'an older'} hookloop "
            f"({meta.get(VERSION)}, file format {meta.get(FORMAT_FIELD)}; this one reads "
            f"format {FORMAT}). {'Upgrade hookloop' if newer else 'Use that hookloop version'} "
            "to resume from it, or load its weights with hookloop.load_checkpoint.")


# -------------------------------------------------------------------------- checking
_PRIMITIVES = (int, float, bool, str, bytes, complex, type(None))
_LEAVES = (torch.dtype, torch.device, torch.Size)


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_meta(path: str, payload: Mapping[str, Any]) -> str:
    """``hookloop`` (and the top-level epoch and step); returns the file's kind."""
    meta = payload[META]
    version = meta.get(FORMAT_FIELD)
    expect_field(path, f"{META}.{FORMAT_FIELD}", version, is_int(version), "an int")
    if version > FORMAT:
        raise CheckpointError(
            f"{path}: written by a newer hookloop (format {version}; this one reads up to "
            f"{FORMAT}); upgrade hookloop to read it.")
    if version < 1:
        raise CheckpointError(
            f"{path}: unknown checkpoint format {version} (valid: 1 to {FORMAT}).")
    kind = meta.get(KIND)
    expect_field(path, f"{META}.{KIND}", kind, kind in (RESUME, BEST), f"{RESUME!r} or {BEST!r}")
    for where, holder, field in ((f"{META}.{EPOCH}", meta, EPOCH), (f"{META}.{STEP}", meta, STEP),
                                 (EPOCH, payload, EPOCH), (STEP, payload, STEP)):
        if holder.get(field) is not None:
            expect_int(path, where, holder[field])
    if meta.get(WORLD_SIZE) is not None:
        expect_int(path, f"{META}.{WORLD_SIZE}", meta[WORLD_SIZE], 1)
    for field in (MONITOR, VERSION):
        if meta.get(field) is not None:
            expect_field(path, f"{META}.{field}", meta[field], isinstance(meta[field], str),
                         "a str or None")
    if meta.get(VALUE) is not None:
        expect_field(path, f"{META}.{VALUE}", meta[VALUE], _is_number(meta[VALUE]),
                     "a number or None")
    return kind


def _check_parts(path: str, payload: Mapping[str, Any]) -> None:
    """``model`` (names to tensors), ``callbacks`` and ``metrics``."""
    model: Any = payload.get(MODEL)
    expect_field(path, MODEL, model, isinstance(model, Mapping), "a mapping of weights")
    for name, value in model.items():
        expect_field(path, f"{MODEL} (a key)", name, isinstance(name, str), "a str")
        if not name.endswith("_extra_state"):
            expect_field(path, f"{MODEL}.{name}", value, isinstance(value, torch.Tensor),
                         "a tensor")
    for field in (CALLBACKS, METRICS):
        if field in payload:
            expect_field(path, field, payload[field], isinstance(payload[field], Mapping), "a dict")


def check_payload(path: str, payload: Mapping[str, Any]) -> None:
    """Check the layout of a loaded hookloop checkpoint; name the first wrong field.

    A well-formed archive can still hold the wrong thing: a format this hookloop does not
    know, a training checkpoint without its optimizer or loop position, fields of the wrong
    type. Each is a `CheckpointError` naming the file and the field, instead of a raw
    KeyError/TypeError deep inside the resume.

    Rules: ``hookloop`` is a dict with an int ``format`` (1 up to `FORMAT`) and a ``kind``
    of ``"resume"`` or ``"best"``, and where present an int ``world_size`` >= 1, ints
    ``epoch`` and ``step`` >= 0 (also at the top level), str ``monitor`` and ``version``,
    and a number ``value``; ``model`` is a mapping of names to tensors; optional
    ``callbacks`` and ``metrics`` are dicts; a ``"resume"`` file also
    has ``optimizer`` (with ``state`` and ``param_groups``) and the parts' fields (each
    part's check, `register_check`).

    Raises:
        CheckpointError: naming ``path`` and the field.

    Example:
        >>> check_payload("x.pt", {"hookloop": {"format": 1, "kind": "best"}, "model": {}})
        >>> check_payload("x.pt", {"hookloop": {"format": 9, "kind": "best"}, "model": {}})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: written by a newer hookloop (format 9; this one reads up to 2); upgrade hookloop to read it.
    """
    kind = _check_meta(path, payload)
    _check_parts(path, payload)
    if kind != RESUME:
        return
    if OPTIMIZER not in payload:
        raise CheckpointError(
            f"{path}: a training checkpoint without its {OPTIMIZER!r} field; it cannot be "
            "resumed (hookloop.load_checkpoint(path, model) still loads the weights).")
    optimizer = payload[OPTIMIZER]
    expect_field(path, OPTIMIZER, optimizer, isinstance(optimizer, Mapping), "a dict")
    for field, kind_of in ((STATE, Mapping), (PARAM_GROUPS, list)):
        value = optimizer.get(field)
        expect_field(path, f"{OPTIMIZER}.{field}", value, isinstance(value, kind_of),
                     "a dict" if kind_of is Mapping else "a list")
    if LOOP not in payload:
        raise CheckpointError(
            f"{path}: a training checkpoint without its {LOOP!r} field (the position to "
            "resume from); it cannot be resumed.")
    expect_field(path, LOOP, payload[LOOP], isinstance(payload[LOOP], Mapping), "a dict")
    for check in _CHECKS:
        check(path, payload)


# --------------------------------------------------------------------------- reading
def _check_container(path: str) -> bool:
    """The file is there, not empty, and a whole ``torch.save`` archive (its CRCs checked
    by `hookloop.runfile.storage.verify_archive`: True where ``torch.load`` may map it, on
    POSIX), or a legacy pickle (False)."""
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
    return head.startswith(b"PK") and os.name == "posix"  # (Windows cannot unlink a mapped file)


def _load(path: str, map_location: Any, *, mapped: bool = False) -> Any:
    try:
        # mapped: the archive's pages, which verify_archive has just read, are mapped, not
        # read again.
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mapped)
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


def read_payload(path: str | os.PathLike[str], map_location: Any) -> dict[str, Any]:
    """Load a hookloop checkpoint file safely, or raise `CheckpointError` saying what is
    wrong.

    The archive's CRCs are checked first (`hookloop.runfile.storage.verify_archive`, the one
    read of the file), then it is loaded with ``torch.load(weights_only=True, mmap=True)``
    from the same pages (on POSIX: tensors loaded to the CPU stay backed by the file's
    pages, copied on write) and its layout checked (`check_payload`).
    """
    path = os.fspath(path)
    payload = _load(path, map_location, mapped=_check_container(path))
    if not isinstance(payload, dict) or not isinstance(payload.get(META), dict):
        keys = (f"top-level keys: {', '.join(map(str, list(payload)[:8]))}"
                if isinstance(payload, dict)
                else f"it holds {with_article(type(payload).__name__)}")
        raise CheckpointError(
            f"{path}: not a hookloop checkpoint ({keys}; no {META!r} entry). Load it with "
            "torch.load, or use a file written by hookloop.callbacks.Checkpoint.")
    if not isinstance(payload.get(MODEL), Mapping):
        raise CheckpointError(f"{path}: the checkpoint has no model weights ({MODEL!r} entry).")
    check_payload(path, payload)
    return payload
