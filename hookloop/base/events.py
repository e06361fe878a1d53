"""The events of the loop, declared once, in firing order."""

from __future__ import annotations

from enum import Enum

__all__ = ["Event", "HOOKS"]


class Event(str, Enum):
    """Every event the loop emits; the value is the name of the `Callback` method.

    The loop, in pseudocode (a test replays recorded event traces against it)::

        fit(epochs):
            setup                          every callback's setup(); the model is moved to
                                           the device; a pending load_state_dict is applied
            on_fit_start
            if sanity_val_batches:         the sanity check (to metric producers only):
                validate(sanity_val_batches)   its metrics and every random stream are put back
            for epoch in range(start_epoch, epochs):
                on_epoch_start
                for batch in train_data:   past the batches a resumed run trained on already
                    on_batch_start         state.batch is on the device; model.train()
                    outputs, loss = forward(batch)       inside forward_context (autocast)
                    after_forward          state.outputs, state.loss (the true loss)
                    scale_loss(loss).backward()          inside train_step_context (no_sync)
                    after_backward         gradients are populated
                    if state.step_boundary:              False inside an accumulation window
                        before_step        a callback may cancel the step
                        optimizer step     routed through a callback (AMP) if one does
                        if the optimizer really stepped:
                            after_step     state.step counts it already
                        optimizer.zero_grad()
                        if it stepped and state.step % val_every_n_steps == 0:
                            validate()
                    on_batch_end
                if the epoch ran through its data and (epoch + 1) % val_every_n_epochs == 0:
                    validate(limit=None):  model.eval(), torch.no_grad(), validation_context
                        on_validation_start
                        for batch in val_data[:limit]:
                            on_validation_batch_start
                            on_validation_batch_end    state.outputs, state.loss of the batch
                        on_validation_end  state.metrics holds val_loss and the metrics
                on_epoch_end
            on_fit_end                     always, also after a stop or an exception
            on_exception(exc)              instead, before on_fit_end, when anything raised

    ``stop()`` ends training at the next step boundary (``on_epoch_end`` and
    ``on_fit_end`` still fire). Events that no callback overrides cost nothing.
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
