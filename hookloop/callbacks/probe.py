"""Run a model for inspection (a summary, a graph trace) without changing anything of the run.

Shared by `ModelSummary` and `TensorBoard(graph=True)`: a probing forward pass must not
change the model's train/eval modes, its buffers (BatchNorm running statistics), its
gradients, or the random number streams that drive dropout and data order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["model_inputs", "untouched"]


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Inside: eval mode and no gradients; on exit, modes, buffers and RNG states as before.

    Example:
        >>> import torch
        >>> model = torch.nn.BatchNorm1d(3)
        >>> with untouched(model):
        ...     _ = model(torch.randn(4, 3) + 5)
        >>> model.training, float(model.running_mean.abs().sum())
        (True, 0.0)
    """
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    devices = [device.index for device in {b.device for _, b in buffers}
               | {p.device for p in model.parameters()} if device.type == "cuda"]
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            model.eval()
            yield
        finally:
            for buffer, saved in buffers:
                buffer.copy_(saved)
            for module, training in modes:
                module.training = training


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
