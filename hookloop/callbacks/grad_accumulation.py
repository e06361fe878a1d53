"""Gradient accumulation: one optimizer step per window of micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hookloop.base.checks import check_choice, check_int
from hookloop.base.compat import foreach_mul_
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["GradAccumulation", "LAST_WINDOW"]

#: What `GradAccumulation` does with an epoch's last window when the data does not fill it.
LAST_WINDOW = ("mean", "as_full", "drop")


class GradAccumulation(Callback):
    """Accumulate the gradients of ``steps`` micro-batches before each optimizer step.

    ``setup`` sets ``loop.accumulation_steps``; from it the loop computes
    ``loop.state.step_boundary`` (True every ``steps`` micro-batches and on the last batch
    of the epoch), which decides when ``before_step``, the optimizer step and ``after_step``
    run, and which `DDP` reads to skip the gradient all-reduce (``no_sync``) inside a
    window. ``loop.state.loss`` keeps the undivided loss. Gradients never leak into the
    next epoch.

    When the data does not fill the epoch's last window (10 batches, ``steps=4``: windows
    of 4, 4 and 2), ``last_window`` says what that window does, as real training loops do:

    * ``"mean"`` (default): each of its micro-batches is divided by the window's real size,
      so every step averages the gradients of exactly the batches in it (the 2 of the last
      window are divided by 2). 3 steps per epoch. timm's train.py does this.
    * ``"as_full"``: divided by ``steps`` as if the window were full, so its step is
      smaller in proportion to the batches it holds (the 2 are divided by 4): the
      ``loss / accumulation_steps`` of a hand-written loop, and accelerate's
      ``accumulate`` (the transformers example scripts built on it). 3 steps per epoch.
    * ``"drop"``: it makes no step; its gradients are dropped at its last batch, as a hand
      loop that steps on ``(i + 1) % k == 0`` and zeroes the gradients at each epoch start.
      ``loop.steps_per_epoch`` is ``batches // steps`` (2 here), and an epoch shorter than
      one window makes no step. Its micro-batches still run forward and backward, and
      their losses count in ``train_loss``.

    The loss division is a per-micro-batch mean (each micro-batch weighs the same), as the
    usual ``loss / accumulation_steps``. Data without a length (an ``IterableDataset``, a
    generator) works too: the loop looks one batch ahead to find where the data ends. With
    ``"mean"``, the micro-batches of the last window were divided by ``steps`` before its
    size was known, so its gradients are multiplied by ``steps / size`` after its last
    backward: the same step as dividing by the real size.

    The window is the loop's geometry: ``loop.accumulation_steps`` is reset to 1 at every
    fit and set again by this callback's ``setup``, so removing the callback removes it.
    A loop that steps on a condition of its own sets ``loop.state.step_boundary`` from a
    callback instead (docs/concepts.md, "One optimizer step, in detail").

    Args:
        steps: Micro-batches per optimizer step (1 means no accumulation).
        last_window: ``"mean"``, ``"as_full"`` or ``"drop"``: the epoch's last, partial
            window, above.

    Raises:
        ConfigurationError: ``steps`` is not an int >= 1, or ``last_window`` is not one of
            the three.

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
        >>> loop.callbacks = [GradAccumulation(4, last_window="drop")]
        >>> loop.fit(2).step - 3
        hookloop: training ended at epoch 2/2, step 5: all 2 epochs are done.
        2
    """

    unique = True

    def __init__(self, steps: int, *, last_window: str = "mean") -> None:
        self.steps = check_int("GradAccumulation steps", steps,
                               hint="It counts the micro-batches per optimizer step; 1 means "
                                    "no accumulation.")
        self.last_window = check_choice(
            "GradAccumulation last_window", last_window, LAST_WINDOW,
            hint="'mean' divides the epoch's last, partial window by its real size, "
                 "'as_full' by steps, 'drop' makes no step for it.")
        self._batches: int | None = 0
        self._dropping = False
        self._sized = False  # the training data has a length (read at setup)

    def __repr__(self) -> str:
        extra = "" if self.last_window == "mean" else f", last_window={self.last_window!r}"
        return f"GradAccumulation({self.steps}{extra})"

    def setup(self, loop: Loop) -> None:
        """Set ``loop.accumulation_steps`` (and, with ``"drop"``, that the partial window
        makes no step, for ``loop.steps_per_epoch``)."""
        loop.accumulation_steps = self.steps
        loop.partial_window_steps = self.last_window != "drop"
        # Whether the data has a length: a later setup (DDP's) may shard it, which changes
        # its length, not whether it has one.
        self._sized = loop.batches_per_epoch is not None

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

    @property
    def _silent_events(self) -> tuple[str, ...]:
        """Without ``"drop"``, nothing to do at a batch start: not called there; nor after a
        backward, unless ``"mean"`` rescales a window that data without a length cut short."""
        if self.last_window == "drop":
            return ()
        silent = ["on_batch_start"]
        if self.last_window != "mean" or self._sized:
            silent.append("after_backward")
        return tuple(name for name in silent  # a subclass's own method is called
                     if getattr(type(self), name) is getattr(GradAccumulation, name))

    def on_batch_start(self, loop: Loop) -> None:
        """With ``"drop"``: the batch that ends the data inside a window is no boundary.

        Cleared before forward, so `DDP` runs it under ``no_sync`` like the window's others.
        """
        state = loop.state
        self._dropping = (self.last_window == "drop" and state.step_boundary
                          and (state.batch_idx + 1) % self.steps != 0)
        if self._dropping:
            state.step_boundary = False

    def scale_loss(self, loop: Loop, loss: torch.Tensor) -> torch.Tensor:
        """The loss divided by the real size of the current window (``"mean"``) or by
        ``steps``."""
        steps = self.steps
        if self.last_window == "mean":
            batch_idx, batches = loop.state.batch_idx, self._batches
            # `window_size` inline where the window is whole (all but an epoch's last)
            whole = batches is not None and batch_idx - batch_idx % steps + steps <= batches
            size = steps if whole else self.window_size(batch_idx)
        else:
            size = steps
        return loss if size == 1 else loss / size

    def after_backward(self, loop: Loop) -> None:
        """Drop the gradients of a dropped window; with ``"mean"`` and data without a
        length, rescale those of a window the data cut short."""
        state = loop.state
        # Tested before any grad-mode context: this runs after every backward, and
        # entering torch.no_grad() costs more than the rest of the call.
        if self._dropping:
            self._dropping = False
            loop.optimizer.zero_grad(set_to_none=True)
            return
        if self.last_window != "mean" or self._batches is not None or not state.step_boundary:
            return
        size = state.batch_idx % self.steps + 1
        if size == self.steps:
            return
        grads = [param.grad for group in loop.optimizer.param_groups for param in group["params"]
                 if param.grad is not None]
        if grads:
            with torch.no_grad():
                foreach_mul_(grads, self.steps / size)
