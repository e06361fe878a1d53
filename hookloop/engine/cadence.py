"""`Cadence`: when the loop validates, counted from the run's start so a resume keeps it."""

from __future__ import annotations

from typing import Any

from hookloop.base.checks import check_optional_int

__all__ = ["Cadence"]


class Cadence:
    """When validation is due: before the first training step (``val_at_start``), at every
    n-th epoch end, after every n-th optimizer step, and the step validation a resume owes.

    Epochs and steps are counted from the start of the run (``state.epoch``,
    ``state.step``), not of the launch, so a resumed run keeps the cadence. An epoch end
    right after a step validation at the same step does not validate again, and a
    validation the run already did before an exception or a kill is not repeated.

    The loop's ``val_every_n_epochs``, ``val_every_n_steps`` and ``val_at_start`` are read at
    every fit start.
    """

    __slots__ = ("every_n_epochs", "every_n_steps", "at_start", "_validated_step")

    def __init__(self) -> None:
        self.every_n_epochs: int | None = None
        self.every_n_steps: int | None = None
        #: The validation before the first training step is due (``Loop(val_at_start=True)``).
        self.at_start = False
        self._validated_step = -1

    def begin(self, position: Any, val_data: Any, every_n_epochs: Any, every_n_steps: Any,
              at_start: Any) -> None:
        """At fit start, after setup (which may rebuild the data): the cadence of this fit.

        ``position``: the loop's `hookloop.engine.position.Position` (its ``public`` ``(epoch,
        batches_done, step)``, and ``validated``: the validation due there already ran,
        before an exception or in the run a checkpoint resumes, so it is not done again);
        then the loop's ``val_data``, ``val_every_n_epochs``, ``val_every_n_steps`` and
        ``val_at_start``.
        """
        self.every_n_epochs = check_optional_int("Loop val_every_n_epochs", every_n_epochs)
        self.every_n_steps = check_optional_int("Loop val_every_n_steps", every_n_steps)
        if val_data is None:
            self.every_n_epochs = self.every_n_steps = None
        where, validated = tuple(position.public), bool(position.validated)
        self._validated_step = where[2] if validated else -1
        # Only at the run's very start: a resume, or fit() again, does not repeat it.
        self.at_start = (bool(at_start) and val_data is not None
                         and where == (0, 0, 0) and not validated)

    def at_epoch_end(self, epoch: int, step: int) -> bool:
        """Due at the end of ``epoch`` (0-based), at optimizer step ``step``?"""
        every = self.every_n_epochs
        return (every is not None and (epoch + 1) % every == 0
                and self._validated_step != step)

    def after_step(self, step: int) -> bool:
        """Due right after optimizer step ``step`` (which really happened)?"""
        every = self.every_n_steps
        return every is not None and step % every == 0

    def owed_on_resume(self, batches_done: int, step: int, validated: bool) -> bool:
        """A run resumed at ``step`` inside an epoch, whose step validation never ran (it
        stopped during it): True when that validation is owed before training goes on."""
        every = self.every_n_steps
        return (every is not None and batches_done > 0 and step > 0
                and not validated and step % every == 0)

    def validated(self, step: int) -> None:
        """A validation that counts ran at ``step``."""
        self._validated_step = step
