"""The loop's resume position: where the weights are, in terms of data and random numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from hookloop.data import length_of
from hookloop.rng import capture_rng, restore_rng

__all__ = ["Position", "RunPosition"]


class RunPosition(NamedTuple):
    """Where the weights are: ``batch_idx`` batches of ``epoch`` done, ``step`` steps taken.

    ``batch_idx == 0`` means the epoch has not started (a finished epoch ``e`` reads as
    ``(e + 1, 0, step)``).
    """

    epoch: int
    batch_idx: int
    step: int


class Position:
    """The last step boundary (or epoch end) the loop reached: where a resume starts.

    A checkpoint taken mid-window or mid-batch resumes from here, and the batches after it
    are trained again with the same data order and the same random draws: the generators
    are recorded at every step boundary and at every epoch start. Torch's generators (CPU,
    CUDA, the DataLoader's) are always recorded, so ``fit()`` after an exception replays
    exactly; with ``full_snapshots`` (turned on by ``Checkpoint``) Python's and NumPy's
    global generators are recorded too.
    """

    __slots__ = ("epoch", "batches_done", "step", "loss_sum", "samples", "full_snapshots",
                 "rng", "epoch_rng", "prefetch_rng", "validated", "_replay")

    def __init__(self) -> None:
        self.epoch = self.batches_done = self.step = self.samples = 0
        self.loss_sum: torch.Tensor | None = None
        self.full_snapshots = False
        self.rng: dict[str, Any] | None = None
        self.epoch_rng: dict[str, Any] | None = None
        #: Data without a length, read one batch ahead: the random state the batch after
        #: the position was fetched with (before the position's own).
        self.prefetch_rng: dict[str, Any] | None = None
        #: The validation due at ``step`` (``Loop(val_every_n_steps=...)``) has run.
        self.validated = False
        self._replay = False  # the next epoch start replays from the recorded generators

    @property
    def public(self) -> RunPosition:
        return RunPosition(self.epoch, self.batches_done, self.step)

    def record(self, epoch: int, batches_done: int, step: int, loss_sum: torch.Tensor | None,
               samples: int, generators: Sequence[torch.Generator],
               prefetch_rng: dict[str, Any] | None = None) -> None:
        """The weights now are those after ``batches_done`` batches of ``epoch``."""
        self.prefetch_rng = prefetch_rng
        self.validated = self.validated and step == self.step  # still that step's
        self.epoch, self.batches_done, self.step = epoch, batches_done, step
        self.loss_sum, self.samples = loss_sum, samples
        self.rng = capture_rng(generators, full=self.full_snapshots)

    def rewind(self) -> None:
        """After an exception: the next epoch start continues from the recorded position."""
        self._replay = True

    def parts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(shared, own)``: what every rank agrees on, and what is this rank's own
        (its generators and the loss sums of its shard). Tensors and plain values only."""
        shared = {"epoch": self.epoch, "batch_idx": self.batches_done, "step": self.step,
                  "validated": self.validated}
        own: dict[str, Any] = {
            "train_loss_sum": None if self.loss_sum is None else self.loss_sum.detach().cpu(),
            "train_samples": self.samples,
        }
        if self.rng is not None:
            own["rng"] = self.rng
            if self.batches_done and self.epoch_rng is not None:
                own["epoch_rng"] = self.epoch_rng
            if self.batches_done and self.prefetch_rng is not None:
                own["prefetch_rng"] = self.prefetch_rng
        return shared, own

    def load(self, shared: Mapping[str, Any], own: Mapping[str, Any], device: torch.device) -> None:
        """Continue from `parts` at the next epoch start."""
        loss_sum = own.get("train_loss_sum")
        self.epoch, self.batches_done = int(shared["epoch"]), int(shared["batch_idx"])
        self.step, self.samples = int(shared["step"]), int(own.get("train_samples") or 0)
        self.validated = bool(shared.get("validated", False))
        self.loss_sum = None if loss_sum is None else loss_sum.to(device)
        self.rng, self.epoch_rng = own.get("rng"), own.get("epoch_rng")
        self.prefetch_rng = own.get("prefetch_rng")
        self._replay = True

    def start_epoch(self, epoch: int, data: Iterable[Any], generators: Sequence[torch.Generator],
                    new_sum: Callable[[], torch.Tensor], live: Any = None,
                    wrap: Callable[[Any], Any] | None = None
                    ) -> tuple[Any, int, torch.Tensor, int]:
        """The epoch's iterator past the batches already trained on, the first batch index,
        and the training-loss sum and sample count so far.

        After `load` or `rewind`, the generators are put back as they were when the
        interrupted run created this epoch's iterator (same data order), the trained batches
        are skipped, then the generators are put back as they were at the position (same
        dropout and augmentation draws). ``live``, the iterator of an epoch that ``stop``
        cut short in this process, is continued as it is. ``wrap`` (the loop's look-ahead
        for data without a length) wraps the iterator after the skipped batches, under the
        random state its first fetch had in the interrupted run.
        """
        skip = self.batches_done if self.epoch == epoch else 0
        if skip and self.loss_sum is not None:
            loss_sum, samples = self.loss_sum, self.samples
        else:
            loss_sum, samples = new_sum(), 0
        replay, self._replay = self._replay, False
        if live is not None and skip and not replay:
            return live, skip, loss_sum, samples
        if replay and skip and self.epoch_rng is not None:
            restore_rng(self.epoch_rng, generators)
        elif replay and not skip and self.rng is not None:
            restore_rng(self.rng, generators)
        if not skip:
            self.epoch_rng = capture_rng(generators, full=self.full_snapshots)
        total = length_of(data)
        # skip == total still iterates: a sampler may draw from the loader's generator when
        # its iterator is exhausted (RandomSampler does, after an even last batch).
        if total is not None and skip > total:
            iterator: Any = iter(())
        else:
            iterator = iter(data)
            for _ in range(skip):
                next(iterator)
        if wrap is not None:
            if replay and skip and self.prefetch_rng is not None:
                restore_rng(self.prefetch_rng, generators)
            iterator = wrap(iterator)
        if replay and skip and self.rng is not None:
            restore_rng(self.rng, generators)
        return iterator, skip, loss_sum, samples
