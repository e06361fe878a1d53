"""`EarlyStopping`: stop training when a monitored metric stops improving."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """End training after ``patience`` epochs without improvement of ``monitor``.

    The patience loop of a hand-written training script, evaluated at the end of every
    epoch::

        if improved(value, best):   # value < best - min_delta (mode="min")
            best, wait = value, 0   # the first epoch always improves (best starts at inf)
        else:
            wait += 1
        if wait >= patience:
            stop after this epoch

    The value is taken from rank 0 (``hookloop.distributed.broadcast_object``), so every
    rank makes the same decision and all ranks leave the loop together. A NaN value never
    improves. ``best``, ``wait`` and ``best_epoch`` are checkpointed; they carry over to
    a later ``fit`` of the same loop and start afresh in a new loop. An epoch cut short by
    ``loop.stop()`` (``loop.epoch_completed`` is False: no validation ran) is not counted,
    even when the monitored metric (``train_loss``) was written for its partial pass.

    Args:
        monitor: The metric to watch, e.g. ``"val_loss"`` or ``"val_acc"`` (must be produced
            by the loop or a callback before this one; checked at fit start).
        mode: ``"min"`` when lower is better, ``"max"`` when higher is better.
        patience: Number of epochs without improvement after which training stops (>= 1).
        min_delta: How much the metric must improve to count as an improvement (>= 0).
        name: State key in checkpoints (set it to use two ``EarlyStopping`` callbacks).

    Raises:
        ConfigurationError: for a bad argument, when the callback is created.

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

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 5,
                 min_delta: float = 0.0, *, name: str | None = None) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigurationError(f"monitor must be a metric name such as 'val_loss', got {monitor!r}.")
        if mode not in ("min", "max"):
            raise ConfigurationError(
                f"mode must be 'min' (lower is better, e.g. a loss) or 'max' (higher is better, "
                f"e.g. accuracy), got {mode!r}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigurationError(
                f"patience must be an int >= 1 (epochs without improvement before stopping), "
                f"got {patience!r}.")
        if (isinstance(min_delta, bool) or not isinstance(min_delta, (int, float))
                or not math.isfinite(min_delta) or min_delta < 0):
            raise ConfigurationError(
                f"min_delta must be a finite number >= 0 (the improvement that counts), got "
                f"{min_delta!r}. The direction comes from mode.")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(f"name must be a non-empty string or None, got {name!r}.")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.name = name
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0
        self.best_epoch = -1
        self._loop: Loop | None = None

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}, "
                f"patience={self.patience}" + (f", name={self.name!r})" if self.name else ")"))

    def monitors(self) -> Iterable[str]:
        """The monitored metric: it must be produced before this callback runs."""
        return (self.monitor,)

    def improved(self, value: float) -> bool:
        """True when ``value`` beats ``best`` by more than ``min_delta`` (NaN never does)."""
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def update(self, value: float, epoch: int | None = None) -> bool:
        """Count one epoch's ``value``; return True when patience has run out."""
        if self.improved(value):
            self.best, self.wait = value, 0
            self.best_epoch = -1 if epoch is None else epoch
        else:
            self.wait += 1
        return self.wait >= self.patience

    def on_fit_start(self, loop: Loop) -> None:
        # Another fit of the same loop continues the count; a new loop starts afresh
        # (a resumed run gets its counters back from Checkpoint, which runs after this).
        if self._loop is not None and self._loop is not loop:
            self.best = math.inf if self.mode == "min" else -math.inf
            self.wait, self.best_epoch = 0, -1
        self._loop = loop

    def on_epoch_end(self, loop: Loop) -> None:
        if not loop.epoch_completed:
            return  # an epoch cut short by stop(): a partial value, nothing to compare
        metrics = loop.state.metrics
        value = metrics.get(self.monitor)
        if value is None:
            raise ConfigurationError(
                f"EarlyStopping monitors {self.monitor!r} but it is not in loop.state.metrics at "
                f"the end of epoch {loop.state.epoch} (available: {', '.join(sorted(metrics))}). "
                "Check that the callback producing it runs every epoch.")
        value = float(distributed.broadcast_object(float(value)))
        if self.update(value, loop.state.epoch):
            loop.stop(f"EarlyStopping: {self.monitor} did not improve for {self.wait} epochs "
                      f"(best {self.best:.6g} at epoch {self.best_epoch})")

    def state_dict(self) -> dict[str, Any]:
        """``best``, ``wait`` and ``best_epoch``."""
        return {"best": self.best, "wait": self.wait, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of `state_dict`."""
        self.best = float(state["best"])
        self.wait = int(state["wait"])
        self.best_epoch = int(state.get("best_epoch", -1))
