"""The built-in callbacks. Stack them in a list, in the order they should run."""

from __future__ import annotations

from hookloop.callbacks.amp import AMP
from hookloop.callbacks.ema import EMA
from hookloop.callbacks.grad_accumulation import GradAccumulation
from hookloop.callbacks.grad_clip import GradClip
from hookloop.callbacks.lr_scheduler import LRScheduler

__all__: list[str] = []
__all__ += ["AMP", "EMA", "GradAccumulation", "GradClip", "LRScheduler"]
