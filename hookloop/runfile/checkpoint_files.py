"""`CheckpointFiles`: the files one `Checkpoint` keeps in its directory.

`Checkpoint` decides when to save, what to keep and what to resume; this class knows the
names (rotating, scored, best and set-aside files), lists them, writes them atomically
through `hookloop.runfile.storage`, prunes them, holds the directory for one job, and retires the
files a rollback abandons (completely or not at all).

A checkpoint of a model FSDP shards with ``state_dict="sharded"`` is a directory of shards
(`hookloop.runfile.shard_files`) named as a file is, with ``.dcp`` for ``.pt``; every rule here
(rotation, best, top k, set-aside, retirement) holds for such directories too, and a
directory counts only once complete.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from contextlib import suppress
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.runfile.directory_lock import DirectoryLock
from hookloop.runfile.ranking import FILE, new_entry, score
from hookloop.runfile.retirement import RETIRED_PREFIX, Retirement
from hookloop.runfile.format import (best_payload, best_score, check_resumable, file_meta,
                                     find_unplain, read_payload, resume_payload, saved_at)
from hookloop.runfile.shard_files import (clean_temporary, link_directory, read_directory,
                                          write_directory)
from hookloop.runfile.sharded import contains_shards
from hookloop.runfile.storage import (checkpoint_directories, is_temporary, link_atomic,
                                      prepare_directory, regular_checkpoint_files, remove_entry,
                                      write_atomic)

if TYPE_CHECKING:
    from hookloop.runfile.ranking import TopK  # noqa: F811 - the type, beside FILE

# file_meta is run_file's, named here as before.
__all__ = ["CheckpointFiles", "RETIRED_PREFIX", "file_meta", "read_checkpoint"]

_FILE, _DIRECTORY = ".pt", ".dcp"
_SUFFIX = r"\.(?:pt|dcp)"


def read_checkpoint(path: str, map_location: Any, *, every_rank: bool = False) -> dict[str, Any]:
    """A checkpoint file (`hookloop.runfile.format.read_payload`) or directory of shards
    (`hookloop.runfile.shard_files.read_directory`: its tensors are read when the run is
    restored): what a resume, a rollback and the ranking's recovery read. ``every_rank``:
    every rank reads it now (a resume: a directory's digests are split among them)."""
    if os.path.isdir(path):
        return read_directory(path, map_location, every_rank=every_rank)
    return read_payload(path, map_location)


def _entries(dirpath: str, names: list[str]) -> list[str]:
    """The paths of ``names`` that are checkpoints: regular files and directories.

    A directory under a final name counts whether complete or not, as a file does whether
    readable or not: hookloop renames both there only once complete, so one that is not was
    damaged, and reading it says so (one policy for both, docs/when-things-go-wrong.md).
    """
    directories = checkpoint_directories(dirpath, names)
    files = set(regular_checkpoint_files(dirpath, [name for name in names
                                                   if name not in directories]))
    return [path for name in names for path in [os.path.join(dirpath, name)]
            if path in files or name in directories]


def _ranked_by(steps: list[int], reached: int, dropped_at: int) -> bool:
    """Whether a rotating file at one of ``steps`` may rank an entry reached and dropped at
    these steps: one written between them (both included: a file of the drop's step may
    have been written before that step's validation)."""
    return any(reached <= step <= dropped_at for step in steps)


def _suffixed(name: str, suffix: str) -> str:
    """``name`` with ``suffix`` for its own (a file's ``.pt`` or a directory's ``.dcp``)."""
    return os.path.splitext(name)[0] + suffix


def _link(source: str, path: str) -> None:
    """`hookloop.runfile.storage.link_atomic` for a file, `link_directory` for a directory."""
    if os.path.isdir(source):
        link_directory(source, path)
    else:
        link_atomic(source, path)


class CheckpointFiles:
    """Names, listing, atomic writes and pruning of one `Checkpoint`'s files.

    * rotating files: ``{prefix}epoch=EEEE-step=SSSSSSSS.pt``, whole training states;
    * scored files (``save_top_k > 1``): ``{prefix}best-{monitor}={value:.6g}-step=SSSSSSSS.pt``;
    * ``{prefix}best.pt``: the best validated weights;
    * set-aside files ``{prefix}dropped-at-step=DDDDDDDD-best-...-step=SSSSSSSS.pt``: weights
      that dropped out of the top k at step D but that a kept rotating file (at a step
      from S to D) still ranks, so a rollback to it finds them. They are deleted once no
      kept rotating file needs them;
    * ``{prefix}rollback-in-progress.json`` while a rollback moves files (see `retire_after`).

    Each checkpoint may instead be a directory of shards, ``.dcp`` for ``.pt`` (a model FSDP
    shards with ``state_dict="sharded"``). Temporary ``.tmp-*.part`` files and directories
    are never listed; a final-named directory is listed complete or not, as a damaged file
    is, so that reading it refuses it by name (`newest_damaged`). Only rank 0 calls the
    methods that move or delete; every rank calls `write_resume` and `write_best` (rank 0
    writes a file, every rank its shards of a directory).

    Args:
        dirpath: The checkpoint directory.
        prefix: ``""``, or ``"name-"`` for a named `Checkpoint`.
        monitor: The metric in the scored names, or None.

    Example:
        >>> import tempfile, torch
        >>> files = CheckpointFiles(tempfile.mkdtemp(), monitor="val_loss")
        >>> files.prepare()
        >>> files.rotating_name(2, 30), files.scored_name(0.25, 30)
        ('epoch=0002-step=00000030.pt', 'best-val_loss=0.25-step=00000030.pt')
        >>> path = files.write({"model": {"w": torch.ones(1)}}, files.rotating_name(0, 1))
        >>> [os.path.basename(name) for name in files.rotating()]
        ['epoch=0000-step=00000001.pt']
    """

    def __init__(self, dirpath: str, prefix: str = "", monitor: str | None = None) -> None:
        self.dirpath = dirpath
        self.prefix = prefix
        self.monitor = monitor
        self._suffix = _FILE  # of the next file written: .dcp while the payloads hold shards
        start = re.escape(prefix)
        self._rotating = re.compile(rf"^{start}epoch=(\d+)-step=(\d+){_SUFFIX}$")
        self._scored = re.compile(rf"^{start}best-{re.escape(monitor or '')}="
                                  rf"([-+0-9.eEinfa]+)-step=(\d+){_SUFFIX}$")
        self._set_aside = re.compile(rf"^{start}dropped-at-step=(\d+)-(best-"
                                     rf"{re.escape(monitor or '')}=[-+0-9.eEinfa]+-step=(\d+)"
                                     rf"{_SUFFIX})$")
        #: The marker of a rollback under way: what it moves, written before the first move.
        self.marker = self.path(f"{prefix}rollback-in-progress.json")
        self._retirement = Retirement(dirpath, self.marker)
        self._lock = DirectoryLock(dirpath)
        #: Steps of rotating files written after their step's validations (this launch).
        self._after_validation: set[int] = set()
        #: Seconds the last rotating save took, from its start to a complete file (None:
        #: none yet in this fit; `Checkpoint` forgets it at each fit's setup).
        self.last_save: float | None = None

    # ------------------------------------------------------------------ names
    def rotating_name(self, epoch: int, step: int) -> str:
        """Name of the rotating file of ``epoch`` (0-based) and optimizer ``step``."""
        return f"{self.prefix}epoch={epoch:04d}-step={step:08d}{self._suffix}"

    def scored_name(self, value: float, step: int) -> str:
        """Name of a top-k file: ``best-val_acc=0.966667-step=00000046.pt``."""
        return f"{self.prefix}best-{self.monitor}={value:.6g}-step={step:08d}{self._suffix}"

    def set_aside_name(self, entry: dict[str, Any], dropped_at: int) -> str:
        """Name under which a dropped ranking entry waits for a rollback that may need it."""
        scored = self.scored_name(*score(entry))[len(self.prefix):]
        return f"{self.prefix}dropped-at-step={dropped_at:08d}-{scored}"

    @property
    def best_name(self) -> str:
        """The name of ``best.pt`` (with the prefix): ``best.dcp`` when that is the one on
        disk, or when the next checkpoints are directories of shards and none is."""
        for suffix in (self._suffix, _DIRECTORY if self._suffix == _FILE else _FILE):
            if os.path.lexists(self.path(f"{self.prefix}best{suffix}")):
                return f"{self.prefix}best{suffix}"
        return f"{self.prefix}best{self._suffix}"

    @property
    def best(self) -> str:
        """Path of ``best.pt`` (see `best_name`)."""
        return self.path(self.best_name)

    def path(self, name: str) -> str:
        """Path of the file ``name`` in the directory."""
        return os.path.join(self.dirpath, name)

    def step_of(self, path: str) -> int | None:
        """The step in a rotating file's name, or None for another name."""
        match = self._rotating.match(os.path.basename(path))
        return int(match.group(2)) if match else None

    def resumed(self, path: str, epoch: int, batches_done: int, step: int) -> str:
        """Note a resume from ``path`` at this position; return the line it says, with the
        epoch numbered as in the file's name (from 0, as ``loop.state.epoch``):
        ``epoch=0002`` is "epoch 2" there, complete or not, never the next epoch's index.

        A file at an epoch's end was written after that step's validations (see
        `after_epoch_end_save`)."""
        match = self._rotating.match(os.path.basename(path))
        named = int(match.group(1)) if match else None
        if batches_done == 0:
            self._after_validation.add(step)
        if named is not None and batches_done == 0 and epoch == named + 1:
            return f"Checkpoint: resumed from {path} (epoch {named} complete, step {step})."
        return f"Checkpoint: resumed from {path} (epoch {epoch}, step {step})."

    # ---------------------------------------------------------------- listing
    def _names(self) -> list[str]:
        try:
            return os.listdir(self.dirpath)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def rotating(self) -> list[str]:
        """Paths of the rotating files, oldest first (by step, then epoch)."""
        found = []
        for name in self._names():
            match = self._rotating.match(name)
            if match:
                found.append(((int(match.group(2)), int(match.group(1))), name))
        return _entries(self.dirpath, [name for _, name in sorted(found)])

    def resumable(self, callbacks: Iterable[object]) -> str | None:
        """The file ``Checkpoint(resume=True)`` resumes: the newest rotating file; None when
        there is none, or when a callback's setup restored the whole run (its
        ``restored_run`` names the source: `FaultTolerance`'s live peer, whose state is newer
        than any file here; said once)."""
        for callback in callbacks:
            source = getattr(callback, "restored_run", None)
            if isinstance(source, str):
                print(f"Checkpoint: not resuming from {self.dirpath}: this fit continues the "
                      f"run restored from {source}.", flush=True)
                return None
        files = self.rotating()
        return files[-1] if files else None

    def scored(self) -> list[tuple[float, int, str]]:
        """Top-k files as ``(value, step, path)``, oldest first, read from the names only."""
        if self.monitor is None:
            return []
        found = []
        names = self._names()
        complete = set(_entries(self.dirpath, names))
        for name in names:
            match = self._scored.match(name)
            if match and self.path(name) in complete:
                with suppress(ValueError):
                    found.append((float(match.group(1)), int(match.group(2)), self.path(name)))
        return sorted(found, key=lambda item: item[1])

    def set_aside(self) -> list[tuple[int, int, str]]:
        """Set-aside files as ``(step reached, step dropped at, path)``."""
        found = []
        for name in self._names():
            match = self._set_aside.match(name)
            if match:
                found.append((int(match.group(3)), int(match.group(1)), self.path(name)))
        return sorted(found)

    def run_files(self) -> list[str]:
        """Every file of this callback: rotating, scored, set aside, ``best.pt``, a marker."""
        files = (self.rotating() + [path for _, _, path in self.scored()]
                 + [path for _, _, path in self.set_aside()])
        return files + [path for path in (self.best, self.marker) if os.path.exists(path)]

    def best_info(self) -> tuple[float, int, int] | None:
        """``(value, epoch, step)`` that ``best.pt`` holds for this monitor, or None."""
        if not os.path.exists(self.best):
            return None
        payload = read_checkpoint(self.best, "cpu")
        value = best_score(payload, self.monitor)
        return None if value is None else (value, *saved_at(payload))

    def recover(self, entries: list[dict[str, Any]], *, single: bool
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The saved `hookloop.runfile.ranking.TopK` entries whose weights are on disk (a file a
        later drop set aside is put back under its name), and the best files on disk that
        they do not name (written after the state was saved: a kill before the next
        rotating file).

        Args:
            entries: Saved entries, best first.
            single: ``save_top_k=1``: ``best.pt`` is the only file (entries name no file).
        """
        if single:
            top = entries[0] if entries else None
            if top is not None and not os.path.exists(self.best):  # a rollback retired it
                self._put_back(top, self.best_name)
            info = self.best_info()
            if info is None:
                return [], []
            if top is not None and score(top)[1] == info[2]:
                return [top], []
            return entries[:1], [new_entry(*info, None)]
        kept = [entry for entry in entries
                if entry[FILE] is not None and self._put_back(entry, entry[FILE])]
        named = {entry[FILE] for entry in kept}
        # Few files, written after the state: their epoch is read from them, not guessed.
        newer = [new_entry(value, saved_at(read_checkpoint(path, "cpu"))[0], step,
                           os.path.basename(path))
                 for value, step, path in self.scored() if os.path.basename(path) not in named]
        return kept, newer

    def reconcile(self, ranking: TopK, *, single: bool) -> None:
        """Make ``ranking`` agree with the disk: keep its entries whose weights are there and
        rank the best files written after its state was saved (a kill before the next
        rotating file). Every rank calls it: rank 0 reads the directory and tells the others.

        Args:
            ranking: The `Checkpoint`'s ranking of the best validations.
            single: ``save_top_k=1``: ``best.pt`` is the only file.
        """
        found = self.recover(ranking.entries, single=single) if distributed.is_main() else None
        kept, newer = distributed.broadcast_object(found)  # type: ignore[misc]  # rank 0's
        ranking.load_state_dict(kept)
        dropped, top = ranking.merge(newer), ranking.best
        if distributed.is_main():
            self.discard(dropped, ranking.files())
            if top is not None and top[FILE] is not None:
                self.link_best(top[FILE])  # a rollback may have retired a later best.pt

    def _put_back(self, entry: dict[str, Any], name: str) -> bool:
        """True when ``name`` holds ``entry``'s weights, after moving its set-aside file there."""
        if os.path.exists(self.path(name)):
            return True
        wanted = self.scored_name(*score(entry))[len(self.prefix):]
        wanted = wanted[:-len(self._suffix)]  # either kind: a file or a directory of shards
        for _, _, path in self.set_aside():
            if os.path.splitext(path)[0].endswith(f"-{wanted}"):
                os.replace(path, self.path(name))
                return True
        return False

    # ---------------------------------------------------------------- reading
    def read_resume(self, path: str, *, every_rank: bool = False) -> dict[str, Any]:
        """A training state to resume from, checked to be one (not a best file, same format);
        ``every_rank``: every rank reads it now (see `read_checkpoint`).

        Raises:
            CheckpointError: naming the file and what to do instead.
        """
        # Onto the CPU, never the device recorded in the file; the loop copies each tensor
        # to where its model, optimizer or callback lives.
        try:
            payload = read_checkpoint(path, torch.device("cpu"), every_rank=every_rank)
        except CheckpointError as error:
            raise self.newest_damaged(path, error) from None
        check_resumable(path, payload)
        return payload

    def newest_damaged(self, path: str, error: CheckpointError) -> CheckpointError:
        """``error`` (``path`` cannot be read), with the fix when ``path`` is the newest
        rotating checkpoint: it is never skipped silently (a file and a directory alike);
        the message names the older one that resuming would continue from and the steps
        that would be redone."""
        rotating = self.rotating()
        if not rotating or os.path.abspath(rotating[-1]) != os.path.abspath(path):
            return error
        older = rotating[-2] if len(rotating) > 1 else None
        step = self.step_of(path)
        then = ("a new run starts (no older checkpoint is here)" if older is None else
                f"resume=True continues from {os.path.basename(older)}, redoing steps "
                f"{(self.step_of(older) or 0) + 1} to {step}")
        return CheckpointError(
            f"{error} It is the newest checkpoint in {self.dirpath}, and hookloop never "
            f"skips a damaged one silently: move it out of the directory (or delete it) and "
            f"{then}; or pass Checkpoint(resume=path) to pick a file.")

    # ---------------------------------------------------------------- writing
    def prepare_on_every_rank(self) -> None:
        """`prepare` on rank 0; every rank learns whether it may use the directory, so none
        waits for it in vain.

        Raises:
            ConfigurationError: on every rank, saying why rank 0 may not use it.
        """
        if refused := distributed.broadcast_object(self.prepare() if distributed.is_main()
                                                   else None):
            raise ConfigurationError(refused)

    def prepare(self) -> str | None:
        """At a fit's setup: create and probe the directory and hold it for this process;
        then delete the temporary files a killed save left and finish a rollback a kill
        interrupted.

        Returns:
            None, or why the directory cannot be used: another running process holds it
            (nothing was touched then). `release` gives it back at the fit's end.
        """
        prepare_directory(self.dirpath)
        holder = self._lock.acquire()
        if holder is not None:
            return (f"Checkpoint: {self.dirpath} is in use by another running job ({holder}). "
                    "Two processes training into one checkpoint directory overwrite each "
                    "other's files and delete each other's temporary files. Wait for it to "
                    "end or stop it (its lock goes with the process, even a SIGKILLed one), "
                    "or give this run another directory.")
        for name in self._names():
            if is_temporary(name):  # a killed save's file or directory (or a set-aside one)
                clean_temporary(self.dirpath, name)
        try:
            finished = self._retirement.finish()
        except CheckpointError:
            self._lock.release()
            raise
        if finished:
            warnings.warn(f"Checkpoint: finished the rollback an earlier launch began in "
                          f"{self.dirpath} (it was killed while moving the abandoned files).",
                          RuntimeWarning, stacklevel=4)
        return None

    def release(self) -> None:
        """Give back the directory `prepare` held (at the fit's end)."""
        self._lock.release()

    def write(self, payload: dict[str, Any], name: str, *, group: Any = None,
              shards: bool | None = None) -> str | None:
        """Write ``payload`` atomically under ``name``; return its path (on rank 0).

        Every rank calls it. A payload holding shards (DTensors) is a directory every rank
        writes its shards into (a collective, over ``group`` when given); any other is a
        file rank 0 writes (the other ranks return None at once).

        Raises:
            CheckpointError: the payload holds something ``torch.load(weights_only=True)``
                would refuse (nothing is written).
            CheckpointWriteError: the file system failed.
        """
        path = self.path(name)
        if contains_shards(payload) if shards is None else shards:  # known to the caller
            write_directory(payload, path, group=group)
            return path if distributed.is_main() else None
        if not distributed.is_main():
            return None
        problem = find_unplain(payload, "checkpoint")
        if problem:
            raise CheckpointError(
                f"Cannot write a checkpoint that torch.load(weights_only=True) can read: "
                f"{problem}. State must hold only tensors, numbers, strings and "
                "lists/tuples/dicts of them; convert that value in the state_dict that returns it.")
        write_atomic(payload, path)
        return path

    def write_resume(self, run: dict[str, Any], epoch: int, step: int,
                     metrics: dict[str, float], *, group: Any = None,
                     shards: bool | None = None) -> str | None:
        """Write the rotating file of ``epoch`` and ``step`` holding ``run`` (`Loop.state_dict`);
        every rank calls it (see `write`). Its duration is kept as `last_save` (`TimeLimit`
        keeps time for the final save through `Checkpoint.last_save_seconds`)."""
        started = time.monotonic()
        shards = contains_shards(run) if shards is None else shards  # known to the caller
        self._suffix = _DIRECTORY if shards else _FILE  # the names from now on
        payload = resume_payload(run, epoch, step, metrics)
        path = self.write(payload, self.rotating_name(epoch, step), group=group, shards=shards)
        self.last_save = time.monotonic() - started
        return path

    def write_best(self, weights: dict[str, Any], value: float, epoch: int, step: int,
                   metrics: dict[str, float], name: str | None) -> str | None:
        """Write validated ``weights`` scoring ``value`` under ``name`` (None: ``best.pt``);
        return the name used (``.dcp`` for shards), or None for ``best.pt``. Every rank
        calls it (see `write`)."""
        shards = contains_shards(weights)
        self._suffix = _DIRECTORY if shards else _FILE
        payload = best_payload(weights, self.monitor, value, epoch, step, metrics)
        name = None if name is None else _suffixed(name, self._suffix)
        self.write(payload, name or f"{self.prefix}best{self._suffix}", shards=shards)
        if name is None and distributed.is_main():
            self._drop_other_best()
        return name

    def _drop_other_best(self) -> None:
        """After best.pt of one kind is complete, the other kind's (an earlier layout) goes."""
        other = _DIRECTORY if self._suffix == _FILE else _FILE
        with suppress(FileNotFoundError):
            remove_entry(self.path(f"{self.prefix}best{other}"))

    def earlier_run_error(self, found: list[str]) -> ConfigurationError:
        """The error of a new run (``resume=False``) over the files ``found`` of an earlier one."""
        names = [os.path.basename(path) for path in found]
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        harm = ("overwrite its best.pt with a possibly worse one and " if
                any(name.endswith("best.pt") for name in names) else "")
        return ConfigurationError(
            f"Checkpoint: {self.dirpath} already holds checkpoints of an earlier run ({listed}), "
            f"and resume=False starts a new run, which would {harm}mix its rotating files with "
            "the earlier run's (a later resume=True could then pick the earlier run's file). "
            "Pass Checkpoint(..., resume=True) to continue that run, or give a new or empty "
            "directory (or delete those files) to start a new one.")

    def link_best(self, name: str) -> None:
        """Make ``best.pt`` the file ``name`` (a hard link, or an atomic copy), unless it is;
        ``best.dcp`` the directory ``name``, for a directory of shards."""
        source = self.path(name)
        target = self.path(f"{self.prefix}best{os.path.splitext(name)[1]}")
        with suppress(OSError):
            if os.path.samefile(source, target):
                return
        _link(source, target)
        self._suffix = os.path.splitext(name)[1]
        self._drop_other_best()

    def discard(self, dropped: list[tuple[int, dict[str, Any]]], kept: set[str]) -> None:
        """The files of ranking entries that dropped out, each with the step it dropped at
        (none named in ``kept``): set aside while a kept rotating file still ranks them,
        else deleted. Set-aside files no longer needed go too."""
        steps = self._rotating_steps()
        for at, entry in dropped:
            if entry[FILE] is None or entry[FILE] in kept:
                continue
            with suppress(FileNotFoundError):
                if _ranked_by(steps, score(entry)[1], at):
                    aside = _suffixed(self.set_aside_name(entry, at),
                                      os.path.splitext(entry[FILE])[1])
                    os.replace(self.path(entry[FILE]), self.path(aside))
                else:
                    remove_entry(self.path(entry[FILE]))
        self._prune_set_aside()

    def set_best_aside(self, entry: dict[str, Any], at: int) -> None:
        """Before ``best.pt`` (``save_top_k=1``) is replaced at step ``at``: keep what it holds
        (``entry``) under its set-aside name while a kept rotating file still ranks it."""
        best = self.best
        if _ranked_by(self._rotating_steps(), score(entry)[1], at) and os.path.exists(best):
            aside = _suffixed(self.set_aside_name(entry, at), os.path.splitext(best)[1])
            _link(best, self.path(aside))

    def _rotating_steps(self) -> list[int]:
        """The steps of the rotating files, from the names alone (no file is opened)."""
        matches = (self._rotating.match(name) for name in self._names())
        return [int(match.group(2)) for match in matches if match]

    def _prune_set_aside(self) -> None:
        """Delete the set-aside files no kept rotating file ranks. A rotating file written
        after its step's validations (`after_epoch_end_save`) does not rank what they dropped."""
        steps = self._rotating_steps()
        for reached, dropped_at, path in self.set_aside():
            ranking = [step for step in steps
                       if step != dropped_at or step not in self._after_validation]
            if not _ranked_by(ranking, reached, dropped_at):
                with suppress(FileNotFoundError):
                    remove_entry(path)

    def after_epoch_end_save(self, step: int) -> None:
        """The rotating file of ``step`` was just written at an epoch's end, after that
        step's validations: what they dropped does not wait for that file (a finished run
        keeps no ``dropped-at-step=`` file that only its last checkpoint would seem to
        need). Remembered for this launch's later prunes."""
        self._after_validation.add(step)
        self._prune_set_aside()

    def explain_set_aside(self) -> str | None:
        """Lines naming each set-aside file left, why, and the kept rotating files that rank
        it (a rollback to one of them needs it); None when there is none."""
        steps = self._rotating_steps()
        lines = []
        for reached, dropped_at, path in self.set_aside():
            ranking = [step for step in steps if reached <= step <= dropped_at and (
                step != dropped_at or step not in self._after_validation)]
            files = " or ".join(self.rotating_name_at(step) for step in ranking)
            lines.append(f"Checkpoint: kept {os.path.basename(path)}: the weights validated at "
                         f"step {reached}, out of the top k since step {dropped_at}, for a "
                         f"rollback to {files} (resume= that file ranks them again); deleted "
                         "with it.")
        return "\n".join(lines) or None

    def rotating_name_at(self, step: int) -> str:
        """The name of the kept rotating file of ``step``."""
        return next((name for name in self._names() if (match := self._rotating.match(name))
                     and int(match.group(2)) == step), f"step={step:08d}")

    def prune_rotating(self, newest: str, keep_last: int | None) -> None:
        """Delete rotating files older than the newest ``keep_last`` (after ``newest`` is complete)."""
        if keep_last is None:
            return
        files = self.rotating()
        if newest not in files:  # pragma: no cover - deleted behind our back
            return
        older = files[: files.index(newest) + 1]
        for path in older[: max(len(older) - keep_last, 0)]:
            with suppress(FileNotFoundError):
                remove_entry(path)
        self._prune_set_aside()  # what only the deleted files ranked is not needed any more

    # ------------------------------------------------------------- retirement
    def retire_after(self, payload: dict[str, Any], resumed: str) -> None:
        """A rollback to ``resumed`` (holding ``payload``): move the later files away.

        The rotating files after ``step`` (``resumed`` itself stays), the scored and
        set-aside files reached after it and a ``best.pt`` reached after it belong to the
        abandoned branch. They are moved, never deleted, into
        ``retired-after-step=SSSSSSSS/`` (``-2``, ``-3``... when that exists), so
        ``resume=True`` continues the new branch. The list of moves is written first, as
        `marker`: a kill in the middle leaves it, and the next start (`prepare`) finishes
        the moves before it picks a file, so the retirement is complete or not begun.
        """
        # The step is in the file's own record of itself (its name says it too).
        recorded = saved_at(payload)[1]
        step = recorded if recorded >= 0 else self.step_of(resumed)
        if step is None:
            return  # a file of unknown position: nothing can be said to come after it
        step, resumed = int(step), os.path.abspath(resumed)
        later = [path for path in self.rotating()
                 if (self.step_of(path) or 0) > step and os.path.abspath(path) != resumed]
        later += [path for _, found, path in self.scored() if found > step]
        later += [path for found, _, path in self.set_aside() if found > step]
        if os.path.exists(self.best):
            with suppress(CheckpointError):  # an unreadable best.pt stays where it is
                if saved_at(read_checkpoint(self.best, "cpu"))[1] > step:
                    later.append(self.best)
        if not later:
            return
        target = self._retirement.retire(later, step)
        warnings.warn(
            f"Checkpoint: resuming from {os.path.basename(resumed)} (step {step}) abandons "
            f"{len(later)} later file(s) of this run; moved to {target} (nothing "
            "deleted), so resume=True continues the new branch.", RuntimeWarning, stacklevel=5)
