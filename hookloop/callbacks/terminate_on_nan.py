"""`TerminateOnNaN`: stop at the first non-finite loss or gradient, before it reaches the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.base.checks import check_flag
from hookloop.base.compat import foreach_copy_
from hookloop.callback import Callback
from hookloop.engine.grads import total_norm
from hookloop.errors import ConfigurationError, NonFiniteError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["TerminateOnNaN"]


class TerminateOnNaN(Callback):
    """Skip the optimizer step of a non-finite loss or gradient and end training at once.

    After each forward pass the loss's finiteness is folded into a flag that stays on the
    device; at the step boundary (``before_step``) the gradients' finiteness is folded in
    too (their largest absolute value, one fused reduction over the gradients, no sync) and
    the flag is read once: one host sync per optimizer step (with ``GradAccumulation(k)``,
    one per ``k`` batches), never one per micro-batch. When any micro-batch of the window
    had a NaN or infinite loss, or the accumulated gradients hold one, on any rank
    (``hookloop.distributed.any_true``), the step is cancelled, so the parameters keep the
    values of the last good step, and ``loop.stop()`` ends training before the next batch;
    ``on_epoch_end`` and ``on_fit_end`` still fire. The message names what was non-finite,
    the epoch, the batch and the step; it is printed on rank 0 and kept in
    ``loop.stop_reason``.

    Buffers: a forward pass in training mode updates BatchNorm running statistics, and a
    NaN input poisons them before any loss is seen. With ``restore_buffers`` (default) the
    model's buffers are copied at every good step boundary (one on-device copy of the
    buffers per step, no sync; BatchNorm statistics are small next to the weights) and put
    back when the step is cancelled, so the whole model is that of the last good step.

    Under `AMP` with a GradScaler (float16: ``loop.scaler`` is set), non-finite gradients
    are the scaler's business: an overflow skips the step and lowers the scale, so only the
    loss is checked then. With float32 or bfloat16 there is no scaler and a non-finite
    gradient is a real fault.

    Args:
        check_gradients: Also stop on non-finite gradients with a finite loss (costs one
            reduction over the gradients per step).
        restore_buffers: Put the model's buffers back as they were at the last good step.
        raise_error: Raise `hookloop.errors.NonFiniteError` (after skipping the step and
            putting the buffers back) instead of stopping quietly, so that a script, a job
            scheduler or a hyper-parameter search sees a failure. ``Checkpoint`` still saves
            the last good step on the way out.

    Raises:
        ConfigurationError: positional arguments, or flags that are not bools.

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
        hookloop: training ended at epoch 1/3, step 0: TerminateOnNaN: non-finite loss in epoch 1...
        0
    """

    unique = True

    def __init__(self, *unexpected: Any, check_gradients: bool = True,
                 restore_buffers: bool = True, raise_error: bool = False) -> None:
        if unexpected:
            raise ConfigurationError(
                f"TerminateOnNaN takes no positional arguments, got {unexpected!r}. Its "
                "options are keywords: TerminateOnNaN(check_gradients=True, "
                "restore_buffers=True, raise_error=False).")
        self.check_gradients = check_flag("TerminateOnNaN check_gradients", check_gradients)
        self.restore_buffers = check_flag("TerminateOnNaN restore_buffers", restore_buffers)
        self.raise_error = check_flag("TerminateOnNaN raise_error", raise_error)
        self._bad_loss: torch.Tensor | None = None
        self._gradients_checked = check_gradients
        self._buffers: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] | None = None

    def __repr__(self) -> str:
        options = [f"{label}=False" for label, value in
                   (("check_gradients", self.check_gradients),
                    ("restore_buffers", self.restore_buffers)) if not value]
        options += ["raise_error=True"] if self.raise_error else []
        return f"TerminateOnNaN({', '.join(options)})"

    def on_fit_start(self, loop: Loop) -> None:
        self._bad_loss = None
        # A GradScaler owns non-finite gradients: they are its overflow signal.
        self._gradients_checked = self.check_gradients and loop.scaler is None
        self._buffers = list(loop.unwrapped_model.buffers()) if self.restore_buffers else []
        self._saved = None  # taken at the first batch: after every on_fit_start (a resume)

    def on_batch_start(self, loop: Loop) -> None:
        if self._buffers and self._saved is None:
            self._save_buffers()

    def after_forward(self, loop: Loop) -> None:
        loss = loop.state.loss
        assert loss is not None
        not_finite = ~torch.isfinite(loss.detach())
        self._bad_loss = not_finite if self._bad_loss is None else self._bad_loss | not_finite

    def before_step(self, loop: Loop) -> None:
        bad_loss, self._bad_loss = self._bad_loss, None
        bad_gradients = self._gradients_not_finite(loop) if self._gradients_checked else None
        # Both flags in one number (bit 0: loss, bit 1: gradients), so one read suffices.
        code: torch.Tensor | None = None
        if bad_loss is not None:
            code = bad_loss.reshape(()).to(torch.uint8)
        if bad_gradients is not None:
            gradients_bit = bad_gradients.reshape(()).to(torch.uint8) * 2
            code = gradients_bit if code is None else code + gradients_bit.to(code.device)
        value = int(code.item()) if code is not None else 0  # the one sync per step
        loss_local, gradients_local = bool(value & 1), bool(value & 2)
        if not distributed.any_true(loss_local or gradients_local):
            if self._buffers:
                self._save_buffers()  # the statistics of this good window
            return
        loop.cancel_step()
        if self._buffers and self._saved is not None:
            with torch.no_grad():
                foreach_copy_(self._buffers, self._saved)
        state = loop.state
        window = loop.accumulation_steps
        where = (f"batch {state.batch_idx}" if window == 1
                 else f"the accumulation window ending at batch {state.batch_idx}")
        if loss_local:
            what = "non-finite loss"
        elif gradients_local:
            what = "non-finite gradients (with a finite loss)"
        else:
            what = "a non-finite loss or gradient on another rank"
        if self._buffers:
            buffers = " and its buffers (BatchNorm statistics) were put back as they were then"
        elif self.restore_buffers or not any(True for _ in loop.unwrapped_model.buffers()):
            buffers = ""
        else:
            buffers = (", but its buffers (BatchNorm statistics) may hold values of the bad "
                       "forward pass (restore_buffers=False)")
        message = (f"TerminateOnNaN: {what} in epoch {state.epoch + 1}, {where}, at optimizer step "
                   f"{state.step + 1}; that step was skipped, so the model's parameters are "
                   f"those after step {state.step}{buffers}; training stops.")
        if self.raise_error:
            raise NonFiniteError(message)
        # Not held by fit(min_epochs=...): training on from here would train on NaN.
        loop.stop(message, force=True)  # the loop prints it at fit end, as the reason

    def _gradients_not_finite(self, loop: Loop) -> torch.Tensor | None:
        gradients = [parameter.grad for group in loop.optimizer.param_groups
                     for parameter in group["params"] if parameter.grad is not None]
        if not gradients:
            return None
        # inf for an inf, NaN for a NaN (amax propagates it), finite otherwise.
        largest = total_norm(gradients, float("inf"))
        return ~torch.isfinite(largest)

    def _save_buffers(self) -> None:
        if self._saved is None:
            self._saved = [buffer.detach().clone() for buffer in self._buffers]
        else:
            with torch.no_grad():
                foreach_copy_(self._saved, self._buffers)
