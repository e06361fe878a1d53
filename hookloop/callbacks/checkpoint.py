"""`Checkpoint`: atomic, resumable checkpoints, ``best.pt``, and `load_checkpoint`."""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.ordering import overrides
from hookloop.storage import (
    FORMAT,
    all_finite,
    find_unplain,
    is_temporary,
    load_checkpoint,
    load_model_weights,
    load_optimizer_state,
    read_payload,
    write_atomic,
)

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Checkpoint", "load_checkpoint"]

_PRIMITIVES = (int, float, bool, str, bytes, complex, type(None))
#: Entries of the loop's position that each rank has for itself (its shard's loss sums).
_RANK_SUMS = ("train_loss_sum", "train_samples")
_LEAVES = (torch.dtype, torch.device, torch.Size)


# ---------------------------------------------------------------------- callback
class Checkpoint(Callback):
    """Save resumable checkpoints atomically, keep ``best.pt``, and resume exactly.

    A rotating checkpoint, named ``epoch=EEEE-step=SSSSSSSS.pt`` after the epoch and the
    optimizer step, holds the model (unwrapped from DDP/compile), the optimizer, the loop's
    position (epoch, step, batches done in the epoch, the epoch's loss sums), the RNG states
    of every rank (Python, NumPy, torch CPU and CUDA, the DataLoader generators), the state
    of every stateful callback under its ``state_key``, and the hookloop version. Only
    tensors and plain containers: ``torch.load(path, weights_only=True)`` reads it.

    When it saves:

    * every ``every_n_epochs`` epochs, at the end of the last epoch, and at the end of an
      epoch cut short by ``loop.stop()`` (``on_epoch_end``);
    * every ``every_n_steps`` optimizer steps (``on_batch_end``, once the loop has recorded
      the position of that step);
    * when ``fit`` raises (KeyboardInterrupt included): the last completed step, unless the
      weights are not finite or the exception came between an optimizer step and the
      recording of its position (then the newest file on disk stays the newest). A second
      Ctrl-C during that save aborts it at once; the final files stay intact.

    ``keep_last`` counts only the rotating files (older ones are deleted after the new one
    is complete). With ``monitor``, ``best.pt`` is written whenever the monitored metric
    improves (decided on the value of rank 0, so all ranks agree): it holds the weights that
    were validated (the EMA weights when ``EMA`` validates with them) and is for inference
    or fine-tuning with `load_checkpoint`, not for resuming. Weights that are not finite
    are never saved.

    Writes are atomic: a temporary file in the same directory, flushed, fsynced and renamed
    with ``os.replace``. Rank 0 writes, every rank loads (onto its own ``loop.device``).
    ``resume=True`` continues from the newest rotating checkpoint in ``dirpath`` (a fresh
    start when there is none); ``resume="path/to/file.pt"`` from that file. A file that
    cannot be read raises `hookloop.CheckpointError`: a run never silently starts over.
    A new run (``resume=False``) in a ``dirpath`` that already holds this callback's files
    from an earlier run (rotating files or ``best.pt``; temporary files do not count)
    raises `hookloop.ConfigurationError` at fit start instead of overwriting them; later
    fits of the same loop continue in their directory.

    Under DDP each rank's position differs in its random generators and in the loss sums
    of the interrupted epoch: step and epoch saves gather both from every rank, and each
    rank resumes with its own. A save on the exception path uses no collective: it holds
    rank 0's generators only and no partial loss sums, so the resumed epoch's
    ``train_loss`` then covers the batches after the resume point.

    Must come after every other stateful callback (checked at fit start), so that their
    state in the file is up to date.

    Args:
        dirpath: Directory of the checkpoints (created when missing).
        monitor: Metric deciding ``best.pt`` (e.g. ``"val_loss"``); None: no ``best.pt``.
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        every_n_epochs: Save every n epochs; None: not by epochs.
        every_n_steps: Save every n optimizer steps (``loop.state.step``); None: not by steps.
        keep_last: How many rotating files to keep; None keeps all.
        resume: False, True (newest checkpoint in ``dirpath``) or the path of a file.
        name: State key, and a prefix of the file names, for a second ``Checkpoint``.

    Raises:
        ConfigurationError: for a bad argument, when the callback is created; at fit start,
            when ``resume=False`` and ``dirpath`` holds checkpoints of an earlier run.
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
                 mode: str = "min", every_n_epochs: int | None = 1,
                 every_n_steps: int | None = None, keep_last: int | None = 1,
                 resume: bool | str | os.PathLike[str] = False, name: str | None = None) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise ConfigurationError(f"dirpath must be a directory path, got {dirpath!r}.")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigurationError(f"monitor must be a metric name or None, got {monitor!r}.")
        if mode not in ("min", "max"):
            raise ConfigurationError(f"mode must be 'min' or 'max', got {mode!r}.")
        for label, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps),
                             ("keep_last", keep_last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigurationError(f"{label} must be an int >= 1 or None, got {value!r}.")
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
        self.resume = resume
        self.name = name
        prefix = f"{name}-" if name else ""
        self._pattern = re.compile(rf"^{re.escape(prefix)}epoch=(\d+)-step=(\d+)\.pt$")
        self._prefix = prefix
        self.best: float | None = None
        self.best_epoch = -1
        self.best_step = -1
        #: Path of the newest complete rotating checkpoint this callback wrote.
        self.last_path: str | None = None
        #: Path of ``best.pt`` once it exists.
        self.best_path: str | None = None
        self._resumed = False
        self._fitting = False
        self._last_position: tuple[int, int, int] | None = None
        self._warned_not_finite = False
        self._loop: Loop | None = None

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

    def checkpoints(self) -> list[str]:
        """Rotating checkpoint files in ``dirpath``, oldest first (temporary files excluded)."""
        try:
            names = os.listdir(self.dirpath)
        except FileNotFoundError:
            return []
        found = []
        for file_name in names:
            match = self._pattern.match(file_name)
            if match:
                found.append(((int(match.group(2)), int(match.group(1))), file_name))
        return [os.path.join(self.dirpath, file_name) for _, file_name in sorted(found)]

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        loop.enable_resume_snapshots()
        if distributed.is_main():
            os.makedirs(self.dirpath, exist_ok=True)

    def run_files(self) -> list[str]:
        """This callback's files in ``dirpath``: rotating checkpoints, then ``best.pt``."""
        files = self.checkpoints()
        best = os.path.join(self.dirpath, f"{self._prefix}best.pt")
        return files + [best] if os.path.isfile(best) else files

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

    def on_fit_start(self, loop: Loop) -> None:
        self._fitting = False
        if self.resume is False and self._loop is not loop:
            # A new run (not a later fit of the loop that wrote here): raises before
            # self._loop is set, so a retry of the same fit checks again.
            self._refuse_earlier_run()
        if self._loop is not None and self._loop is not loop:  # reused in a new run
            self.best, self.best_epoch, self.best_step = None, -1, -1
            self.best_path, self.last_path, self._resumed = None, None, False
        self._loop = loop
        if distributed.is_main():
            for file_name in os.listdir(self.dirpath):  # left by a crash during a save
                if is_temporary(file_name):
                    with suppress(OSError):
                        os.unlink(os.path.join(self.dirpath, file_name))
        if self.resume is not False and not self._resumed:
            self._resumed = True
            if self.resume is True:
                newest = self.checkpoints()[-1] if distributed.is_main() and self.checkpoints() else None
                path = distributed.broadcast_object(newest)
            else:
                path = os.fspath(self.resume)
            if path is not None:
                self._restore(loop, path)
            else:
                self._adopt_best(loop)
        position = loop.state_dict()
        self._last_position = (position["epoch"], position["batch_idx"], position["step"])
        self._fitting = True

    def on_batch_end(self, loop: Loop) -> None:
        state = loop.state
        if (self.every_n_steps is not None and state.step_boundary and state.step
                and state.step % self.every_n_steps == 0):
            self._save(loop, collective=True)

    def on_validation_end(self, loop: Loop) -> None:
        if self.monitor is not None and self._fitting:
            self._consider_best(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        state = loop.state
        position = loop.state_dict()
        completed = position["epoch"] == state.epoch + 1 and position["batch_idx"] == 0
        if self.monitor is not None and loop.val_data is None and completed:
            self._consider_best(loop)
        due = self.every_n_epochs is not None and (state.epoch + 1) % self.every_n_epochs == 0
        if (completed and (due or state.epoch + 1 >= state.epochs)) or loop.stop_requested:
            self._save(loop, collective=True)

    def on_fit_end(self, loop: Loop) -> None:
        self._fitting = False

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        if not self._fitting or not distributed.is_main():
            return
        position = loop.state_dict()
        if loop.state.step != position["step"]:
            warnings.warn(
                f"Checkpoint: no checkpoint written for the {type(exc).__name__}: it came after "
                f"optimizer step {loop.state.step} but before the loop recorded that step's "
                f"position, so the weights and the position disagree. The newest file in "
                f"{self.dirpath} stays the one to resume from.", RuntimeWarning, stacklevel=2)
            return
        # No collectives here: the other ranks may be dead or stuck elsewhere.
        self._save(loop, collective=False)

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The best value so far and where it was reached."""
        return {"best": self.best, "best_epoch": self.best_epoch, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`."""
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_epoch = int(state.get("best_epoch", -1))
        self.best_step = int(state.get("best_step", -1))
        if self.best is not None:
            path = os.path.join(self.dirpath, f"{self._prefix}best.pt")
            self.best_path = path if os.path.exists(path) else None

    # ------------------------------------------------------------------ inside
    def _meta(self, kind: str) -> dict[str, Any]:
        import hookloop

        return {"version": hookloop.__version__, "format": FORMAT, "kind": kind,
                "world_size": distributed.world_size()}

    def _check_plain(self, payload: Mapping[str, Any]) -> None:
        problem = find_unplain(payload, "checkpoint")
        if problem:
            raise CheckpointError(
                f"Cannot write a checkpoint that torch.load(weights_only=True) can read: "
                f"{problem}. State must hold only tensors, numbers, strings and "
                "lists/tuples/dicts of them; convert that value in the state_dict that returns it.")

    def _save(self, loop: Loop, *, collective: bool) -> None:
        state = loop.state
        position = loop.state_dict()
        key = (position["epoch"], position["batch_idx"], position["step"])
        rng = {name: position.pop(name) for name in ("rng", "epoch_rng") if name in position}
        if key == self._last_position:
            return  # this position is on disk already (or is where the run started)
        # The epoch's loss sums so far are each rank's own, like its random generators.
        sums = {name: position[name] for name in _RANK_SUMS}
        if collective:
            gathered = distributed.all_gather_object({"rng": rng, "sums": sums})
            rank_rng = [entry["rng"] for entry in gathered]
            rank_sums: list[dict[str, Any]] | None = [entry["sums"] for entry in gathered]
        else:
            rank_rng, rank_sums = [rng], [sums]
            if distributed.world_size() > 1:
                # No collective on the exception path: the other ranks' sums are unknown, and
                # rank 0's stand for none but its own. The resumed epoch's train_loss then
                # covers the batches after the resume point.
                position.update(train_loss_sum=None, train_samples=0)
                rank_sums = None
        self._last_position = key
        if not distributed.is_main():
            return
        model_state = loop.unwrapped_model.state_dict()
        if not all_finite(model_state):
            if not self._warned_not_finite:
                warnings.warn(
                    f"Checkpoint: the weights at epoch {state.epoch}, step {state.step} are not "
                    "finite (NaN/inf); no checkpoint written, the older files are kept. Add "
                    "TerminateOnNaN() to stop before a NaN reaches the weights.", RuntimeWarning,
                    stacklevel=2)
                self._warned_not_finite = True
            return
        stateful = [c for c in loop.callbacks if overrides(c, "state_dict")]
        payload = {
            "hookloop": self._meta("resume"),
            "model": model_state,
            "optimizer": loop.optimizer.state_dict(),
            "loop": position,
            "rng": rank_rng,
            **({} if rank_sums is None else {"rank_sums": rank_sums}),
            "callbacks": {callback.state_key: callback.state_dict() for callback in stateful},
            "metrics": dict(state.metrics),
        }
        self._check_plain(payload)
        path = os.path.join(self.dirpath, self.filename(state.epoch, state.step))
        write_atomic(payload, path)
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
        metrics = loop.state.metrics
        if self.monitor not in metrics:
            raise ConfigurationError(
                f"Checkpoint monitors {self.monitor!r} but it is not in loop.state.metrics "
                f"(available: {', '.join(sorted(metrics))}).")
        value = float(distributed.broadcast_object(float(metrics[self.monitor])))
        if not math.isfinite(value):
            return
        if self.best is not None and not (value < self.best if self.mode == "min"
                                          else value > self.best):
            return
        if distributed.is_main():
            weights = loop.unwrapped_model.state_dict()
            if not all_finite(weights):
                return
            state = loop.state
            payload = {"hookloop": {**self._meta("best"), "monitor": self.monitor, "value": value},
                       "model": weights, "epoch": state.epoch, "step": state.step,
                       "metrics": dict(metrics)}
            self._check_plain(payload)
            path = os.path.join(self.dirpath, f"{self._prefix}best.pt")
            write_atomic(payload, path)
            self.best_path = path
        self.best, self.best_epoch, self.best_step = value, loop.state.epoch, loop.state.step

    def _adopt_best(self, loop: Loop) -> None:
        """Nothing to resume from, but a ``best.pt`` (a crash before the first rotating file):
        keep its score, so it is only ever replaced by a better one."""
        best = os.path.join(self.dirpath, f"{self._prefix}best.pt")
        value = None
        if self.monitor is not None and distributed.is_main() and os.path.exists(best):
            meta = read_payload(best, "cpu")["hookloop"]
            if meta.get("monitor") == self.monitor and meta.get("value") is not None:
                value = float(meta["value"])
        value = distributed.broadcast_object(value)
        if value is not None:
            self.best, self.best_path = value, best

    def _restore(self, loop: Loop, path: str) -> None:
        payload = read_payload(path, loop.device)
        meta = payload["hookloop"]
        if meta.get("kind") != "resume" or "loop" not in payload:
            raise CheckpointError(
                f"{path}: holds only validated weights (a best.pt file), not a training state; "
                "resume from a rotating checkpoint (epoch=...-step=....pt), or load the weights "
                "with hookloop.load_checkpoint(path, model).")
        if int(meta.get("format", 0)) > FORMAT:
            raise CheckpointError(
                f"{path}: written by a newer hookloop ({meta.get('version')}, format "
                f"{meta.get('format')}); upgrade hookloop to resume from it.")
        load_model_weights(path, loop.unwrapped_model, payload["model"])
        load_optimizer_state(path, loop.optimizer, payload["optimizer"])
        saved = dict(payload.get("callbacks", {}))
        for callback in loop.callbacks:
            if not overrides(callback, "state_dict"):
                continue
            if callback.state_key in saved:
                callback.load_state_dict(saved.pop(callback.state_key))
            elif distributed.is_main():
                warnings.warn(f"Checkpoint: {path} has no state for {callback!r} (key "
                              f"{callback.state_key!r}); it starts fresh.", RuntimeWarning,
                              stacklevel=2)
        if saved and distributed.is_main():
            warnings.warn(
                f"Checkpoint: {path} holds state that no callback in the stack claims: "
                f"{', '.join(sorted(saved))}. Add those callbacks (with the same name=) to "
                "restore it, or ignore this if you removed them on purpose.", RuntimeWarning,
                stacklevel=2)
        position = dict(payload["loop"])
        rank_rng = payload.get("rng") or [{}]
        rank = distributed.rank()
        if rank < len(rank_rng):
            position.update(rank_rng[rank])
        else:
            position.update(rank_rng[0])
            warnings.warn(
                f"Checkpoint: {path} has no RNG state for rank {rank} (it was written by "
                f"{meta.get('world_size')} process(es), or after an exception); rank {rank} "
                "uses rank 0's, so its random draws differ from an uninterrupted run.",
                RuntimeWarning, stacklevel=2)
        saved_world = int(meta.get("world_size", 1))
        rank_sums = payload.get("rank_sums")
        if (saved_world == distributed.world_size() and isinstance(rank_sums, list)
                and rank < len(rank_sums) and isinstance(rank_sums[rank], Mapping)):
            position.update({name: rank_sums[rank].get(name, position.get(name))
                             for name in _RANK_SUMS})
        elif saved_world > 1 or distributed.world_size() > 1:
            # Not this rank's own sums: the resumed epoch's train_loss covers what follows.
            position.update(train_loss_sum=None, train_samples=0)
        if saved_world != distributed.world_size() and distributed.is_main():
            warnings.warn(
                f"Checkpoint: {path} was written by {meta.get('world_size')} process(es), this "
                f"run has {distributed.world_size()}: the position in the epoch does not carry "
                "over exactly.", RuntimeWarning, stacklevel=2)
        loop.load_state_dict(position)
        self.last_path = path if self._pattern.match(os.path.basename(path)) else self.last_path
        if distributed.is_main():
            print(f"Checkpoint: resumed from {path} (epoch {position['epoch']}, "
                  f"step {position['step']}).", flush=True)
