"""`BoundaryStates`: the callbacks' states as they were at the last step boundary.

The position a checkpoint resumes from is the last step boundary (`hookloop.engine.position`);
an exception inside an accumulation window, or inside a batch, comes later, when a
callback that acts on every batch (a batch counter) has moved on. So that every part of
the run's state describes that one boundary, the loop copies, at every step boundary and
every epoch start, the ``state_dict()`` of the stateful callbacks that act between
boundaries, and puts the copy back into them when an exception ends the fit: the
checkpoint written on the exception path, and a ``fit()`` that continues after it, see the
states of the boundary they resume from.

A callback whose state already describes the last boundary (it does not change between
boundaries, or it keeps its own copy: ``Metrics``, ``AMP``) says so with
``Callback.state_at_boundaries = True`` and is not copied. A stack without such a callback
costs nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hookloop.callback import Callback
from hookloop.engine.dispatch import annotate
from hookloop.engine.ordering import overrides

if TYPE_CHECKING:
    from hookloop.engine.position import Position

__all__ = ["BoundaryStates", "WINDOW_EVENTS"]

#: The events that fire between two step boundaries (or inside the batch that ends one,
#: before the optimizer step).
WINDOW_EVENTS = ("on_batch_start", "after_forward", "after_backward", "before_step",
                 "on_batch_end")


class BoundaryStates:
    """The copied states of the callbacks that act between boundaries, and where."""

    __slots__ = ("callbacks", "_states", "_at")

    def __init__(self) -> None:
        #: The callbacks copied at every boundary (set at every fit start).
        self.callbacks: tuple[Callback, ...] = ()
        self._states: list[Any] | None = None
        self._at: tuple[int, int, int] | None = None

    def attach(self, callbacks: Iterable[Callback]) -> None:
        """At fit start: the stateful callbacks that act between boundaries."""
        self.callbacks = tuple(
            callback for callback in callbacks
            if overrides(callback, "state_dict") and not callback.state_at_boundaries
            and any(overrides(callback, event) for event in WINDOW_EVENTS))
        self._states = self._at = None

    def mark(self, position: Position) -> None:
        """At a step boundary (after its last event) or an epoch start (before its first):
        copy the states, for where ``position`` is now. Nothing to copy costs nothing."""
        if self.callbacks:
            self._states, self._at = [copy.deepcopy(callback.state_dict())
                                      for callback in self.callbacks], (*position.public,)

    def rewind(self, at: tuple[int, int, int]) -> None:
        """After an exception, the position at ``at``: put the copied states back, when
        they are that position's (an exception after the boundary's own events leaves
        the states as they are: they describe it)."""
        states, self._states = self._states, None
        if states is None or self._at != tuple(at):
            return
        for callback, state in zip(self.callbacks, states):
            try:
                callback.load_state_dict(state)
            except BaseException as exc:
                annotate(exc, callback.load_state_dict)
                raise
