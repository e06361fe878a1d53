"""`OptimizerStep`: the optimizer step at a step boundary, counted only when it happened."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from hookloop.dispatch import Table, call, emit
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """Takes the step at a step boundary: ``before_step``, then the step itself (routed
    through the one callback that overrides ``optimizer_step``, AMP's ``scaler.step``, or
    a plain ``optimizer.step()``), and says whether the optimizer really stepped.

    A step is observed through an optimizer step hook, so a step a GradScaler skipped
    (inf/NaN gradients) or a callback cancelled in ``before_step`` is not counted. An
    optimizer without step hooks (a duck-typed one) is trusted: every call counts.
    """

    __slots__ = ("cancelled", "stepped", "_observed", "_checked")

    def __init__(self) -> None:
        #: A callback called ``loop.cancel_step()`` at this boundary.
        self.cancelled = False
        #: The optimizer really stepped at the current boundary.
        self.stepped = False
        self._observed = True
        self._checked = False  # the first routed step of the fit was checked

    @contextmanager
    def observing(self, optimizer: Any) -> Iterator[None]:
        """For one fit: watch ``optimizer.step`` through its step hook, where it has one."""
        register = getattr(optimizer, "register_step_post_hook", None)
        handle = register(self._mark) if register is not None else None
        self._observed, self._checked = handle is not None, False
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    def _mark(self, *_: Any) -> None:
        self.stepped = True

    def take(self, loop: Loop, table: Table) -> bool:
        """``before_step``, then the step unless cancelled; True when the optimizer stepped."""
        self.cancelled = False
        if table.before_step:
            emit(loop, table.before_step)
        self.stepped = False
        if self.cancelled:
            return False
        if table.step is None:
            loop.optimizer.step()
        else:
            said = call(table.step, loop)
            if said is True and not self.stepped:  # the router updated the weights itself
                self.stepped = True
            elif not self._checked:
                self._check_routed(loop, table)
        if not self._observed:  # an optimizer without step hooks: trust the call
            self.stepped = True
        return self.stepped

    def _check_routed(self, loop: Loop, table: Table) -> None:
        """The first routed step of a fit must really step (or say that it did)."""
        self._checked = True
        if self.stepped or not self._observed or loop.scaler is not None:
            return  # a GradScaler may skip a step: that is not the router's mistake
        owner = type(getattr(table.step, "__self__", None)).__name__
        raise ConfigurationError(
            f"{owner}.optimizer_step returned without calling loop.optimizer.step(), so the "
            "loop saw no optimizer step: state.step would stay at 0, after_step would never "
            "fire, and schedules, EMA and checkpoints would not advance. Call "
            "loop.optimizer.step() (or scaler.step(loop.optimizer)) inside optimizer_step; if "
            "it updates the weights another way, return True from it; to skip a step on "
            "purpose, call loop.cancel_step() in before_step.")
