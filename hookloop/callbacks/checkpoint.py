"""`Checkpoint`: when to save the run, what to keep, and which file to resume. The loop
gathers and restores the run; the files (`hookloop.runfile.background_save`), the ranking
(`hookloop.runfile.ranking`) and the weights' checks (`hookloop.runfile.weights`) sit below.
The details: docs/callbacks/checkpoint.md.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.base.checks import (check_choice, check_name, check_number, check_optional_int,
                                   check_path)
from hookloop.base.deprecation import CheckpointAliases
from hookloop.checkpoint_remote import UrlDispatch
from hookloop.monitor import MODES, Monitor
from hookloop.runfile.background_save import RotatingWrites
from hookloop.runfile.ranking import TopK, check_ranking_options

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Checkpoint"]


class Checkpoint(Callback, CheckpointAliases, UrlDispatch):  # a URL: hookloop/checkpoint_remote.py
    """Save resumable checkpoints atomically, keep the best weights, and resume exactly.

    A rotating file ``epoch=EEEE-step=SSSSSSSS.pt`` holds `Loop.state_dict`. It is written every
    ``every_n_epochs`` epochs, ``every_n_steps`` optimizer steps and ``every_n_seconds``, at the
    end of the last epoch or of one cut short by ``loop.stop()``, and when ``fit`` raises. With
    ``monitor``, ``best.pt`` holds the best validated weights (for `load_checkpoint`), and
    ``save_top_k=k`` keeps the ``k`` best as ``best-<monitor>=<value>-step=S.pt``. Writes are
    atomic; rank 0 writes, every rank loads. It comes after every stateful callback.
    ``async_save=True`` writes rotating files in a thread from a host copy (docs/callbacks/
    checkpoint.md: the step waits for the copy; a failure is raised at the next step).

    Args:
        dirpath: Directory of the checkpoints (created when missing), or an fsspec URL.
        monitor: Metric deciding ``best.pt`` (e.g. ``"val_loss"``); None: no ``best.pt``.
        mode: ``"auto"`` (from the metric's name), ``"min"`` or ``"max"``.
        every_n_epochs: Save every n epochs; None: not by epochs.
        every_n_steps: Save every n optimizer steps; None: not by steps.
        every_n_seconds: Save every n seconds of ``fit`` (rank 0's clock; agreed by all ranks).
        keep_last: How many rotating files to keep; None keeps all.
        resume: False (a new run), True (the newest rotating file in ``dirpath``, if any) or
            a file path (a rollback when it is older than the newest: later files retire).
        name: State key, and a prefix of the file names, for a second ``Checkpoint``.
        save_top_k: How many best-scoring files to keep (with ``monitor``); None: all.
        initial_value_threshold: No best file until the monitored score beats this value.
        async_save: Write the rotating files in the background (see above).

    Raises:
        ConfigurationError: a bad argument; at fit start, ``resume=False`` over an earlier
            run's files, or a ``mode="auto"`` that cannot tell the direction of ``monitor``.
        CheckpointError: when resuming from a file that is missing, corrupt or does not fit.

    Example:
        >>> import os, tempfile, torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import Checkpoint
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[Checkpoint(directory := tempfile.mkdtemp(), keep_last=2)])
        >>> _ = loop.fit(3)
        hookloop: training ended at epoch 3/3, step 9: all 3 epochs are done.
        >>> sorted(os.listdir(directory))
        ['epoch=0001-step=00000006.pt', 'epoch=0002-step=00000009.pt']
    """

    state_at_boundaries = True  # its bookkeeping changes at saves, which are at boundaries
    runs_after = {"stateful": "Checkpoint saves the state of every stateful callback, so they "
                              "must have updated it before Checkpoint writes"}

    def __init__(self, dirpath: str | os.PathLike[str], *, monitor: str | None = None,
                 mode: str = "auto", every_n_epochs: int | None = 1,
                 every_n_steps: int | None = None, keep_last: int | None = 1,
                 resume: bool | str | os.PathLike[str] = False, name: str | None = None,
                 save_top_k: int | None = 1, initial_value_threshold: float | None = None,
                 async_save: bool = False, every_n_seconds: float | None = None) -> None:
        self.dirpath = check_path("Checkpoint dirpath", dirpath)
        self.mode = check_choice("Checkpoint mode", mode, MODES)
        self._monitor = Monitor(monitor, mode, owner="Checkpoint") if monitor is not None else None
        self.monitor = monitor
        self.every_n_epochs = check_optional_int("Checkpoint every_n_epochs", every_n_epochs)
        self.every_n_steps = check_optional_int("Checkpoint every_n_steps", every_n_steps)
        self.keep_last = check_optional_int("Checkpoint keep_last", keep_last)
        self.save_top_k = check_optional_int("Checkpoint save_top_k", save_top_k,
                                             hint="None keeps every validation's file.")
        self.initial_value_threshold = check_number("Checkpoint initial_value_threshold",
                                                    initial_value_threshold, optional=True)
        check_ranking_options("Checkpoint", monitor, save_top_k, initial_value_threshold)
        self.resume = resume if isinstance(resume, bool) else check_path(
            "Checkpoint resume", resume, hint="Or True (the newest file in dirpath) or False.")
        self.name = check_name("Checkpoint name", name)
        self._writes = RotatingWrites(self.dirpath, self.keep_last, background=async_save,
                                      prefix=f"{name}-" if name else "", monitor=monitor,
                                      every_n_seconds=every_n_seconds)
        self.files, self._timed = self._writes.files, self._writes.timed
        self.every_n_seconds = self._timed.every_n_seconds
        self._ranking = TopK(self._monitor.better, save_top_k) if self._monitor else None
        self._started = False  # the first fit chose between resuming and a new run
        self._saved_at: tuple[int, int, int] | None = None  # a `loop.position`
        self._resumed_from: str | None = None

    def __repr__(self) -> str:
        extra = f", monitor={self.monitor!r}" if self.monitor else ""
        extra += f", name={self.name!r}" if self.name else ""
        return f"Checkpoint({self.dirpath!r}{extra})"

    def monitors(self) -> Iterable[str]:
        """The metric deciding ``best.pt``, if any."""
        return (self.monitor,) if self.monitor else ()

    @property
    def top_k(self) -> list[dict[str, Any]]:
        """The kept best validations, best first: ``{"value", "epoch", "step", "file"}``
        (``file``: the scored file's name; None with ``save_top_k=1``, where best.pt is it)."""
        return self._ranking.entries if self._ranking is not None else []

    @property
    def last_path(self) -> str | None:
        """Path of the newest complete rotating checkpoint this callback wrote (or resumed)."""
        return self._writes.last_path

    @property
    def best(self) -> float | None:
        """The best monitored value kept so far, or None."""
        return self._ranking.best_value if self._ranking is not None else None

    @property
    def last_save_seconds(self) -> float | None:
        """Seconds this fit's last rotating save took, to a complete file (None: none yet)."""
        return self.files.last_save

    @property
    def best_path(self) -> str | None:
        """Path of ``best.pt`` once it holds a kept best."""
        return self.files.best if self.top_k else None

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """At a fit: check the directory, and at the first fit pick the file to resume."""
        if not loop.fitting:
            return  # validate/evaluate/predict alone write and read nothing
        self._saved_at = self.files.last_save = None  # a fit that fails to start saves nothing
        if self._monitor is not None:
            self._monitor.resolve()
        self.files.prepare_on_every_rank()  # refused on every rank, or used by rank 0
        if self._started:
            return  # a later fit of the same loop continues in this directory
        if self.resume is False:  # a new run must not overwrite or mix with an earlier one
            if found := distributed.broadcast_object(
                    self.files.run_files() if distributed.is_main() else None):
                raise self.files.earlier_run_error(found)
        elif self.resume is True:
            newest = self.files.resumable(loop.callbacks) if distributed.is_main() else None
            path = distributed.broadcast_object(newest)
            if path is not None:
                self._resume_from(loop, path)
            elif self._ranking is not None:  # best files of a run killed before its first file
                self.files.reconcile(self._ranking, single=self.save_top_k == 1)
        else:
            self._resume_from(loop, self.resume, rollback=True)
        self._started = True

    def on_fit_start(self, loop: Loop) -> None:
        self._saved_at = loop.position  # where the run starts is on disk already
        self._writes.follow(loop.unwrapped_model)  # wrapped by now: do its saves hold shards
        self._timed.begin()
        if self._resumed_from is not None and distributed.is_main():
            print(self.files.resumed(self._resumed_from, *loop.position), flush=True)
        self._resumed_from = None

    def on_batch_end(self, loop: Loop) -> None:
        self._writes.poll()  # a background write that failed is raised here, naming its file
        state = loop.state
        if state.step_boundary and self._timed.at_boundary(state.step, self.every_n_steps):
            self._save(loop, collective=True)

    def on_validation_end(self, loop: Loop) -> None:
        if self._monitor is not None and self._monitor.due(loop):
            self._consider_best(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        if self._monitor is not None and self._monitor.due(loop, epoch_end=True):
            self._consider_best(loop)
        every, epoch = self.every_n_epochs, loop.state.epoch
        if (every is not None and loop.epoch_completed and (epoch + 1) % every == 0) \
                or self._training_ends(loop):
            wrote = self._save(loop, collective=True)
            self._writes.wait()  # the training's end: before DDP/FSDP tear their group down
            if wrote and distributed.is_main():
                self.files.after_epoch_end_save(loop.state.step)

    def on_fit_end(self, loop: Loop) -> None:  # also a launch's: its last file is complete
        if distributed.is_main() and (kept := self.files.explain_set_aside()):
            print(kept, flush=True)  # what the run leaves beside its checkpoints, and why
        self._writes.close(release=distributed.is_main())  # the directory is free again

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        if not loop.fitting or self._saved_at is None or not distributed.is_main():
            return  # the fit failed before it started (a bad stack, a bad file): nothing new
        if loop.state.step != loop.position.step:
            warnings.warn(f"Checkpoint: no checkpoint written for the {type(exc).__name__}: it "
                          f"came during optimizer step {loop.state.step + 1}, so the weights may "
                          f"be half-updated. The newest file in {self.dirpath} stays the one to "
                          "resume from.", RuntimeWarning, stacklevel=2)
            return
        try:  # no collectives here: the other ranks may be dead or stuck elsewhere
            self._writes.wait(raising=False)  # a failed background write is saved below
            self._save(loop, collective=False)
        except KeyboardInterrupt:  # a second Ctrl-C: fit stops at once, without on_fit_end
            self.files.release()
            raise

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The best value so far and the kept top-k entries."""
        ranking = self._ranking
        return {"best": None if ranking is None else ranking.best_value,  # `best`
                "top_k": [] if ranking is None else ranking.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`, then make it agree with the files on disk."""
        if self._ranking is not None:
            self._ranking.load_state_dict(state.get("top_k") or ())
            self.files.reconcile(self._ranking, single=self.save_top_k == 1)  # after a kill

    # ------------------------------------------------------------------ inside
    @staticmethod
    def _training_ends(loop: Loop) -> bool:
        """At an epoch end: the fit's last epoch is complete, or a stop was asked for."""
        state = loop.state
        return loop.epoch_completed and state.epoch + 1 >= state.epochs or loop.stop_requested

    def _resume_from(self, loop: Loop, path: str, *, rollback: bool = False) -> None:
        payload = self.files.read_resume(path, every_rank=True)  # every rank resumes here
        if rollback and distributed.is_main():
            self.files.retire_after(payload, path)
        loop.load_state_dict(payload, source=path)
        self._resumed_from = path  # said at on_fit_start, once the loop has applied it
        if self.files.step_of(path) is not None:
            self._writes.last_path = path

    def _save(self, loop: Loop, *, collective: bool) -> bool:
        """Save the run here; True when a file was written (or is being written)."""
        position = loop.position
        if position == self._saved_at:
            return False  # this position is on disk already (or is where the run started)
        run = loop.state_dict(gather=collective)  # a collective under DDP/FSDP when gathering
        previous, self._saved_at, state = self._saved_at, position, loop.state
        return self._writes.save(run, state.epoch, state.step, state.metrics, now=not collective,
                                 failed=lambda: setattr(self, "_saved_at", previous),  # redone
                                 callbacks=loop.callbacks)  # named in a non-finite warning

    def _consider_best(self, loop: Loop) -> None:
        monitor, ranking, state = self._monitor, self._ranking, loop.state
        assert monitor is not None and ranking is not None
        value = monitor.read(loop, when=f"at epoch {state.epoch}")
        threshold = self.initial_value_threshold
        if not math.isfinite(value) or not ranking.admits(value, state.step) or (
                threshold is not None and not monitor.better(value, threshold)):
            return
        # Every rank asks (the weights agree under DDP), so the rankings stay the same.
        weights = self._writes.best_weights(loop.unwrapped_model)
        if weights is None:
            return
        is_best = ranking.best_value is None or monitor.better(value, ranking.best_value)
        if distributed.is_main() and self.save_top_k == 1 and ranking.best is not None:
            self.files.set_best_aside(ranking.best, at=state.step)  # best.pt is to be replaced
        name = self.files.write_best(weights, value, state.epoch, state.step, state.metrics,
                                     None if self.save_top_k == 1 else
                                     self.files.scored_name(value, state.step))
        if distributed.is_main() and name is not None and is_best:
            self.files.link_best(name)
        dropped = ranking.offer(value, state.epoch, state.step, name)
        if distributed.is_main():  # only now that the new file is complete
            self.files.discard([(state.step, entry) for entry in dropped], ranking.files())
