"""Where the run is in its data: the batches (and samples of the epoch's global order) of
this epoch not trained on yet, and where the weights are."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from hookloop import distributed
from hookloop.base.deprecation import deprecated_alias
from hookloop.engine.data import Lookahead, LossMark, LossSum, length_of
from hookloop.engine.resumable import (
    StampedBatches,
    data_source,
    distributed_sampler,
    prefetched_batches,
    epoch_order_key,
    global_batch,
    rest_of_epoch,
    sampler_batches,
    stateful_batches,
    stateful_part,
    stateful_view,
)
from hookloop.engine.rng import (RNG_GENERATORS, RNG_PYTHON, RNG_TORCH, capture_rng, cuda_rng,
                                  host_rng, loader_generators, restore_generators,
                                  restore_host_rng, restore_rng)
from hookloop.errors import ConfigurationError

__all__ = ["Position", "EpochPass", "RunPosition"]

_default_state = torch.default_generator.get_state  # bound once: read at every step boundary


class RunPosition(NamedTuple):
    """Where the weights are: ``batches_done`` batches of ``epoch`` trained on, ``step``
    optimizer steps taken.

    ``batches_done == 0`` means the epoch has not started (a finished epoch ``e`` reads as
    ``(e + 1, 0, step)``).
    """

    epoch: int
    batches_done: int
    step: int

    @property
    def batch_idx(self) -> int:
        """Deprecated: ``batches_done`` (the old name; removed in hookloop 0.3)."""
        return self.batches_done  # for type checkers: the alias set below, which warns, runs

    @property
    def resumed_mid_epoch(self) -> bool:
        """Read in ``on_epoch_start``: True when this epoch starts part-way, at batch
        ``batches_done`` (a resume from a mid-epoch checkpoint, ``fit()`` again after an
        exception or a stop). ``on_epoch_start`` fires again for such an epoch; a callback
        that must act once per epoch skips it then. Same as ``batches_done > 0``."""
        return self.batches_done > 0


# A NamedTuple's body holds only fields and methods (for type checkers): the alias replaces
# the typed property there.
setattr(RunPosition, "batch_idx", deprecated_alias(  # noqa: B010
    "loop.position.batches_done", lambda self: self.batches_done, old="loop.position.batch_idx"))


class Position:
    """The last step boundary (or epoch end) the loop reached, and the data that follows it.

    It hands the loop each epoch's batches (`start_epoch`), past the ones already trained
    on, and is told at every step boundary where the weights now are (`EpochPass.record`).
    A checkpoint taken mid-window or mid-batch resumes from the last boundary, and the
    batches after it are trained again with the same data order and the same random draws:
    torch's generators (CPU, CUDA, the DataLoader's) are recorded at every step boundary, and
    every generator, Python's and NumPy's too, at every epoch start. Python's and NumPy's
    cost tens of microseconds to copy, so the position's own copy of them is taken when it
    is read (`hookloop.engine.position_part.RankPart`, at a save) while nothing has drawn for the run since the boundary
    (`host_now`). Read later (a save at an exception, mid-window), the position holds none
    of them: a resume, like ``fit()`` after an exception, replays the epoch from its start's
    generators and fetches the trained batches again, so the data's draws from Python's and
    NumPy's generators repeat (draws the model itself made from them do not); a validation
    inside the epoch captures them in full once it ended (`host_mark`), and the replay puts
    them back there, since it does not validate again.

    The position is also kept in samples of the epoch's global order (`epoch_samples`), so
    it means the same on any number of ranks: a resume whose global batch differs (another
    number of ranks) derives its batch from the samples and, where they are not a whole
    number of the new batches, trains the rest of the epoch's order resharded (`attach`,
    `start_epoch`); `step_offset` keeps the run's total steps right.

    An epoch that ``stop()`` cut short keeps its live iterator (`EpochPass` suspends it),
    so a later ``fit`` in this process continues it; after an exception (`rewind`) or a
    restore (`hookloop.engine.position_part`) the epoch is replayed from the recorded generators instead.
    """

    __slots__ = ("epoch", "batches_done", "step", "loss_sum", "samples", "rng", "_cuda",
                 "epoch_rng", "prefetch_rng", "validated", "generators", "host_now", "host_mark",
                 "_replay", "_live", "source", "workers_rng", "data_state",
                 "_stateful", "batch_samples", "epoch_samples", "step_offset", "base",
                 "loaded", "order", "attached", "batches", "drawn_ahead",
                 "_ahead")

    def __init__(self) -> None:
        self.epoch = self.batches_done = self.step = self.samples = 0
        #: The training loss sum at the position: a `LossMark` (resolved when read) or,
        #: after a load, the saved tensor.
        self.loss_sum: LossMark | torch.Tensor | None = None
        self.rng: dict[str, Any] | None = None
        self._cuda = False  # CUDA was initialized at the epoch's start: record its generators
        self.epoch_rng: dict[str, Any] | None = None
        #: Data without a length, read one batch ahead: the random state the batch after
        #: the position was fetched with (before the position's own).
        self.prefetch_rng: dict[str, Any] | None = None
        #: The validation due at ``step`` (``Loop(val_every_n_steps=...)``) has run.
        self.validated = False
        #: The generators the training data draws its order from (set at every setup).
        self.generators: list[torch.Generator] = []
        #: Nothing drew for the run since `record` (no batch fetched, no validation): Python's
        #: and NumPy's generators can be read for this position as they are now.
        self.host_now = False
        #: ``(batches_done, full snapshot)`` right after the epoch's last validation inside
        #: it (``val_every_n_steps``), or None: where a replay puts Python's and NumPy's back.
        self.host_mark: tuple[int, dict[str, Any]] | None = None
        self._replay = False  # the next epoch start replays from the recorded generators
        self._live: tuple[int, Iterator[Any]] | None = None  # an epoch stop() cut short
        #: How the training data resumes inside an epoch (`hookloop.engine.resumable.data_source`).
        self.source = "replay"
        #: With stamped DataLoader workers: each worker's generator states at the position.
        self.workers_rng: list[dict[str, Any] | None] | None = None
        #: Data with ``state_dict()``: its state at the position.
        self.data_state: Any = None
        self._stateful: Any = None  # the object that has that state
        #: Samples of the epoch's global order one batch of every rank takes (None: the
        #: data has no fixed batch size, or no order to count in).
        self.batch_samples: int | None = None
        #: Samples of the epoch's global order trained on at the position (None: not
        #: known, `batch_samples` is None): what the position means on any number of ranks.
        self.epoch_samples: int | None = 0
        #: Optimizer steps the run takes beyond ``steps_per_epoch * epochs`` of the current
        #: geometry: the steps taken on another number of ranks (`hookloop.engine.geometry`).
        self.step_offset = 0
        #: ``(batches, samples)`` where this epoch's pass began counting batches from: the
        #: position a resume on another number of ranks derived from ``epoch_samples``.
        self.base = (0, 0)
        #: After `load`, until `attach`: the saved global batch and epoch order key.
        self.loaded: tuple[int | None, str | None] | None = None
        #: The key of the epoch order of the data (`hookloop.engine.resumable.epoch_order_key`).
        self.order: str | None = None
        #: `attach` ran since the last `detach`: `batches` is the running fit's epoch length.
        self.attached = False
        #: ``len()`` of the data `attach` was given (None: it has none): `Geometry` reads
        #: it while a fit runs, so the step geometry is one for the whole fit.
        self.batches: int | None = None
        #: Batches the DataLoader's sampler had drawn past the position (its workers'
        #: prefetch, `hookloop.engine.resumable.prefetched_batches`); None: not known (an older
        #: file). A resume with another number of workers draws from the generators as
        #: the interrupted run's sampler drew from them (`_batches`).
        self.drawn_ahead: int | None = None
        self._ahead = 0  # ... for the data attached now

    def batches_of(self, data: Any, fitting: bool) -> int | None:
        """``len(data)`` (None: it has none); inside a fit (``fitting``, once `attach`ed), the
        length of the data the fit trains on: `Geometry`'s and the file's epoch length."""
        return self.batches if self.attached and fitting else length_of(data)

    @property
    def public(self) -> RunPosition:
        return RunPosition(self.epoch, self.batches_done, self.step)

    def detach(self) -> None:
        """At every setup's start: the data is not attached yet (the setup hooks may shard
        it); `Geometry` reads the loop's data afresh until `attach`."""
        self.attached = False

    def attach(self, data: Any, window: int = 1, partial_steps: bool = True) -> None:
        """At every setup: the training data (DDP may have rebuilt it) and its generators.

        After a `load` whose global batch differs from this data's (another number of
        ranks), the position inside the epoch is derived from ``epoch_samples``: the
        epoch's pass starts at the batch from which the samples not trained on yet fill
        the rest of the epoch, and `step_offset` counts the run's steps in the new geometry
        (``window`` batches a step, ``partial_steps``: an epoch's last, partial window
        steps)."""
        self.attached, self.batches = True, length_of(data)
        self.generators = loader_generators(data)
        self._cuda = torch.cuda.is_initialized() and torch.cuda.is_available()
        self.source = data_source(data)
        self._ahead = prefetched_batches(data) if self.source == "sampler" else 0
        self._stateful = stateful_view(data) if self.source == "stateful" else None
        self.batch_samples = global_batch(data)
        sampler = distributed_sampler(data) if self.source == "sampler" else None
        self.order = None if sampler is None else epoch_order_key(sampler)
        loaded, self.loaded = self.loaded, None
        if loaded is None or loaded[0] is None or self.batch_samples in (None, loaded[0]):
            return  # the same global batch: the position means the same batches
        total, done = length_of(data), self.batches_done
        if total is None:
            return
        start = phase = 0
        if done and self.epoch_samples is not None and sampler is not None:
            rest = length_of(rest_of_epoch(data, self.epoch_samples)) or 0
            start = self.batches_done = max(1, total - rest)
            self.base = (start, self.epoch_samples)
            total = start + rest
            # The windows count from where `_resharded` has the epoch count them: the resume
            # batch when the rest is resharded, batch 0 when the position is whole batches.
            phase = 0 if self.epoch_samples == start * self.batch_samples else start
        # The steps of the run: those taken, the rest of this epoch's, then whole epochs.
        per_epoch = _steps(0, length_of(data) or 0, window, 0, partial_steps)
        left = _steps(start, total, window, phase, partial_steps) if done else per_epoch
        self.step_offset = self.step + left - per_epoch * (self.epoch + 1)

    def record(self, epoch: int, batches_done: int, step: int,
               loss_sum: LossMark | torch.Tensor | None,
               samples: int, prefetch: tuple[Any, Any, Any] | None = None,
               workers_rng: list[dict[str, Any] | None] | None = None) -> None:
        """The weights now are those after ``batches_done`` batches of ``epoch``; with a
        lookahead, ``prefetch`` is its snapshot from before the batch it fetched ahead."""
        stateful = self._stateful
        if prefetch is not None:
            self.prefetch_rng, data_state, self.workers_rng = prefetch
        else:
            self.prefetch_rng, self.workers_rng = None, workers_rng
            data_state = stateful_part(stateful).state_dict() if stateful is not None else None
        self.data_state = data_state if stateful is not None and batches_done else None
        size, (base_batches, base_samples) = self.batch_samples, self.base
        self.epoch_samples = 0 if not batches_done else None if size is None else \
            base_samples + (batches_done - base_batches) * size
        self.validated = self.validated and step == self.step  # still that step's
        self.drawn_ahead = self._ahead
        self.epoch, self.batches_done, self.step = epoch, batches_done, step
        self.loss_sum, self.samples = loss_sum, samples
        # torch's generators at every boundary, read here without `capture_rng`'s call and
        # CUDA question (a tenth of a tiny step's own work); Python's and NumPy's when read.
        generators = self.generators
        rng = self.rng = {RNG_TORCH: _default_state(),
                          RNG_GENERATORS: [gen.get_state() for gen in generators] if generators
                          else []}
        if self._cuda:
            rng.update(cuda_rng())
        self.host_now = True

    def mark_validated(self) -> None:
        """A validation that counts ran at the position, outside an epoch's pass (the one
        before the first step, ``Loop(val_at_start=True)``): the generators are recorded as
        it left them, and a later fit, or a resume from here, does not run it again."""
        self.record(self.epoch, self.batches_done, self.step, self.loss_sum, self.samples)
        self.validated = True

    def loss_total(self) -> torch.Tensor | None:
        loss_sum = self.loss_sum
        return loss_sum.resolved() if isinstance(loss_sum, LossMark) else loss_sum

    @property
    def live(self) -> Iterator[Any] | None:
        """The iterator of the epoch `stop` cut short, kept for a later fit to continue."""
        return None if self._live is None else self._live[1]

    def rewind(self) -> None:
        """After an exception: the next epoch start continues from the recorded position."""
        self._replay = True
        self._live = None

    def start_epoch(self, epoch: int, data: Any, window: int, device: Any,
                    stop_due: Callable[[], bool],
                    check: Callable[[Any], None] | None = None) -> EpochPass:
        """The training pass of ``epoch`` over ``data`` (``window`` batches a step, the loss
        summed on ``device``): its batches past those already trained on; ``stop_due()``
        says at a step boundary whether to end it there; ``check(batch)`` is called with
        its first batch, before the pass yields it (`EpochPass`).

        After `load` or `rewind`, the generators are put back as they were when the
        interrupted run created this epoch's iterator (same data order), the trained batches
        are skipped, then the generators are put back as they were at the position (same
        dropout and augmentation draws). The live iterator of an epoch that ``stop`` cut
        short in this process is continued as it is. Data without a length and an
        accumulation window is read one batch ahead, to know where the last window ends.
        A position whose samples are not a whole number of this data's batches (a resume
        on another number of ranks) continues with the samples of the epoch's order not
        trained on yet, resharded (`hookloop.engine.resumable.rest_of_epoch`); its windows count
        from there.
        """
        generators = self.generators
        # Read once an epoch, not at every boundary: a GPU run has initialized CUDA by its
        # setup (the model moved there), a CPU run does not draw from CUDA's generators.
        self._cuda = torch.cuda.is_initialized() and torch.cuda.is_available()
        live, self._live = self._live, None
        skip = self.batches_done if self.epoch == epoch else 0
        data, phase = self._resharded(data, skip)
        losses = self._losses(device, skip)
        replay, self._replay = self._replay, False
        total = length_of(data) if not phase else skip + (length_of(data) or 0)
        if live is not None and live[0] == epoch and skip and not replay:
            return EpochPass(self, epoch, live[1], skip, total, window, stop_due, losses, phase,
                             check)
        self._epoch_generators(skip, replay)
        # skip == total still iterates: a sampler may draw from the loader's generator when
        # its iterator is exhausted (RandomSampler does, after an even last batch).
        later = generators  # put back below: not those `_batches` put back already
        if total is not None and skip > total:
            iterator: Iterator[Any] = iter(())
        elif phase:
            iterator = iter(data)  # the rest of the epoch: nothing of it was read
        else:
            iterator, later = self._batches(data, skip, replay)
        if total is None and window > 1:
            if replay and skip and self.prefetch_rng is not None:
                restore_rng(self.prefetch_rng, later)
            iterator = self._lookahead(iterator, generators)
        if replay and skip and self.rng is not None:
            restore_rng(self.rng, later)
        return EpochPass(self, epoch, iterator, skip, total, window, stop_due, losses, phase,
                         check)

    def _losses(self, device: Any, skip: int) -> LossSum:
        """The epoch's loss sum, from the position's where the epoch resumes inside."""
        return LossSum(device, *((self.loss_total(), self.samples)
                                 if skip and self.loss_sum is not None else ()))

    def _streams(self, skip: int, replay: bool) -> bool:
        """A replay inside the epoch whose DataLoader sampler redraws what the interrupted
        run's had drawn (`drawn_ahead`), the generators put back inside its draws."""
        return self.source == "sampler" and replay and bool(skip) and self.rng is not None \
            and self.drawn_ahead is not None

    def _resharded(self, data: Any, skip: int) -> tuple[Any, int]:
        """``(data, 0)``; or, where the epoch resumes from a sample that does not start one
        of this data's batches, the epoch's samples from there on sharded over the ranks
        afresh (`hookloop.engine.resumable.rest_of_epoch`) and the batch its windows count from."""
        if not skip:
            self.base = (0, 0)
        samples, size = self.epoch_samples, self.batch_samples
        if not skip or self.order is None or samples is None or size is None or \
                samples == skip * size:
            return data, 0
        return rest_of_epoch(data, samples), self.base[0]

    def _epoch_generators(self, skip: int, replay: bool) -> None:
        """Put the generators back as the interrupted run had them when it created this
        epoch's iterator (``replay``); at an epoch's start, record them all."""
        generators = self.generators
        if replay and skip and self.epoch_rng is not None:
            restore_rng(self.epoch_rng, generators)
        elif replay and not skip and self.rng is not None:
            restore_rng(self.rng, generators)
        if not skip:
            self.epoch_rng = capture_rng(generators)  # every generator, once an epoch
            self.host_mark = None

    def _lookahead(self, iterator: Iterator[Any], generators: Any) -> Lookahead:
        """A `Lookahead` whose snapshot, taken before each fetch, is what a boundary before
        that fetch records: the generators, the stateful data's state and the workers'
        (read live at the boundary, they would already be one prefetched batch ahead)."""
        stateful, inner = self._stateful, iterator
        stamped = type(inner) is StampedBatches

        def snapshot() -> tuple[Any, Any, Any]:
            return (capture_rng(generators, full=False),
                    stateful_part(stateful).state_dict() if stateful is not None else None,
                    list(inner.states) if stamped else None)  # type: ignore[attr-defined]

        return Lookahead(iterator, snapshot=snapshot)

    def _batches(self, data: Any, skip: int, replay: bool
                 ) -> tuple[Iterator[Any], list[torch.Generator]]:
        """An iterator over ``data`` past its first ``skip`` batches: a DataLoader's sampler
        advanced without reading a sample, data with a state loaded at it, else the batches
        fetched again. Python's and NumPy's generators unknown at the position (a save after
        something drew) make a DataLoader replay too: the data's draws then repeat.

        And the generators the position's state is still to be put back in: none of the
        DataLoader's where they were put back inside its sampler's draws, once the sampler
        drew what the interrupted run's had drawn at the position (`drawn_ahead`), so that
        its later draws come from them whatever the number of workers now prefetches (a
        shuffling sampler draws the next permutation when it runs out: before the position
        with workers, after it without)."""
        source, exact_host = self.source, RNG_PYTHON in (self.rng or {})
        streamed = self._streams(skip, replay)
        later = [] if streamed else self.generators
        if source == "sampler":
            if skip and exact_host:
                return sampler_batches(data, skip, self.workers_rng,
                                       self._put_back_after(0) if streamed else None), later
            iterator = sampler_batches(data, 0, None,
                                       self._put_back_after(skip) if streamed else None)
        elif source == "stateful" and (self.data_state is not None or not skip):
            return stateful_batches(data, self._stateful, skip, self.data_state,
                                    self.workers_rng), later
        else:
            iterator = iter(data)
        if skip:
            _say_replay(data, skip, source)
        mark = self.host_mark if replay and not exact_host else None
        for index in range(skip):  # a mark is always before the position's batch
            if mark is not None and index == mark[0]:  # a validation drew up to here
                restore_host_rng(mark[1])
            next(iterator)
        return iterator, later

    def _put_back_after(self, batches: int) -> tuple[int, Callable[[], None]]:
        """``ahead`` of `hookloop.engine.resumable.SkipBatches`: draw ``batches`` and the
        batches the interrupted run's sampler had drawn past the position, then put the
        DataLoader's generators back as they were at the position."""
        rng, generators = self.rng, self.generators
        assert rng is not None and self.drawn_ahead is not None
        return batches + self.drawn_ahead, lambda: restore_generators(rng, generators)


def _steps(start: int, end: int, window: int, phase: int, partial: bool) -> int:
    """Optimizer steps between ``start`` and ``end`` batches done of an epoch whose windows
    of ``window`` batches count from batch ``phase``, the last, partial one stepping when
    ``partial``."""
    whole = (end - phase) // window - (start - phase) // window
    return whole + int(partial and end > start and (end - phase) % window != 0)


def _say_replay(data: Any, skip: int, source: str) -> None:
    """One line at a resume that fetches the trained batches again (rank 0)."""
    if not distributed.is_main():
        return
    batches = f"{skip} batch{'es' if skip != 1 else ''}"
    if source == "sampler":
        print(f"hookloop: resuming inside the epoch fetches the {batches} already trained on "
              "again: the position was saved after Python's and NumPy's generators drew past "
              "its step boundary (an exception's checkpoint, or fit() again after one), and "
              "the replay draws them again; a checkpoint written at a step boundary "
              "(every_n_steps, a stop, a signal) resumes without reading them.", flush=True)
        return
    print(f"hookloop: resuming inside the epoch fetches the {batches} already trained on "
          f"again, since the training data ({type(data).__name__}) cannot be advanced "
          "without reading it; a DataLoader over a map-style dataset, or data with "
          "state_dict() and load_state_dict(), resumes without reading them.", flush=True)


class EpochPass:
    """One epoch's training batches, as ``(batch_idx, batch, step_boundary)``.

    ``step_boundary`` is True every ``window`` batches and on the batch that ends the data
    (a callback may change it: the loop steps where ``loop.state.step_boundary`` says). At a
    step boundary the loop took (`record`) where ``stop_due()`` is True, the pass ends: when
    more data follows, its iterator is kept by the `Position` for a later ``fit`` and
    `completed` is False. The pass sums the training loss on the device (`losses`) and
    reads it once (`train_loss`).
    """

    __slots__ = ("_position", "epoch", "_iterator", "start", "_total", "_window", "_stop_due",
                 "losses", "batches_done", "completed", "_at_boundary", "_phase", "_check")

    def __init__(self, position: Position, epoch: int, iterator: Iterator[Any], start: int,
                 total: int | None, window: int, stop_due: Callable[[], bool],
                 losses: LossSum, phase: int = 0,
                 check: Callable[[Any], None] | None = None) -> None:
        self._position, self.epoch, self._iterator = position, epoch, iterator
        self._check = check  # called with the first batch (the loop's forward rule's check)
        self._phase = phase  # the windows count from this batch (a resharded epoch's start)
        self.start, self._total, self._window, self._stop_due = start, total, window, stop_due
        #: The sample-weighted sum of this epoch's training losses, on the device.
        self.losses = losses
        #: Batches of the epoch trained on so far (the resumed ones included).
        self.batches_done = start
        #: False when a stop ended the pass before the data ran out.
        self.completed = True
        self._at_boundary = True  # the weights match `batches_done`: a stop may end here

    def __iter__(self) -> Iterator[tuple[int, Any, bool]]:
        iterator, total, window, phase = self._iterator, self._total, self._window, self._phase
        lookahead = iterator if isinstance(iterator, Lookahead) else None
        boundary, batch_idx = True, self.start - 1
        stop_due, position, check = self._stop_due, self._position, self._check
        while True:
            # A stop takes effect at a step boundary the loop took (`record`), never inside
            # a window, also one a callback drew with loop.state.step_boundary.
            stopping = self._at_boundary and stop_due()
            # More data is known to follow: keep the iterator for a later fit. Without a
            # length (and no look-ahead), one more batch is fetched below to find out.
            if stopping and (batch_idx + 1 < total if total is not None
                             else lookahead is not None and not lookahead.exhausted):
                return self._suspend(iterator)
            position.host_now = False  # a fetch may draw, also one that raises
            try:
                batch = next(iterator)
            except StopIteration:
                return
            if stopping:  # the data outlived its len(): keep it for a later fit
                return self._suspend(itertools.chain([batch], iterator))
            if check is not None:
                self._check_first(check, batch)
                check = None
            batch_idx += 1
            # Every batch ends a step without accumulation; else every window-th batch
            # and the one that ends the data.
            boundary = window == 1 or (batch_idx + 1 - phase) % window == 0 or (
                lookahead.exhausted if lookahead is not None
                else total is not None and batch_idx == total - 1)
            self.batches_done = batch_idx + 1
            self._at_boundary = False
            yield batch_idx, batch, boundary

    def _check_first(self, check: Callable[[Any], None], batch: Any) -> None:
        """``check(batch)`` on the pass's first batch, as it arrives: a batch the loop
        cannot train on (a mapping with a ``loss_fn`` and no ``inputs=``) is refused before
        any callback or the model sees it, and without loading a sample the training does
        not (a resume loads none it trained on). A refused epoch that had just started puts
        every generator back as it found them (the iterator drew its seeds)."""
        try:
            check(batch)
        except ConfigurationError:
            position = self._position
            if not self.start and position.epoch_rng is not None:
                restore_rng(position.epoch_rng, position.generators)
            raise

    def _suspend(self, iterator: Iterator[Any]) -> None:
        self._position._live = (self.epoch, iterator)
        self.completed = False

    def record(self, step: int, *, validated: bool = False) -> None:
        """At a step boundary: the weights are those after `batches_done` batches."""
        iterator: Any = self._iterator
        kind = type(iterator)
        prefetch = iterator.pending_snapshot if kind is Lookahead else None
        workers = list(iterator.states) if kind is StampedBatches else None
        losses = self.losses
        self._position.record(self.epoch, self.batches_done, step, losses.mark(),
                              losses.samples, prefetch, workers)
        self._at_boundary = True
        if validated:  # once a validation: Python's and NumPy's as it left them, for replays
            position = self._position
            position.validated = True
            position.rng.update(host_rng())  # type: ignore[union-attr]
            position.host_mark = (self.batches_done, position.rng)  # type: ignore[assignment]

    def train_loss(self) -> float | None:
        """The epoch's sample-weighted mean training loss over all ranks: one host sync.

        None when this rank trained on nothing in the pass (a resume at the epoch's end).

        Raises:
            ConfigurationError: a whole pass that yielded no batch (empty training data).
        """
        if not self.losses.samples:
            if self.completed and not self.start:
                raise ConfigurationError("train_data yielded no batches in this epoch: it is "
                                         "empty.")
            return None
        return self.losses.mean()
