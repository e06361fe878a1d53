"""Training throughput: samples/s, batches/s, tokens/s and MFU, per logging interval."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.checks import check_int, check_number
from hookloop.errors import ConfigurationError
from hookloop.phase import Phase

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode

    from hookloop.loop import Loop

__all__ = ["ThroughputMonitor"]

Tokens = Callable[[Any], "int | torch.Tensor"]


class ThroughputMonitor(Callback):
    """Measure training speed per logging interval and put it in ``loop.state.metrics``.

    Every ``every_n_steps`` optimizer steps (and at the last training batch of an epoch,
    for data with a length) it writes, for the interval since the previous report:

    * ``samples_per_s``: samples trained per second, over all ranks (this rank's count
      times the world size: DDP gives every rank as many batches);
    * ``batches_per_s``: this rank's batches (micro-batches) per second;
    * ``tokens_per_s``: with ``tokens``, tokens per second over all ranks;
    * ``mfu``: with FLOPs per sample and ``peak_flops``, the model FLOPs utilization of
      this rank's device: ``flops_per_sample * samples/s per rank / peak_flops``.

    The views show them: `TensorBoard` logs ``metrics/samples_per_s``... at each
    validation and epoch end, `ProgressBar` shows them in the epoch's row, `CSVLogger` in
    the history rows (they are in ``loop.state.history``). Put the monitor before the views
    in the list so that their epoch-end rows show the epoch's last interval.

    Time is wall-clock time of the training pass: the clock starts at the first batch of
    each epoch (the data loader's start-up is not counted) and stops during validation.
    Counting samples reads only shapes; on CUDA the clock is read after one
    ``torch.cuda.synchronize`` per report, the one host sync of the interval (a report
    at a step where `TensorBoard` also logs shares it). No sync on other batches.

    FLOPs. ``flops_per_sample`` is the training cost of one sample (forward and backward;
    about ``6 * parameters * tokens`` for a transformer). ``"measure"`` counts it once with
    ``torch.utils.flop_counter.FlopCounterMode`` around the first training batch's forward
    and backward (that batch is not timed): the matrix products and convolutions, which is
    what MFU counts. With `Compile`, give the number instead (the counter runs the model
    outside the compiled graph, which would count a first-batch compile twice).

    Args:
        every_n_steps: The reporting interval, in optimizer steps.
        tokens: ``fn(batch) -> int`` (or a 0-dim tensor) counting the tokens of a batch, e.g.
            ``lambda batch: batch["attention_mask"].sum()`` (a tensor: summed on the device
            and read with the report) or ``lambda batch: batch["input_ids"].numel()``.
        flops_per_sample: Training FLOPs of one sample, or ``"measure"``; None: no MFU.
        peak_flops: The device's peak FLOP/s in the precision trained in (an H100 SXM:
            about ``989e12`` dense bf16; check the data sheet of yours); None: no MFU.

    Raises:
        ConfigurationError: a bad interval, a ``tokens`` that is not callable, or a
            ``flops_per_sample``/``peak_flops`` that is not a positive number.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        >>> monitor = ThroughputMonitor(every_n_steps=2, flops_per_sample="measure",
        ...                             peak_flops=1e12)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu", callbacks=[monitor])
        >>> metrics = loop.fit(1).metrics
        hookloop: training ended at epoch 1/1, step 4: its 1 epoch is done.
        >>> sorted(name for name in metrics if name != "train_loss")
        ['batches_per_s', 'mfu', 'samples_per_s']
        >>> monitor.flops_per_sample  # forward 2*4*1, the weight's gradient 2*4*1
        16.0
    """

    def __init__(self, *, every_n_steps: int = 50, tokens: Tokens | None = None,
                 flops_per_sample: float | str | None = None,
                 peak_flops: float | None = None) -> None:
        self.every_n_steps = check_int("ThroughputMonitor every_n_steps", every_n_steps)
        if tokens is not None and not callable(tokens):
            raise ConfigurationError(
                f"ThroughputMonitor tokens must be a function batch -> number of tokens or "
                f"None, got {tokens!r}.")
        self.tokens = tokens
        self._measure = flops_per_sample == "measure"
        #: Training FLOPs per sample (measured at the first batch with ``"measure"``).
        self.flops_per_sample: float | None = None if self._measure else check_number(
            "ThroughputMonitor flops_per_sample", flops_per_sample, above=0, optional=True,
            hint='Give the training FLOPs of one sample, or "measure".')
        self.peak_flops = check_number("ThroughputMonitor peak_flops", peak_flops, above=0,
                                       optional=True)
        self._counter: FlopCounterMode | None = None
        self._counted = 0  # the batch size the counter ran on
        self._start: float | None = None
        self._paused_at: float | None = None
        self._paused = 0.0
        self._samples = self._batches = 0
        self._tokens: int | torch.Tensor = 0
        self._reported_at = -1  # the step of the latest report

    def __repr__(self) -> str:
        return f"ThroughputMonitor(every_n_steps={self.every_n_steps})"

    def produces(self, loop: Loop) -> Iterable[str]:
        names = ["samples_per_s", "batches_per_s"]
        if self.tokens is not None:
            names.append("tokens_per_s")
        if (self.flops_per_sample is not None or self._measure) and self.peak_flops is not None:
            names.append("mfu")
        return names

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        self._counter = None

    def on_epoch_start(self, loop: Loop) -> None:
        """The clock starts at the epoch's first batch."""
        self._start = None
        self._reported_at = -1

    def on_batch_start(self, loop: Loop) -> None:
        """Count the batch (its samples and tokens, from shapes); start the clock."""
        if self._measuring():
            return  # the counted batch runs slower: it is not timed
        if self._start is None:
            self._restart(time.perf_counter())
        state = loop.state
        self._samples += state.batch_size
        self._batches += 1
        if self.tokens is not None:
            count = self.tokens(state.batch)
            self._tokens = self._tokens + (count.detach() if isinstance(count, torch.Tensor)
                                           else int(count))

    def train_step_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """Around the first training batch's forward and backward: the FLOP counter."""
        if not self._measuring():
            return None
        from torch.utils.flop_counter import FlopCounterMode

        self._counter, self._counted = FlopCounterMode(display=False), loop.state.batch_size
        return self._counter

    def after_step(self, loop: Loop) -> None:
        """Report every ``every_n_steps`` steps."""
        if loop.state.step % self.every_n_steps == 0:
            self._report(loop)

    def on_batch_end(self, loop: Loop) -> None:
        """Report at the last batch of the training pass (data with a length)."""
        total = loop.batches_per_epoch
        if total is not None and loop.state.batch_idx == total - 1:
            self._report(loop)

    def on_validation_start(self, loop: Loop) -> None:
        """Stop the clock: validation is not training time."""
        if loop.phase is Phase.VALIDATE and self._start is not None:
            self._paused_at = time.perf_counter()

    def on_validation_end(self, loop: Loop) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    # ------------------------------------------------------------------ inside
    def _measuring(self) -> bool:
        return self._measure and self.flops_per_sample is None and self._counter is None

    def _restart(self, now: float) -> None:
        self._start, self._paused, self._paused_at = now, 0.0, None
        self._samples = self._batches = 0
        self._tokens = 0

    def _report(self, loop: Loop) -> None:
        state = loop.state
        if self._start is None or not self._batches or self._reported_at == state.step:
            return
        if self._counter is not None and self.flops_per_sample is None:
            self.flops_per_sample = self._counter.get_total_flops() / max(1, self._counted)
        if loop.device.type == "cuda":
            torch.cuda.synchronize(loop.device)  # the interval's one sync: real time
        now = time.perf_counter()
        seconds = max(now - self._start - self._paused, 1e-9)
        world = distributed.world_size()
        metrics = state.metrics
        samples_per_s = self._samples / seconds
        metrics["samples_per_s"] = samples_per_s * world
        metrics["batches_per_s"] = self._batches / seconds
        if self.tokens is not None:
            tokens = self._tokens
            count = tokens.item() if isinstance(tokens, torch.Tensor) else tokens
            metrics["tokens_per_s"] = count / seconds * world
        if self.flops_per_sample is not None and self.peak_flops is not None:
            metrics["mfu"] = self.flops_per_sample * samples_per_s / self.peak_flops
        self._reported_at = state.step
        self._restart(now)
