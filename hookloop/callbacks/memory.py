"""Peak memory per epoch: CUDA's allocator peak, or the process's peak RSS elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from hookloop import distributed
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["MemoryMonitor", "peak_rss_bytes"]

_MIB = 2.0 ** 20


def peak_rss_bytes() -> int | None:
    """The largest resident set size this process has had, in bytes (None where the
    platform does not say: Windows without ``resource``).

    Example:
        >>> peak_rss_bytes() > 0
        True
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux: KiB


class MemoryMonitor(Callback):
    """Put the epoch's peak memory in ``loop.state.metrics["peak_memory_mib"]`` (MiB).

    On CUDA: ``torch.cuda.max_memory_allocated`` of the loop's device, the peak of the
    tensors torch allocated, training and validation included; the peak is reset at each
    epoch start, so each epoch's value is its own. Elsewhere (CPU, MPS): the process's
    peak resident set size (``getrusage``), which the system never resets: the largest
    value of the run so far. Under DDP or FSDP the value is the maximum over the ranks
    (each rank reads its own, then one all-reduce of a number), the same on every rank: the
    rank that needs the most memory is the one that runs out first.

    Written at the last training batch of the epoch (data with a length), at the end of
    each validation and at the epoch end, and shown by the views that read the metrics
    (`TensorBoard` as ``metrics/peak_memory_mib``, `ProgressBar` in the epoch's row,
    `CSVLogger` and ``loop.state.history``). Put it before the views so their epoch-end
    rows show the value that includes validation. Reading the peak costs no device sync;
    it is read a few times per epoch, never per batch (with several ranks, each read is a
    collective, at points every rank reaches).

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[MemoryMonitor()])
        >>> loop.fit(1).metrics["peak_memory_mib"] > 0
        hookloop: training ended at epoch 1/1, step 4: its 1 epoch is done.
        True
    """

    def __repr__(self) -> str:
        return "MemoryMonitor()"

    def produces(self, loop: Loop) -> Iterable[str]:
        return ("peak_memory_mib",)

    def on_epoch_start(self, loop: Loop) -> None:
        """Start the epoch's CUDA peak from the memory in use now."""
        if loop.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(loop.device)

    def on_batch_end(self, loop: Loop) -> None:
        """At the training pass's last batch: the peak so far."""
        total = loop.batches_per_epoch
        if total is not None and loop.state.batch_idx == total - 1:
            self._write(loop)

    def on_validation_end(self, loop: Loop) -> None:
        self._write(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        self._write(loop)

    def _write(self, loop: Loop) -> None:
        if loop.device.type == "cuda":
            peak: int | None = torch.cuda.max_memory_allocated(loop.device)
        else:
            peak = peak_rss_bytes()
        if distributed.world_size() > 1:  # the largest rank's; -1: a rank that cannot tell
            mine = torch.tensor([-1.0 if peak is None else float(peak)], dtype=torch.float64,
                                device=distributed.collective_device())
            largest = float(distributed.all_reduce_max(mine).item())
            peak = None if largest < 0 else int(largest)
        if peak is not None:
            loop.state.metrics["peak_memory_mib"] = peak / _MIB
