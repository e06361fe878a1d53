"""Batch helpers: moving nested batches to a device, finding targets and batch sizes; and
the keeper that lets the DataLoader workers of a collected loop stop at once
(`worker_queues_kept`)."""

from __future__ import annotations

import gc
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from hookloop import distributed
from hookloop.base.compat import worker_queues
from hookloop.errors import ConfigurationError

__all__ = ["move_to_device", "find_targets", "batch_size_of", "is_pair", "length_of", "Lookahead",
           "LossSum", "LossMark", "worker_queues_kept"]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor nested in tuples, lists, dicts and namedtuples to ``device``.

    Copies are non-blocking; containers keep their type; other objects pass through.

    Example:
        >>> move_to_device({"x": [torch.ones(2)]}, torch.device("cpu"))["x"][0]
        tensor([1., 1.])
    """
    if isinstance(batch, torch.Tensor):
        # Comparing devices is cheaper than .to(), which returns the same tensor anyway.
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    kind = type(batch)
    if kind is tuple or kind is list:  # the usual (inputs, targets): no namedtuple test
        moved = [value if isinstance(value, torch.Tensor) and value.device == device
                 else move_to_device(value, device) for value in batch]
        return moved if kind is list else tuple(moved)
    if isinstance(batch, Mapping):
        mapped = {key: move_to_device(value, device) for key, value in batch.items()}
        if type(batch) is dict:
            return mapped
        try:
            return type(batch)(mapped)  # type: ignore[call-arg]  # a dict subclass takes one
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
    kind = type(batch)
    if kind is tuple or kind is list:  # the usual batch: no failed attribute lookup
        return len(batch) == 2
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


def _folded(total: torch.Tensor, losses: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``total + sizes[0] * losses[0] + sizes[1] * losses[1] + ...``, added in that order.

    One sequential sum (``cumsum``) on the device: on the CPU every partial sum is rounded
    as a per-batch ``torch.add(total, loss, alpha=size)`` would round it (each product of a
    float32 loss and an int size is exact in float64), so the result does not depend on
    how the losses were grouped. Consecutive equal sizes are weighted by one multiply (no
    host-to-device copy of the sizes).
    """
    if not losses:
        return total
    runs, start = [], 0
    for index in range(1, len(sizes) + 1):
        if index == len(sizes) or sizes[index] != sizes[start]:
            values = torch.stack(losses[start:index]).to(total.dtype)
            runs.append(values * sizes[start])
            start = index
    return torch.cat([total.reshape(1), *runs]).cumsum(0)[-1]


class LossMark(NamedTuple):
    """A `LossSum` as it was at one moment (a step boundary), resolved only when read.

    The lists are only appended to after that moment (a fold starts new ones), so their
    first ``count`` items are that moment's. Taking one costs no device operation.
    """

    total: torch.Tensor
    losses: list[torch.Tensor]
    sizes: list[int]
    count: int  # type: ignore[assignment]  # the field, over tuple's count() method

    def resolved(self) -> torch.Tensor:
        """The sample-weighted sum at that moment, on the device."""
        count = self.count
        return _folded(self.total, self.losses[:count], self.sizes[:count])


_new_tuple = tuple.__new__  # LossMark(...) without the Python-level __new__ of a NamedTuple


class LossSum:
    """A sample-weighted sum of batch losses, kept on the device and read once.

    Adding keeps the detached loss and costs no device operation; every `FOLD` losses (and
    whenever the total is read) they are summed into a float64 total on the device, in
    their order (`_folded`): the same total as adding each loss as it comes. `mean`
    reduces over all ranks with one all-reduce and reads the result once; `mark` is the sum
    as it is now, for the position of a step boundary.

    Example:
        >>> losses = LossSum(torch.device("cpu"))
        >>> losses.add(torch.tensor(1.0), 2); losses.add(torch.tensor(4.0), 1)
        >>> losses.mean()
        2.0
    """

    __slots__ = ("_total", "_losses", "_sizes", "samples")

    #: Losses kept before they are summed: one fold of a few device operations per this
    #: many batches, and as many scalar tensors alive at most.
    FOLD = 64

    def __init__(self, device: torch.device, total: torch.Tensor | None = None,
                 samples: int = 0) -> None:
        if total is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            total = torch.zeros((), dtype=dtype, device=device)
        self._total, self.samples = total, samples
        self._losses: list[torch.Tensor] = []
        self._sizes: list[int] = []

    def add(self, loss: torch.Tensor, batch_size: int, weight: int | None = None) -> None:
        """Add a batch's loss weighted by its size (or by ``weight``: 1 for a loss that is
        already the sum over the batch's samples)."""
        losses = self._losses
        losses.append(loss.detach())
        self._sizes.append(batch_size if weight is None else weight)
        self.samples += batch_size
        if len(losses) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        self._total = _folded(self._total, self._losses, self._sizes)
        self._losses, self._sizes = [], []  # new lists: a LossMark keeps the old ones

    @property
    def total(self) -> torch.Tensor:
        """The sample-weighted sum so far, on the device."""
        self._fold()
        return self._total

    def mark(self) -> LossMark:
        """The sum as it is now, resolved when read (a step boundary's position)."""
        losses = self._losses
        return _new_tuple(LossMark, (self._total, losses, self._sizes, len(losses)))

    def mean(self, *, empty: str = "the data") -> float:
        """The mean over every rank's samples: one all-reduce, one host read.

        Raises:
            ConfigurationError: no rank saw a sample (``empty`` names the data).
        """
        total = self.total
        totals = distributed.data_parallel_sum(torch.stack([total, total.new_tensor(self.samples)]))
        total_value, samples = totals.tolist()
        if samples == 0:
            raise ConfigurationError(f"{empty} yielded no batches: it is empty.")
        return total_value / samples


#: What `worker_queues_kept` does not search: the data and plain values.
_NOT_SEARCHED = (torch.Tensor, torch.utils.data.Dataset, torch.utils.data.Sampler, str, bytes,
                 type, types.FunctionType, types.ModuleType)  # not into a script's globals


def _let_go(*queues: Any) -> None:
    """The keeper's end (`worker_queues_kept`): it only held the queues."""


def worker_queues_kept(previous: Any, owner: Any, *roots: Any) -> weakref.finalize | None:
    """Keep the queues of the DataLoader workers behind ``roots`` (loaders with persistent
    workers, the iterator of an epoch cut short, kept to be continued) until ``owner`` is
    gone; ``previous`` (an earlier keeper) lets go of its own.

    A loop is freed by Python's cyclic garbage collector, and its loaders' iterators with
    it. The collector may close the workers' queues (multiprocessing's finalizers) before
    an iterator's ``__del__`` stops its workers through them; torch then waits 5 s for each
    worker (``MP_STATUS_CHECK_INTERVAL``) and terminates it. Held here, the queues are not
    part of that garbage: the workers get their stop message and exit at once. Searched a
    few hundred objects down from ``roots`` (once a fit), not the datasets and samplers.

    Returns:
        The keeper (a `weakref.finalize` of ``owner``), or None with no worker behind ``roots``.
    """
    if previous is not None:
        previous.detach()
    queues: list[Any] = []
    seen: set[int] = set()
    todo = deque(root for root in roots if root is not None)
    while todo and len(seen) < 512:  # nearest first
        item = todo.popleft()
        if id(item) in seen or isinstance(item, _NOT_SEARCHED) or (
                isinstance(item, (list, tuple, dict, set)) and len(item) > 256):
            continue  # the data: no DataLoader iterator is there, and it may be large
        seen.add(id(item))
        found = worker_queues(item)
        if found is not None:
            queues += found
            continue
        todo.extend(gc.get_referents(item))
    return weakref.finalize(owner, _let_go, *queues) if queues else None
