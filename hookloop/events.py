"""The events of the loop, declared once, in firing order."""

from __future__ import annotations

from enum import Enum

__all__ = ["Event", "HOOKS"]


class Event(str, Enum):
    """Every event the loop emits; the value is the name of the `Callback` method.

    The loop, in pseudocode (``*`` marks events that fire only when a callback listens)::

        on_fit_start
        for epoch in range(start_epoch, epochs):
            on_epoch_start
            model.train()
            for batch in train_data:
                on_batch_start                 state.batch is on the device
                outputs, loss = forward(batch)
                after_forward                  state.outputs, state.loss (the true loss)
                loss_for_backward.backward()
                after_backward                 gradients are populated
                if state.step_boundary:        (False inside an accumulation window)
                    before_step                a callback may cancel the step
                    optimizer step             routed through a callback (AMP) if one does
                    after_step                 only if the optimizer really stepped
                    optimizer.zero_grad()
                on_batch_end
            if val_data is not None:
                on_validation_start
                for batch in val_data:         model.eval(), torch.no_grad()
                    on_validation_batch_start
                    on_validation_batch_end    state.outputs, state.loss of this batch
                on_validation_end              state.metrics has this epoch's metrics
            on_epoch_end
        on_fit_end                             always, also after a stop or an exception
        on_exception(exc)                      before on_fit_end when anything raised
    """

    ON_FIT_START = "on_fit_start"
    ON_EPOCH_START = "on_epoch_start"
    ON_BATCH_START = "on_batch_start"
    AFTER_FORWARD = "after_forward"
    AFTER_BACKWARD = "after_backward"
    BEFORE_STEP = "before_step"
    AFTER_STEP = "after_step"
    ON_BATCH_END = "on_batch_end"
    ON_VALIDATION_START = "on_validation_start"
    ON_VALIDATION_BATCH_START = "on_validation_batch_start"
    ON_VALIDATION_BATCH_END = "on_validation_batch_end"
    ON_VALIDATION_END = "on_validation_end"
    ON_EPOCH_END = "on_epoch_end"
    ON_FIT_END = "on_fit_end"
    ON_EXCEPTION = "on_exception"


#: Methods a callback may override that are not events: they change how the loop works.
#: ``setup`` runs before the model is moved and before ``on_fit_start``; the three
#: ``*_context`` hooks return a context manager (or None) that the loop enters;
#: ``scale_loss`` transforms the loss used for backward; ``optimizer_step`` routes the step.
HOOKS: tuple[str, ...] = (
    "setup",
    "forward_context",
    "train_step_context",
    "validation_context",
    "scale_loss",
    "optimizer_step",
    "state_dict",
    "load_state_dict",
)
