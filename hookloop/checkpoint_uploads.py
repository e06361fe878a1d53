"""`CheckpointUploads`: the checkpoints an experiment tracker uploads (``log_checkpoints=``
of `hookloop.callbacks.WandbLogger` and `hookloop.callbacks.MLflowLogger`).

How a save is known to be complete: through the public attributes of the savers in the stack
(`hookloop.callbacks.Checkpoint`, or any callback offering them, as `TimeLimit` finds
``last_save_seconds``; callbacks stay leaves): ``top_k`` (the kept best validations, best
first, with their step and value), ``best_path``, ``last_path`` (the newest complete rotating
checkpoint; an async save counts once its file is complete), ``monitor`` and ``dirpath``.
They change only once a file is complete, so the tracker looks at them at its events
(after each optimizer step, at validation and epoch ends, at fit end) and uploads what is new.

Each upload has a name that says the step and the monitored value
(``best-step=00000012-val_loss=0.4321``, ``step=00000016-val_loss=0.4101``). The file is
first hard-linked (copied where links fail) into an entry of the checkpoint directory named
by the tracker run and the upload (``.upload-<run id>-<name>/``, with ``upload.json``, what
is uploaded), so a newer save may replace or prune the checkpoint while a thread uploads the
link. That entry is the record of an upload the tracker does not hold for sure yet: it is
deleted once the tracker confirms it (MLflow: the upload returned; W&B: committed online,
the run finished offline), and a relaunch that continues the run uploads again each entry
the tracker does not hold (after a kill mid-upload, or a W&B offline file that lost its
last block). A name the tracker holds already is never uploaded again, so a relaunch that
saves the same best again uploads nothing. A failed upload is retried at later looks (after
n failures in a row a few looks are skipped, at most 32) and once more at fit end; what is
still not uploaded then is said in one line and stays staged for the next launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hookloop.errors import ConfigurationError
from hookloop.runfile.storage import snapshot

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["MODES", "Upload", "CheckpointUploads", "check_mode"]

#: The values of ``log_checkpoints``: None/False (off), "best", "all".
MODES = ("best", "all")
_STEP = re.compile(r"step=(\d+)")
_SAVER = ("top_k", "best_path", "last_path", "dirpath")  # and the metric it monitors
_STAGED, _RECORD, _MAX_SKIP = ".upload-", "upload.json", 32


def check_mode(owner: str, value: Any) -> str | None:
    """``log_checkpoints`` checked: None for off (None or False), else "best" or "all"."""
    if value is None or value is False:
        return None
    if value not in MODES:
        raise ConfigurationError(
            f"{owner} log_checkpoints must be 'best' (each new best file), 'all' (every "
            f"checkpoint file) or None/False (none, the default), got {value!r}.")
    return str(value)


class Upload:
    """One checkpoint to upload: ``name`` (says step and value), ``path`` (the staged copy),
    ``kind`` ("best" or "last"), ``epoch``, ``step``, ``metric`` (the monitored one),
    ``value``, ``file`` (its name in the checkpoint directory)."""

    def __init__(self, *, kind: str, file: str, epoch: int | None, step: int,
                 metric: str | None, value: float | None) -> None:
        self.kind, self.file, self.epoch, self.step = kind, file, epoch, step
        self.metric, self.value = metric, value
        scored = "" if metric is None or value is None else f"-{metric}={value:.6g}"
        self.name = f"{'best-' if kind == 'best' else ''}step={step:08d}{scored}"
        self.path = ""

    def metadata(self) -> dict[str, Any]:
        """What the tracker stores with it."""
        return dict(kind=self.kind, file=self.file, epoch=self.epoch, step=self.step,
                    metric=self.metric, value=self.value)

    @classmethod
    def staged(cls, holder: str) -> Upload | None:
        """The upload an earlier launch staged in ``holder``; None when it is incomplete."""
        try:
            with open(os.path.join(holder, _RECORD), encoding="utf-8") as handle:
                record = json.load(handle)
            upload = cls(kind=str(record["kind"]), file=str(record["file"]),
                         epoch=record["epoch"], step=int(record["step"]),
                         metric=record["metric"], value=record["value"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        upload.path = os.path.join(holder, os.path.basename(upload.file))
        return upload if os.path.lexists(upload.path) else None


def _metric(saver: Any) -> str | None:
    """The metric a saver monitors (`Checkpoint.monitor`), None when it has none."""
    try:
        return saver.monitor or None
    except AttributeError:  # another package's saver may monitor nothing
        return None


def _stage(source: str, holder: str, upload: Upload) -> str:
    """A link (or copy) of the file or directory ``source`` in the entry ``holder``, after
    the record of ``upload``; returns its path."""
    shutil.rmtree(holder, ignore_errors=True)  # an earlier launch's incomplete one
    os.mkdir(holder)
    with open(os.path.join(holder, _RECORD), "w", encoding="utf-8") as handle:
        json.dump(upload.metadata(), handle)
    target = os.path.join(holder, os.path.basename(source))
    try:
        snapshot(source, target)
    except BaseException:
        shutil.rmtree(holder, ignore_errors=True)
        raise
    return target


class CheckpointUploads:
    """The uploads of one tracker callback: what is new at each look, in a thread.

    Args:
        owner: The tracker's name, for messages.
        mode: "best" (each new best), "all" (every rotating and best file), or None.
        upload: Uploads one `Upload` (called in the thread); returns True when the tracker
            holds it for sure now, False when only once the run is closed (`confirm`).
    """

    def __init__(self, owner: str, mode: str | None, upload: Callable[[Upload], bool]) -> None:
        self.owner, self.mode, self._upload = owner, mode, upload
        #: The names the tracker holds, or that this process queued.
        self.logged: set[str] = set()
        self.run_id = ""  # the tracker run the staged entries belong to
        self._savers: list[Any] = []
        self._seen: dict[int, tuple[Any, Any]] = {}  # per saver: (best entry, last path)
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[tuple[Future[bool], Upload]] = []
        self._later: list[Upload] = []  # uploaded, held for sure once the run is closed
        self._retry: list[Upload] = []  # failed, tried again later
        self._failures = self._skip = 0
        self._cause = ""
        self._warned = False

    def attach(self, loop: Loop) -> None:
        """At setup: find the savers; an upload mode without one is refused."""
        if self.mode is None:
            return
        self._savers = [callback for callback in loop.callbacks
                        if all(hasattr(callback, name) for name in _SAVER)]
        scored = [saver for saver in self._savers if _metric(saver)]
        if not self._savers or (self.mode == "best" and not scored):
            needs = "Checkpoint(dirpath, monitor='val_loss')" if self.mode == "best" else \
                "Checkpoint(dirpath)"
            raise ConfigurationError(
                f"{self.owner}(log_checkpoints={self.mode!r}) uploads the checkpoints of the "
                f"stack's Checkpoint{' (one with a monitor)' if self.mode == 'best' else ''}, "
                f"but the stack has none: add {needs} after it, or log_checkpoints=None.")

    def look(self, loop: Loop) -> None:
        """Queue what completed since the last look (the tracker run must be open)."""
        for saver in self._savers:
            seen = self._seen.get(id(saver), (None, None))
            metric = _metric(saver)
            best: Any = saver.top_k[0] if metric and saver.top_k else None
            key = None if best is None else (best["step"], best["value"])
            if key is not None and key != seen[0]:
                file = best["file"] or os.path.basename(saver.best_path or "")
                self._queue(saver, os.path.join(saver.dirpath, file), Upload(
                    kind="best", file=file, epoch=best["epoch"], step=int(best["step"]),
                    metric=metric, value=float(best["value"])))
            last = saver.last_path if self.mode == "all" else None
            if last is not None and last != seen[1]:
                self._queue(saver, last, self._rotating(loop, saver, last))
            self._seen[id(saver)] = (key, last)
        self._report()
        if self._retry and self._skip > 0:
            self._skip -= 1
        elif self._retry:
            retry, self._retry = self._retry, []
            for upload in retry:
                self._submit(upload)

    def resume(self, run_id: str, held: Callable[[Upload], bool]) -> None:
        """At a tracker run's open: the entries an earlier launch staged for that run and the
        tracker does not hold (``held``) are uploaded again; the others are deleted."""
        self.run_id = run_id
        staged = []
        for saver in self._savers:
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(saver.dirpath)):
                    if name.startswith(f"{_STAGED}{run_id}-"):
                        holder = os.path.join(str(saver.dirpath), name)
                        staged.append((Upload.staged(holder), holder))
        for upload, holder in sorted(staged, key=lambda found: (
                -1 if found[0] is None else found[0].step, found[1])):
            try:
                holds = upload is None or held(upload)
            except Exception:  # noqa: BLE001 - unknown: kept staged for the next launch
                continue
            if holds or upload is None:
                shutil.rmtree(holder, ignore_errors=True)
            else:
                self.logged.add(upload.name)
                self._submit(upload)

    def _rotating(self, loop: Loop, saver: Any, path: str) -> Upload:
        """A rotating file: its step from its name; the monitored value of the newest
        validation at or before that step, from the run's history."""
        file = os.path.basename(path)
        found = _STEP.search(file)
        step = int(found.group(1)) if found else loop.state.step
        metric, value = _metric(saver), None
        for row in loop.state.history:
            if row.get("step", -1) <= step and metric in row:
                value = float(row[metric])
        return Upload(kind="last", file=file, epoch=None, step=step,
                      metric=metric if value is not None else None, value=value)

    def _queue(self, saver: Any, source: str, upload: Upload) -> None:
        if upload.name in self.logged or not os.path.exists(source):
            return
        entry = f"{_STAGED}{self.run_id}-{upload.name}".replace("/", "_")  # "val/loss"
        holder = os.path.join(str(saver.dirpath), entry)
        try:
            upload.path = _stage(source, holder, upload)
        except OSError as error:
            self._warn(upload, error, "staging it")
            return
        self.logged.add(upload.name)
        self._submit(upload)

    def _submit(self, upload: Upload) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hookloop-upload")
        self._futures.append((self._pool.submit(self._upload, upload), upload))

    def confirm(self) -> None:
        """The tracker run was closed: it holds what was uploaded; the staged entries go."""
        for upload in self._later:
            shutil.rmtree(os.path.dirname(upload.path), ignore_errors=True)
        self._later = []

    def _report(self) -> None:
        """Failed uploads are warned (once) and kept to retry; training goes on."""
        pending = []
        for future, upload in self._futures:
            if not future.done():
                pending.append((future, upload))
            elif future.exception() is not None:
                self._retry.append(upload)
                self._failures += 1
                self._skip = min(2 ** (self._failures - 1), _MAX_SKIP) - 1
                self._warn(upload, future.exception(), "uploading it")
            else:
                self._failures = 0
                if future.result():
                    shutil.rmtree(os.path.dirname(upload.path), ignore_errors=True)
                else:
                    self._later.append(upload)
        self._futures = pending

    def _warn(self, upload: Upload, error: BaseException | None, doing: str) -> None:
        detail = f": {error}" if str(error) else ""
        self._cause = f"{type(error).__name__}{detail}"[:300]
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.owner}: {doing} failed for the checkpoint {upload.file} "
                          f"({upload.name}; {self._cause}); training goes on, it is tried "
                          "again later (said once per fit; the fit's end line says what was "
                          "not uploaded).", RuntimeWarning, stacklevel=3)

    def _finish(self) -> None:
        for future, _ in self._futures:
            future.exception()  # waits; a failure is reported below
        self._report()

    def wait(self) -> None:
        """At fit end: every queued upload finished, the failed ones tried once more (before
        the tracker run is closed); one line says what is still not uploaded."""
        self._finish()
        retry, self._retry = self._retry, []
        for upload in retry:
            self._submit(upload)
        self._finish()
        if self._retry:
            names = ", ".join(upload.name for upload in self._retry)
            print(f"hookloop: {self.owner} did not upload {len(self._retry)} checkpoint(s) "
                  f"({names}): {self._cause}. They stay staged ({_STAGED}{self.run_id}-* in the "
                  "checkpoint directory) and are uploaded when the run continues.", flush=True)
        self._retry, self._failures, self._skip, self._warned = [], 0, 0, False
