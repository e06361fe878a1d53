"""Checkpoint directories of shards (``torch.distributed.checkpoint``, DCP): written by every
rank together, atomically; read back on any number of ranks; removed, linked and replaced
so that a checkpoint directory is always complete or absent.

A sharded checkpoint is a directory (``epoch=0001-step=00000040.dcp``) holding DCP's
files (``.metadata`` and one ``__R_0.distcp`` per rank) and ``hookloop.pt``: a
`hookloop.runfile.storage` file with everything that is not a shard (the file's own record, the
loop's position, every rank's generators, the callbacks' plain state, the optimizer's
hyper-parameters). Every tensor of the model and of the optimizer's state goes to DCP,
and so does every DTensor of a callback's state (an EMA over shards); in ``hookloop.pt``
such a tensor is a small marker naming it.

The directory is written under a temporary name (``.tmp-*.part``, never taken for a
checkpoint) and renamed by rank 0 once DCP wrote every rank's shards and its metadata and
rank 0 wrote ``hookloop.pt``: a kill at any point leaves the earlier checkpoints as they
were and at worst a temporary directory, which the next start deletes.

``hookloop.pt`` records the save's id (also in ``.metadata``) and the size and XXH3-128 of
every other file (each rank digests the shards it writes as DCP writes them, in one pass:
`hookloop.runfile.digests`); `read_directory` checks them
before DCP reads a byte, and DCP reads through `hookloop.runfile.integrity`'s reader, which admits
only DCP's metadata classes (see that module). A final-named directory that is not
complete was damaged: it is listed, and reading it is a `CheckpointError` naming it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import torch
from torch import nn

from hookloop import distributed
from hookloop.errors import CheckpointError, CheckpointWriteError
from hookloop.runfile import integrity
from hookloop.runfile.sharded import contains_shards, is_sharded_tensor, load_sharded_state, \
    sharded_targets
from hookloop.runfile.format import (META, MODEL, OPTIMIZER, PARAM_GROUPS, SHARDS,
                                     STATE, find_unplain, read_payload)
from hookloop.runfile.storage import TEMP_PREFIX, TEMP_SUFFIX, fsync_directory, remove_entry, \
    write_atomic

__all__ = ["PLAIN_FILE", "Shards", "clean_temporary", "contains_shards",
           "install_directory", "is_complete", "link_directory", "read_directory",
           "remove_entry", "split_shards", "write_directory"]

#: The file of a sharded checkpoint directory that holds everything but the shards.
PLAIN_FILE = "hookloop.pt"
_METADATA = ".metadata"
#: In ``hookloop.pt`` of a directory, what stands for a tensor kept in the shards.
SHARD_MARK = _MARK = "__hookloop_shard__"
KEYS = (SHARD_MARK,)
SHARED_WORDS: frozenset[str] = frozenset()
_REPLACED = "replaced-"


def is_complete(path: str) -> bool:
    """True for a directory holding DCP's ``.metadata`` and ``hookloop.pt``: a complete
    sharded checkpoint (a save renames it there only once both are written).

    Example:
        >>> import tempfile
        >>> is_complete(tempfile.mkdtemp())
        False
    """
    return (os.path.isfile(os.path.join(path, _METADATA))
            and os.path.isfile(os.path.join(path, PLAIN_FILE)))


def _marked(value: Any, key: str, path: str, moved: dict[str, Any]) -> Any:
    """``value`` with each DTensor moved into ``moved[path]``, a marker naming
    ``key.path`` (its DCP key) in its place."""
    if is_sharded_tensor(value):
        moved[path] = value
        return {_MARK: f"{key}.{path}"}
    if isinstance(value, Mapping):
        return {name: _marked(item, key, f"{path}/{name}" if path else str(name), moved)
                for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_marked(item, key, f"{path}/{index}" if path else str(index), moved)
                           for index, item in enumerate(value))
    return value


def split_shards(payload: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(plain, tensors)``: what goes to ``hookloop.pt`` and what goes to DCP.

    The model's entries and the optimizer's state go to DCP whole (keyed by parameter
    name, so DCP can re-shard them); the optimizer's param groups stay in ``plain``. Every
    other DTensor (in a callback's state, an EMA over shards) goes to DCP, a marker in its
    place in ``plain``.

    Example:
        >>> plain, tensors = split_shards({"model": {"w": torch.ones(1)}, "epoch": 2})
        >>> plain, list(tensors["model"])
        ({'model': {}, 'epoch': 2}, ['w'])
    """
    plain: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for key, value in payload.items():
        if key == MODEL:
            tensors[MODEL], plain[MODEL] = dict(value), {}
        elif key == OPTIMIZER and isinstance(value, Mapping):
            tensors[OPTIMIZER] = {STATE: dict(value.get(STATE, {}))}
            plain[OPTIMIZER] = {STATE: {}, PARAM_GROUPS: list(value.get(PARAM_GROUPS, []))}
        else:
            moved: dict[str, Any] = {}
            plain[key] = _marked(value, str(key), "", moved)
            if moved:
                tensors[str(key)] = moved
    return plain, tensors


_failed = integrity.write_error


def _gathered_record(own: dict[str, dict[str, Any]], group: Any) -> dict[str, dict[str, Any]]:
    """Every rank's record of the files it wrote (`hookloop.runfile.integrity.writer_record`:
    digested as DCP wrote them), merged on every rank."""
    import torch.distributed as dist

    parts: list[Any] = [own]
    if distributed.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, own, group=group)
    return {name: entry for part in parts for name, entry in part.items()}


def install_directory(temporary: str, path: str) -> None:
    """Rename the complete directory ``temporary`` to ``path``, replacing one there.

    A directory cannot be renamed over another, so one already at ``path`` is first moved
    to ``.tmp-replaced-<name>.part``; a kill between the two renames leaves that name,
    and `clean_temporary` moves it back at the next start (the replacement never began).
    """
    directory = os.path.dirname(path) or "."
    if os.path.lexists(path):
        aside = os.path.join(directory, f"{TEMP_PREFIX}{_REPLACED}{os.path.basename(path)}"
                                        f"{TEMP_SUFFIX}")
        if os.path.lexists(aside):
            remove_entry(aside)
        os.replace(path, aside)
        os.replace(temporary, path)
        fsync_directory(directory)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(temporary, path)
    fsync_directory(directory)


def clean_temporary(dirpath: str, name: str) -> None:
    """At a start: delete the temporary file or directory ``name`` a killed save left, or
    put back a checkpoint a kill left set aside in the middle of `install_directory`."""
    path = os.path.join(dirpath, name)
    original = name[len(TEMP_PREFIX):-len(TEMP_SUFFIX)]
    if original.startswith(_REPLACED):
        target = os.path.join(dirpath, original[len(_REPLACED):])
        if not os.path.lexists(target) and is_complete(path):
            os.replace(path, target)
            return
    with suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def write_directory(payload: Mapping[str, Any], path: str, *, group: Any = None) -> None:
    """Write ``payload`` (a state holding DTensors) as the sharded checkpoint ``path``.

    A collective: every rank calls it and writes its own shards into one temporary
    directory (on a file system every rank reaches); rank 0 then writes ``hookloop.pt``
    and renames the directory to ``path``. Every rank returns once the directory is in
    place, or raises if any part failed. ``group``: the process group of its collectives
    (a gloo group of its own for a write in the background); None: the default one.

    Raises:
        CheckpointError: the plain part holds what ``torch.load(weights_only=True)`` refuses.
        CheckpointWriteError: the file system failed, on any rank (named, with its cause).
    """
    import torch.distributed.checkpoint as dcp

    plain, tensors = split_shards(payload)
    problem = find_unplain(plain, "checkpoint")
    if problem:
        raise CheckpointError(
            f"Cannot write a checkpoint that torch.load(weights_only=True) can read: "
            f"{problem}. State must hold only tensors, numbers, strings and "
            "lists/tuples/dicts of them; convert that value in the state_dict that returns it.")
    directory = os.path.dirname(path) or "."
    main = distributed.is_main()
    temporary: str = distributed.broadcast_object(  # rank 0's name, on every rank
        os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}{TEMP_SUFFIX}") if main else "",
        group=group)
    save_id = integrity.new_save_id()
    storage_writer = integrity.writer(temporary, save_id)
    try:
        # DCP gathers every rank's outcome: a failure on one rank raises on all of them (a
        # CheckpointException, a BaseException: caught here, Ctrl-C and exit excepted).
        dcp.save(tensors, storage_writer=storage_writer, process_group=group)
    except BaseException as error:
        integrity.writer_record(storage_writer)  # its helper thread stops
        if main:
            shutil.rmtree(temporary, ignore_errors=True)
        stop = integrity.control_flow(error)
        if stop is not None:
            raise stop from None
        raise _failed(path, error, "writing the shards (torch.distributed.checkpoint.save)"
                      ) from None
    # Each rank digested its own shards as DCP wrote them.
    record = _gathered_record(integrity.writer_record(storage_writer), group)
    failure: Exception | None = None
    if main:
        plain[META] = {**plain.get(META, {}), integrity.SAVE_ID_KEY: save_id,
                             integrity.FILES_KEY: record}
        try:
            write_atomic(plain, os.path.join(temporary, PLAIN_FILE))
            install_directory(temporary, path)
        except Exception as error:
            shutil.rmtree(temporary, ignore_errors=True)
            failure = error
    # Every rank learns whether the directory is in place, so none goes on believing it is.
    said = distributed.broadcast_object(None if failure is None else str(failure), group=group)
    if failure is not None:
        if isinstance(failure, (CheckpointError, CheckpointWriteError)):
            raise failure
        raise _failed(path, failure, "writing hookloop.pt and renaming the directory"
                      ) from failure
    if said is not None:
        raise CheckpointWriteError(f"Rank 0 could not finish the sharded checkpoint {path}: "
                                   f"{said}")


def link_directory(source: str, path: str) -> None:
    """Make ``path`` a complete copy of the sharded checkpoint ``source``, atomically: its
    files hard-linked (copied where the file system has no hard links) into a temporary
    directory, which `install_directory` puts in place. ``source`` stays."""
    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}{TEMP_SUFFIX}")

    def link_or_copy(origin: str, target: str) -> None:
        try:
            os.link(origin, target)
        except OSError:
            shutil.copy2(origin, target)

    try:
        shutil.copytree(source, temporary, copy_function=link_or_copy)
        install_directory(temporary, path)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, OSError):
            raise _failed(path, error, f"linking {os.path.basename(source)} to it") from error
        raise


class Shards:
    """The tensors of a complete sharded checkpoint directory, read when the run is restored.

    Reading is a collective under a process group (every rank calls it with the same
    keys); DCP re-shards what it reads to the current ranks, so a directory written by N
    ranks loads on M.

    Args:
        path: The directory.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"Shards({self.path!r})"

    def read_into(self, targets: dict[str, Any]) -> None:
        """Fill ``targets`` (tensors and DTensors, in place) from the directory.

        Raises:
            CheckpointError: the directory lacks an entry or cannot be read.
        """
        import torch.distributed.checkpoint as dcp

        try:
            dcp.load(targets, storage_reader=integrity.verified_reader(self.path),
                     planner=integrity.safe_planner())
        except BaseException as error:  # torch's CheckpointException is one
            stop = integrity.control_flow(error)
            if stop is not None:
                raise stop from None
            raise integrity.read_error(self.path, error) from None

    def resolve(self, value: Any) -> Any:
        """``value`` (the plain part) with each marker replaced by the whole tensor it
        names, read from the directory (a callback places it as it needs: an EMA cuts its
        shard of it)."""
        marks: list[str] = []
        self._find(value, marks)
        if not marks:
            return value
        entries = integrity.read_metadata(self.path).state_dict_metadata
        wholes: dict[str, torch.Tensor] = {}
        targets: dict[str, dict[str, torch.Tensor]] = {}
        for mark in marks:
            entry = entries.get(mark)
            if entry is None or not hasattr(entry, "size"):
                raise CheckpointError(f"{self.path}: the shards of {mark} are missing; the "
                                      "directory was edited or damaged.")
            wholes[mark] = torch.empty(entry.size, dtype=entry.properties.dtype)
            key, _, path = mark.partition(".")
            targets.setdefault(key, {})[path] = wholes[mark]
        self.read_into(targets)
        return self._replaced(value, wholes)

    def _find(self, value: Any, marks: list[str]) -> None:
        if isinstance(value, Mapping):
            if set(value) == {_MARK}:
                marks.append(str(value[_MARK]))
                return
            for item in value.values():
                self._find(item, marks)
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._find(item, marks)

    def _replaced(self, value: Any, wholes: Mapping[str, torch.Tensor]) -> Any:
        if isinstance(value, Mapping):
            if set(value) == {_MARK}:
                return wholes[str(value[_MARK])]
            return {key: self._replaced(item, wholes) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._replaced(item, wholes) for item in value)
        return value

    def load(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             param_groups: list[Any] | None) -> None:
        """Read the model (and the optimizer, with its saved ``param_groups``) into
        ``module``, sharded or not, and ``optimizer``."""
        targets = sharded_targets(module, optimizer)
        self.read_into(targets)
        try:
            load_sharded_state(module, optimizer, targets, param_groups)
        except (RuntimeError, KeyError, ValueError, TypeError) as error:
            text = " ".join(str(error).split())[:600]
            raise CheckpointError(f"{self.path}: the sharded checkpoint does not fit this "
                                  f"model or optimizer: {text}") from None


def read_directory(path: str, map_location: Any, *, every_rank: bool = False
                   ) -> dict[str, Any]:
    """The plain part of the sharded checkpoint ``path``, its `Shards` under `SHARDS`.
    ``every_rank``: every rank reads it now, and the files' digests are split among them
    (`hookloop.runfile.integrity.check_files`).

    Raises:
        CheckpointError: the directory is not a complete sharded checkpoint, or its
            ``hookloop.pt`` is damaged.
    """
    integrity.refuse_links(path)  # before any of its files is opened, hookloop.pt too
    if not is_complete(path):
        lacks = [name for name in (_METADATA, PLAIN_FILE)
                 if not os.path.isfile(os.path.join(path, name))]
        raise CheckpointError(
            f"{path}: not a complete sharded checkpoint: it lacks {' and '.join(lacks)} "
            "(hookloop renames a directory to its final name only once complete, so it was "
            "edited or damaged). Resume from another checkpoint.")
    payload = read_payload(os.path.join(path, PLAIN_FILE), map_location)
    meta = payload[META]
    integrity.check_files(path, meta, PLAIN_FILE, every_rank=every_rank)  # before DCP reads
    recorded = integrity.read_metadata(path).storage_meta.save_id
    if recorded != meta[integrity.SAVE_ID_KEY]:
        raise CheckpointError(
            f"{os.path.join(path, _METADATA)}: records save {recorded}, but {PLAIN_FILE} "
            f"records save {meta[integrity.SAVE_ID_KEY]}: the files belong to different "
            "saves. Resume from another checkpoint.")
    payload[SHARDS] = Shards(path)
    return payload

