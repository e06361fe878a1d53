"""Learning-rate schedules built as ordinary torch schedulers (use them with `LRScheduler`)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler as _TorchScheduler

from hookloop.base.checks import check_int, check_number
from hookloop.errors import ConfigurationError

__all__ = ["WarmupCosine", "WarmupLinear", "warmup_cosine", "warmup_linear", "resolve_warmup"]


def resolve_warmup(total_steps: int, warmup_steps: int | float, *,
                   label: str = "warmup_steps") -> int:
    """The number of warmup steps: an int as is, a fraction ``0 < x < 1`` of ``total_steps``.

    A fraction becomes ``round(x * total_steps)``.

    Args:
        total_steps: The optimizer steps of the run.
        warmup_steps: An int number of steps, or a fraction ``0 < x < 1`` of ``total_steps``.
        label: Who passed ``warmup_steps``, for the error message
            (``"warmup_cosine warmup_steps"``).

    Raises:
        ConfigurationError: a negative count, a count above ``total_steps``, or a float
            outside ``(0, 1)``.

    Example:
        >>> resolve_warmup(1000, 0.05)
        50
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float)):
        raise ConfigurationError(
            f"{label} must be an int number of steps or a fraction 0 < x < 1 of total_steps, "
            f"got {warmup_steps!r}.")
    if isinstance(warmup_steps, float):
        if not 0.0 < warmup_steps < 1.0:
            raise ConfigurationError(
                f"{label} must be strictly between 0 and 1 when it is a float (a fraction of "
                f"total_steps), got {warmup_steps!r}. Pass an int for a number of steps (e.g. "
                "warmup_steps=500) or a fraction (e.g. warmup_steps=0.05).")
        return round(warmup_steps * total_steps)
    check_int(label, warmup_steps, minimum=0)
    if warmup_steps > total_steps:
        raise ConfigurationError(
            f"{label} must be an int <= total_steps ({total_steps}), got {warmup_steps!r}.")
    return warmup_steps


class _Warmup(_TorchScheduler):
    """A linear warmup from 0 followed by a decay that subclasses define in `lr_at`.

    The learning rates are computed in closed form from ``last_epoch`` (no chaining), so
    ``get_lr`` also serves torch's deprecated ``step(epoch)``, and the state (``state_dict``) holds only numbers, so it loads with
    ``torch.load(weights_only=True)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                 min_lr: float = 0.0, last_epoch: int = -1) -> None:
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.min_lr = min_lr
        super().__init__(optimizer, last_epoch)

    def decay(self, progress: float) -> float:
        """The fraction of ``base - min_lr`` left at ``progress`` (0 to 1) of the decay."""
        raise NotImplementedError

    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate after ``step`` scheduler steps for a group whose base is ``base_lr``."""
        if step < self.warmup_steps:
            return base_lr * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr + (base_lr - self.min_lr) * self.decay(progress)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """Learning rates for the current ``last_epoch``."""
        return [self.lr_at(self.last_epoch, float(base_lr)) for base_lr in self.base_lrs]


class WarmupCosine(_Warmup):
    """Linear warmup from 0, then a cosine decay to ``min_lr``; see `warmup_cosine`."""

    def decay(self, progress: float) -> float:
        """Half a cosine period: 1 at the end of the warmup, 0 at ``total_steps``."""
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupLinear(_Warmup):
    """Linear warmup from 0, then a linear decay to ``min_lr``; see `warmup_linear`."""

    def decay(self, progress: float) -> float:
        """A straight line: 1 at the end of the warmup, 0 at ``total_steps``."""
        return 1.0 - progress


def _check(owner: str, total_steps: int, min_lr: float) -> None:
    check_int(f"{owner} total_steps", total_steps)
    check_number(f"{owner} min_lr", min_lr, minimum=0,
                 hint="It is the learning rate the schedule decays to: 0.0 (the default) or a "
                      "small positive rate such as 1e-6; a negative one would ascend the loss.")


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int,
                  warmup_steps: int | float, min_lr: float = 0.0) -> WarmupCosine:
    """Linear warmup then cosine decay, as one torch scheduler stepped once per optimizer step.

    With ``t`` the number of scheduler steps taken so far (the step about to run is step
    ``t``), ``W`` the warmup steps, ``T`` = ``total_steps`` and ``base`` each group's initial
    learning rate::

        t <  W:  lr = base * t / W
        t >= W:  p  = min(1, (t - W) / max(1, T - W))
                 lr = min_lr + (base - min_lr) * (1 + cos(pi * p)) / 2

    The warmup is the usual ``lr = base_lr * global_step / warmup_steps`` (so the very first
    step runs at lr 0 when ``W > 0``); the cosine part is ``CosineAnnealingLR(T_max=T - W,
    eta_min=min_lr)``. Past the end of the decay the rate stays at ``min_lr``.

    Args:
        optimizer: The optimizer whose groups' ``lr`` are scheduled.
        total_steps: Optimizer steps of the whole run (``LRScheduler`` passes
            ``loop.total_steps`` when given this function as a factory).
        warmup_steps: An int number of steps, or a fraction ``0 < x < 1`` of ``total_steps``
            (``round(x * total_steps)`` steps).
        min_lr: The learning rate at the end of the decay (absolute, the same for all groups).

    Returns:
        A `WarmupCosine` scheduler (a ``torch.optim.lr_scheduler.LRScheduler``).

    Raises:
        ConfigurationError: a non-positive ``total_steps`` or a bad ``warmup_steps``.

    Example:
        >>> import functools, torch
        >>> from hookloop.callbacks import LRScheduler
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> schedule = warmup_cosine(optimizer, total_steps=100, warmup_steps=0.1)
        >>> schedule.warmup_steps
        10
        >>> callback = LRScheduler(functools.partial(warmup_cosine, warmup_steps=0.05))
    """
    _check("warmup_cosine", total_steps, min_lr)
    warmup = resolve_warmup(total_steps, warmup_steps, label="warmup_cosine warmup_steps")
    return WarmupCosine(optimizer, total_steps, warmup, float(min_lr))


def warmup_linear(optimizer: torch.optim.Optimizer, total_steps: int,
                  warmup_steps: int | float, min_lr: float = 0.0) -> WarmupLinear:
    """Linear warmup then linear decay, the usual schedule for fine-tuning transformers.

    With ``t`` the scheduler steps taken so far, ``W`` the warmup steps, ``T`` =
    ``total_steps`` and ``base`` each group's initial learning rate::

        t <  W:  lr = base * t / W
        t >= W:  p  = min(1, (t - W) / max(1, T - W))
                 lr = min_lr + (base - min_lr) * (1 - p)

    Past ``total_steps`` the rate stays at ``min_lr``.

    Args:
        optimizer: The optimizer whose groups' ``lr`` are scheduled.
        total_steps: Optimizer steps of the whole run (``LRScheduler`` passes
            ``loop.total_steps`` when given this function as a factory).
        warmup_steps: An int number of steps, or a fraction ``0 < x < 1`` of ``total_steps``.
        min_lr: The learning rate at the end of the decay (absolute, the same for all groups).

    Returns:
        A `WarmupLinear` scheduler (a ``torch.optim.lr_scheduler.LRScheduler``).

    Raises:
        ConfigurationError: a non-positive ``total_steps`` or a bad ``warmup_steps``.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> schedule = warmup_linear(optimizer, total_steps=10, warmup_steps=2)
        >>> [round(schedule.lr_at(step, 0.1), 4) for step in (0, 1, 2, 6, 10)]
        [0.0, 0.05, 0.1, 0.05, 0.0]
    """
    _check("warmup_linear", total_steps, min_lr)
    warmup = resolve_warmup(total_steps, warmup_steps, label="warmup_linear warmup_steps")
    return WarmupLinear(optimizer, total_steps, warmup, float(min_lr))
