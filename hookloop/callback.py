"""The `Callback` base class: every feature of hookloop is one of these."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Callback"]


class Callback:
    """Base class of all callbacks. Override only the events you need.

    An event that no callback overrides costs nothing: the loop builds, at fit start, a
    table of the methods each callback really overrides and calls only those.

    Ordering is declared on the class, never computed from numbers:

    * ``runs_after``: ``{name: reason}``; when a callback whose class (or a base class) or
      role is ``name`` is in the stack, it must come before this one. (There is no
      ``runs_before``: the callback that must come later declares the constraint.)
    * ``conflicts_with``: ``{name: reason}`` of callbacks that cannot be in the same stack.
    * ``roles``: extra names other callbacks can refer to. A callback that overrides
      ``state_dict`` also has the role ``"stateful"``.
    * ``unique``: at most one instance of this class in a stack.
    * ``rank_zero_only``: under DDP, the callback is left out of the other ranks' dispatch
      (for callbacks that write files or print). It must not call collectives.

    Metrics: ``produces(loop)`` names the metrics the callback writes into
    ``loop.state.metrics``; ``monitors()`` names those it reads. A monitor must come after
    the producer, and a monitored metric nothing produces fails at fit start.

    State: a callback that overrides ``state_dict``/``load_state_dict`` is checkpointed
    under ``state_key`` (its ``name`` if set, else its class name). Keys must be unique.
    A checkpoint describes the last step boundary: when such a callback also acts between
    boundaries (``on_batch_start``, ``after_forward``, ``after_backward``, ``before_step``,
    ``on_batch_end``), the loop copies its ``state_dict()`` at every boundary and loads the
    copy back when an exception ends the fit (`hookloop.engine.boundary`).
    ``state_at_boundaries = True`` says the copy is not needed: the state does not change
    between boundaries, or the callback keeps its own copy of the boundary's.

    Example:
        >>> import torch
        >>> from hookloop import Callback
        >>> class CountSteps(Callback):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def after_step(self, loop):
        ...         self.steps += 1
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state):
        ...         self.steps = state["steps"]
    """

    runs_after: ClassVar[Mapping[str, str]] = {}
    conflicts_with: ClassVar[Mapping[str, str]] = {}
    roles: ClassVar[tuple[str, ...]] = ()
    unique: ClassVar[bool] = False
    rank_zero_only: ClassVar[bool] = False
    #: ``state_dict()`` always describes the last step boundary (see `hookloop.engine.boundary`).
    state_at_boundaries: ClassVar[bool] = False

    #: Overrides the state key; set it to tell two instances of one class apart.
    name: str | None = None

    # ----------------------------------------------------------------- identity
    @property
    def state_key(self) -> str:
        """The key this callback's state is stored under in a checkpoint."""
        return self.name or type(self).__name__

    def produces(self, loop: Loop) -> Iterable[str]:
        """Names of the metrics this callback writes into ``loop.state.metrics``."""
        return ()

    def monitors(self) -> Iterable[str]:
        """Names of the metrics this callback reads from ``loop.state.metrics``."""
        return ()

    def __repr__(self) -> str:
        if self.name:
            return f"{type(self).__name__}(name={self.name!r})"
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------- events
    def on_fit_start(self, loop: Loop) -> None:
        """Once per ``fit``, after ``setup``, before the first epoch."""

    def on_epoch_start(self, loop: Loop) -> None:
        """At the start of every epoch."""

    def on_batch_start(self, loop: Loop) -> None:
        """Before the forward pass; ``loop.state.batch`` is on the device."""

    def after_forward(self, loop: Loop) -> None:
        """After forward and loss; ``loop.state.outputs`` and ``loop.state.loss`` are set."""

    def after_backward(self, loop: Loop) -> None:
        """After ``backward``; gradients are populated (still scaled under AMP float16)."""

    def before_step(self, loop: Loop) -> None:
        """At a step boundary, before the optimizer step; ``loop.cancel_step()`` cancels it."""

    def after_step(self, loop: Loop) -> None:
        """Only when the optimizer really stepped; ``loop.state.step`` counts it already."""

    def on_batch_end(self, loop: Loop) -> None:
        """After every training batch, step or not."""

    def on_validation_start(self, loop: Loop) -> None:
        """Before the validation pass (model in eval mode, gradients off)."""

    def on_validation_batch_start(self, loop: Loop) -> None:
        """Before each validation forward; ``loop.state.batch`` is on the device."""

    def on_validation_batch_end(self, loop: Loop) -> None:
        """After each validation forward; outputs and loss of the batch are set."""

    def on_validation_end(self, loop: Loop) -> None:
        """After the validation pass; ``loop.state.metrics`` holds ``val_loss``."""

    def on_epoch_end(self, loop: Loop) -> None:
        """At the end of every epoch, also one ended early by ``loop.stop()``."""

    def on_fit_end(self, loop: Loop) -> None:
        """Always, last: after a normal end, a stop or an exception."""

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        """When anything raised inside ``fit`` (KeyboardInterrupt too), before ``on_fit_end``."""

    # -------------------------------------------------------------------- hooks
    def setup(self, loop: Loop) -> None:
        """Prepare the environment before the model is moved and before ``on_fit_start``.

        For callbacks that change ``loop.device``, ``loop.model``, ``loop.train_data`` or
        ``loop.val_data`` (DDP), or set ``loop.accumulation_steps``. Runs at every ``fit``
        and ``validate`` call; it must be idempotent.
        """

    def forward_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """A context entered around forward and loss, in training and validation (autocast)."""
        return None

    def train_step_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """A context entered around forward and backward of a training batch (no_sync)."""
        return None

    def validation_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """A context entered around the whole validation pass, events included (EMA swap)."""
        return None

    def scale_loss(self, loop: Loop, loss: torch.Tensor) -> torch.Tensor:
        """Transform the loss used for backward; ``loop.state.loss`` keeps the true loss."""
        return loss

    def optimizer_step(self, loop: Loop) -> bool | None:
        """Take the optimizer step in place of ``loop.optimizer.step()`` (one callback only).

        Call ``loop.optimizer.step()`` (or ``scaler.step(loop.optimizer)``): the loop counts
        a step when it sees the optimizer step. A router that updates the weights another
        way returns True, so the step is counted; one whose first step neither calls the
        optimizer nor returns True is refused (without a GradScaler, which may skip a
        step). To skip a step on purpose, call ``loop.cancel_step()`` in ``before_step``.
        """
        loop.optimizer.step()
        return None

    def state_dict(self) -> dict[str, Any]:
        """This callback's state: tensors and plain containers only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
