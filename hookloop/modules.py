"""The one helper that finds the user's module inside training wrappers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["unwrap", "modes_kept", "tensors_kept"]


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
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


@contextmanager
def modes_kept(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule's train/eval mode back as it was (a frozen BatchNorm stays in
    eval mode), whatever the block sets.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> _ = model[1].eval()
        >>> with modes_kept(model):
        ...     _ = model.train()
        >>> model[1].training
        False
    """
    modes = [(module, module.training) for module in model.modules()]
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


@contextmanager
def tensors_kept(model: nn.Module) -> Iterator[nn.Module]:
    """Put every parameter and buffer back as it was, non-persistent buffers included."""
    with torch.no_grad():
        saved = [(tensor, tensor.detach().clone()) for tensor in
                 (*model.parameters(), *model.buffers())]
    try:
        yield model
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)
