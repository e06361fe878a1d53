"""`Status`: what the loop reports of itself, read-only: its phase, where the weights are,
whether a stop was asked and why, whether the optimizer stepped and the epoch completed.

`Loop` has these as properties; each reads the owner the loop asks (`Phases`, `RunEnd`,
`OptimizerStep`, `Position`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookloop.base.phase import Phase

if TYPE_CHECKING:
    from hookloop.base.phase import Phases
    from hookloop.engine.position import Position, RunPosition
    from hookloop.engine.run_end import RunEnd
    from hookloop.engine.stepper import OptimizerStep

__all__ = ["Status"]


class Status:
    """The loop's read-only status properties (`hookloop.loop.Loop` inherits them)."""

    _end: RunEnd
    _phases: Phases
    _stepper: OptimizerStep
    _position: Position
    _epoch_completed: bool

    @property
    def stop_requested(self) -> bool:
        """True once `stop` was called in this fit, or once every rank agreed to end the
        launch (a resumable stop is True from the boundary where all agreed); a stop held by
        ``fit(min_epochs=, min_steps=)`` is True from where they are reached."""
        return self._end.release()

    @property
    def stop_reason(self) -> str | None:
        """The reason given to `stop` in this fit (None before a stop, or without one)."""
        return self._end.reason

    @property
    def stop_resumable(self) -> bool:
        """True when the stop ends only this launch and the run goes on (a signal,
        ``TimeLimit``, ``stop(resumable=True)``): a logger keeps its run open."""
        return self._end.suspension is not None

    @property
    def epoch_completed(self) -> bool:
        """In ``on_epoch_end``: True when the training pass ran through all the data.

        False for an epoch that `stop` cut short: callbacks that act once per epoch (epoch
        schedulers) skip such an epoch.
        """
        return self._epoch_completed

    @property
    def phase(self) -> Phase:
        """What the loop is running now: a `Phase` (``TRAIN``, ``VALIDATE``...).

        ``loop.phase is Phase.VALIDATE`` is the validation that counts (inside ``fit``, not
        the sanity check, not an ``evaluate`` pass).
        """
        return self._phases.current

    @property
    def fitting(self) -> bool:
        """True inside `fit` (from ``setup`` to ``on_fit_end``), outside the passes a
        callback runs itself with `validate`, `evaluate` or `predict`."""
        return self._phases.current.fitting

    @property
    def sanity_checking(self) -> bool:
        """True during the short validation before training (``sanity_val_batches``).

        Callbacks that decide on metrics (best checkpoint, early stopping, plateau
        schedules, loggers) ignore that pass; its metrics are discarded.
        """
        return self._phases.current is Phase.SANITY_CHECK

    @property
    def optimizer_stepped(self) -> bool:
        """True when the optimizer really stepped at the current step boundary.

        Observed through an optimizer step hook: False after a step a GradScaler skipped
        (inf/NaN gradients) or a callback cancelled. Valid from the step to the next boundary.
        """
        return self._stepper.stepped

    @property
    def position(self) -> RunPosition:
        """Where the weights are: ``(epoch, batches_done, step)`` of the last step boundary.

        ``batches_done`` batches of ``epoch`` were trained on; a checkpoint resumes here.
        """
        return self._position.public
