"""Throughput: samples/s, batches/s, tokens/s and MFU, per logging interval of training and
per pass of ``validate``, ``evaluate`` and ``predict``; the peak FLOP/s of common devices."""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.base.checks import check_choice, check_int, check_number
from hookloop.base.phase import Phase
from hookloop.callback import Callback
from hookloop.engine.data import batch_size_of
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode

    from hookloop.loop import Loop

__all__ = ["PEAK_FLOPS", "PRECISIONS", "ThroughputMonitor", "peak_flops_of"]

Tokens = Callable[[Any], "int | torch.Tensor"]

#: The precisions of `PEAK_FLOPS`: a float32 matmul on tensor cores is ``"tf32"``.
PRECISIONS = ("float32", "tf32", "bfloat16", "float16", "float8")

_T = 1e12
#: Dense peak FLOP/s of one device per precision (the data sheets' figures without
#: sparsity), by a pattern of the name torch reports (``torch.cuda.get_device_name``).
#: The first pattern found in the name wins, so the more specific come first. A device or
#: precision missing here gives no MFU unless ``ThroughputMonitor(peak_flops=...)``.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    r"H200 NVL": {"float32": 60 * _T, "tf32": 417.5 * _T, "bfloat16": 835.5 * _T,
                  "float16": 835.5 * _T, "float8": 1670.5 * _T},
    r"H200|GH200": {"float32": 67 * _T, "tf32": 494.7 * _T, "bfloat16": 989.4 * _T,
                    "float16": 989.4 * _T, "float8": 1978.9 * _T},
    r"H100 NVL": {"float32": 60 * _T, "tf32": 417.5 * _T, "bfloat16": 835.5 * _T,
                  "float16": 835.5 * _T, "float8": 1670.5 * _T},
    r"H100 PCIe": {"float32": 51 * _T, "tf32": 378 * _T, "bfloat16": 756.5 * _T,
                   "float16": 756.5 * _T, "float8": 1513 * _T},
    r"H100": {"float32": 67 * _T, "tf32": 494.7 * _T, "bfloat16": 989.4 * _T,
              "float16": 989.4 * _T, "float8": 1978.9 * _T},
    r"B200": {"float32": 75 * _T, "tf32": 1100 * _T, "bfloat16": 2250 * _T,
              "float16": 2250 * _T, "float8": 4500 * _T},
    r"A100": {"float32": 19.5 * _T, "tf32": 156 * _T, "bfloat16": 312 * _T, "float16": 312 * _T},
    r"\bA10G?\b": {"float32": 31.2 * _T, "tf32": 62.5 * _T, "bfloat16": 125 * _T,
                   "float16": 125 * _T},
    r"L40S": {"float32": 91.6 * _T, "tf32": 183 * _T, "bfloat16": 362 * _T, "float16": 362 * _T,
              "float8": 733 * _T},
    r"L40\b": {"float32": 90.5 * _T, "tf32": 90.5 * _T, "bfloat16": 181 * _T,
               "float16": 181 * _T, "float8": 362 * _T},
    r"\bL4\b": {"float32": 30.3 * _T, "tf32": 60 * _T, "bfloat16": 121 * _T, "float16": 121 * _T,
                "float8": 242 * _T},
    r"RTX A6000": {"float32": 38.7 * _T, "tf32": 77.4 * _T, "bfloat16": 154.8 * _T,
                   "float16": 154.8 * _T},
    r"V100S": {"float32": 16.4 * _T, "float16": 130 * _T},
    r"V100-PCIE|V100 PCIe": {"float32": 14 * _T, "float16": 112 * _T},
    r"V100": {"float32": 15.7 * _T, "float16": 125 * _T},
    r"\bT4\b": {"float32": 8.1 * _T, "float16": 65 * _T},
    r"RTX 4090": {"float32": 82.6 * _T, "tf32": 82.6 * _T, "bfloat16": 165.2 * _T,
                  "float16": 165.2 * _T, "float8": 330.3 * _T},
    r"RTX 3090": {"float32": 35.6 * _T, "tf32": 35.6 * _T, "bfloat16": 71 * _T,
                  "float16": 71 * _T},
    r"MI300X|MI325X": {"float32": 163.4 * _T, "tf32": 653.7 * _T, "bfloat16": 1307.4 * _T,
                       "float16": 1307.4 * _T, "float8": 2614.9 * _T},
    r"MI250X": {"float32": 95.7 * _T, "bfloat16": 383 * _T, "float16": 383 * _T},
    r"MI250": {"float32": 90.5 * _T, "bfloat16": 362.1 * _T, "float16": 362.1 * _T},
    r"MI210": {"float32": 45.3 * _T, "bfloat16": 181 * _T, "float16": 181 * _T},
}


def peak_flops_of(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the device named ``device_name`` in ``precision``, from
    `PEAK_FLOPS`; None when the device or that precision is not in the table.

    Example:
        >>> peak_flops_of("NVIDIA H100 80GB HBM3", "bfloat16")
        989400000000000.0
        >>> peak_flops_of("NVIDIA A100-SXM4-40GB", "tf32"), peak_flops_of("Tesla T4", "bfloat16")
        (156000000000000.0, None)
    """
    check_choice("peak_flops_of precision", precision, PRECISIONS)
    for pattern, peaks in PEAK_FLOPS.items():
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def _precision_of(dtype: torch.dtype, device: torch.device) -> str:
    """The `PRECISIONS` name of a computation in ``dtype`` (float32 matmuls on CUDA use
    TF32 when torch allows it: ``torch.backends.cuda.matmul.allow_tf32``)."""
    if dtype in (torch.bfloat16, torch.float16):
        return str(dtype).removeprefix("torch.")
    if "float8" in str(dtype):
        return "float8"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "float32"


def _first_floating(value: Any) -> torch.dtype | None:
    """The dtype of the first floating tensor in ``value`` (outputs: a tensor, a mapping,
    a sequence or an object with a ``logits``), or None."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    items = (value.values() if isinstance(value, dict) else value
             if isinstance(value, (list, tuple)) else [getattr(value, "logits", None)])
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            return item.dtype
    return None


def device_name(device: torch.device) -> str:
    """The name torch reports for ``device`` (``"NVIDIA H100 80GB HBM3"``), or its type."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


class _Count:
    """Samples, batches and tokens since ``start`` (seconds, minus time paused)."""

    __slots__ = ("start", "paused", "paused_at", "samples", "batches", "tokens")

    def __init__(self, start: float | None = None) -> None:
        self.start, self.paused = start, 0.0
        self.paused_at: float | None = None
        self.samples = self.batches = 0
        self.tokens: int | torch.Tensor = 0

    def add(self, samples: int, tokens: Tokens | None, batch: Any) -> None:
        self.samples += samples
        self.batches += 1
        if tokens is not None:
            count = tokens(batch)
            self.tokens = self.tokens + (count.detach() if isinstance(count, torch.Tensor)
                                         else int(count))

    def token_count(self) -> float:
        tokens = self.tokens
        return float(tokens.item() if isinstance(tokens, torch.Tensor) else tokens)


class ThroughputMonitor(Callback):
    """Measure training speed per logging interval and put it in ``loop.state.metrics``.

    Every ``every_n_steps`` optimizer steps (and at the last training batch of an epoch,
    for data with a length) it writes, for the interval since the previous report:

    * ``samples_per_s``: samples trained per second, over all ranks (this rank's count
      times the world size: DDP gives every rank as many batches; under `TensorParallel`
      times the data-parallel ranks only, as the ranks of a group read the same samples);
    * ``batches_per_s``: this rank's batches (micro-batches) per second;
    * ``tokens_per_s``: with ``tokens``, tokens per second over all ranks (counted as
      ``samples_per_s``);
    * ``mfu``: with FLOPs per sample and ``peak_flops``, the model FLOPs utilization of
      this rank's device: ``flops_per_sample * samples/s per rank / peak_flops`` (under
      `TensorParallel`, each rank of a group of ``tp`` does ``1/tp`` of its samples' FLOPs).

    ``loop.validate()``, ``loop.evaluate(data, prefix=...)`` and ``loop.predict(data)`` are
    measured too, each pass as a whole (its first batch to its end, synchronized on CUDA):
    ``{prefix}_samples_per_s``, ``{prefix}_batches_per_s``, ``{prefix}_tokens_per_s`` and
    ``{prefix}_mfu`` (``val_...`` for ``validate()``, ``test_...`` for ``evaluate`` by
    default, ``predict_...`` for ``predict``), in ``loop.state.metrics`` and in what
    ``validate``/``evaluate`` return. A pass's MFU counts the forward only: a third of
    ``flops_per_sample`` (backward costs about twice the forward). The validations inside
    ``fit`` are not measured (their time is left out of training's instead).

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
        peak_flops: The device's peak FLOP/s in the precision trained in; None looks it up
            in `PEAK_FLOPS` from the device's name (``torch.cuda.get_device_name``: A100,
            H100, H200, B200, L4, L40S, A10G, V100, T4, RTX 4090/3090, MI250/MI300X...) and
            the precision. A device or precision not in the table gets no MFU and one
            ``RuntimeWarning`` naming it, so it can be given here.
        precision: The precision the peak is looked up for: one of `PRECISIONS`
            (``"bfloat16"``, ``"tf32"``...) or a torch dtype; None: the dtype of the
            model's outputs at the first report (``bfloat16`` under ``AMP``), float32
            counted as ``"tf32"`` on CUDA when torch allows TF32 matmuls.

    Raises:
        ConfigurationError: a bad interval, a ``tokens`` that is not callable, or a
            ``flops_per_sample``/``peak_flops`` that is not a positive number, a precision
            not in `PRECISIONS`.

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
                 peak_flops: float | None = None,
                 precision: str | torch.dtype | None = None) -> None:
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
        if isinstance(precision, torch.dtype):
            precision = _precision_of(precision, torch.device("cpu"))
        self.precision = None if precision is None else check_choice(
            "ThroughputMonitor precision", precision, PRECISIONS)
        self._counter: FlopCounterMode | None = None
        self._counted = 0  # the batch size the counter ran on
        self._train = _Count()
        self._pass: _Count | None = None  # a validate/evaluate/predict pass being measured
        self._reported_at = -1  # the step of the latest report
        self._peak: tuple[str, str, float | None] | None = None  # (device, precision, peak)

    def __repr__(self) -> str:
        return f"ThroughputMonitor(every_n_steps={self.every_n_steps})"

    def produces(self, loop: Loop) -> Iterable[str]:
        names = ["samples_per_s", "batches_per_s"]
        if self.tokens is not None:
            names.append("tokens_per_s")
        if (self.flops_per_sample is not None or self._measure) and (
                self.peak_flops is not None or any(
                    re.search(pattern, device_name(loop.device)) for pattern in PEAK_FLOPS)):
            names.append("mfu")
        return names

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        self._counter = None

    def on_epoch_start(self, loop: Loop) -> None:
        """The clock starts at the epoch's first batch."""
        self._train = _Count()
        self._reported_at = -1

    def on_batch_start(self, loop: Loop) -> None:
        """Count the batch (its samples and tokens, from shapes); start the clock."""
        if self._measuring():
            return  # the counted batch runs slower: it is not timed
        if self._train.start is None:
            self._train = _Count(time.perf_counter())
        state = loop.state
        self._train.add(state.batch_size, self.tokens, state.batch)

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
        """Stop the training clock (validation is not training time); start a pass's."""
        if self._train.start is not None and self._train.paused_at is None:
            self._train.paused_at = time.perf_counter()
        if loop.phase is Phase.EVALUATE:
            self._pass = _Count()

    def on_validation_batch_start(self, loop: Loop) -> None:
        """In ``validate``/``evaluate``: count the batch (the clock starts at the first)."""
        if self._pass is not None:
            self._count_pass(loop.state.batch_size, loop.state.batch)

    def on_validation_end(self, loop: Loop) -> None:
        """Report a ``validate``/``evaluate`` pass; restart the training clock."""
        if self._pass is not None and loop.phase is Phase.EVALUATE:
            self._report_pass(loop, loop.state.prefix, loop.state.outputs)
        train = self._train
        if train.paused_at is not None:
            train.paused += time.perf_counter() - train.paused_at
            train.paused_at = None

    def validation_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """Around ``predict``: the pass measured as ``predict_*``."""
        return self._predicting(loop) if loop.phase is Phase.PREDICT else None

    def forward_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """In ``predict`` only: count the batch (``loop.state.batch``)."""
        if loop.phase is Phase.PREDICT and self._pass is not None:
            batch = loop.state.batch
            self._count_pass(batch_size_of(batch), batch)
        return None

    # ------------------------------------------------------------------ inside
    def _measuring(self) -> bool:
        return self._measure and self.flops_per_sample is None and self._counter is None

    @contextmanager
    def _predicting(self, loop: Loop) -> Iterator[None]:
        self._pass = _Count()
        try:
            yield
        finally:
            if self._pass is not None:
                self._report_pass(loop, "predict", None)

    def _count_pass(self, samples: int, batch: Any) -> None:
        assert self._pass is not None
        if self._pass.start is None:
            self._pass.start = time.perf_counter()
        self._pass.add(samples, self.tokens, batch)

    def _report_pass(self, loop: Loop, prefix: str, outputs: Any) -> None:
        """``{prefix}_samples_per_s``... of the pass just ended (forward-only FLOPs)."""
        count, self._pass = self._pass, None
        if count is None or count.start is None:
            return
        flops = None if self.flops_per_sample is None else self.flops_per_sample / 3
        self._write(loop, count, prefix + "_", flops, outputs)

    def _report(self, loop: Loop) -> None:
        state = loop.state
        train = self._train
        if train.start is None or not train.batches or self._reported_at == state.step:
            return
        if self._counter is not None and self.flops_per_sample is None:
            self.flops_per_sample = self._counter.get_total_flops() / max(1, self._counted)
        now = self._write(loop, train, "", self.flops_per_sample, state.outputs)
        self._reported_at = state.step
        self._train = _Count(now)

    def _write(self, loop: Loop, count: _Count, prefix: str, flops: float | None,
               outputs: Any) -> float:
        """Write the rates of ``count`` under ``prefix``; return the time read."""
        if loop.device.type == "cuda":
            torch.cuda.synchronize(loop.device)  # the interval's one sync: real time
        now = time.perf_counter()
        seconds = max(now - count.start - count.paused, 1e-9)  # type: ignore[operator]
        # The ranks of a tensor-parallel group read the same samples and share their FLOPs.
        replicas = distributed.data_parallel_size()
        group = max(1, distributed.world_size() // replicas)
        metrics = loop.state.metrics
        samples_per_s = count.samples / seconds
        metrics[f"{prefix}samples_per_s"] = samples_per_s * replicas
        metrics[f"{prefix}batches_per_s"] = count.batches / seconds
        if self.tokens is not None:
            metrics[f"{prefix}tokens_per_s"] = count.token_count() / seconds * replicas
        peak = self._peak_flops(loop, outputs) if flops is not None else None
        if flops is not None and peak is not None:
            metrics[f"{prefix}mfu"] = flops * samples_per_s / group / peak
        return now

    def _peak_flops(self, loop: Loop, outputs: Any) -> float | None:
        """``peak_flops``, else the table's figure for this device and precision (looked up
        once per device; a device or precision not in it is named in one warning)."""
        if self.peak_flops is not None:
            return self.peak_flops
        name = device_name(loop.device)
        if self._peak is not None and self._peak[0] == name:
            return self._peak[2]
        precision = self.precision
        if precision is None:
            dtype = _first_floating(outputs)
            if dtype is None:
                dtype = next((parameter.dtype for parameter in loop.unwrapped_model.parameters()
                              if parameter.is_floating_point()), torch.float32)
            precision = _precision_of(dtype, loop.device)
        peak = peak_flops_of(name, precision)
        self._peak = (name, precision, peak)
        if peak is None and distributed.is_main():
            warnings.warn(
                f"ThroughputMonitor: no peak FLOP/s known for the device {name!r} in "
                f"{precision}, so there is no MFU. Pass peak_flops= (its data sheet's dense "
                f"{precision} FLOP/s) to get one; the known devices are those of "
                "hookloop.callbacks.throughput.PEAK_FLOPS.", RuntimeWarning, stacklevel=2)
        return peak
