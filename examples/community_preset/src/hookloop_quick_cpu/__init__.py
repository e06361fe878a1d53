"""A hookloop preset published by a separate package: ``presets.get("quick_cpu")``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hookloop import Callback, presets
from hookloop.callbacks import TerminateOnNaN

__all__ = ["quick_cpu"]


# The hookloop versions this preset is made for: outside them, hookloop refuses it by name.
@presets.requires(">=0.1,<1")
def quick_cpu(*, clip: float | None = 1.0, warmup: int | float = 0.05,
              metrics: Mapping[str, Callable[..., Any]] | None = None) -> list[Callback]:
    """Full precision, clipping, warmup-cosine and a NaN check; no files: CPU experiments.

    A preset is a function returning a new list of callbacks. This one starts from the
    built-in standard stack with everything that writes files or needs a GPU switched off,
    and adds a check for non-finite losses in front.

    Args:
        clip: Maximum total gradient norm; None: no clipping.
        warmup: Warmup steps of the schedule, or a fraction of the run's steps.
        metrics: ``{"acc": fn(outputs, targets)}`` to compute on the validation data.

    Returns:
        The callbacks, in order.

    Example:
        >>> [type(callback).__name__ for callback in quick_cpu()]
        ['TerminateOnNaN', 'GradClip', 'LRScheduler']
    """
    return [TerminateOnNaN()] + presets.standard(
        amp=None, clip=clip, ema=None, warmup=warmup, metrics=metrics, early_stopping=None,
        checkpoint_dir=None, tensorboard=None, progress=False)
