"""`EarlyStopping`: stop training when a monitored metric stops improving."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.base.checks import check_flag, check_int, check_name, check_number
from hookloop.callback import Callback
from hookloop.monitor import Monitor

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """End training after ``patience`` validations without improvement of ``monitor``.

    The patience loop of a hand-written training script, evaluated at every validation
    (at every epoch end when the loop has no validation data)::

        if not finite(value): stop now   # check_finite=True
        if better(value, best):          # value < best - min_delta (mode="min")
            best = value                 # the first value always improves
            if baseline is None or better(value, baseline):
                wait = 0
            else:
                wait += 1
        else:
            wait += 1
        if value < stopping_threshold or value > divergence_threshold:   # mode="min"
            stop after this validation   # (value > ... / value < ... with mode="max")
        if wait >= patience:
            stop after this validation

    The value is taken from rank 0, so every rank makes the same decision and all ranks
    leave the loop together. A validation in the middle of an epoch
    (``Loop(val_every_n_steps=...)``) counts like one at an epoch end; validations before
    ``start_from_epoch`` are not counted. ``best``, ``wait``, ``best_epoch`` (and the best
    weights with ``restore_best_weights``) are checkpointed and carry over to a later
    ``fit`` of the same loop.

    A run resumed from a checkpoint keeps counting where it was: after an early stop, a
    relaunch with a larger ``epochs`` has no patience left and stops again after its next
    validation that does not improve. At such a resume rank 0 prints what the restored
    patience will do (how many validations without improvement are left) and how to train
    on anyway: a larger ``patience``, or ``restart_patience_on_resume=True``, which counts
    the patience from 0 again at every resume (the best value is kept, so only a real
    improvement resets it later). Use that for a relaunch meant to train longer, not for a
    job that requeues itself, whose patience would then never run out.

    Args:
        monitor: The metric to watch, e.g. ``"val_loss"`` or ``"val_acc"`` (must be produced
            by the loop or a callback before this one; checked at fit start).
        mode: ``"auto"`` (max for accuracy-like names, min for loss-like names; other names
            need an explicit mode), ``"min"`` or ``"max"``.
        patience: Validations without improvement after which training stops (>= 1).
        min_delta: How much the metric must improve to count as an improvement (>= 0).
        baseline: Stop unless the metric beats this value within ``patience`` validations.
        start_from_epoch: Validations in epochs before this one (0-based) are not counted
            (a warm-up in which the metric may not improve yet).
        stopping_threshold: Stop as soon as the metric is strictly better than this value
            (Lightning's semantics); that value is the best, and its weights are restored.
        divergence_threshold: Stop as soon as the metric is strictly worse than this value.
        check_finite: Stop at once, with a message, when the metric is NaN or infinite.
        restore_best_weights: When the fit ends normally (its epochs, ``max_steps`` or a
            stop), put the weights of the best validation back into the model (the weights
            that were validated: the EMA weights when ``EMA`` validates with them). The copy
            is kept on the device the weights are on. Not done after an exception, so that
            a later ``fit`` continues from where it was.
        name: State key in checkpoints (set it to use two ``EarlyStopping`` callbacks).
        restart_patience_on_resume: When a run is resumed from a checkpoint, count the
            patience from 0 again (``wait = 0``), keeping the best value and its epoch.

    Raises:
        ConfigurationError: for a bad argument, when the callback is created; at fit start,
            for ``mode="auto"`` with a metric name that says nothing about its direction.

    Example:
        >>> from hookloop.callbacks import EarlyStopping
        >>> stopper = EarlyStopping(monitor="val_loss", patience=2)
        >>> for value in [1.0, 0.8, 0.9, 0.85]:
        ...     stopper.update(value)
        False
        False
        False
        True
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "auto", patience: int = 5,
                 min_delta: float = 0.0, *, baseline: float | None = None,
                 start_from_epoch: int = 0, stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None, check_finite: bool = True,
                 restore_best_weights: bool = False, name: str | None = None,
                 restart_patience_on_resume: bool = False) -> None:
        self._monitor = Monitor(monitor, mode, owner="EarlyStopping", min_delta=min_delta)
        self.monitor = monitor
        self.mode = mode
        self.patience = check_int("EarlyStopping patience", patience,
                                  hint="It counts validations without improvement before "
                                       "stopping.")
        self.min_delta = self._monitor.min_delta
        self.baseline = check_number("EarlyStopping baseline", baseline, optional=True)
        self.start_from_epoch = check_int("EarlyStopping start_from_epoch", start_from_epoch,
                                          minimum=0)
        self.stopping_threshold = check_number("EarlyStopping stopping_threshold",
                                               stopping_threshold, optional=True)
        self.divergence_threshold = check_number("EarlyStopping divergence_threshold",
                                                 divergence_threshold, optional=True)
        self.check_finite = check_flag("EarlyStopping check_finite", check_finite)
        self.restore_best_weights = check_flag("EarlyStopping restore_best_weights",
                                               restore_best_weights)
        self.name = check_name("EarlyStopping name", name)
        self.restart_patience_on_resume = check_flag("EarlyStopping restart_patience_on_resume",
                                                     restart_patience_on_resume)
        #: The best value so far (+inf/-inf before the first; None while ``mode="auto"``
        #: has not been resolved from an unclear name).
        self.best: float | None = self._monitor.worst if self._monitor.mode else None
        self.wait = 0
        self.best_epoch = -1
        self.best_step = -1
        #: Why this callback stopped the run, or None.
        self.stopped_reason: str | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None
        self._failed = False
        self._resumed_wait: int | None = None  # the wait a loaded state brought, until said

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}, "
                f"patience={self.patience}" + (f", name={self.name!r})" if self.name else ")"))

    def monitors(self) -> Iterable[str]:
        """The monitored metric: it must be produced before this callback runs."""
        return (self.monitor,)

    def update(self, value: float, epoch: int | None = None, step: int | None = None) -> bool:
        """Count one validation's ``value``; return True when training should stop."""
        monitor = self._monitor
        if self.check_finite and not math.isfinite(value):
            self.stopped_reason = (f"EarlyStopping: {self.monitor} is {value} (not finite); "
                                   "stopping at once")
            return True
        # The best is updated first: a value that reaches stopping_threshold is the best
        # so far, and restore_best_weights must restore it (not the one before).
        if monitor.better(value, self.best):  # by more than min_delta; NaN never is
            self.best = value
            self.best_epoch = -1 if epoch is None else epoch
            self.best_step = -1 if step is None else step
            beats_baseline = self.baseline is None or monitor.better(value, self.baseline)
            self.wait = 0 if beats_baseline else self.wait + 1
        else:
            self.wait += 1
        lower = monitor.resolve() == "min"
        threshold = self.stopping_threshold
        if threshold is not None and (value < threshold if lower else value > threshold):
            self.stopped_reason = (f"EarlyStopping: {self.monitor}={value:.6g} is better than "
                                   f"the stopping threshold {threshold:.6g}")
            return True
        threshold = self.divergence_threshold
        if threshold is not None and (value > threshold if lower else value < threshold):
            self.stopped_reason = (f"EarlyStopping: {self.monitor}={value:.6g} is worse than the "
                                   f"divergence threshold {threshold:.6g}")
            return True
        if self.wait >= self.patience:
            best = ("none yet" if self.best is None or math.isinf(self.best)
                    else f"best {self.best:.6g} at epoch {self.best_epoch + 1}")
            target = "" if self.baseline is None else f" beyond the baseline {self.baseline:.6g}"
            self.stopped_reason = (f"EarlyStopping: {self.monitor} did not improve{target} for "
                                   f"{self.wait} validations ({best})")
            return True
        return False

    def resume_note(self, saved_wait: int) -> str:
        """What the patience restored from a checkpoint will do, in one line (printed by
        rank 0 at the start of a resumed fit).

        Example:
            >>> stopper = EarlyStopping(monitor="val_acc", patience=3)
            >>> stopper.load_state_dict({"best": 0.9, "wait": 3, "best_epoch": 5})
            >>> print(stopper.resume_note(3))  # doctest: +NORMALIZE_WHITESPACE
            EarlyStopping: resumed with val_acc not improved for 3 validation(s) (best 0.9 at
            epoch 6), patience 3: none left, so this run stops after its next validation
            unless val_acc improves. To train on anyway, give EarlyStopping a larger
            patience= or restart_patience_on_resume=True (the patience counts from 0 again;
            the best is kept).
        """
        owner = f"EarlyStopping({self.name!r})" if self.name else "EarlyStopping"
        best = ("no best yet" if self.best is None or math.isinf(self.best) else
                f"best {self.best:.6g}" + (f" at epoch {self.best_epoch + 1}"
                                          if self.best_epoch >= 0 else ""))
        counted = (f"resumed with {self.monitor} not improved for {saved_wait} validation(s) "
                   f"({best})")
        if self.restart_patience_on_resume:
            return (f"{owner}: {counted}; restart_patience_on_resume=True: the patience counts "
                    f"from 0 again, {self.patience} validation(s) without improvement.")
        left = self.patience - self.wait
        if left > 1:
            return (f"{owner}: {counted}, patience {self.patience}: it stops after {left} more "
                    f"validations without improvement.")
        what = "none left" if left <= 0 else "1 left"
        return (f"{owner}: {counted}, patience {self.patience}: {what}, so this run stops after "
                f"its next validation unless {self.monitor} improves. To train on anyway, give "
                "EarlyStopping a larger patience= or restart_patience_on_resume=True (the "
                "patience counts from 0 again; the best is kept).")

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        self._monitor.resolve()  # mode="auto" with an unclear name fails before training

    def on_validation_end(self, loop: Loop) -> None:
        if self._monitor.due(loop):
            self._check(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        if self._monitor.due(loop, epoch_end=True):
            self._check(loop)

    def on_fit_start(self, loop: Loop) -> None:
        self._failed = False
        resumed, self._resumed_wait = self._resumed_wait, None
        if resumed is not None and not loop.stop_requested and distributed.is_main():
            print(self.resume_note(resumed), flush=True)  # stop_requested: nothing to train
        if self._best_weights is not None:  # loaded from a file: back to the weights' device
            entries = loop.unwrapped_model.state_dict()
            self._best_weights = {key: value.to(entries[key].device) if key in entries else value
                                  for key, value in self._best_weights.items()}

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self._failed = True

    def on_fit_end(self, loop: Loop) -> None:
        if self.restore_best_weights and self._best_weights is not None and not self._failed:
            loop.unwrapped_model.load_state_dict(self._best_weights)

    def _check(self, loop: Loop) -> None:
        state = loop.state
        if state.epoch < self.start_from_epoch:
            return
        value = self._monitor.read(loop, when=f"at epoch {state.epoch}")
        before = self.best
        stop = self.update(value, state.epoch, state.step)
        if self.restore_best_weights and self.best is not None and self.best != before:
            self._best_weights = {key: tensor.detach().clone() for key, tensor
                                  in loop.unwrapped_model.state_dict().items()}
        if stop:  # held until fit(min_epochs=, min_steps=); a NaN or inf ends it now
            loop.stop(self.stopped_reason, force=self.check_finite and not math.isfinite(value))

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``best``, ``wait``, ``best_epoch``, ``best_step`` (and the best weights)."""
        state: dict[str, Any] = {"best": self.best, "wait": self.wait,
                                 "best_epoch": self.best_epoch, "best_step": self.best_step}
        if self.restore_best_weights and self._best_weights is not None:
            state["best_weights"] = {key: tensor.detach().cpu()
                                     for key, tensor in self._best_weights.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of `state_dict` (and the best weights); with
        ``restart_patience_on_resume``, ``wait`` starts at 0 again."""
        best = state.get("best")
        self.best = None if best is None else float(best)
        self._resumed_wait = int(state["wait"])
        self.wait = 0 if self.restart_patience_on_resume else self._resumed_wait
        self.best_epoch = int(state.get("best_epoch", -1))
        self.best_step = int(state.get("best_step", -1))
        weights = state.get("best_weights")
        self._best_weights = dict(weights) if weights else None
