"""Batch helpers: moving nested batches to a device, finding targets and batch sizes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["move_to_device", "find_targets", "batch_size_of", "is_pair", "length_of"]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor nested in tuples, lists, dicts and namedtuples to ``device``.

    Copies are non-blocking; containers keep their type; other objects pass through.

    Example:
        >>> move_to_device({"x": [torch.ones(2)]}, torch.device("cpu"))["x"][0]
        tensor([1., 1.])
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {key: move_to_device(value, device) for key, value in batch.items()}
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if isinstance(batch, tuple):
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(move_to_device(value, device) for value in batch))
        return tuple(move_to_device(value, device) for value in batch)
    if isinstance(batch, list):
        return [move_to_device(value, device) for value in batch]
    return batch


def is_pair(batch: Any) -> bool:
    """True for an ``(inputs, targets)`` batch: a plain tuple or list of two items."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields")


def find_targets(batch: Any) -> Any:
    """The targets of a batch: item 1 of a pair, or ``labels``/``targets`` of a mapping."""
    if is_pair(batch):
        return batch[1]
    if isinstance(batch, Mapping):
        if "labels" in batch:
            return batch["labels"]
        return batch.get("targets")
    return None


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def batch_size_of(batch: Any, targets: Any = None) -> int:
    """Number of samples in a batch, read from shapes only (no device sync).

    The targets' first dimension when they are a tensor, else the first dimension of the
    first tensor found in the batch, else 1.
    """
    tensor = targets if isinstance(targets, torch.Tensor) else _first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        return 1
    return int(tensor.shape[0])


def length_of(data: Any) -> int | None:
    """``len(data)``, or None for data without a length (an iterable dataset, a generator)."""
    try:
        return len(data)
    except TypeError:
        return None
