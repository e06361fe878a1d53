"""Gradient accumulation: one optimizer step per window of micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hookloop.callback import Callback
from hookloop.checks import check_int
from hookloop.compat import foreach_mul_

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["GradAccumulation"]


class GradAccumulation(Callback):
    """Accumulate the gradients of ``steps`` micro-batches before each optimizer step.

    ``setup`` sets ``loop.accumulation_steps``; from it the loop computes
    ``loop.state.step_boundary`` (True every ``steps`` micro-batches and on the last batch
    of the epoch), which decides when ``before_step``, the optimizer step and ``after_step``
    run, and which `DDP` reads to skip the gradient all-reduce (``no_sync``) inside a
    window. Each micro-batch's loss is divided by the real size of its window, so every
    step averages the gradients of exactly the batches in it: with 10 batches and
    ``steps=4`` an epoch makes 3 steps, averaging 4, 4 and 2 batches. Gradients never leak
    into the next epoch. ``loop.state.loss`` keeps the undivided loss.

    The loss division is a per-micro-batch mean (each micro-batch weighs the same), as the
    usual ``loss / accumulation_steps`` of a hand-written loop.

    Data without a length (an ``IterableDataset``, a generator) works too: the loop looks
    one batch ahead to find where the data ends, and the last, partial window is stepped
    there. Its micro-batches were divided by ``steps`` before its size was known, so its
    gradients are multiplied by ``steps / size`` after its last backward: the same step
    as dividing by the real size.

    The window is the loop's geometry: ``loop.accumulation_steps`` is reset to 1 at every
    fit and set again by this callback's ``setup``, so removing the callback removes it.

    Args:
        steps: Micro-batches per optimizer step (1 means no accumulation).

    Raises:
        ConfigurationError: ``steps`` is not an int >= 1.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(10)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[GradAccumulation(4)])
        >>> loop.fit(1).step
        hookloop: training ended at epoch 1/1, step 3: its 1 epoch is done.
        3
    """

    unique = True

    def __init__(self, steps: int) -> None:
        self.steps = check_int("GradAccumulation steps", steps,
                               hint="It counts the micro-batches per optimizer step; 1 means "
                                    "no accumulation.")
        self._batches: int | None = 0

    def __repr__(self) -> str:
        return f"GradAccumulation({self.steps})"

    def setup(self, loop: Loop) -> None:
        """Set ``loop.accumulation_steps``."""
        loop.accumulation_steps = self.steps

    def on_fit_start(self, loop: Loop) -> None:
        # Read after every setup ran: DDP may have re-sharded train_data.
        self._batches = loop.batches_per_epoch

    def window_size(self, batch_idx: int) -> int:
        """Number of micro-batches in the window that holds batch ``batch_idx``
        (``steps`` for data without a length, where it is known only at the end)."""
        if self._batches is None:
            return self.steps
        start = batch_idx - batch_idx % self.steps
        return max(1, min(self.steps, self._batches - start))

    def scale_loss(self, loop: Loop, loss: torch.Tensor) -> torch.Tensor:
        """The loss divided by the real size of the current window."""
        size = self.window_size(loop.state.batch_idx)
        return loss if size == 1 else loss / size

    @torch.no_grad()
    def after_backward(self, loop: Loop) -> None:
        """Data without a length: rescale the gradients of a window the data cut short."""
        state = loop.state
        if self._batches is not None or not state.step_boundary:
            return
        size = state.batch_idx % self.steps + 1
        if size == self.steps:
            return
        grads = [param.grad for group in loop.optimizer.param_groups for param in group["params"]
                 if param.grad is not None]
        if grads:
            foreach_mul_(grads, self.steps / size)
