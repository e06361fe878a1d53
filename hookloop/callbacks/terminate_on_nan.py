"""`TerminateOnNaN`: stop at the first non-finite training loss, before it reaches the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hookloop import distributed
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["TerminateOnNaN"]


class TerminateOnNaN(Callback):
    """Skip the optimizer step of a non-finite loss and end training at once.

    After each forward pass the loss's finiteness is folded into a flag that stays on the
    device; at the step boundary (``before_step``) the flag is read once, so there is one
    host sync per optimizer step (with ``GradAccumulation(k)``, one per ``k`` batches),
    never one per micro-batch. When any micro-batch of the window had a NaN or infinite
    loss, on any rank (``hookloop.distributed.any_true``), the step is cancelled, so the
    weights keep their last finite values, and ``loop.stop()`` ends training before the
    next batch; ``on_epoch_end`` and ``on_fit_end`` still fire. The message names the epoch,
    the batch and the step; it is printed on rank 0 and kept in ``loop.stop_reason``.

    It looks at the true loss (``loop.state.loss``), not at gradients: an AMP float16
    overflow (finite loss, infinite scaled gradients) is left to the GradScaler.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import TerminateOnNaN
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.full((4, 1), float("nan")))]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, callbacks=[TerminateOnNaN()],
        ...             device="cpu")
        >>> loop.fit(3).step  # doctest: +ELLIPSIS
        TerminateOnNaN: non-finite loss in epoch 0, batch 0...
        0
    """

    unique = True

    def __init__(self) -> None:
        self._bad: torch.Tensor | None = None

    def on_fit_start(self, loop: Loop) -> None:
        self._bad = None

    def after_forward(self, loop: Loop) -> None:
        loss = loop.state.loss
        assert loss is not None
        not_finite = ~torch.isfinite(loss.detach())
        self._bad = not_finite if self._bad is None else self._bad | not_finite

    def before_step(self, loop: Loop) -> None:
        bad, self._bad = self._bad, None
        local = bool(bad.item()) if bad is not None else False  # the one sync per step
        if not distributed.any_true(local):
            return
        loop.cancel_step()
        state = loop.state
        window = loop.accumulation_steps
        where = (f"batch {state.batch_idx}" if window == 1
                 else f"the accumulation window ending at batch {state.batch_idx}")
        message = (f"TerminateOnNaN: non-finite loss in epoch {state.epoch}, {where}, at "
                   f"optimizer step {state.step + 1}; that step was skipped (the weights are "
                   f"those after step {state.step}) and training stops.")
        if distributed.is_main():
            print(message, flush=True)
        loop.stop(message)
