"""The built-in presets, `standard`, `finetune` and `debug`: the functions behind
``hookloop.presets.standard``... (`hookloop.presets` is where users find them, with the
registry's `get` and `available`; `hookloop.presets.registry` builds these by name from here).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from hookloop.base.checks import check_int, check_number
from hookloop.callback import Callback
from hookloop.callbacks.detect_anomaly import DetectAnomaly
from hookloop.callbacks.short_run import ShortRun
from hookloop.errors import ConfigurationError
from hookloop.monitor import Monitor

__all__ = ["standard", "finetune", "debug"]
_SCHEDULES = ("warmup_cosine", "warmup_linear")
_AMP_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
              torch.bfloat16: "bf16", torch.float16: "fp16"}


# ------------------------------------------------------------------ built-in presets
def standard(
    *,
    amp: str | torch.dtype | None = "bf16",
    clip: float | None = 1.0,
    accumulate: int | None = 1,
    ema: float | None = 0.999,
    schedule: str | Callable[[torch.optim.Optimizer, int], Any] | None = "warmup_cosine",
    warmup: int | float = 0.05,
    checkpoint_dir: str | os.PathLike[str] | None = "ckpt",
    tensorboard: str | os.PathLike[str] | None = "runs",
    early_stopping: int | None = 5,
    metrics: Mapping[str, Any] | Callback | None = None,
    monitor: str | None = "val_loss",
    mode: str = "auto",
    resume: bool | str | os.PathLike[str] = False,
    progress: bool = True,
    tracker: str | Callback | None = None,
) -> list[Callback]:
    """Mixed precision, clipping, EMA, warmup-cosine, metrics, early stopping, checkpoints, logs.

    The stack, in this order (each part is left out when its argument is None, False or
    0; ``accumulate=1`` means no accumulation)::

        AMP -> GradAccumulation -> GradClip -> EMA -> LRScheduler -> Metrics
            -> EarlyStopping -> TensorBoard -> tracker -> ProgressBar -> Checkpoint

    AMP comes before GradClip (gradients are unscaled before clipping), Metrics before the
    callbacks that monitor its values, and Checkpoint after every stateful callback.

    Args:
        amp: ``"bf16"`` or ``"fp16"`` (a GradScaler is added for fp16), or a torch dtype.
        clip: Maximum total gradient norm (``GradClip(clip)``).
        accumulate: Micro-batches per optimizer step (``GradAccumulation``); 1, 0, False
            or None: one batch per step (no ``GradAccumulation``).
        ema: Decay of the weights' moving average (``EMA(ema)``); validation and
            ``best.pt`` then use the averaged weights.
        schedule: ``"warmup_cosine"``, ``"warmup_linear"``, or a factory
            ``fn(optimizer, total_steps) -> scheduler`` (stepped after every optimizer step).
        warmup: Warmup of the named schedules: a number of steps, or a fraction
            ``0 < x < 1`` of the run's steps.
        checkpoint_dir: Directory of the resumable checkpoints and ``best.pt``.
        tensorboard: Directory of the TensorBoard event files.
        early_stopping: Patience in validations without improvement of ``monitor`` (ignored
            when ``monitor`` is None).
        metrics: ``{"acc": fn(outputs, targets)}`` for ``Metrics(**metrics)``, or a
            ready ``Metrics(...)`` callback.
        monitor: The metric early stopping and ``best.pt`` follow (``"val_acc"`` needs
            ``metrics={"acc": ...}``; ``"train_loss"`` for a run without validation data).
            None: no early stopping (whatever ``early_stopping`` says) and no ``best.pt``.
        mode: ``"min"``, ``"max"``, or ``"auto"``: max for accuracy-like names (acc, f1,
            auc, precision, recall, iou, score...), min for loss-like ones (loss, error,
            perplexity...).
        resume: ``Checkpoint(resume=...)``: True continues from the newest checkpoint in
            ``checkpoint_dir`` (a fresh start when there is none), a path from that file.
        progress: Show the progress display (``ProgressBar``).
        tracker: An experiment tracker: ``"wandb"`` (``WandbLogger()``), ``"mlflow"``
            (``MLflowLogger()``), a ready tracker callback, or None (default: none; an
            installed tracker is never switched on by itself).

    Returns:
        A new list of callbacks, to pass to ``Loop(..., callbacks=...)`` or to edit.

    Raises:
        ConfigurationError: a value the stack cannot use, named with the argument.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.standard(tensorboard=None, progress=False, ema=None)
        >>> [type(callback).__name__ for callback in callbacks]
        ['AMP', 'GradClip', 'LRScheduler', 'EarlyStopping', 'Checkpoint']
    """
    from hookloop.callbacks import (
        AMP,
        EMA,
        Checkpoint,
        EarlyStopping,
        GradAccumulation,
        GradClip,
        LRScheduler,
        Metrics,
    )

    callbacks: list[Callback] = []
    if amp:
        callbacks.append(AMP(_amp_name(amp)))
    if accumulate is True or accumulate not in (None, False, 0, 1):  # True == 1: refused
        callbacks.append(GradAccumulation(check_int(
            "presets.standard accumulate", accumulate, hint="Use 1 for one batch per step.")))
    if clip:
        callbacks.append(GradClip(check_number("presets.standard clip", clip, above=0,
                                               hint="Use None for no clipping.")))
    if ema:
        callbacks.append(EMA(ema))
    if schedule:
        callbacks.append(LRScheduler(_schedule_factory(schedule, warmup)))
    if metrics is not None:
        callbacks.append(_metrics(metrics, Metrics))
    resolved = Monitor(monitor, mode, owner="standard()").resolve() if monitor else None
    if early_stopping and monitor:  # monitor=None switches early stopping off
        patience = check_int("presets.standard early_stopping", early_stopping,
                             hint="Use None for no early stopping.")
        callbacks.append(EarlyStopping(monitor=monitor, mode=resolved or "auto", patience=patience))
    if tensorboard:
        from hookloop.callbacks import TensorBoard

        callbacks.append(TensorBoard(os.fspath(tensorboard)))
    if tracker is not None:
        callbacks.append(_tracker(tracker))
    if progress:
        from hookloop.callbacks import ProgressBar

        callbacks.append(ProgressBar())
    if checkpoint_dir:
        callbacks.append(Checkpoint(checkpoint_dir, monitor=monitor or None,
                                    mode=resolved or "min", resume=resume))
    return callbacks


# finetune is standard with other defaults: the defaults live here, the parameters in standard.
_FINETUNE_DEFAULTS: dict[str, Any] = {
    "ema": None,
    "schedule": "warmup_linear",
    "warmup": 0.1,
    "early_stopping": None,
}


def finetune(**arguments: Any) -> list[Callback]:
    """Fine-tune a pretrained model: bf16, clipping at 1.0, warmup then linear decay, no EMA.

    The usual recipe for a pretrained transformer-style model (a short run at a small
    learning rate, e.g. AdamW at 2e-5): 10% of the steps of linear warmup, then a linear
    decay to 0 (``schedule="warmup_cosine"`` for a cosine decay), gradients clipped at a
    total norm of 1.0, no weight averaging and no early stopping. It is `standard` with
    those defaults; every argument means the same as there.

    Returns:
        A new list of callbacks.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.finetune(tensorboard=None, progress=False, checkpoint_dir=None)
        >>> [type(callback).__name__ for callback in callbacks]
        ['AMP', 'GradClip', 'LRScheduler']
    """
    try:
        bound = _FINETUNE_SIGNATURE.bind(**arguments)
    except TypeError as error:  # name this function, not standard, in the message
        raise TypeError(f"finetune() {error}") from None
    bound.apply_defaults()
    return standard(**bound.arguments)


def _with_defaults(function: Callable[..., Any], defaults: Mapping[str, Any]) -> inspect.Signature:
    """``function``'s signature with some of its defaults replaced."""
    signature = inspect.signature(function)
    return signature.replace(parameters=[
        parameter.replace(default=defaults.get(parameter.name, parameter.default))
        for parameter in signature.parameters.values()])


# What help(), inspect.signature, `hookloop describe` and `presets.get` see: standard's
# keyword-only parameters with finetune's defaults.
_FINETUNE_SIGNATURE = _with_defaults(standard, _FINETUNE_DEFAULTS)
finetune.__signature__ = _FINETUNE_SIGNATURE  # type: ignore[attr-defined]


def debug(
    *,
    steps: int | None = 20,
    anomaly_steps: int | None = 5,
    summary: bool = True,
    input_size: Any = None,
    depth: int = 3,
    profile: bool = True,
) -> list[Callback]:
    """A short, watchful first run: model summary, NaN check, anomaly detection, profiler.

    The stack: ``ModelSummary`` (a torchinfo table at fit start), ``TerminateOnNaN`` (stop
    at the first non-finite loss, before it reaches the weights), `DetectAnomaly` (autograd
    anomaly detection for the first ``anomaly_steps`` steps: the forward line that made a
    NaN gradient), `ShortRun` (end after ``steps`` optimizer steps) and ``Profiler`` (time
    per callback and phase, printed at fit end). Put it in front of another stack to check
    that one: ``presets.debug() + presets.standard(...)``.

    Args:
        steps: Optimizer steps of the run; None runs the whole fit.
        anomaly_steps: Steps with anomaly detection (slow); None: off.
        summary: Print the model summary.
        input_size: Input shape for the summary; None takes the model's inputs from the
            first batch, through the loop's own forward (``forward=``, dict batches).
        depth: Depth of nested modules in the summary.
        profile: Time callbacks and phases.

    Returns:
        A new list of callbacks.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.debug(summary=False, profile=False)
        >>> [type(callback).__name__ for callback in callbacks]
        ['TerminateOnNaN', 'DetectAnomaly', 'ShortRun']
    """
    from hookloop.callbacks import TerminateOnNaN

    callbacks: list[Callback] = []
    if summary:
        from hookloop.callbacks import ModelSummary

        callbacks.append(ModelSummary(input_size=input_size, depth=depth))
    callbacks.append(TerminateOnNaN())
    if anomaly_steps:
        callbacks.append(DetectAnomaly(anomaly_steps))
    if steps:
        callbacks.append(ShortRun(steps))
    if profile:
        from hookloop.callbacks import Profiler

        callbacks.append(Profiler())
    return callbacks


# ------------------------------------------------------------------ helpers
def _amp_name(amp: Any) -> str:
    """The ``AMP`` precision ``standard(amp=...)`` names: ``"bf16"`` or ``"fp16"``."""
    if not isinstance(amp, (str, torch.dtype)) or amp not in _AMP_NAMES:
        raise ConfigurationError(
            f"standard(amp={amp!r}): use 'bf16' or 'fp16' (or a torch dtype), or None to "
            "train in full precision.")
    return _AMP_NAMES[amp]


def _metrics(metrics: Any, kind: Callable[..., Callback]) -> Callback:
    """The metrics callback ``standard(metrics=...)`` names: a ready one, or ``kind(**metrics)``."""
    if isinstance(metrics, Callback):
        return metrics
    if isinstance(metrics, Mapping) and metrics:
        return kind(**metrics)
    raise ConfigurationError(
        f"standard(metrics={metrics!r}): pass a dict of metric functions, e.g. "
        "metrics={'acc': accuracy}, or a Metrics(...) callback.")


def _tracker(tracker: str | Callback) -> Callback:
    """The tracker callback ``standard(tracker=...)`` names."""
    if isinstance(tracker, Callback):
        return tracker
    if tracker == "wandb":
        from hookloop.callbacks import WandbLogger

        return WandbLogger()
    if tracker == "mlflow":
        from hookloop.callbacks import MLflowLogger

        return MLflowLogger()
    raise ConfigurationError(
        f"standard(tracker={tracker!r}): use 'wandb' or 'mlflow' (pip install "
        "'hookloop[wandb]' or 'hookloop[mlflow]'), a tracker callback such as "
        "MLflowLogger('my-experiment'), or None for no tracker.")


def _schedule_factory(schedule: Any, warmup: int | float) -> Callable[..., Any]:
    """A factory ``fn(optimizer, total_steps)`` for ``LRScheduler`` from a name or a factory."""
    from hookloop import schedules

    if callable(schedule):
        return cast(Callable[..., Any], schedule)
    if schedule not in _SCHEDULES:
        raise ConfigurationError(
            f"schedule={schedule!r}: use one of {', '.join(map(repr, _SCHEDULES))}, a factory "
            "fn(optimizer, total_steps) -> scheduler, or None for a constant learning rate.")
    # Checked now, with a made-up length, so a bad warmup fails here and not at fit start.
    if isinstance(warmup, float) or not isinstance(warmup, int) or isinstance(warmup, bool):
        schedules.resolve_warmup(100, warmup)
    else:
        check_int("presets.standard warmup", warmup, minimum=0,
                  hint="A fraction 0 < x < 1 of the run's steps works too (warmup=0.05).")
    return functools.partial(getattr(schedules, schedule), warmup_steps=warmup)
