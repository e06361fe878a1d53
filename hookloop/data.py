"""Batch helpers: moving nested batches to a device, finding targets and batch sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from hookloop import distributed
from hookloop.errors import ConfigurationError

__all__ = ["move_to_device", "find_targets", "batch_size_of", "is_pair", "length_of", "Lookahead",
           "LossSum"]


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


def _batched_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor with a batch dimension: direct items first, then nested ones."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() > 0 else None
    items = list(value.values()) if isinstance(value, Mapping) else value
    if not isinstance(items, (tuple, list)):
        return None
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            return item
    for item in items:
        if isinstance(item, (Mapping, tuple, list)):
            found = _batched_tensor(item)
            if found is not None:
                return found
    return None


def batch_size_of(batch: Any, targets: Any = None) -> int:
    """Number of samples in a batch, read from shapes and lengths only (no device sync).

    The length of the targets (a tensor's first dimension, or a list's length), else the
    first dimension of the first batched tensor of the batch, looking at its direct items
    before nested ones; else 1.
    """
    if isinstance(targets, torch.Tensor) and targets.dim() > 0:
        return int(targets.shape[0])
    if isinstance(targets, (list, tuple)) and targets:
        return len(targets)
    tensor = _batched_tensor(batch)
    return 1 if tensor is None else int(tensor.shape[0])


def length_of(data: Any) -> int | None:
    """``len(data)``, or None for data without a length (an iterable dataset, a generator)."""
    try:
        return len(data)
    except TypeError:
        return None


class Lookahead:
    """An iterator that knows, once it has yielded an item, whether another one follows.

    ``snapshot()``, when given, is called before each item is fetched, and its result kept
    in ``pending_snapshot`` for the item fetched but not yet yielded: the random state that
    item was drawn with (a resume fetches it again with the same draws).
    """

    __slots__ = ("_iterator", "_next", "_snapshot", "exhausted", "pending_snapshot")
    _EMPTY = object()

    def __init__(self, iterator: Iterator[Any], snapshot: Callable[[], Any] | None = None) -> None:
        self._iterator = iterator
        self._snapshot = snapshot
        self._next = self._fetch()
        self.exhausted = self._next is self._EMPTY

    def _fetch(self) -> Any:
        self.pending_snapshot = self._snapshot() if self._snapshot is not None else None
        return next(self._iterator, self._EMPTY)

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._next is self._EMPTY:
            raise StopIteration
        item, self._next = self._next, self._fetch()
        self.exhausted = self._next is self._EMPTY
        return item


class LossSum:
    """A sample-weighted sum of batch losses, kept on the device and read once.

    Adding costs one device operation and no host sync; `mean` reduces over all ranks
    with one all-reduce and reads the result once.

    Example:
        >>> losses = LossSum(torch.device("cpu"))
        >>> losses.add(torch.tensor(1.0), 2); losses.add(torch.tensor(4.0), 1)
        >>> losses.mean()
        2.0
    """

    __slots__ = ("total", "samples")

    def __init__(self, device: torch.device, total: torch.Tensor | None = None,
                 samples: int = 0) -> None:
        if total is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            total = torch.zeros((), dtype=dtype, device=device)
        self.total, self.samples = total, samples

    def add(self, loss: torch.Tensor, batch_size: int) -> None:
        """Add a batch's loss weighted by its size."""
        self.total = torch.add(self.total, loss.detach(), alpha=batch_size)
        self.samples += batch_size

    def mean(self, *, empty: str = "the data") -> float:
        """The mean over every rank's samples: one all-reduce, one host read.

        Raises:
            ConfigurationError: no rank saw a sample (``empty`` names the data).
        """
        totals = distributed.all_reduce_sum(
            torch.stack([self.total, self.total.new_tensor(self.samples)]))
        total, samples = totals.tolist()
        if samples == 0:
            raise ConfigurationError(f"{empty} yielded no batches: it is empty.")
        return total / samples
