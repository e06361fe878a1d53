"""`Monitor`: the one helper behind every callback that watches a metric.

EarlyStopping, Checkpoint (``best.pt``) and plateau schedules compare a metric to the best
value so far. They share this class, so the direction, the missing-metric error and the
collective decision are the same everywhere.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import TYPE_CHECKING

from hookloop import distributed
from hookloop.base.checks import check_choice, check_number
from hookloop.base.phase import Phase
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Monitor", "MODES", "HIGHER_IS_BETTER", "LOWER_IS_BETTER", "infer_mode",
           "contradiction"]

MODES = ("auto", "min", "max")
#: Name parts of metrics where a higher value is better (``mode="auto"`` picks ``"max"``).
HIGHER_IS_BETTER = frozenset({"acc", "accuracy", "f1", "auc", "auroc", "precision", "recall",
                              "iou", "miou", "dice", "map", "bleu", "rouge", "top1", "top5"})
#: Name parts of metrics where a lower value is better (``mode="auto"`` picks ``"min"``).
LOWER_IS_BETTER = frozenset({"loss", "error", "err", "mse", "mae", "rmse", "perplexity", "ppl",
                             "nll", "wer", "cer"})


def infer_mode(metric: str) -> str | None:
    """``"max"`` or ``"min"`` from the parts of a metric name, or None when it is unclear.

    The name is split on anything that is not a letter or a digit, and trailing digits are
    dropped from each part (``acc1`` reads as ``acc``).

    Example:
        >>> infer_mode("val_acc"), infer_mode("val_loss"), infer_mode("val_score")
        ('max', 'min', None)
        >>> infer_mode("val_f1"), infer_mode("acc1"), infer_mode("train/perplexity")
        ('max', 'max', 'min')
    """
    words = re.split(r"[^a-z0-9]+", metric.lower())
    parts = {*words, *(word.rstrip("0123456789") for word in words)}
    higher, lower = bool(parts & HIGHER_IS_BETTER), bool(parts & LOWER_IS_BETTER)
    if higher == lower:  # neither, or both ("acc_loss"): the user must say
        return None
    return "max" if higher else "min"


def contradiction(owner: str, metric: str, mode: str, named: str) -> str:
    """The warning for an explicit ``mode`` against the direction the metric's name says.

    Example:
        >>> print(contradiction("EarlyStopping", "val_acc", "min", "max"))  # doctest: +ELLIPSIS
        EarlyStopping monitors 'val_acc' with mode='min', but the name says higher is better...
    """
    better, other = ("higher", "lower") if named == "max" else ("lower", "higher")
    return (f"{owner} monitors {metric!r} with mode={mode!r}, but the name says {better} is "
            f"better (mode='auto' picks {named!r}): {owner} will take the {other} values for the "
            f"better ones. If that is a slip, pass mode={named!r} (or leave mode='auto'). If "
            f"{other} really is better for this metric, silence this warning with "
            f"warnings.filterwarnings('ignore', message=\"{owner} monitors {metric!r} with "
            f"mode={mode!r}\") before creating {owner}.")


class Monitor:
    """A watched metric: its direction, its best value so far, and how to read it.

    Args:
        metric: The metric name in ``loop.state.metrics`` (``"val_loss"``, ``"val_acc"``).
        mode: ``"min"``, ``"max"``, or ``"auto"``: ``"max"`` for names with a part such as
            acc, accuracy, f1, auc, precision, recall, iou, dice, map, bleu, rouge; ``"min"``
            for loss, error, mse, mae, rmse, perplexity. Any other name needs an explicit mode
            (`resolve` raises at fit start). An explicit mode against the direction the
            name says (``"val_acc"`` with ``"min"``) is kept, with a ``UserWarning`` that
            says how to silence it.
        owner: Who monitors (used in error messages), e.g. ``"EarlyStopping"``.
        min_delta: How much a value must beat the best by to count as better (>= 0).

    Example:
        >>> monitor = Monitor("val_acc", owner="EarlyStopping")
        >>> monitor.resolve()
        'max'
        >>> monitor.better(0.9, 0.8), monitor.better(0.8, 0.9)
        (True, False)
    """

    __slots__ = ("metric", "owner", "min_delta", "mode")

    def __init__(self, metric: str, mode: str = "auto", *, owner: str,
                 min_delta: float = 0.0) -> None:
        if not isinstance(metric, str) or not metric:
            raise ConfigurationError(
                f"{owner} monitor must be a metric name such as 'val_loss', got {metric!r}.")
        check_choice(f"{owner} mode", mode, MODES,
                     hint="'min': lower is better (a loss); 'max': higher is better (accuracy); "
                          "'auto': read from the metric's name.")
        min_delta = check_number(f"{owner} min_delta", min_delta, minimum=0,
                                 hint="It is the improvement that counts; the direction comes "
                                      "from mode.")
        self.metric = metric
        self.owner = owner
        self.min_delta = float(min_delta)
        self.mode = mode if mode != "auto" else infer_mode(metric)
        named = infer_mode(metric)
        if mode != "auto" and named is not None and named != mode:
            warnings.warn(contradiction(owner, metric, mode, named), UserWarning, stacklevel=3)

    def resolve(self) -> str:
        """The direction, ``"min"`` or ``"max"``; raises when ``"auto"`` cannot tell.

        Raises:
            ConfigurationError: ``mode="auto"`` and the name says nothing about its direction.
        """
        if self.mode is None:
            raise ConfigurationError(
                f"{self.owner} monitors {self.metric!r} with mode='auto', but the name does not "
                "say whether higher or lower is better. Pass mode='max' (higher is better) or "
                "mode='min' (lower is better).")
        return self.mode

    @property
    def worst(self) -> float:
        """The starting best value: +inf for ``"min"``, -inf for ``"max"``."""
        return math.inf if self.resolve() == "min" else -math.inf

    def better(self, value: float, best: float | None) -> bool:
        """True when ``value`` beats ``best`` by more than ``min_delta`` (NaN never does)."""
        if best is None:
            return not math.isnan(value)
        if self.resolve() == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def read(self, loop: Loop, *, when: str = "") -> float:
        """The metric's value as rank 0 has it, on every rank (a collective under DDP).

        Raises:
            ConfigurationError: the metric is not in ``loop.state.metrics``; the message
                lists the metrics that are.
        """
        metrics = loop.state.metrics
        value = metrics.get(self.metric)
        if value is None:
            where = f" {when}" if when else ""
            raise ConfigurationError(
                f"{self.owner} monitors {self.metric!r} but it is not in loop.state.metrics"
                f"{where} (available: {', '.join(sorted(metrics)) or 'none'}). Monitor one of "
                "those, or make sure the callback producing it runs before "
                f"{self.owner} in every epoch.")
        return float(distributed.broadcast_object(float(value)))

    def due(self, loop: Loop, *, epoch_end: bool = False) -> bool:
        """Whether a decision on the metric is due now.

        From ``on_validation_end``: True at a validation that counts (``loop.phase is
        Phase.VALIDATE``: inside ``fit``, not the sanity check, not an ``evaluate`` pass).
        From ``on_epoch_end`` with ``epoch_end=True``: True when the loop has no validation
        data and the epoch ran through all its data, so the decision is taken on the
        training metrics there.
        """
        if epoch_end:
            return loop.val_data is None and loop.epoch_completed
        return loop.phase is Phase.VALIDATE
