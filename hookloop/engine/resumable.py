"""How the training data continues from a position inside an epoch, without reading again
what was trained on.

`data_source` sorts the training data into three kinds:

- ``"sampler"``: a torch ``DataLoader`` over a map-style dataset (any sampler or batch
  sampler: ``SequentialSampler``, ``RandomSampler``, ``DistributedSampler``, ``BatchSampler``,
  hookloop's own). A resume draws the sampler's index stream up to the position and drops
  those indices: no sample is loaded, transformed or collated. With ``num_workers > 0``
  each batch carries its worker's generator states (`WorkerStamp`), so that the workers of
  the resumed epoch start from the states the interrupted run's workers had at the step
  boundary.
- ``"stateful"``: data with ``state_dict()`` and ``load_state_dict()`` (torchdata's
  ``StatefulDataLoader``, an ``IterableDataset`` with that protocol, or a ``DataLoader``
  over one with ``num_workers=0``): its state at the step boundary is saved and loaded.
- ``"replay"``: anything else (a generator, a list, an iterable without state): the
  batches already trained on are fetched again and dropped.

On another number of ranks (`reshard_problem`), a ``DataLoader`` drawing from a torch
``DistributedSampler`` continues from a position in samples of the epoch's global order:
`rest_of_epoch` shards the samples of that order not trained on yet over the new ranks.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from hookloop.base.compat import loader_view, seed_worker_as
from hookloop.engine.rng import RNG_GENERATORS, RNG_NUMPY, RNG_PYTHON, RNG_TORCH, restore_rng
from hookloop.engine.worker_rng import SAME, StateReads, resolved

__all__ = ["data_source", "stateful_part", "SkipBatches", "WorkerStamp", "ResumedWorkers",
           "StampedBatches", "sampler_batches", "prefetched_batches"]


def stateful_part(data: Any) -> Any:
    """The object whose ``state_dict()``/``load_state_dict()`` say where ``data`` is, or None.

    ``data`` itself when it has both; else the dataset of a ``DataLoader`` with
    ``num_workers=0`` (its workers, with more, hold copies the main process cannot read).
    """
    if _has_state(data):
        return data
    if isinstance(data, DataLoader) and data.num_workers == 0 and _has_state(data.dataset):
        return data.dataset
    return None


def _has_state(item: Any) -> bool:
    return callable(getattr(item, "state_dict", None)) and \
        callable(getattr(item, "load_state_dict", None))


def data_source(data: Any) -> str:
    """``"stateful"``, ``"sampler"`` or ``"replay"``: how ``data`` resumes inside an epoch."""
    if stateful_part(data) is not None:
        return "stateful"
    if type(data).__iter__ is DataLoader.__iter__ and isinstance(data, DataLoader) and \
            not isinstance(data.dataset, IterableDataset):
        return "sampler"
    return "replay"


class SkipBatches:
    """An index sampler whose first iteration leaves out its first ``skip`` items (the
    batches of indices already trained on); later iterations are the sampler's own.

    The items are drawn when the iterator is first advanced, as the sampler's own would
    draw them (after the DataLoader drew its workers' base seed), or when `advance` is
    called; the samples behind them are never read. With ``ahead=(count, then)``, ``count``
    more items are drawn at once and kept for the iterator to yield, then ``then()`` is
    called: the sampler has drawn what the interrupted run's had at its position (its
    workers' prefetch), and ``then`` puts the generators back as they were there, so that
    what the sampler draws from here on (another number of workers prefetches another
    number of batches) is drawn from them, as in the interrupted run.
    """

    def __init__(self, sampler: Any, skip: int,
                 ahead: tuple[int, Callable[[], None]] | None = None) -> None:
        self.sampler, self.skip, self.ahead = sampler, skip, ahead
        self._pending: _Skipping | None = None

    def __iter__(self) -> Iterator[Any]:
        # Every iterator until one has skipped (torch's multi-worker iterator asks twice).
        if not self.skip and self.ahead is None:
            return iter(self.sampler)
        self._pending = _Skipping(self)
        return self._pending

    def advance(self) -> None:
        """Draw the skipped items now (before the position's generators are put back)."""
        pending = self._pending
        if pending is not None:
            pending.advance()

    def __len__(self) -> int:
        return len(self.sampler)


class _Skipping:
    __slots__ = ("_owner", "_iterator")

    def __init__(self, owner: SkipBatches) -> None:
        self._owner = owner
        self._iterator: Iterator[Any] | None = None

    def advance(self) -> Iterator[Any]:
        iterator = self._iterator
        if iterator is None:
            owner = self._owner
            skip, ahead = owner.skip, owner.ahead
            owner.skip, owner.ahead, owner._pending = 0, None, None
            iterator = self._iterator = iter(owner.sampler)
            for _ in range(skip):
                if next(iterator, _END) is _END:
                    break
            if ahead is not None:
                count, then = ahead
                drawn = list(itertools.islice(iterator, count))
                then()
                iterator = self._iterator = itertools.chain(drawn, iterator)
        return iterator

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        iterator = self._iterator
        return next(iterator if iterator is not None else self.advance())


_END = object()


class WorkerStamp:
    """A worker-side ``collate_fn``: the batch, and the worker's generator states right after
    it was made (torch's as bytes, Python's and NumPy's as tuples; Python's and NumPy's
    are `hookloop.engine.worker_rng.SAME` when they did not move since the worker's previous
    batch, `hookloop.engine.worker_rng.StateReads`).

    The main process strips the states off (`StampedBatches`) and keeps, for each worker,
    the states after its latest batch: what a resume hands to the worker that makes the
    next batch. Picklable, so it works with every start method.
    """

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self._reads = StateReads()  # this worker's previous states (each worker has a copy)

    def __call__(self, samples: Any) -> tuple[Any, tuple[Any, ...]]:
        return self.collate(samples), self._reads.stamp()

    def __getstate__(self) -> dict[str, Any]:
        return {"collate": self.collate}  # a worker started by spawn reads afresh

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.collate, self._reads = state["collate"], StateReads()


def saved_rng(state: Any) -> dict[str, Any] | None:
    """A worker's stamped state (`WorkerStamp`) as `hookloop.engine.rng.capture_rng` gives it
    (a saved one as it is)."""
    if state is None or isinstance(state, dict):
        return state
    torch_bytes, (version, words, gauss), numpy_state = state
    saved: dict[str, Any] = {
        RNG_TORCH: torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8),
        RNG_GENERATORS: [], RNG_PYTHON: [version, list(words), gauss]}
    if numpy_state is not None:
        kind, keys, position, has_gauss, cached = numpy_state
        saved[RNG_NUMPY] = [kind, torch.from_numpy(keys.astype("int64")), int(position),
                            int(has_gauss), float(cached)]
    return saved


class ResumedWorkers:
    """A worker-side ``worker_init_fn`` for an epoch resumed after ``skip`` batches: worker
    ``w`` makes the batches the interrupted run's worker ``(skip + w) % workers`` would have
    made next, so it starts from that worker's states (``states``), or, where that worker had
    made no batch yet, from the seeds torch gives that worker."""

    def __init__(self, init: Any, skip: int, states: list[dict[str, Any] | None]) -> None:
        self.init, self.skip, self.states = init, skip, states

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        workers = len(self.states)
        role = (self.skip + worker_id) % workers
        state = self.states[role]
        if state is None:  # that worker had made no batch: torch's seeds for it
            seed_worker_as(role, info.seed - worker_id)  # type: ignore[union-attr]  # in a worker
        if self.init is not None:
            self.init(worker_id)
        if state is not None:
            restore_rng(saved_rng(state))  # type: ignore[arg-type]  # not None: state is not


class StampedBatches:
    """The batches of a loader whose ``collate_fn`` is a `WorkerStamp`, stamps stripped.

    ``states[w]`` holds the states after the latest batch made by worker ``w`` of the
    epoch (batches go to the workers in turn: batch ``b`` to worker ``b % workers``), so
    at a step boundary it is what each worker's next batch starts from.
    """

    __slots__ = ("_iterator", "_index", "states")

    def __init__(self, iterator: Iterator[Any], start: int,
                 states: list[dict[str, Any] | None]) -> None:
        self._iterator, self._index, self.states = iterator, start, states

    def __iter__(self) -> StampedBatches:
        return self

    def __next__(self) -> Any:
        batch, stamp = next(self._iterator)
        states = self.states
        slot = self._index % len(states)
        # SAME: a generator that did not move since this worker's previous batch.
        states[slot] = cast(Any, resolved(stamp, states[slot]) if SAME in stamp else stamp)
        self._index += 1
        return batch

    def __len__(self) -> int:
        return len(self._iterator)  # type: ignore[arg-type]


def _warn_workers(why: str) -> None:
    warnings.warn(
        f"resuming inside the epoch: {why}, so the workers start from fresh seeds and their "
        "random draws (augmentations in the dataset) differ from the uninterrupted run's; "
        "the data order and the samples are exact. Resume with the same num_workers, "
        "persistent_workers=False and in_order=True for exact draws.", RuntimeWarning,
        stacklevel=5)


def stamps_workers(loader: DataLoader) -> bool:
    """Whether the workers' generator states travel with the batches: workers that start
    afresh every epoch and deliver the batches in order."""
    return loader.num_workers > 0 and not loader.persistent_workers and \
        getattr(loader, "in_order", True)


def sampler_batches(loader: DataLoader, skip: int, states: list[dict[str, Any] | None] | None,
                    ahead: tuple[int, Callable[[], None]] | None = None) -> Iterator[Any]:
    """The batches of ``loader`` after its first ``skip``, none of them read; with stamped
    workers (`stamps_workers`), a `StampedBatches` whose workers resume from ``states``;
    with ``ahead``, the sampler draws that many batches more before it calls its function
    (`SkipBatches`).

    The loader itself is left as it is: a shallow copy of it gets the skipping sampler and
    the worker-side functions (torch reads them when the iterator is created).
    """
    stamped = stamps_workers(loader)
    if skip and loader.num_workers > 0 and not stamped:
        _warn_workers("the loader's workers are persistent_workers=True or in_order=False, "
                      "whose generator states hookloop does not carry")
    skipping = _skipping(loader, skip, ahead)
    if skipping is None and not stamped:
        return iter(loader)
    view = loader_view(loader, skipping) if skipping is not None else copy.copy(loader)
    if not stamped:
        iterator = iter(view)
        if skipping is not None:
            skipping.advance()
        return iterator
    workers = loader.num_workers
    if skip and (states is None or len(states) != workers):
        _warn_workers(f"the checkpoint holds the generator states of "
                      f"{'no' if states is None else len(states)} DataLoader workers, this "
                      f"loader has {workers}")
    if states is None or len(states) != workers:
        states = [None] * workers
    view.collate_fn = WorkerStamp(loader.collate_fn)
    if skip:
        view.worker_init_fn = ResumedWorkers(loader.worker_init_fn, skip, list(states))
    iterator = iter(view)  # the workers' first indices are drawn now (prefetch)
    if skipping is not None:
        skipping.advance()
    return StampedBatches(iterator, skip, list(states) if skip else [None] * workers)


def _skipping(loader: DataLoader, skip: int, ahead: tuple[int, Callable[[], None]] | None
              ) -> SkipBatches | None:
    """The loader's index sampler skipping ``skip`` batches and drawing ``ahead``, or None
    where it does neither."""
    if not skip and ahead is None:
        return None
    return SkipBatches(loader.batch_sampler if loader.batch_sampler is not None
                       else loader.sampler, skip, ahead)


def prefetched_batches(data: Any) -> int:
    """Batches of indices a DataLoader's iterator has drawn from its sampler past the
    batches it delivered (up to the epoch's end): its workers' prefetch, ``prefetch_factor``
    per worker (torch puts that many indices in the queues, and one more per batch
    delivered); none without workers. What the loader's generators hold at a step boundary
    depends on it (a shuffling sampler draws its next permutation when its iterator runs
    out)."""
    if not isinstance(data, DataLoader) or data.num_workers == 0:
        return 0
    return int(data.prefetch_factor or 0) * data.num_workers


def stateful_view(data: Any) -> Any:
    """What a stateful training data is iterated through: a ``DataLoader`` subclass with a
    state (``StatefulDataLoader``) whose workers `stamps_workers` gets a copy whose batches
    carry the workers' generator states; other data is itself."""
    if not (isinstance(data, DataLoader) and _has_state(data) and stamps_workers(data)):
        return data
    view = copy.copy(data)
    view.__dict__["_iterator"] = None
    view.collate_fn = WorkerStamp(data.collate_fn)
    return view


def stateful_batches(data: Any, view: Any, skip: int, state: Any,
                     states: list[dict[str, Any] | None] | None) -> Iterator[Any]:
    """The batches of stateful data, its state at the position loaded where ``skip``.

    A loader that keeps its place in the workers' turn (``StatefulDataLoader`` does) gives
    the next batch to the worker that would have made it: each worker resumes from its
    own states."""
    if skip and state is not None:
        stateful_part(view).load_state_dict(state)
    if view is data:
        return iter(data)
    workers = data.num_workers
    if skip and (states is None or len(states) != workers):
        _warn_workers(f"the checkpoint holds the generator states of "
                      f"{'no' if states is None else len(states)} DataLoader workers, this "
                      f"loader has {workers}")
    if not skip or states is None or len(states) != workers:
        states = [None] * workers
    view.worker_init_fn = ResumedWorkers(data.worker_init_fn, 0, list(states)) if skip \
        else data.worker_init_fn
    return StampedBatches(iter(view), skip, list(states))


def global_batch(data: Any) -> int | None:
    """Samples of the epoch's global order that one batch on every rank takes: the batch
    size, times the number of ranks where the sampler shards (``DistributedSampler``,
    `hookloop.engine.samplers.UnpaddedDistributedSampler`); None for data without a sampler and a
    fixed batch size."""
    if data_source(data) != "sampler" and not isinstance(data, DataLoader):
        return None
    batch_sampler = getattr(data, "batch_sampler", None)
    size = getattr(batch_sampler, "batch_size", None) if batch_sampler is not None else 1
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else \
        getattr(data, "sampler", None)
    if not isinstance(size, int) or sampler is None:
        return None
    replicas = getattr(sampler, "num_replicas", 1)
    return size * replicas if isinstance(replicas, int) else None


def distributed_sampler(data: Any) -> DistributedSampler | None:
    """The torch ``DistributedSampler`` a ``DataLoader`` draws its indices from (directly,
    or through a plain ``BatchSampler``), or None: the samplers whose epoch order hookloop
    can reshard over another number of ranks."""
    if not isinstance(data, DataLoader):
        return None
    batch_sampler = data.batch_sampler
    sampler = data.sampler if batch_sampler is None else (
        batch_sampler.sampler if type(batch_sampler) is BatchSampler else None)
    return sampler if type(sampler) is DistributedSampler else None


def epoch_order_key(sampler: DistributedSampler) -> str:
    """What decides a ``DistributedSampler``'s order of an epoch over all ranks (its seed,
    shuffle, dataset size and drop_last): the same key, the same order on any number of
    ranks."""
    return (f"DistributedSampler(seed={sampler.seed}, shuffle={sampler.shuffle}, "
            f"size={len(sampler.dataset)}, "  # type: ignore[arg-type]
            f"drop_last={sampler.drop_last})")


class RestOfEpoch(Sampler[int]):
    """This rank's share of an epoch's samples from position ``start`` of the epoch's global
    order on (the samples not trained on yet), sharded as ``DistributedSampler`` shards a
    whole epoch: rank ``r`` of ``R`` takes every ``R``-th sample from the ``r``-th, the
    rest padded by repeating its first samples (or cut, with ``drop_last``) so that every
    rank gets as many. The order is the sampler's own for its current epoch (torch's
    ``DistributedSampler`` over one replica draws it), read when iterated.
    """

    def __init__(self, sampler: DistributedSampler, start: int) -> None:
        self.sampler, self.start = sampler, start

    def _size(self) -> int:
        size: int = len(self.sampler.dataset)  # type: ignore[arg-type]
        rest, replicas = max(0, size - self.start), self.sampler.num_replicas
        return rest // replicas if self.sampler.drop_last else math.ceil(rest / replicas)

    def __iter__(self) -> Iterator[int]:
        whole = copy.copy(self.sampler)  # the same order, over one replica, unpadded
        whole.num_replicas, whole.rank, whole.drop_last = 1, 0, False
        whole.num_samples = whole.total_size = len(self.sampler.dataset)  # type: ignore[arg-type]
        rest = list(whole)[self.start:]
        replicas, size = self.sampler.num_replicas, self._size()
        total = size * replicas
        while rest and len(rest) < total:  # padded as DistributedSampler pads
            rest += rest[:total - len(rest)]
        return iter(rest[self.sampler.rank:total:replicas])

    def __len__(self) -> int:
        return self._size()


def rest_of_epoch(loader: DataLoader, start: int) -> DataLoader:
    """A view of ``loader`` (`hookloop.base.compat.loader_view`) whose epoch is the samples of
    its ``DistributedSampler``'s order from ``start`` on, sharded over its ranks
    (`RestOfEpoch`), batched as ``loader`` batches; ``loader`` is left as it is."""
    sampler = distributed_sampler(loader)
    assert sampler is not None
    rest = RestOfEpoch(sampler, start)
    batch_sampler = loader.batch_sampler
    index = rest if batch_sampler is None else BatchSampler(
        rest, batch_sampler.batch_size, batch_sampler.drop_last)  # type: ignore[attr-defined]
    return loader_view(loader, index)


def reshard_problem(data: Any, samples: int | None, order: str | None) -> str | None:
    """Why a position of ``samples`` of the epoch's ``order`` (a checkpoint's, written inside
    an epoch by another number of ranks) cannot continue over ``data``'s ranks, or None:
    ``data`` is a DataLoader drawing from a torch ``DistributedSampler`` whose epoch order
    is the one the position counts samples of (same seed, shuffle, dataset size)."""
    sampler = distributed_sampler(data)
    if sampler is None:
        return (f"the training data ({type(data).__name__}) does not draw from a torch "
                "DistributedSampler, whose order of the epoch is the same on any number of "
                "ranks (DDP and FSDP give a DataLoader one; a run meant to change its number "
                "of ranks starts with DDP or FSDP also on one process, under torchrun "
                "--nproc_per_node=1)")
    if samples is None or order is None:
        return ("the checkpoint does not say which samples of the epoch's order were trained "
                "on (its data was not sharded by a DistributedSampler, or an older hookloop "
                "wrote it)")
    if order != epoch_order_key(sampler):
        return (f"the epoch's order was that of {order} and is now that of "
                f"{epoch_order_key(sampler)}")
    return None
