"""The loop's resume position: where the weights are, in terms of data and random numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from hookloop.data import length_of
from hookloop.rng import capture_rng, restore_rng

__all__ = ["Position"]


class Position:
    """The last step boundary (or epoch end) the loop reached: what a checkpoint resumes from.

    A checkpoint taken mid-window or mid-batch resumes from here, and the batches after it
    are trained again. With ``snapshots`` on (``Loop.enable_resume_snapshots``), the random
    generators are recorded at every position and at every epoch start, so the replay draws
    the same data order and the same dropout as the interrupted run.
    """

    __slots__ = ("epoch", "batches_done", "step", "loss_sum", "samples", "snapshots", "rng",
                 "epoch_rng", "_pending")

    def __init__(self) -> None:
        self.epoch = self.batches_done = self.step = self.samples = 0
        self.loss_sum: torch.Tensor | None = None
        self.snapshots = False
        self.rng: dict[str, Any] | None = None
        self.epoch_rng: dict[str, Any] | None = None
        self._pending: Mapping[str, Any] | None = None

    def record(self, epoch: int, batches_done: int, step: int, loss_sum: torch.Tensor | None,
               samples: int, generators: Sequence[torch.Generator]) -> None:
        """The weights now are those after ``batches_done`` batches of ``epoch``."""
        self.epoch, self.batches_done, self.step = epoch, batches_done, step
        self.loss_sum, self.samples = loss_sum, samples
        if self.snapshots:
            self.rng = capture_rng(generators)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (``torch.load(weights_only=True)`` reads them)."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batch_idx": self.batches_done,
            "step": self.step,
            "train_loss_sum": None if self.loss_sum is None else self.loss_sum.detach().cpu(),
            "train_samples": self.samples,
        }
        if self.snapshots and self.rng is not None:
            state["rng"] = self.rng
            if self.batches_done and self.epoch_rng is not None:
                state["epoch_rng"] = self.epoch_rng
        return state

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        """Continue from ``state`` at the next epoch iteration."""
        loss_sum = state.get("train_loss_sum")
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batch_idx"])
        self.step, self.samples = int(state["step"]), int(state.get("train_samples", 0))
        self.loss_sum = None if loss_sum is None else loss_sum.to(device)
        self.rng, self.epoch_rng = state.get("rng"), state.get("epoch_rng")
        self._pending = state

    def start_epoch(self, epoch: int, data: Iterable[Any], generators: Sequence[torch.Generator],
                    new_sum: Callable[[], torch.Tensor], live: Any = None
                    ) -> tuple[Any, int, torch.Tensor, int]:
        """The epoch's iterator past the batches already trained on, the first batch index,
        and the training-loss sum and sample count so far.

        After `load_state_dict`, the generators are put back as they were when the
        interrupted run created this epoch's iterator (same data order), the trained batches
        are skipped, then the generators are put back as they were at the position (same
        dropout and augmentation draws). ``live``, the iterator of an epoch that ``stop``
        cut short in this process, is continued as it is.
        """
        skip = self.batches_done if self.epoch == epoch else 0
        if skip and self.loss_sum is not None:
            loss_sum, samples = self.loss_sum, self.samples
        else:
            loss_sum, samples = new_sum(), 0
        if live is not None and skip and self._pending is None:
            return live, skip, loss_sum, samples
        pending, self._pending = self._pending, None
        if pending is not None and skip and pending.get("epoch_rng") is not None:
            restore_rng(pending["epoch_rng"], generators)
        elif pending is not None and not skip and pending.get("rng") is not None:
            restore_rng(pending["rng"], generators)
        if self.snapshots and not skip:
            self.epoch_rng = capture_rng(generators)
        total = length_of(data)
        # skip == total still iterates: a sampler may draw from the loader's generator when
        # its iterator is exhausted (RandomSampler does, after an even last batch).
        if total is not None and skip > total:
            iterator: Any = iter(())
        else:
            iterator = iter(data)
            for _ in range(skip):
                next(iterator)
        if pending is not None and skip and pending.get("rng") is not None:
            restore_rng(pending["rng"], generators)
        return iterator, skip, loss_sum, samples
