"""`Geometry`: how many batches and optimizer steps an epoch and a fit have.

`Loop` has these as properties, from the loop's data and its accumulation window (set by
``GradAccumulation`` in ``setup``), so DDP's sharding and a changed window are accounted
for. Inside a fit, from the end of its setup to its last ``on_fit_end``, the data's length
is the one the fit trains on, as the setup hooks left it (`Position.attach` records it):
one geometry for the whole fit, also after ``DDP`` gives the user's unsharded loader back
in its ``on_fit_end``. Outside a fit it is read afresh every time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import nn

from hookloop.base.modules import unwrap

if TYPE_CHECKING:
    from hookloop.base.phase import Phases
    from hookloop.engine.state import LoopState

__all__ = ["Geometry"]


class Geometry:
    """The model behind its wrappers, and the step geometry of a loop.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(2, 1)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...             [(torch.ones(1, 2), torch.ones(1, 1))] * 10, device="cpu")
        >>> loop.accumulation_steps = 4
        >>> loop.batches_per_epoch, loop.steps_per_epoch
        (10, 3)
    """

    model: nn.Module
    train_data: Any
    accumulation_steps: int
    #: Whether an epoch's last, partial window makes a step (``GradAccumulation(last_window=
    #: "drop")`` sets False).
    partial_window_steps: bool
    state: LoopState
    _position: Any  # the loop's `hookloop.engine.position.Position`
    _phases: Phases  # the loop's

    def _set_mode(self, training: bool) -> bool:
        """``model.train(training)``, then the mode read back: a model's own ``train`` (one
        that keeps BatchNorm frozen) may not return the model."""
        self.model.train(training)
        return self.model.training

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without DDP/DataParallel or ``torch.compile`` wrappers."""
        return unwrap(self.model)

    @property
    def batches_per_epoch(self) -> int | None:
        """``len(train_data)``, or None for data without a length; inside a fit, the length
        of the data the fit trains on (the same value from setup's end to ``on_fit_end``)."""
        return self._position.batches_of(self.train_data, self._phases.current.fitting)

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch (accumulation and sharding accounted), or None.

        ``ceil(batches / accumulation_steps)``, or ``batches // accumulation_steps`` when the
        last, partial window makes no step (``partial_window_steps`` False).
        """
        batches = self.batches_per_epoch
        if batches is None:
            return None
        if not self.partial_window_steps:
            return batches // self.accumulation_steps
        return math.ceil(batches / self.accumulation_steps)

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps the current fit makes in all, from its start (or None)."""
        per_epoch = self.steps_per_epoch
        # Steps taken on another number of ranks count as taken (`Position.step_offset`).
        total = None if per_epoch is None else \
            per_epoch * self.state.epochs + self._position.step_offset
        if self.state.max_steps is not None:
            total = self.state.max_steps if total is None else min(total, self.state.max_steps)
        return total
