"""`Checkpoint`: when to save the run, what to call the files, what to keep, what to resume.

The loop gathers and restores the run itself (`Loop.state_dict` / `Loop.load_state_dict`);
`hookloop.storage` writes and reads the files. This module holds the policy only.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.grads import non_finite_weights_advice
from hookloop.monitor import Monitor
from hookloop.storage import (
    FORMAT,
    all_finite,
    find_unplain,
    is_temporary,
    link_atomic,
    load_checkpoint,
    prepare_directory,
    read_payload,
    regular_checkpoint_files,
    write_atomic,
)

if TYPE_CHECKING:
    from hookloop.loop import Loop
    from hookloop.position import RunPosition

__all__ = ["Checkpoint", "load_checkpoint"]

RETIRED_PREFIX = "retired-after-step="


class Checkpoint(Callback):
    """Save resumable checkpoints atomically, keep ``best.pt``, and resume exactly.

    A rotating checkpoint, named ``epoch=EEEE-step=SSSSSSSS.pt`` after the epoch and the
    optimizer step, holds the whole run as `Loop.state_dict` returns it: the model
    (unwrapped from DDP/compile), the optimizer, the loop's position and history, every
    rank's random generators, and the state of every stateful callback under its
    ``state_key``; plus the hookloop version. Only tensors and plain containers:
    ``torch.load(path, weights_only=True)`` reads it.

    When it saves:

    * every ``every_n_epochs`` epochs, at the end of the last epoch, and at the end of an
      epoch cut short by ``loop.stop()`` (``on_epoch_end``);
    * every ``every_n_steps`` optimizer steps (``on_batch_end``);
    * when ``fit`` raises (KeyboardInterrupt included): the last completed step, unless the
      weights are not finite. A second Ctrl-C during that save aborts it at once; the final
      files stay intact.

    ``keep_last`` counts only the rotating files (older ones are deleted after the new one
    is complete). With ``monitor``, ``best.pt`` is written whenever the monitored metric
    improves at a validation (decided on the value of rank 0, so all ranks agree; without
    validation data, at each epoch end): it holds the weights that were validated (the EMA
    weights when ``EMA`` validates with them) and is for inference or fine-tuning with
    `load_checkpoint`, not for resuming. Weights that are not finite are never saved.

    ``save_top_k=k`` keeps the ``k`` best validations: ``best.pt`` is always the single
    best; with ``k > 1`` (or None: every validation) each of the ``k`` best is also kept as
    ``best-<monitor>=<value>-step=SSSSSSSS.pt`` (``best.pt`` is a hard link to the best of
    them, not a second write), so the scores are readable from the names without loading
    a file. A value enters only when it beats the ``k``-th best strictly: of equal scores
    the earlier is kept. A file that drops out of the top ``k`` is deleted after the new one
    is complete. The list is in this callback's state, so a resumed run keeps it.
    ``initial_value_threshold``: no best file is written until the score beats it (e.g.
    when fine-tuning, not before the new run beats the old model's score).

    Resuming: ``resume=True`` continues from the newest rotating checkpoint in ``dirpath``
    (a fresh start when there is none); ``resume="path/to/file.pt"`` from that file. The
    loop applies the file after every ``setup`` and before ``on_fit_start``. A run that
    had ended (its epochs, ``max_steps``, a callback's stop) stays ended: relaunched with
    the same ``epochs`` it trains nothing and says why. Resuming from a file older than
    the newest (a rollback) starts a new branch of the run: the abandoned branch's later
    files (rotating files and a ``best.pt`` reached after the file) are moved, never
    deleted, into ``dirpath/retired-after-step=SSSSSSSS/``, so a later ``resume=True``
    continues the new branch. A file that cannot be read raises
    `hookloop.CheckpointError`: a run never silently starts over. A new run
    (``resume=False``) in a ``dirpath`` that already holds this callback's files raises
    `hookloop.ConfigurationError` at fit start instead of overwriting them.

    Writes are atomic: a temporary file in the same directory, flushed, fsynced and renamed
    with ``os.replace``. Rank 0 writes, every rank loads. Must come after every other
    stateful callback (checked at fit start), so that their state in the file is current.

    Args:
        dirpath: Directory of the checkpoints (created when missing).
        monitor: Metric deciding ``best.pt`` (e.g. ``"val_loss"``); None: no ``best.pt``.
        mode: ``"auto"`` (from the metric's name: max for accuracy-like names, min for
            loss-like ones), ``"min"`` or ``"max"``.
        every_n_epochs: Save every n epochs; None: not by epochs.
        every_n_steps: Save every n optimizer steps (``loop.state.step``); None: not by steps.
        keep_last: How many rotating files to keep; None keeps all.
        save_top_k: How many best-scoring files to keep (needs ``monitor`` unless 1); None
            keeps one per validation.
        initial_value_threshold: No best file until the monitored score beats this value.
        resume: False, True (newest checkpoint in ``dirpath``) or the path of a file.
        name: State key, and a prefix of the file names, for a second ``Checkpoint``.

    Raises:
        ConfigurationError: for a bad argument, when the callback is created; at fit start,
            when ``resume=False`` and ``dirpath`` holds checkpoints of an earlier run, or
            ``mode="auto"`` cannot tell the direction of ``monitor``.
        CheckpointError: when resuming from a file that is missing, corrupt or does not fit.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import Checkpoint
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
        >>> directory = tempfile.mkdtemp()
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[Checkpoint(directory, keep_last=2)])
        >>> loop.fit(3).step
        9
        >>> sorted(path.name for path in Path(directory).iterdir())
        ['epoch=0001-step=00000006.pt', 'epoch=0002-step=00000009.pt']
    """

    runs_after = {"stateful": "Checkpoint saves the state of every stateful callback, so they "
                              "must have updated it before Checkpoint writes"}
    roles = ("checkpoint",)

    def __init__(self, dirpath: str | os.PathLike[str], *, monitor: str | None = None,
                 mode: str = "auto", every_n_epochs: int | None = 1,
                 every_n_steps: int | None = None, keep_last: int | None = 1,
                 resume: bool | str | os.PathLike[str] = False, name: str | None = None,
                 save_top_k: int | None = 1,
                 initial_value_threshold: float | None = None) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise ConfigurationError(f"dirpath must be a directory path, got {dirpath!r}.")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigurationError(f"monitor must be a metric name or None, got {monitor!r}.")
        self._monitor = Monitor(monitor, mode, owner="Checkpoint") if monitor else None
        if monitor is None and mode not in ("auto", "min", "max"):
            raise ConfigurationError(f"mode must be 'auto', 'min' or 'max', got {mode!r}.")
        for label, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps),
                             ("keep_last", keep_last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigurationError(f"{label} must be an int >= 1 or None, got {value!r}.")
        if save_top_k is not None and (isinstance(save_top_k, bool)
                                       or not isinstance(save_top_k, int) or save_top_k < 1):
            raise ConfigurationError(
                f"save_top_k must be an int >= 1 or None (keep every validation's file), got "
                f"{save_top_k!r}.")
        if initial_value_threshold is not None and (
                isinstance(initial_value_threshold, bool)
                or not isinstance(initial_value_threshold, (int, float))
                or not math.isfinite(initial_value_threshold)):
            raise ConfigurationError(
                f"initial_value_threshold must be a finite number or None, got "
                f"{initial_value_threshold!r}.")
        if monitor is None and (save_top_k != 1 or initial_value_threshold is not None):
            option = "save_top_k" if save_top_k != 1 else "initial_value_threshold"
            raise ConfigurationError(
                f"Checkpoint {option}= ranks files by a monitored metric, but monitor is None: "
                "pass monitor='val_loss' (or the metric to rank by).")
        if not isinstance(resume, (bool, str, os.PathLike)):
            raise ConfigurationError(
                f"resume must be False, True (newest checkpoint in dirpath) or a file path, got "
                f"{resume!r}.")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ConfigurationError(f"name must be a non-empty string without '/', got {name!r}.")
        self.dirpath = os.fspath(dirpath)
        self.monitor = monitor
        self.mode = mode
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.save_top_k = save_top_k
        self.initial_value_threshold = (None if initial_value_threshold is None
                                        else float(initial_value_threshold))
        self.resume = resume
        self.name = name
        self._prefix = f"{name}-" if name else ""
        self._pattern = re.compile(rf"^{re.escape(self._prefix)}epoch=(\d+)-step=(\d+)\.pt$")
        self._scored = re.compile(rf"^{re.escape(self._prefix)}best-{re.escape(monitor or '')}="
                                  r"([-+0-9.eEinfa]+)-step=(\d+)\.pt$")
        #: The kept best validations, best first: ``{"value", "epoch", "step", "file"}``
        #: (``file``: the scored file's name, None with ``save_top_k=1`` where best.pt is it).
        self.top_k: list[dict[str, Any]] = []
        self.best: float | None = None
        self.best_epoch = -1
        self.best_step = -1
        #: Path of the newest complete rotating checkpoint this callback wrote (or resumed).
        self.last_path: str | None = None
        #: Path of ``best.pt`` once it exists.
        self.best_path: str | None = None
        self._started = False  # the first fit chose between resuming and a new run
        self._saved_at: RunPosition | None = None
        self._resumed_from: str | None = None
        self._warned_not_finite = False

    def __repr__(self) -> str:
        extra = f", monitor={self.monitor!r}" if self.monitor else ""
        extra += f", name={self.name!r}" if self.name else ""
        return f"Checkpoint({self.dirpath!r}{extra})"

    def monitors(self) -> Iterable[str]:
        """The metric deciding ``best.pt``, if any."""
        return (self.monitor,) if self.monitor else ()

    # ------------------------------------------------------------------ naming
    def filename(self, epoch: int, step: int) -> str:
        """Name of the rotating checkpoint of ``epoch`` (0-based) and optimizer ``step``."""
        return f"{self._prefix}epoch={epoch:04d}-step={step:08d}.pt"

    def scored_filename(self, value: float, step: int) -> str:
        """Name of a top-k file: ``best-val_acc=0.966667-step=00000046.pt``."""
        return f"{self._prefix}best-{self.monitor}={value:.6g}-step={step:08d}.pt"

    def scored_files(self) -> list[tuple[float, int, str]]:
        """Top-k files in ``dirpath`` as ``(value, step, path)``, read from the names only."""
        if self.monitor is None:
            return []
        found = []
        for match, file_name in self._matching(self._scored):
            with suppress(ValueError):
                found.append((float(match.group(1)), int(match.group(2)),
                              os.path.join(self.dirpath, file_name)))
        return sorted(found, key=lambda item: item[1])

    def _matching(self, pattern: re.Pattern[str]) -> list[tuple[re.Match[str], str]]:
        """``(match, file name)`` of the names in ``dirpath`` that ``pattern`` matches."""
        try:
            names = os.listdir(self.dirpath)
        except (FileNotFoundError, NotADirectoryError):
            return []
        matches = ((pattern.match(file_name), file_name) for file_name in names)
        return [(match, file_name) for match, file_name in matches if match]

    def checkpoints(self) -> list[str]:
        """Rotating checkpoint files in ``dirpath``, oldest first (temporary files excluded)."""
        found = [((int(match.group(2)), int(match.group(1))), file_name)
                 for match, file_name in self._matching(self._pattern)]
        return regular_checkpoint_files(self.dirpath, [file_name for _, file_name in sorted(found)])

    def run_files(self) -> list[str]:
        """This callback's files in ``dirpath``: rotating checkpoints, top-k files, ``best.pt``."""
        files = self.checkpoints() + [path for _, _, path in self.scored_files()]
        best = self._best_file
        return files + [best] if os.path.isfile(best) else files

    @property
    def _best_file(self) -> str:
        return os.path.join(self.dirpath, f"{self._prefix}best.pt")

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """At a fit: check the directory, and at the first fit pick the file to resume."""
        if not loop.fitting:
            return  # validate/evaluate/predict alone write and read nothing
        self._saved_at = None  # until on_fit_start: a fit that fails to start saves nothing
        if self._monitor is not None:
            self._monitor.resolve()
        loop.enable_resume_snapshots()
        if distributed.is_main():
            prepare_directory(self.dirpath)
            for file_name in os.listdir(self.dirpath):  # left by a crash during a save
                if is_temporary(file_name):
                    with suppress(OSError):
                        os.unlink(os.path.join(self.dirpath, file_name))
        if self._started:
            return  # a later fit of the same loop continues in this directory
        if self.resume is False:
            self._refuse_earlier_run()
        elif self.resume is True:
            files = self.checkpoints() if distributed.is_main() else []
            path = distributed.broadcast_object(files[-1] if files else None)
            if path is not None:
                self._resume_from(loop, path)
            else:
                self._adopt_best()
        else:
            self._resume_from(loop, os.fspath(self.resume), rollback=True)
        self._started = True

    def on_fit_start(self, loop: Loop) -> None:
        self._saved_at = loop.position  # where the run starts is on disk already
        if self._resumed_from is not None and distributed.is_main():
            epoch, _, step = loop.position
            print(f"Checkpoint: resumed from {self._resumed_from} (epoch {epoch}, step {step}).",
                  flush=True)
        self._resumed_from = None

    def on_batch_end(self, loop: Loop) -> None:
        state = loop.state
        if (self.every_n_steps is not None and state.step_boundary and state.step
                and state.step % self.every_n_steps == 0):
            self._save(loop, collective=True)

    def on_validation_end(self, loop: Loop) -> None:
        if (self._monitor is not None and loop.fitting and not loop.sanity_checking
                and loop.state.prefix == "val"):
            self._consider_best(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        state = loop.state
        completed = loop.epoch_completed
        if self._monitor is not None and loop.val_data is None and completed:
            self._consider_best(loop)
        due = self.every_n_epochs is not None and (state.epoch + 1) % self.every_n_epochs == 0
        if (completed and (due or state.epoch + 1 >= state.epochs)) or loop.stop_requested:
            self._save(loop, collective=True)

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        if not loop.fitting or self._saved_at is None or not distributed.is_main():
            return  # the fit failed before it started (a bad stack, a bad file): nothing new
        if loop.state.step != loop.position.step:
            warnings.warn(
                f"Checkpoint: no checkpoint written for the {type(exc).__name__}: it came during "
                f"optimizer step {loop.state.step + 1}, so the weights may be half-updated. The "
                f"newest file in {self.dirpath} stays the one to resume from.", RuntimeWarning,
                stacklevel=2)
            return
        # No collectives here: the other ranks may be dead or stuck elsewhere.
        self._save(loop, collective=False)

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The best value so far, where it was reached, and the kept top-k entries."""
        return {"best": self.best, "best_epoch": self.best_epoch, "best_step": self.best_step,
                "top_k": [dict(entry) for entry in self.top_k]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`."""
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_epoch = int(state.get("best_epoch", -1))
        self.best_step = int(state.get("best_step", -1))
        if self.best is not None:
            self.best_path = self._best_file if os.path.exists(self._best_file) else None
        # Entries whose file is gone (deleted after this state was saved) cannot be kept.
        self.top_k = [dict(entry) for entry in state.get("top_k") or ()
                      if entry.get("file") is None
                      or os.path.isfile(os.path.join(self.dirpath, entry["file"]))]
        top = self.top_k[0] if self.top_k else None
        if (top is not None and top["file"] is not None and top["value"] == self.best
                and self.best_path is None):  # a rollback retired a later best.pt
            if distributed.is_main():
                link_atomic(os.path.join(self.dirpath, top["file"]), self._best_file)
            self.best_path = self._best_file
        if self.best is not None and self.best_path is None:
            # No file holds that score any more (a rollback retired best.pt): the branch
            # starts its best file afresh rather than run without one.
            self.best, self.best_epoch, self.best_step, self.top_k = None, -1, -1, []
        self._adopt_best()

    # ------------------------------------------------------------------ inside
    def _meta(self, kind: str) -> dict[str, Any]:
        import hookloop

        return {"version": hookloop.__version__, "format": FORMAT, "kind": kind,
                "world_size": distributed.world_size()}

    def _check_plain(self, payload: dict[str, Any]) -> None:
        problem = find_unplain(payload, "checkpoint")
        if problem:
            raise CheckpointError(
                f"Cannot write a checkpoint that torch.load(weights_only=True) can read: "
                f"{problem}. State must hold only tensors, numbers, strings and "
                "lists/tuples/dicts of them; convert that value in the state_dict that returns it.")

    def _refuse_earlier_run(self) -> None:
        """A new run must not overwrite (or mix its files with) the files of an earlier one."""
        found = distributed.broadcast_object(self.run_files() if distributed.is_main() else None)
        if not found:
            return
        names = [os.path.basename(path) for path in found]
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        harm = ("overwrite its best.pt with a possibly worse one and " if
                any(name.endswith("best.pt") for name in names) else "")
        raise ConfigurationError(
            f"Checkpoint: {self.dirpath} already holds checkpoints of an earlier run ({listed}), "
            f"and resume=False starts a new run, which would {harm}mix its rotating files with "
            "the earlier run's (a later resume=True could then pick the earlier run's file). "
            "Pass Checkpoint(..., resume=True) to continue that run, or give a new or empty "
            "directory (or delete those files) to start a new one.")

    def _resume_from(self, loop: Loop, path: str, *, rollback: bool = False) -> None:
        # Onto the CPU, never the device recorded in the file; the loop copies each tensor
        # to where its model, optimizer or callback lives.
        payload = read_payload(path, torch.device("cpu"))
        meta = payload["hookloop"]
        if meta.get("kind") != "resume" or "loop" not in payload:
            raise CheckpointError(
                f"{path}: holds only validated weights (a best.pt file), not a training state; "
                "resume from a rotating checkpoint (epoch=...-step=....pt), or load the weights "
                "with hookloop.load_checkpoint(path, model).")
        if int(meta.get("format", 0)) != FORMAT:
            newer = int(meta.get("format", 0)) > FORMAT
            raise CheckpointError(
                f"{path}: written by {'a newer' if newer else 'an older'} hookloop "
                f"({meta.get('version')}, file format {meta.get('format')}; this one reads "
                f"format {FORMAT}). {'Upgrade hookloop' if newer else 'Use that hookloop version'} "
                "to resume from it, or load its weights with hookloop.load_checkpoint.")
        if rollback and distributed.is_main():
            self._retire_later_than(path, payload)
        loop.load_state_dict(payload, source=path)
        self._resumed_from = path  # said at on_fit_start, once the loop has applied it
        if self._pattern.match(os.path.basename(path)):
            self.last_path = path

    def _retire_later_than(self, path: str, payload: dict[str, Any]) -> None:
        """Move the files a rollback abandons out of the way of the new branch."""
        # The step is in this callback's own record of the file (its name says it too).
        step = payload["hookloop"].get("step")
        if step is None:
            match = self._pattern.match(os.path.basename(path))
            if match is None:
                return  # a file of unknown position: nothing can be said to come after it
            step = match.group(2)
        step = int(step)
        resumed = os.path.abspath(path)
        later = []
        for candidate in self.checkpoints():
            found = self._pattern.match(os.path.basename(candidate))
            assert found is not None
            if int(found.group(2)) > step and os.path.abspath(candidate) != resumed:
                later.append(candidate)
        later += [path for _, found_step, path in self.scored_files() if found_step > step]
        best = self._best_file
        if os.path.isfile(best):
            with suppress(CheckpointError):
                if int(read_payload(best, "cpu").get("step", -1)) > step:
                    later.append(best)
        if not later:
            return
        target = os.path.join(self.dirpath, f"{RETIRED_PREFIX}{step:08d}")
        suffix = 1
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(self.dirpath, f"{RETIRED_PREFIX}{step:08d}-{suffix}")
        os.makedirs(target)
        for file_path in later:
            os.replace(file_path, os.path.join(target, os.path.basename(file_path)))
        warnings.warn(
            f"Checkpoint: resuming from {os.path.basename(path)} (step {step}) abandons "
            f"{len(later)} later file(s) of this run; moved to {target} (nothing deleted), so "
            "resume=True continues the new branch.", RuntimeWarning, stacklevel=4)

    def _save(self, loop: Loop, *, collective: bool) -> None:
        position = loop.position
        if position == self._saved_at:
            return  # this position is on disk already (or is where the run started)
        run = loop.state_dict(gather=collective)  # a collective under DDP when gathering
        previous, self._saved_at = self._saved_at, position
        if not distributed.is_main():
            return
        state = loop.state
        if not all_finite(run["model"]):
            if not self._warned_not_finite:
                warnings.warn(
                    f"Checkpoint: the weights at epoch {state.epoch}, step {state.step} are not "
                    "finite (NaN/inf); no checkpoint written, the older files are kept. "
                    + non_finite_weights_advice(loop.callbacks), RuntimeWarning, stacklevel=2)
                self._warned_not_finite = True
            return
        payload = {"hookloop": {**self._meta("resume"), "epoch": state.epoch, "step": state.step},
                   **run, "metrics": dict(state.metrics)}
        self._check_plain(payload)
        path = os.path.join(self.dirpath, self.filename(state.epoch, state.step))
        try:
            write_atomic(payload, path)
        except BaseException:
            self._saved_at = previous  # not on disk: on_exception writes it
            raise
        self.last_path = path
        self._prune(path)

    def _prune(self, newest: str) -> None:
        """Delete rotating files older than the newest ``keep_last`` (after the write)."""
        if self.keep_last is None:
            return
        files = self.checkpoints()
        if newest not in files:  # pragma: no cover - deleted behind our back
            return
        older = files[: files.index(newest) + 1]
        for path in older[: max(len(older) - self.keep_last, 0)]:
            with suppress(FileNotFoundError):
                os.unlink(path)

    def _consider_best(self, loop: Loop) -> None:
        monitor = self._monitor
        assert monitor is not None
        value = self._monitor.read(loop, when=f"at epoch {loop.state.epoch}")
        threshold = self.initial_value_threshold
        if not math.isfinite(value) or (threshold is not None and
                                        not monitor.better(value, threshold)):
            return
        is_best = monitor.better(value, self.best)
        k = self.save_top_k
        kept = self.top_k
        enters = is_best or (k != 1 and (k is None or len(kept) < k
                                         or monitor.better(value, kept[-1]["value"])))
        if not enters:
            return
        state = loop.state
        entry = {"value": value, "epoch": state.epoch, "step": state.step, "file": None}
        if distributed.is_main():
            weights = loop.unwrapped_model.state_dict()
            if not all_finite(weights):
                return
            payload = {"hookloop": {**self._meta("best"), "monitor": self.monitor, "value": value},
                       "model": weights, "epoch": state.epoch, "step": state.step,
                       "metrics": dict(state.metrics)}
            self._check_plain(payload)
            if k == 1:
                write_atomic(payload, self._best_file)
            else:
                entry["file"] = self.scored_filename(value, state.step)
                scored = os.path.join(self.dirpath, entry["file"])
                write_atomic(payload, scored)
                if is_best:
                    link_atomic(scored, self._best_file)
            if is_best:
                self.best_path = self._best_file
        # After the equal-or-better entries: of equal scores the earlier stays ahead.
        place = next((index for index, other in enumerate(kept)
                      if monitor.better(value, other["value"])), len(kept))
        kept.insert(place, entry)
        dropped = kept[k:] if k is not None else []
        del kept[len(kept) - len(dropped):]
        if distributed.is_main():
            for old in dropped:  # only now that the new file is complete
                if old["file"] is not None:
                    with suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.dirpath, old["file"]))
        if is_best:
            self.best, self.best_epoch, self.best_step = value, state.epoch, state.step

    def _adopt_best(self) -> None:
        """Keep what the files on disk say when it is better than the state: ``best.pt`` (and
        the scored top-k files) may be newer than the file resumed from (a kill between a
        validation and the next rotating file), so a best file is only ever replaced by a
        better one, and the kept files stay ``save_top_k``."""
        if self._monitor is None:
            return
        found = None
        if distributed.is_main() and os.path.exists(self._best_file):
            payload = read_payload(self._best_file, "cpu")
            meta = payload["hookloop"]
            if meta.get("monitor") == self.monitor and meta.get("value") is not None:
                found = (float(meta["value"]), int(payload.get("epoch", -1)),
                         int(payload.get("step", -1)))
        found = distributed.broadcast_object(found)
        if found is not None and self._monitor.better(found[0], self.best):
            self.best, self.best_epoch, self.best_step = found
            self.best_path = self._best_file
        if self.save_top_k == 1:  # best.pt is the only file
            return
        scored = distributed.broadcast_object(
            self.scored_files() if distributed.is_main() else None)
        ranked = [dict(entry) for entry in self.top_k]
        known = {entry["file"] for entry in ranked}
        for value, step, path in scored:  # oldest first: ties keep the earlier
            if os.path.basename(path) in known:
                continue
            place = next((index for index, other in enumerate(ranked)
                          if self._monitor.better(value, other["value"])), len(ranked))
            ranked.insert(place, {"value": value, "epoch": -1, "step": step,
                                  "file": os.path.basename(path)})
        limit = self.save_top_k if self.save_top_k is not None else len(ranked)
        self.top_k = ranked[:limit]
        if distributed.is_main():  # files beyond the k best, as the normal pruning would
            for entry in ranked[limit:]:
                if entry["file"] is not None:
                    with suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.dirpath, entry["file"]))
