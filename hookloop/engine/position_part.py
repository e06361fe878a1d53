"""The position's part of the run file: what every rank shares of it, in ``loop``
(`PositionPart`), and each rank's own part, in ``ranks`` (`RankPart`). Each writes, checks
and reads its own keys; an older file's position (no global batch) is read here.

The loop registers both once (`hookloop.loop.Loop`): ``state_dict``, ``check(saved,
source)`` before anything is touched, ``load_state_dict(saved)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookloop import distributed
from hookloop.base.phase import FITTING, Phases
from hookloop.engine.position import Position
from hookloop.engine.resumable import reshard_problem, saved_rng
from hookloop.engine.rng import RNG_NUMPY, RNG_PYTHON, host_rng, rng_state_problem
from hookloop.errors import CheckpointError, expect_field, expect_int
from hookloop.runfile.format import EPOCH, LOOP, STEP, WORLD_SIZE, register_check

__all__ = ["KEYS", "PositionPart", "RankPart"]

# ``loop``: the position every rank shares. The position in samples: the global batch it was
# counted in, the sampler's order (seed, shuffle, size, drop_last) and the steps taken
# before the epoch's pass began on its ranks.
BATCH_IDX, VALIDATED, EPOCH_SAMPLES = "batch_idx", "validated", "epoch_samples"
GLOBAL_BATCH, EPOCH_ORDER, STEP_OFFSET = "global_batch", "epoch_order", "step_offset"
BATCHES_PER_EPOCH = "batches_per_epoch"
#: The top-level key of every rank's own part (a list, one part per rank); and each part's.
RANKS = "ranks"
# Each part of ``ranks``.
TRAIN_LOSS_SUM, TRAIN_SAMPLES, DATA_STATE = "train_loss_sum", "train_samples", "data_state"
RNG, EPOCH_RNG, PREFETCH_RNG, MARK_RNG = "rng", "epoch_rng", "prefetch_rng", "mark_rng"
MARK_BATCHES, WORKERS_RNG = "mark_batches", "workers_rng"
#: Batches the training DataLoader's sampler had drawn past the position (its prefetch).
DRAWN_AHEAD = "drawn_ahead"
KEYS = (RANKS, BATCH_IDX, VALIDATED, EPOCH_SAMPLES, GLOBAL_BATCH, EPOCH_ORDER, STEP_OFFSET,
        BATCHES_PER_EPOCH, TRAIN_LOSS_SUM, TRAIN_SAMPLES, DATA_STATE, RNG, EPOCH_RNG,
        PREFETCH_RNG, MARK_RNG, MARK_BATCHES, WORKERS_RNG, DRAWN_AHEAD)
#: Keys that are also ordinary words elsewhere (a `LoopState` field).
SHARED_WORDS = frozenset((BATCH_IDX,))


class PositionPart:
    """``loop``'s position: epoch, batches done, step, the samples and order behind them,
    the world size and the epoch's length. ``data()`` is the loop's training data now (DDP
    rebuilds it at setup); ``phases`` the loop's (the length inside a fit is the fit's)."""

    def __init__(self, position: Position, data: Callable[[], Any], phases: Phases) -> None:
        self.position, self.data, self.phases = position, data, phases

    def batches(self) -> int | None:
        """``loop.batches_per_epoch``."""
        return self.position.batches_of(self.data(), self.phases.current in FITTING)

    def state_dict(self) -> dict[str, Any]:
        position = self.position
        shared: dict[str, Any] = {EPOCH: position.epoch, BATCH_IDX: position.batches_done,
                                  STEP: position.step, VALIDATED: position.validated,
                                  WORLD_SIZE: distributed.world_size(),
                                  BATCHES_PER_EPOCH: self.batches()}
        if position.epoch_samples is not None and position.batch_samples is not None:
            shared.update({EPOCH_SAMPLES: position.epoch_samples,
                           GLOBAL_BATCH: position.batch_samples})
        if position.order is not None:
            shared[EPOCH_ORDER] = position.order
        if position.step_offset:
            shared[STEP_OFFSET] = position.step_offset
        return {LOOP: shared}

    @staticmethod
    def check_file(source: str, saved: Mapping[str, Any]) -> None:
        """The position's fields have their types (run on every resume file read)."""
        part = saved.get(LOOP)
        if part is None:
            raise CheckpointError(f"{source}: a training checkpoint without its {LOOP!r} field "
                                  "(the position to resume from); it cannot be resumed.")
        expect_field(source, LOOP, part, isinstance(part, Mapping), "a dict")
        for field in (EPOCH, BATCH_IDX, STEP):
            if field not in part:
                raise CheckpointError(f"{source}: the checkpoint's field '{LOOP}.{field}' is "
                                      "missing; it cannot be resumed.")
            expect_int(source, f"{LOOP}.{field}", part[field])
        for field, minimum in ((EPOCH_SAMPLES, 0), (WORLD_SIZE, 1), (GLOBAL_BATCH, 0),
                               (STEP_OFFSET, None)):
            if field in part:
                expect_int(source, f"{LOOP}.{field}", part[field], minimum)
        for field, kind, expected in ((EPOCH_ORDER, str, "a str (the sampler's order)"),
                                      (VALIDATED, bool, "a bool")):
            if field in part:
                expect_field(source, f"{LOOP}.{field}", part[field],
                             isinstance(part[field], kind), expected)

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        """The fields' types, then whether this run's data and ranks can continue there.

        Raises:
            CheckpointError: naming ``source``, the field (or the data) and the fix.
        """
        self.check_file(source, saved)
        part = saved[LOOP]
        self._check_same_data(part, source)
        self._check_new_world(part, saved.get(RANKS) or [], source)

    def _check_same_data(self, part: Mapping[str, Any], source: str) -> None:
        """Another number of training batches per epoch (same world size): refused inside
        an epoch, where the position would skip batches of other data than those trained
        on; a warning at an epoch end, where the run goes on with the new data."""
        saved, now = part.get(BATCHES_PER_EPOCH), self.batches()
        if saved is None or now is None or int(saved) == now or \
                int(part.get(WORLD_SIZE, 1)) != distributed.world_size():
            return
        done, epoch = int(part[BATCH_IDX]), int(part[EPOCH])
        if done:
            raise CheckpointError(
                f"{source}: the run was saved after {done} of {saved} batches of epoch "
                f"{epoch + 1}, but train_data now has {now} batches per epoch, so resuming "
                f"would skip its first {done} batch{'es' if done != 1 else ''}, which are not "
                "the ones it trained on. Resume with the training data the run was saved "
                "with, or from a checkpoint written at an epoch end, or start a new run "
                "(Checkpoint(resume=False) in a new directory).")
        if distributed.is_main():
            warnings.warn(
                f"{source}: the run had {saved} batches per epoch and train_data now has {now}: "
                f"it continues from epoch {epoch + 1} with the new data (a schedule built for "
                "the run's total steps is rebuilt for the new total).", RuntimeWarning,
                stacklevel=4)

    def _check_new_world(self, part: Mapping[str, Any], ranks: Any, source: str) -> None:
        """A position inside an epoch written by another number of ranks goes on over the
        new ranks, in samples of the epoch's order, where the data draws that order from a
        ``DistributedSampler`` (`hookloop.engine.resumable.reshard_problem`); a rank's own
        state of the data, or another order, cannot be split or merged: refused."""
        saved_world, world = int(part.get(WORLD_SIZE, 1)), distributed.world_size()
        if saved_world == world or not int(part[BATCH_IDX]):
            return
        epoch, data = int(part[EPOCH]) + 1, self.data()
        where = (f"{source}: the run was saved inside epoch {epoch} by {saved_world} "
                 "process(es)")
        if any(isinstance(own, Mapping) and own.get(DATA_STATE) is not None for own in ranks):
            raise CheckpointError(
                f"{where}, each with its own state of the training data "
                f"({type(data).__name__}.state_dict()), and this run has {world}: a "
                "per-rank data state cannot be split or merged over another number of ranks. "
                f"Relaunch on {saved_world} process(es), or resume from a checkpoint written "
                "at an epoch end, or use a DataLoader over a map-style dataset (its position "
                "is kept in samples).")
        problem = reshard_problem(data, part.get(EPOCH_SAMPLES), part.get(EPOCH_ORDER))
        if problem is not None:
            raise CheckpointError(
                f"{where} and this run has {world}; the samples of the epoch not trained on "
                "yet can be resharded over the new ranks only when both launches draw the "
                f"same order from a DistributedSampler, but {problem}. Relaunch on "
                f"{saved_world} process(es), or resume from a checkpoint written at an epoch "
                "end.")

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "") -> None:
        """Continue from the saved position at the next epoch start."""
        position, shared = self.position, saved[LOOP]
        position.epoch, position.batches_done = int(shared[EPOCH]), int(shared[BATCH_IDX])
        position.step = int(shared[STEP])
        position.validated = bool(shared.get(VALIDATED, False))
        samples, size = shared.get(EPOCH_SAMPLES), shared.get(GLOBAL_BATCH)
        if size is None and samples is not None and position.batches_done:  # an older file
            size = int(samples) // position.batches_done
        position.epoch_samples = None if samples is None else int(samples)
        position.step_offset = int(shared.get(STEP_OFFSET, 0))
        position.loaded = (None if size is None else int(size), shared.get(EPOCH_ORDER))
        position.base = (position.batches_done, position.epoch_samples or 0)
        position.rewind()  # the epoch is replayed from the recorded generators


class RankPart:
    """This rank's own part of ``ranks``: its generators, its loss sums, its data's state.

    ``Loop.state_dict`` gathers it from every rank (`gathered`)."""

    def __init__(self, position: Position, device: Callable[[], torch.device]) -> None:
        self.position, self.device = position, device

    def gathered(self, gather: bool) -> dict[str, list[dict[str, Any]]]:
        """``ranks``: every rank's part (a collective), or this rank's only (``gather=False``,
        the exception path: the other ranks' sums are unknown, the resumed epoch recounts)."""
        own = self.state_dict()
        if gather:
            return {RANKS: distributed.all_gather_object(own)}
        if distributed.world_size() > 1:
            own.update({TRAIN_LOSS_SUM: None, TRAIN_SAMPLES: 0})
        return {RANKS: [own]}

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only: Python's and NumPy's generators where known."""
        position = self.position
        loss_sum = position.loss_total()
        own: dict[str, Any] = {
            TRAIN_LOSS_SUM: None if loss_sum is None else loss_sum.detach().cpu(),
            TRAIN_SAMPLES: position.samples}
        rng = position.rng
        if rng is not None:
            # Python's and NumPy's generators where known: now, when nothing drew since the
            # boundary; at an epoch's start (the epoch began right after the position);
            # else left out (the replay draws them again).
            if RNG_PYTHON not in rng and position.host_now:
                rng.update(host_rng())
            elif RNG_PYTHON not in rng and not position.batches_done and \
                    position.epoch_rng is not None:
                rng.update({key: position.epoch_rng[key] for key in (RNG_PYTHON, RNG_NUMPY)
                            if key in position.epoch_rng})
            own[RNG] = rng
            if position.batches_done:
                own.update(_inside_epoch(position, rng))
        if position.batches_done and position.data_state is not None:
            own[DATA_STATE] = position.data_state
        return own

    @staticmethod
    def check_file(source: str, saved: Mapping[str, Any]) -> None:
        """``ranks`` is a list; each saved rank's loss sums, counters and generator states
        have their types."""
        if RANKS in saved:
            expect_field(source, RANKS, saved[RANKS], isinstance(saved[RANKS], list), "a list")
        for index, part in enumerate(saved.get(RANKS) or []):
            where = f"{RANKS}[{index}]"
            expect_field(source, where, part, isinstance(part, Mapping), "a dict")
            for field in (TRAIN_SAMPLES, MARK_BATCHES, DRAWN_AHEAD):
                if field in part:
                    expect_int(source, f"{where}.{field}", part[field])
            if part.get(TRAIN_LOSS_SUM) is not None:
                expect_field(source, f"{where}.{TRAIN_LOSS_SUM}", part[TRAIN_LOSS_SUM],
                             isinstance(part[TRAIN_LOSS_SUM], torch.Tensor), "a tensor or None")
            workers = part.get(WORKERS_RNG)
            if workers is not None:
                expect_field(source, f"{where}.{WORKERS_RNG}", workers, isinstance(workers, list),
                             "a list (a generator state or None for each DataLoader worker)")
            states = [(name, part.get(name)) for name in (RNG, EPOCH_RNG, PREFETCH_RNG, MARK_RNG)]
            states += [(f"{WORKERS_RNG}[{i}]", item) for i, item in enumerate(workers or ())]
            for field, state in states:
                problem = rng_state_problem(state) if state is not None else None
                if problem is not None:
                    inner, value, expected = problem
                    expect_field(source, f"{where}.{field}" + (f".{inner}" if inner else ""),
                                 value, False, expected)

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        self.check_file(source, saved)

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "the state") -> None:
        """This rank's part; its loss sums only where they are its own (the same world)."""
        ranks, position = saved.get(RANKS) or [{}], self.position
        rank, world = distributed.rank(), distributed.world_size()
        saved_world = int(saved[LOOP].get(WORLD_SIZE, 1))
        own = dict(ranks[rank] if rank < len(ranks) else ranks[0])
        if rank >= len(ranks):
            warnings.warn(
                f"{source} has no random-generator state for rank {rank} (it was written by "
                f"{saved_world} process(es), or after an exception); rank {rank} uses rank "
                "0's, so its random draws differ from an uninterrupted run.", RuntimeWarning,
                stacklevel=4)
        if saved_world != world or (world > 1 and len(ranks) < world):
            own.update({TRAIN_LOSS_SUM: None, TRAIN_SAMPLES: 0})  # not this rank's own sums
        loss_sum, device = own.get(TRAIN_LOSS_SUM), self.device()
        position.samples = int(own.get(TRAIN_SAMPLES) or 0)
        position.loss_sum = None if loss_sum is None else loss_sum.to(device)
        position.rng, position.epoch_rng = own.get(RNG), own.get(EPOCH_RNG)
        position.prefetch_rng = own.get(PREFETCH_RNG)
        position.workers_rng, position.data_state = own.get(WORKERS_RNG), own.get(DATA_STATE)
        ahead, mark = own.get(DRAWN_AHEAD), own.get(MARK_RNG)
        position.drawn_ahead = None if ahead is None else int(ahead)
        position.host_mark = None if mark is None else (int(own[MARK_BATCHES]), mark)


def _inside_epoch(position: Position, rng: dict[str, Any]) -> dict[str, Any]:
    """The generators' states and counts of a position inside an epoch."""
    own: dict[str, Any] = {}
    if position.epoch_rng is not None:
        own[EPOCH_RNG] = position.epoch_rng
    if position.prefetch_rng is not None:
        own[PREFETCH_RNG] = position.prefetch_rng
    if position.host_mark is not None and RNG_PYTHON not in rng:
        own[MARK_BATCHES], own[MARK_RNG] = position.host_mark
    if position.workers_rng is not None:
        own[WORKERS_RNG] = [saved_rng(state) for state in position.workers_rng]
    if position.drawn_ahead is not None:
        own[DRAWN_AHEAD] = position.drawn_ahead
    return own


register_check(PositionPart.check_file)
register_check(RankPart.check_file)
