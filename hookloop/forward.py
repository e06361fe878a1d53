"""How the loop gets outputs and loss from a batch: the four rules of the SPEC."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookloop.data import is_pair
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["compute", "check_loss"]


def compute(loop: Loop, batch: Any) -> tuple[Any, torch.Tensor]:
    """Outputs and loss of one batch, by the first rule that applies.

    1. ``loop.forward(loop, batch) -> (outputs, loss)`` when given.
    2. An ``(inputs, targets)`` pair with ``loop.loss_fn``: ``loss_fn(model(inputs), targets)``.
    3. A mapping: ``outputs = model(**batch)`` and ``outputs["loss"]`` or ``outputs.loss``.
    4. Otherwise a `ConfigurationError` saying which of the three to use.
    """
    if loop.forward is not None:
        result = loop.forward(loop, batch)
        if not isinstance(result, tuple) or len(result) != 2:
            raise ConfigurationError(
                f"forward(loop, batch) must return (outputs, loss); it returned "
                f"{type(result).__name__}.")
        return result
    if is_pair(batch) and loop.loss_fn is not None:
        inputs, targets = batch
        outputs = loop.model(inputs)
        return outputs, loop.loss_fn(outputs, targets)
    if isinstance(batch, Mapping):
        outputs = loop.model(**batch)
        if isinstance(outputs, Mapping) and outputs.get("loss") is not None:
            return outputs, outputs["loss"]
        if not isinstance(outputs, Mapping) and getattr(outputs, "loss", None) is not None:
            return outputs, outputs.loss
        keys = f" (keys: {', '.join(map(str, outputs))})" if isinstance(outputs, Mapping) else ""
        raise ConfigurationError(
            f"The batch is a mapping, so the model was called as model(**batch), but its "
            f"output, a {type(outputs).__name__}{keys}, has no 'loss'. Return the loss from "
            "the model (outputs['loss'] or outputs.loss), or pass forward=fn(loop, batch) -> "
            "(outputs, loss) to the Loop.")
    if is_pair(batch):
        raise ConfigurationError(
            "The batch is an (inputs, targets) pair but the Loop has no loss_fn. Pass "
            "loss_fn=fn(outputs, targets) (e.g. torch.nn.functional.cross_entropy), or "
            "forward=fn(loop, batch) -> (outputs, loss).")
    raise ConfigurationError(
        f"Cannot compute a loss from a batch of type {type(batch).__name__}. Use one of: "
        "forward=fn(loop, batch) -> (outputs, loss); (inputs, targets) batches with "
        "loss_fn=fn(outputs, targets); or mapping batches with a model returning a 'loss'.")


def check_loss(loss: Any, training: bool) -> None:
    """Raise unless ``loss`` is a scalar tensor (that requires grad, in training).

    Reads only metadata (type, shape, requires_grad): no device sync.
    """
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationError(f"The loss must be a scalar tensor, got {type(loss).__name__}.")
    if loss.dim() != 0:
        raise ConfigurationError(
            f"The loss must be a scalar tensor, but it has shape {tuple(loss.shape)}. "
            "Reduce it (loss.mean()) or use a loss function with reduction='mean'.")
    if training and not loss.requires_grad:
        raise ConfigurationError(
            "The loss does not require grad, so backward cannot run: it was detached, "
            "computed under torch.no_grad(), or no trainable parameter took part in it.")
