"""`Phase`: what the loop is running now, the one answer callbacks read instead of flags."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

__all__ = ["FITTING", "Phase", "Phases"]


class Phase(str, Enum):
    """What the loop is running now: ``loop.phase``.

    A callback that acts on validation results asks ``loop.phase is Phase.VALIDATE``
    ("is this a validation that counts?") instead of combining ``loop.fitting``,
    ``loop.sanity_checking`` and ``loop.state.prefix``. The value is a plain string, so
    ``loop.phase == "validate"`` works too.

    * ``IDLE``: no call of the loop is running (before the first ``fit``, between calls).
    * ``TRAIN``: inside ``fit``, outside its validation passes: ``setup``,
      ``on_fit_start``, the epochs and their training batches, ``on_fit_end``.
    * ``SANITY_CHECK``: the short validation before training
      (``Loop(sanity_val_batches=...)``). Its metrics are discarded; monitors, loggers and
      history ignore it.
    * ``VALIDATE``: a validation inside ``fit`` (at an epoch end or every n steps). Its
      metrics count: they go into the history, and monitors (EarlyStopping, Checkpoint's
      best, plateau schedules) decide on them.
    * ``EVALUATE``: ``loop.validate()`` or ``loop.evaluate(data)`` called on its own (also
      from a callback inside ``fit``): metrics are reported, nothing is decided on them.
    * ``PREDICT``: ``loop.predict(data)``.

    Example:
        >>> Phase.VALIDATE == "validate", Phase("train") is Phase.TRAIN
        (True, True)
    """

    IDLE = "idle"
    TRAIN = "train"
    SANITY_CHECK = "sanity_check"
    VALIDATE = "validate"
    EVALUATE = "evaluate"
    PREDICT = "predict"

    def __str__(self) -> str:
        return self.value

    @property
    def fitting(self) -> bool:
        """True for the phases inside ``fit``: TRAIN, SANITY_CHECK and VALIDATE (`FITTING`)."""
        return self in FITTING


#: The phases inside ``fit`` (`Phase.fitting`): a set, for a test without a call.
FITTING = frozenset((Phase.TRAIN, Phase.SANITY_CHECK, Phase.VALIDATE))


class Phases:
    """The loop's current `Phase`, entered and left as blocks nest (an ``evaluate`` called
    from a callback inside ``fit`` returns to ``TRAIN`` when it ends)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = Phase.IDLE

    @contextmanager
    def entered(self, phase: Phase) -> Iterator[None]:
        """``phase`` inside the block, the previous one after it (also on an exception)."""
        previous, self.current = self.current, phase
        try:
            yield
        finally:
            self.current = previous
