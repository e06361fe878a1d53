"""The one helper that finds the user's module inside training wrappers."""

from __future__ import annotations

from torch import nn

from hookloop.base.compat import compiled_original

__all__ = ["unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` without DistributedDataParallel, DataParallel or ``torch.compile`` wrappers.

    Example:
        >>> import torch
        >>> inner = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(inner)) is inner
        True
    """
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif (original := compiled_original(model)) is not None:
            model = original
        else:
            return model
