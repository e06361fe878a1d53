"""How the loop gets outputs and loss from a batch: the four rules of the SPEC."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookloop.data import is_pair, move_to_device
from hookloop.dispatch import Handlers, entered
from hookloop.errors import ConfigurationError, with_article

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["compute", "check_loss", "predict_outputs", "predict_all", "concatenate",
           "model_inputs"]


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
            f"output, {with_article(type(outputs).__name__)}{keys}, has no 'loss'. Return the "
            "loss from the model (outputs['loss'] or outputs.loss), or pass "
            "forward=fn(loop, batch) -> (outputs, loss) to the Loop.")
    if is_pair(batch):
        raise ConfigurationError(
            "The batch is an (inputs, targets) pair but the Loop has no loss_fn. Pass "
            "loss_fn=fn(outputs, targets) (e.g. torch.nn.functional.cross_entropy), or "
            "forward=fn(loop, batch) -> (outputs, loss).")
    raise ConfigurationError(
        f"Cannot compute a loss from a batch of type {type(batch).__name__}. Use one of: "
        "forward=fn(loop, batch) -> (outputs, loss); (inputs, targets) batches with "
        "loss_fn=fn(outputs, targets); or mapping batches with a model returning a 'loss'.")


def check_loss(loss: Any, training: bool, replaced: bool = False) -> None:
    """Raise unless ``loss`` is a scalar tensor (that requires grad, in training).

    Reads only metadata (type, shape, requires_grad): no device sync. ``replaced``: the
    loss is one a callback put in ``loop.state.loss`` in ``after_forward``.
    """
    what = "The loss a callback put in loop.state.loss in after_forward" if replaced else "The loss"
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationError(f"{what} must be a scalar tensor, got {type(loss).__name__}.")
    if loss.dim() != 0:
        raise ConfigurationError(
            f"{what} must be a scalar tensor, but it has shape {tuple(loss.shape)}. "
            "Reduce it (loss.mean()) or use a loss function with reduction='mean'.")
    if training and not loss.requires_grad:
        raise ConfigurationError(
            f"{what} does not require grad, so backward cannot run: it was detached, "
            "computed under torch.no_grad(), or no trainable parameter took part in it.")


def predict_outputs(loop: Loop, batch: Any) -> Any:
    """What the model returns for ``batch``, without needing targets or a loss.

    ``forward(loop, batch)`` when given (its outputs); the inputs of a pair (or the first
    item of any tuple or list); ``model(**batch)`` for a mapping; ``model(batch)`` otherwise.
    """
    if loop.forward is not None:
        result = loop.forward(loop, batch)
        return result[0] if isinstance(result, tuple) and len(result) == 2 else result
    if isinstance(batch, Mapping):
        return loop.model(**batch)
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields") and batch:
        return loop.model(batch[0])
    return loop.model(batch)


def predict_all(loop: Loop, data: Iterable[Any], contexts: Handlers) -> Any:
    """`predict_outputs` of every batch of ``data``, inside the ``forward_context`` hooks
    ``contexts``, moved to the CPU and joined with `concatenate`."""
    outputs: list[Any] = []
    cpu = torch.device("cpu")
    for batch in data:
        batch = move_to_device(batch, loop.device)
        with entered(contexts, loop):
            outputs.append(move_to_device(predict_outputs(loop, batch), cpu))
    return concatenate(outputs)


def concatenate(outputs: list[Any]) -> Any:
    """Per-batch outputs joined along the batch dimension where they are tensors.

    Tensors (with a batch dimension) are concatenated, also inside tuples, lists and
    mappings of the same structure in every batch; anything else stays a list of batches.

    Example:
        >>> concatenate([torch.zeros(2, 3), torch.ones(1, 3)]).shape
        torch.Size([3, 3])
        >>> {k: v.shape for k, v in concatenate([{"logits": torch.zeros(2, 4)}] * 2).items()}
        {'logits': torch.Size([4, 4])}
    """
    if not outputs:
        return []
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(item, torch.Tensor) and item.dim() > 0
               and item.shape[1:] == first.shape[1:] for item in outputs):
            return torch.cat(outputs)
        return outputs
    if isinstance(first, Mapping) and all(isinstance(item, Mapping) and item.keys() == first.keys()
                                          for item in outputs):
        joined = {key: concatenate([item[key] for item in outputs]) for key in first}
        try:
            return type(first)(joined) if type(first) is not dict else joined
        except TypeError:
            return joined
    if isinstance(first, (tuple, list)) and all(
            isinstance(item, type(first)) and len(item) == len(first) for item in outputs):
        columns = [concatenate([item[index] for item in outputs]) for index in range(len(first))]
        if hasattr(first, "_fields"):
            return type(first)(*columns)
        return type(first)(columns)
    return outputs


def model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """What the loop's built-in rules pass to the model: ``(args, kwargs)``, or None.

    An ``(inputs, targets)`` pair (or longer tuple/list) gives ``model(inputs)``; a mapping
    gives ``model(**batch)``; a lone tensor gives ``model(batch)``.

    Example:
        >>> import torch
        >>> args, kwargs = model_inputs((torch.zeros(2, 3), torch.zeros(2)))
        >>> args[0].shape, kwargs
        (torch.Size([2, 3]), {})
    """
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and batch:
        return (batch[0],), {}
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    return None
