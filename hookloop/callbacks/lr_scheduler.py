"""Step a torch learning-rate scheduler per optimizer step, per epoch, or on a metric."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Union

import torch
from torch.optim.lr_scheduler import LRScheduler as TorchScheduler
from torch.optim.lr_scheduler import ReduceLROnPlateau

from hookloop.callback import Callback
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["LRScheduler"]

SchedulerFactory = Callable[[torch.optim.Optimizer, int], Any]
_INTERVALS = ("step", "epoch")


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (TorchScheduler, ReduceLROnPlateau)) or (
        callable(getattr(obj, "step", None)) and callable(getattr(obj, "state_dict", None))
        and hasattr(obj, "optimizer"))


class LRScheduler(Callback):
    """Drive a torch learning-rate scheduler from the loop's events.

    ``scheduler`` is either a scheduler already built on ``loop.optimizer``, or a factory
    ``fn(optimizer, total_steps) -> scheduler`` called at fit start with
    ``loop.total_steps``: the optimizer steps of the whole run, with accumulation, DDP
    sharding, epochs and ``max_steps`` accounted (so ``OneCycleLR(total_steps=...)`` never
    steps past its end). A factory is called again at a later ``fit`` only when that total
    changed (``fit(2)`` then ``fit(4)``); the new scheduler is advanced to where the old one
    was. Used with another loop (another optimizer), a factory starts a fresh schedule.

    * ``interval="step"``: ``scheduler.step()`` in ``after_step``, which fires only for real
      optimizer steps: never inside an accumulation window, never for a step the
      GradScaler skipped or a callback cancelled.
    * ``interval="epoch"``: ``scheduler.step()`` at the ``on_epoch_end`` of every epoch
      that ran through all the data (``loop.epoch_completed``). An epoch cut short by
      ``loop.stop()`` does not step it: a later ``fit`` or a resume trains that epoch
      again, and the scheduler steps then, once.
    * ``ReduceLROnPlateau`` needs ``monitor`` and steps with ``loop.state.metrics[monitor]``
      at ``on_validation_end`` of each fit epoch (at ``on_epoch_end`` of each complete
      epoch for a loop without validation data); ``interval`` does not apply.
      ``monitors()`` declares the metric, so the stack check requires its producer to
      come first.

    Args:
        scheduler: A torch scheduler, or ``fn(optimizer, total_steps)`` returning one
            (``functools.partial(hookloop.schedules.warmup_cosine, warmup_steps=0.05)``).
        interval: ``"step"`` or ``"epoch"``.
        monitor: The metric a ``ReduceLROnPlateau`` reads (``"val_loss"``, ``"val_acc"``).
        name: State key, to keep two schedulers' states apart.

    Raises:
        ConfigurationError: a bad interval; a plateau scheduler without ``monitor`` (or a
            monitor for another scheduler); a factory with data that has no length (at fit
            start: pass ``fit(..., max_steps=N)`` or a built scheduler); at fit start, a
            scheduler with a fixed ``total_steps`` (``OneCycleLR``) shorter than the steps
            this fit will take (what is left of ``loop.total_steps`` after
            ``loop.state.step``), instead of torch's "Tried to step N times" mid-run.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(5)]
        >>> schedule = LRScheduler(lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(
        ...     opt, max_lr=0.1, total_steps=total))
        >>> loop = Loop(model, optimizer, data, loss_fn=torch.nn.functional.mse_loss,
        ...             device="cpu", callbacks=[schedule])
        >>> loop.fit(2).step
        10
    """

    def __init__(self, scheduler: Union[TorchScheduler, ReduceLROnPlateau, SchedulerFactory],
                 *, interval: str = "step", monitor: str | None = None,
                 name: str | None = None) -> None:
        if interval not in _INTERVALS:
            raise ConfigurationError(
                f"LRScheduler interval must be 'step' (after every optimizer step) or 'epoch' "
                f"(at every epoch end), got {interval!r}.")
        if monitor is not None and not isinstance(monitor, str):
            raise ConfigurationError(f"LRScheduler monitor must be a metric name, got {monitor!r}.")
        self.interval = interval
        self.monitor = monitor
        self.name = name
        self._factory: SchedulerFactory | None = None
        self._scheduler: Any = None
        self._built_total: int | None = None
        self._pending: dict[str, Any] | None = None
        self._fitting = False
        if _is_scheduler(scheduler):
            self._scheduler = scheduler
            self._check_monitor(scheduler)
        elif callable(scheduler):
            self._factory = scheduler
        else:
            raise ConfigurationError(
                f"LRScheduler needs a torch scheduler or a factory fn(optimizer, total_steps), "
                f"got {type(scheduler).__name__}.")

    def __repr__(self) -> str:
        inner = type(self._scheduler).__name__ if self._scheduler is not None else "factory"
        return f"LRScheduler({inner}" + (f", name={self.name!r})" if self.name else ")")

    @property
    def scheduler(self) -> Any:
        """The torch scheduler (built from the factory at fit start), or None before that."""
        return self._scheduler

    @property
    def is_plateau(self) -> bool:
        """True when the scheduler is a ``ReduceLROnPlateau`` (metric-driven)."""
        return isinstance(self._scheduler, ReduceLROnPlateau)

    def monitors(self) -> Iterable[str]:
        return (self.monitor,) if self.monitor is not None else ()

    def _check_monitor(self, scheduler: Any) -> None:
        if isinstance(scheduler, ReduceLROnPlateau):
            if self.monitor is None:
                raise ConfigurationError(
                    "ReduceLROnPlateau steps on a metric, so LRScheduler needs monitor=..., "
                    "e.g. LRScheduler(ReduceLROnPlateau(optimizer), monitor='val_loss').")
        elif self.monitor is not None:
            raise ConfigurationError(
                f"LRScheduler monitor={self.monitor!r} is only used by ReduceLROnPlateau; "
                f"{type(scheduler).__name__} does not read metrics. Remove monitor=.")

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        """Build the scheduler from the factory with ``loop.total_steps`` and check it."""
        self._fitting = True
        if self._factory is not None:
            total = loop.total_steps
            if total is None:
                raise ConfigurationError(
                    "The LRScheduler factory needs the number of optimizer steps, but "
                    f"train_data ({type(loop.train_data).__name__}) has no length. Pass "
                    "fit(..., max_steps=N), give the data a __len__, or pass a scheduler "
                    "built by hand instead of a factory.")
            if total == 0:  # fit(0) or nothing left to do: no step will need a scheduler
                return
            if getattr(self._scheduler, "optimizer", None) is not loop.optimizer:
                self._scheduler = None  # first fit, or a new loop: start the schedule afresh
            if self._scheduler is None or (self._built_total != total and not self.is_plateau):
                self._build(loop, total)
        if getattr(self._scheduler, "optimizer", loop.optimizer) is not loop.optimizer:
            raise ConfigurationError(
                "The scheduler given to LRScheduler was built on another optimizer than "
                "the loop's. Build it on loop.optimizer (the one passed to Loop).")
        self._check_length(loop)

    def _check_length(self, loop: Loop) -> None:
        """Raise if a fixed-length scheduler (``total_steps``) would run out during this fit.

        OneCycleLR raises "Tried to step N times" past its end; this says so before the
        first batch. Its remaining length is ``total_steps - last_epoch`` (a loaded state
        counts); the fit needs ``loop.total_steps - loop.state.step`` steps (what is left of
        the run), or the epochs left with ``interval="epoch"``.
        """
        length = getattr(self._scheduler, "total_steps", None)
        if isinstance(length, bool) or not isinstance(length, int) or self.is_plateau:
            return
        taken = int(getattr(self._scheduler, "last_epoch", 0) or 0)
        left = length - max(taken, 0)
        if self.interval == "step":
            total = loop.total_steps
            if total is None:
                return
            needed, unit = total - loop.state.step, "optimizer steps"
            done = f"loop.total_steps={total} minus {loop.state.step} already taken"
        else:
            if loop.state.max_steps is not None:  # max_steps may end the run early
                return
            position = int(loop.state_dict()["epoch"])
            needed, unit = loop.state.epochs - position, "epochs"
            done = f"fit({loop.state.epochs}) minus {position} epochs already done"
        if needed <= left:
            return
        name = type(self._scheduler).__name__
        if self._factory is not None:
            fix = ("Build the scheduler with the total the factory receives: "
                   "lambda opt, total: OneCycleLR(opt, max_lr, total_steps=total).")
        else:
            fix = ("Pass a factory instead, so the loop supplies the total: "
                   "LRScheduler(lambda opt, total: OneCycleLR(opt, max_lr, total_steps=total)).")
        raise ConfigurationError(
            f"LRScheduler: the {name} has total_steps={length} ({left} steps left after "
            f"{taken} taken), but this fit will step it {needed} times ({unit}: {done}); it "
            f"would fail mid-run with torch's 'Tried to step {left + 1} times'. {fix}")

    def _build(self, loop: Loop, total: int) -> None:
        previous = self._scheduler
        scheduler = self._factory(loop.optimizer, total)  # type: ignore[misc]
        if not _is_scheduler(scheduler):
            raise ConfigurationError(
                f"The LRScheduler factory returned {type(scheduler).__name__}, not a torch "
                "scheduler. It must be fn(optimizer, total_steps) -> scheduler.")
        self._check_monitor(scheduler)
        if self._pending is not None:
            scheduler.load_state_dict(self._pending)
            self._pending = None
        elif previous is not None:  # a later fit with another total: catch up
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(int(getattr(previous, "last_epoch", 0))):
                    scheduler.step()
        self._scheduler, self._built_total = scheduler, total

    def on_fit_end(self, loop: Loop) -> None:
        self._fitting = False

    def after_step(self, loop: Loop) -> None:
        if self.interval == "step" and not self.is_plateau:
            self._scheduler.step()

    def on_validation_end(self, loop: Loop) -> None:
        if self.is_plateau and self._fitting:
            self._scheduler.step(self._metric(loop))

    def on_epoch_end(self, loop: Loop) -> None:
        if not loop.epoch_completed:  # cut short by stop(): the epoch is done again later
            return
        if self.is_plateau:
            if loop.val_data is None and self.monitor in loop.state.metrics:
                self._scheduler.step(self._metric(loop))
        elif self.interval == "epoch":
            self._scheduler.step()

    def _metric(self, loop: Loop) -> float:
        metrics = loop.state.metrics
        if self.monitor not in metrics:
            raise ConfigurationError(
                f"LRScheduler monitors {self.monitor!r}, which is not in this epoch's metrics "
                f"({', '.join(sorted(metrics)) or 'none'}). Monitor one of those, or add the "
                "callback that writes it before LRScheduler.")
        return float(metrics[self.monitor])

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The scheduler's own ``state_dict()`` (or a loaded one not yet applied)."""
        if self._scheduler is not None:
            return self._scheduler.state_dict()
        return dict(self._pending or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load into the scheduler now, or into the factory's scheduler when it is built."""
        if not state:
            return
        if self._scheduler is not None:
            self._scheduler.load_state_dict(state)
        else:
            self._pending = dict(state)
