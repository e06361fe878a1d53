"""`lr_find`: the learning-rate range test, leaving the run exactly as it was."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hookloop.base.checks import check_int, check_number
from hookloop.engine.data import move_to_device
from hookloop.engine.forward import ForwardRule, check_loss
from hookloop.engine.rng import loader_generators
from hookloop.engine.untouched import untouched
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["lr_find", "LRFindResult"]


@dataclass
class LRFindResult:
    """What `lr_find` tried and saw.

    Attributes:
        lrs: The learning rate of each optimizer step, in order.
        losses: The smoothed (bias-corrected) training loss after each of those steps.
        raw_losses: The loss of each step's batch, as computed.
        suggestion: The learning rate at the steepest descent of the smoothed loss against
            ``log(lr)``, or None when fewer than 3 points were recorded.
        stop_reason: Why the test ended before ``steps`` steps, or None.
    """

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    raw_losses: list[float] = field(default_factory=list)
    suggestion: float | None = None
    stop_reason: str | None = None

    def table(self, rows: int = 12, width: int = 30) -> str:
        """A text plot: about ``rows`` evenly spaced points, the loss drawn as a bar.

        The suggested rate is marked with ``<- suggestion``.
        """
        if not self.lrs:
            return "lr_find: no point recorded"
        every = max(1, math.ceil(len(self.lrs) / rows))
        picked = sorted(set(range(0, len(self.lrs), every)) | {len(self.lrs) - 1} |
                        ({self.lrs.index(self.suggestion)} if self.suggestion is not None else set()))
        shown = self.losses[:-1] if self.stop_reason and len(self.losses) > 1 else self.losses
        low, high = min(shown), max(shown)  # the diverging point would flatten the rest
        span = (high - low) or 1.0
        lines = [f"{'lr':>10}  {'smoothed loss':>13}"]
        for index in picked:
            loss = self.losses[index]
            length = 1 + round((width - 1) * (loss - low) / span)
            bar = "#" * min(length, width) + (">" if length > width else "")
            mark = "  <- suggestion" if self.lrs[index] == self.suggestion else ""
            lines.append(f"{self.lrs[index]:>10.3g}  {loss:>13.5g}  {bar}{mark}")
        return "\n".join(lines)


def _cycle(data: Any) -> Iterator[Any]:
    """Batches of ``data``, starting over each time it runs out (a new pass of a loader)."""
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise ConfigurationError("lr_find: train_data yielded no batches: it is empty.")


def _steepest(lrs: list[float], losses: list[float]) -> float | None:
    """The lr where the smoothed loss falls fastest against log(lr) (central differences),
    leaving out the first fifth of the points (at most 10): there the smoothed curve still
    follows its first few batches."""
    begin = min(10, len(losses) // 5)
    lrs, losses = lrs[begin:], losses[begin:]
    if len(losses) < 3:
        return None
    logs = [math.log(lr) for lr in lrs]
    slopes = []
    for index in range(len(losses)):
        left, right = max(index - 1, 0), min(index + 1, len(losses) - 1)
        slopes.append((losses[right] - losses[left]) / (logs[right] - logs[left]))
    return lrs[min(range(len(slopes)), key=slopes.__getitem__)]


def lr_find(loop: Loop, start_lr: float = 1e-7, end_lr: float = 10.0, steps: int = 100, *,
            smoothing: float = 0.98, divergence: float = 4.0) -> LRFindResult:
    """Run the learning-rate range test on ``loop``, then put everything back.

    Trains for up to ``steps`` optimizer steps on ``loop.train_data`` (starting the data
    over when it is shorter), with the learning rate of every param group set to::

        lr_i = start_lr * (end_lr / start_lr) ** (i / (steps - 1))     i = 0 .. steps-1

    After each step it records the batch's loss and its smoothed value
    ``avg_i = smoothing * avg_{i-1} + (1 - smoothing) * loss_i`` (``avg_{-1} = 0``),
    bias-corrected as ``avg_i / (1 - smoothing ** (i + 1))``. It stops early when the loss
    is not finite (that point is not recorded) or the smoothed loss exceeds ``divergence``
    times the lowest one (that point is recorded). The suggested rate is the one at the
    steepest descent of the smoothed loss against ``log(lr)`` (central differences; the
    first fifth of the points, at most 10, and a diverging last point are left out, as
    the smoothed curve there follows a few batches); many users then take a
    rate somewhat below it, or a tenth of the rate of the lowest loss.

    The test runs the loop's loss rules (``forward``, ``loss_fn``, mapping batches) on
    ``loop.device``, with the plain optimizer step: no callback runs (no AMP autocast,
    clipping or accumulation), and ``loop.fit`` is not called, so the run's state,
    history and callbacks stay untouched. Afterwards the model's weights and buffers, its
    train/eval mode, the optimizer's state and hyper-parameters (learning rates included)
    and every random generator (Python, NumPy, torch, CUDA and the loader's generators)
    are exactly what they were; gradients are cleared. The model stays on ``loop.device``,
    where ``fit`` puts it anyway.

    Args:
        loop: The loop whose model, optimizer and training data are tested.
        start_lr: The first learning rate (> 0).
        end_lr: The last learning rate (> start_lr).
        steps: The number of optimizer steps (>= 2).
        smoothing: The exponential smoothing factor of the loss, in [0, 1).
        divergence: Stop when the smoothed loss exceeds this multiple of the best (> 1).

    Returns:
        An `LRFindResult` with ``lrs``, ``losses`` (smoothed), ``raw_losses``,
        ``suggestion`` and ``table()``, a text plot.

    Raises:
        ConfigurationError: a bad argument, or empty training data.

    Example:
        >>> import torch, hookloop
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(4)]
        >>> loop = hookloop.Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                      loss_fn=torch.nn.functional.mse_loss, device="cpu")
        >>> result = hookloop.lr_find(loop, start_lr=1e-4, end_lr=1.0, steps=5)
        >>> [f"{lr:.0e}" for lr in result.lrs]
        ['1e-04', '1e-03', '1e-02', '1e-01', '1e+00']
        >>> loop.optimizer.param_groups[0]["lr"]
        0.1
    """
    sweep = ("The range test sweeps learning rates from start_lr up to end_lr on a log scale, "
             "so both are > 0: the defaults start_lr=1e-7, end_lr=10 suit most models.")
    check_number("lr_find start_lr", start_lr, above=0, hint=sweep)
    check_number("lr_find end_lr", end_lr, above=0, hint=sweep)
    if end_lr <= start_lr:
        raise ConfigurationError(
            f"lr_find end_lr must be larger than start_lr ({start_lr!r}), got {end_lr!r}. The "
            "range test ramps the learning rate up.")
    check_int("lr_find steps", steps, minimum=2)
    check_number("lr_find smoothing", smoothing, minimum=0, below=1,
                 hint="0 turns the smoothing of the loss off.")
    check_number("lr_find divergence", divergence, above=1,
                 hint="It is the multiple of the best loss at which the test stops.")
    model, optimizer = loop.model, loop.optimizer
    model.to(loop.device)
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    result = LRFindResult()
    # Every parameter and buffer (non-persistent ones too), every submodule's mode and
    # every random generator.
    with untouched(model, loader_generators(loop.train_data), tensors="all"):
        try:
            _ramp(loop, start_lr, end_lr, steps, smoothing, divergence, result)
        finally:
            optimizer.zero_grad(set_to_none=True)
            optimizer.load_state_dict(saved_optimizer)
    # The diverging point is shown, but the suggestion comes from the curve before it.
    end = len(result.losses) - (1 if result.stop_reason and result.losses else 0)
    result.suggestion = _steepest(result.lrs[:end], result.losses[:end])
    return result


def _ramp(loop: Loop, start_lr: float, end_lr: float, steps: int, smoothing: float,
          divergence: float, result: LRFindResult) -> None:
    """The range test itself: an exponential ramp, stopped at divergence."""
    model, optimizer = loop.model, loop.optimizer
    model.train()
    optimizer.zero_grad(set_to_none=True)
    batches = _cycle(loop.train_data)
    rule = ForwardRule(loop, loop.forward, loop.loss_fn, loop.inputs, loop.targets)
    ratio = end_lr / start_lr
    average, best = 0.0, math.inf
    for index in range(steps):
        lr = start_lr * ratio ** (index / (steps - 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = move_to_device(next(batches), loop.device)
        _, loss = rule.compute(loop.model, batch)
        loss = check_loss(loss, training=True)
        value = float(loss.detach())  # one host sync per step: this is a measurement
        if not math.isfinite(value):
            result.stop_reason = f"the loss is {value} at lr={lr:.3g}"
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        average = smoothing * average + (1 - smoothing) * value
        smoothed = average / (1 - smoothing ** (index + 1))
        result.lrs.append(lr)
        result.raw_losses.append(value)
        result.losses.append(smoothed)
        best = min(best, smoothed)
        if smoothed > divergence * best:
            result.stop_reason = (f"the smoothed loss {smoothed:.4g} exceeds {divergence:g}x "
                                  f"the best {best:.4g} at lr={lr:.3g}")
            break

