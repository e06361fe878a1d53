"""Step a torch learning-rate scheduler per optimizer step, per epoch, or on a metric."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Union

import torch
from torch.optim.lr_scheduler import LRScheduler as TorchScheduler
from torch.optim.lr_scheduler import ReduceLROnPlateau

from hookloop import distributed
from hookloop.base.checks import check_choice, check_flag, check_name
from hookloop.callback import Callback
from hookloop.errors import CallbackOrderError, ConfigurationError, with_article
from hookloop.monitor import Monitor, infer_mode

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["LRScheduler"]

SchedulerFactory = Callable[[torch.optim.Optimizer, int], Any]
_INTERVALS = ("step", "epoch")
_LARGEST = 1.7976931348623157e308  # the largest finite float: NaN and inf compare False


def _steps_by_count(obj: Any) -> bool:
    """timm's protocol: ``step(epoch, metric=None)`` at epoch ends and
    ``step_update(num_updates, metric=None)`` after optimizer updates."""
    return callable(getattr(obj, "step_update", None))


def _is_scheduler(obj: Any) -> bool:
    if _steps_by_count(obj) and callable(getattr(obj, "step", None)):
        return True  # timm's: state_dict and optimizer are optional
    return isinstance(obj, (TorchScheduler, ReduceLROnPlateau)) or (
        callable(getattr(obj, "step", None)) and callable(getattr(obj, "state_dict", None))
        and hasattr(obj, "optimizer"))


class LRScheduler(Callback):
    """Drive a torch learning-rate scheduler from the loop's events.

    ``scheduler`` is either a scheduler already built on ``loop.optimizer``, or a factory
    ``fn(optimizer, total_steps) -> scheduler`` called at fit start with
    ``loop.total_steps``: the optimizer steps of the whole run, with accumulation, DDP
    sharding, epochs and ``max_steps`` accounted (so ``OneCycleLR(total_steps=...)`` never
    steps past its end).

    A factory is called again whenever that total changes (``fit(2)`` then ``fit(4)``, or
    a run resumed with a larger ``epochs``), and the new scheduler is advanced to the step
    the run is at, so it continues on the new schedule: a stretched schedule, whose learning
    rate at this step differs from the old one's. Rank 0 says so at the fit's start (the old
    and the new total steps, the learning rates before and after); the total a schedule was
    built for is kept in the callback's state, so a relaunch knows it too. The scheduler is built at
    ``setup`` (after `GradAccumulation` and `DDP` set the geometry; the stack check enforces
    their order), so a resumed run's state is loaded into it before ``on_fit_start``. A
    hand-built fixed-length scheduler too short for the fit is an error before the first
    batch.

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
      come first. Each time it lowers the learning rate, rank 0 prints one line saying
      so (Keras' ``verbose``), with the metric, the old and the new rates and where:
      ``LRScheduler: val_loss stopped improving; ReduceLROnPlateau lowered the learning
      rate from 0.1 to 0.05 (epoch 4/10, step 40).`` ``verbose=False`` keeps it quiet.
    * A scheduler with timm's stepping protocol (``step(epoch, metric=None)`` and
      ``step_update(num_updates, metric=None)``, any object with a ``step_update`` method)
      is driven as timm's own training script drives it: ``step_update(num_updates=
      loop.state.step)`` after every real optimizer step, and ``step(loop.state.epoch + 1)``
      at the end of every epoch that ran through all the data (with
      ``metric=loop.state.metrics[monitor]`` when ``monitor`` is given, for timm's plateau
      schedule). The scheduler's own ``t_in_epochs`` decides which of the two moves the
      learning rate; ``interval`` does not apply. A resumed run loads its state and calls
      both once with where the run is, so the learning rate is the schedule's there.

    Args:
        scheduler: A torch scheduler, or ``fn(optimizer, total_steps)`` returning one
            (``functools.partial(hookloop.schedules.warmup_cosine, warmup_steps=0.05)``).
        interval: ``"step"`` or ``"epoch"``.
        monitor: The metric a ``ReduceLROnPlateau`` reads (``"val_loss"``, ``"val_acc"``).
        name: State key, to keep two schedulers' states apart.
        verbose: Say (rank 0, one line) when a ``ReduceLROnPlateau`` lowers the learning
            rate.

    Raises:
        ConfigurationError: a bad interval; a plateau scheduler without ``monitor`` (or a
            monitor for another scheduler); a factory with data that has no length (at fit
            start: pass ``fit(..., max_steps=N)`` or a built scheduler); at fit start, a
            scheduler with a fixed ``total_steps`` (``OneCycleLR``) shorter than the steps
            this fit will take (what is left of ``loop.total_steps`` after
            ``loop.state.step``), instead of torch's "Tried to step N times" mid-run.
        CallbackOrderError: at fit start, a ``ReduceLROnPlateau`` on an optimizer that
            another ``LRScheduler`` of the stack already drives (warmup-cosine and a
            plateau): a plateau schedule must be its optimizer's only schedule.

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
        hookloop: training ended at epoch 2/2, step 10: all 2 epochs are done.
        10
    """

    runs_after = {
        "GradAccumulation": "the schedule's length counts optimizer steps, and GradAccumulation "
                            "sets how many batches make one",
        "distributed": "DDP shards the data, which sets the number of steps per epoch",
    }

    def __init__(self, scheduler: Union[TorchScheduler, ReduceLROnPlateau, SchedulerFactory],
                 *, interval: str = "step", monitor: str | None = None,
                 name: str | None = None, verbose: bool = True) -> None:
        self.interval = check_choice("LRScheduler interval", interval, _INTERVALS,
                                     hint="'step' steps after every optimizer step, 'epoch' "
                                          "at every epoch end.")
        self._monitor = None if monitor is None else Monitor(monitor, owner="LRScheduler")
        self.monitor = monitor
        self.name = check_name("LRScheduler name", name)
        self.verbose = check_flag("LRScheduler verbose", verbose)
        self._factory: SchedulerFactory | None = None
        self._scheduler: Any = None
        self._built_total: int | None = None
        self._stretched: str | None = None  # said at on_fit_start
        self._stretch_from: tuple[int, list[float]] | None = None  # the total and rates before
        # The lowest rate a schedule set on an accelerator since the last check, kept there:
        # reading a device tensor at every step would sync the host (`_check_rates`).
        self._device_lowest: torch.Tensor | None = None
        # How `after_step` steps the scheduler it was worked out for ("count": timm's
        # step_update; "step"; None: not after a step): asked once per scheduler, not at
        # every step.
        self._stepping: tuple[Any, str | None] = (None, None)
        if _is_scheduler(scheduler):
            self._scheduler = scheduler
            self._check_monitor(scheduler)
        elif callable(scheduler):
            self._factory = scheduler
        else:
            raise ConfigurationError(
                f"LRScheduler scheduler must be a torch scheduler or a factory fn(optimizer, "
                f"total_steps), got {scheduler!r}.")

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

    @property
    def steps_by_count(self) -> bool:
        """True for a scheduler with timm's protocol (``step(epoch)``/``step_update(n)``)."""
        return _steps_by_count(self._scheduler)

    def _check_monitor(self, scheduler: Any) -> None:
        if _steps_by_count(scheduler):
            return  # timm's plateau schedule reads a metric; the others ignore it
        if isinstance(scheduler, ReduceLROnPlateau):
            if self.monitor is None:
                raise ConfigurationError(
                    "LRScheduler monitor must be a metric name for a ReduceLROnPlateau (it "
                    "steps on a metric), got None. Write for example "
                    "LRScheduler(ReduceLROnPlateau(optimizer), monitor='val_loss').")
        elif self.monitor is not None:
            raise ConfigurationError(
                "LRScheduler monitor must be None for "
                f"{with_article(type(scheduler).__name__)}, which does not read metrics, got "
                f"{self.monitor!r}. monitor is only used by ReduceLROnPlateau (and schedulers "
                "with timm's step(epoch, metric) protocol): remove monitor=.")

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """Build the scheduler from the factory with ``loop.total_steps`` (at a fit), and
        refuse a plateau schedule sharing its optimizer with another schedule."""
        if not loop.fitting:
            return
        self._prepare(loop)
        self._check_plateau_alone(loop)

    def _check_plateau_alone(self, loop: Loop) -> None:
        """A plateau schedule must own its optimizer's learning rate: with another schedule
        on it, the other one recomputes the rate at each of its steps and the plateau's cuts
        are lost or compounded, silently. The later of the two raises (its setup runs after
        the earlier one has built its scheduler)."""
        mine = getattr(self._scheduler, "optimizer", None)
        if mine is None:
            return
        for index, other in enumerate(loop.callbacks):
            if other is self:
                return
            if not isinstance(other, LRScheduler) or (not self.is_plateau
                                                      and not other.is_plateau):
                continue
            if getattr(other.scheduler, "optimizer", None) is mine:
                here = loop.callbacks.index(self)
                plateau, fixed = ((f"{self!r} (position {here})", f"{other!r} (position {index})")
                                  if self.is_plateau else
                                  (f"{other!r} (position {index})", f"{self!r} (position {here})"))
                raise CallbackOrderError(
                    f"{plateau} and {fixed} both drive the learning rate of the same "
                    f"optimizer: the second sets it from its formula at every step it takes, "
                    "so the plateau's reductions would be undone or compounded without a word "
                    "(Keras refuses the same). A plateau schedule must be the only schedule of "
                    "its optimizer: remove one of the two (with presets.standard, "
                    "schedule=None leaves the learning rate to your plateau schedule).")

    def _prepare(self, loop: Loop) -> None:
        if self._factory is None:
            if getattr(self._scheduler, "optimizer", loop.optimizer) is not loop.optimizer:
                raise ConfigurationError(
                    "The scheduler given to LRScheduler was built on another optimizer than "
                    "the loop's. Build it on loop.optimizer (the one passed to Loop).")
            if self.is_plateau:
                self._check_plateau_mode()
            return
        total = loop.total_steps
        if total is None:
            raise ConfigurationError(
                "The LRScheduler factory needs the number of optimizer steps, but "
                f"train_data ({type(loop.train_data).__name__}) has no length. Pass "
                "fit(..., max_steps=N), give the data a __len__, or pass a scheduler "
                "built by hand instead of a factory.")
        if total == 0:  # fit(0): no step will need a scheduler
            return
        if self._scheduler is None or (self._built_total != total and not self.is_plateau):
            old_total, rates = self._stretch_from or (self._built_total, _rates(loop.optimizer))
            if self._scheduler is not None:
                done = int(getattr(self._scheduler, "last_epoch", 0))
            else:  # where the run is: its steps (or whole epochs) so far
                done = loop.state.step if self.interval == "step" else loop.position.epoch
            self._build(loop.optimizer, total)
            if not self.is_plateau:  # a plateau schedule has no position to advance to
                self._advance(done)
                if old_total is not None and done:
                    self._note_stretch(old_total, rates, done, _geometry_changed(loop))

    def _fit_start(self, loop: Loop) -> None:
        """Check that a fixed-length scheduler lasts for what is left of the run; on rank 0,
        say when a factory's schedule was stretched (nothing is said when nothing trains)."""
        stretched, self._stretched, self._stretch_from = self._stretched, None, None
        if stretched is not None and not loop.stop_requested and distributed.is_main():
            print(stretched, flush=True)
        self._check_length(loop)

    def _note_stretch(self, old_total: int, rates: list[float], done: int,
                      ranks_changed: bool = False) -> None:
        """Remember, for on_fit_start, that the factory's schedule now has another length
        (``ranks_changed``: the run resumed on another number of ranks, whose global batch
        makes the rest of the run another number of steps)."""
        unit = "steps" if self.interval == "step" else "epochs"
        self._stretch_from = (old_total, rates)
        after = _rates(self._scheduler.optimizer)
        if rates == after:
            change = f"the learning rate stays {_listed(after)} here"
        else:
            change = f"the learning rate goes from {_listed(rates)} to {_listed(after)}"
        if ranks_changed:
            self._stretched = (
                f"LRScheduler: the run resumed with another global batch (another number of "
                f"ranks), so the rest of the run takes another number of optimizer steps: the "
                f"factory's schedule, built for {old_total} steps in all, is rebuilt for "
                f"{self._built_total} (the {done} {unit} taken and those left at the new "
                f"global batch) and continues at step {done}, so {change}; it ends where the "
                "run ends.")
            return
        self._stretched = (
            f"LRScheduler: the factory's schedule was built for {old_total} optimizer steps in "
            f"all, and this fit's total is {self._built_total}: it is rebuilt for "
            f"{self._built_total} and continues where the run is ({done} {unit} in), so "
            f"{change}. The schedule is stretched, not continued as it was; to keep the old "
            "one, relaunch with the old epochs and max_steps, or give LRScheduler a scheduler "
            "built by hand.")

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
            position = loop.position.epoch
            needed, unit = loop.state.epochs - position, "epochs"
            done = f"fit({loop.state.epochs}) minus {position} epochs already done"
        name = type(self._scheduler).__name__
        if needed < left and self._factory is None and self.interval == "step" and \
                _geometry_changed(loop) and distributed.is_main():
            warnings.warn(
                f"LRScheduler: the run resumed on another number of ranks, whose global batch "
                f"leaves {needed} optimizer steps, but the {name} built by hand has {left} "
                f"left (total_steps={length}): it would not reach its end. Pass a factory, "
                "LRScheduler(lambda opt, total: OneCycleLR(opt, max_lr, total_steps=total)), "
                "whose schedule is rebuilt for the steps the run takes.", RuntimeWarning,
                stacklevel=2)
        if needed <= left:
            return
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

    def _build(self, optimizer: torch.optim.Optimizer, total: int) -> None:
        # A schedule starts from the optimizer's own learning rates, not from where an
        # earlier schedule left them (chainable schedulers such as CosineAnnealingLR read
        # the current lr as their start).
        for group in optimizer.param_groups:
            if "initial_lr" in group:
                group["lr"] = group["initial_lr"]
        scheduler = self._factory(optimizer, total)  # type: ignore[misc]
        if not _is_scheduler(scheduler):
            raise ConfigurationError(
                f"The LRScheduler factory returned {type(scheduler).__name__}, not a torch "
                "scheduler. It must be fn(optimizer, total_steps) -> scheduler.")
        self._check_monitor(scheduler)
        self._scheduler, self._built_total = scheduler, total
        if self.is_plateau:
            self._check_plateau_mode()

    def _advance(self, steps: int) -> None:
        """Step a freshly built schedule until it has taken ``steps`` steps: where the run is.

        The learning rates are first put back to the schedule's own (a loaded optimizer
        state holds the saved run's), since some schedulers compute each step from the last.
        """
        scheduler = self._scheduler
        if _steps_by_count(scheduler):
            return  # its learning rate is a function of the count: set at the next call
        get_last_lr = getattr(scheduler, "get_last_lr", None)
        try:
            last = get_last_lr() if callable(get_last_lr) else None
        except AttributeError:  # a scheduler-like object that has not stepped yet
            last = None
        if isinstance(last, list):
            for group, rate in zip(scheduler.optimizer.param_groups, last):
                group["lr"] = rate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "step() before optimizer.step()": on purpose
            for _ in range(max(0, steps - int(getattr(self._scheduler, "last_epoch", 0)))):
                self._scheduler.step()

    def _check_plateau_mode(self) -> None:
        """A plateau scheduler's own ``mode`` must agree with the monitored metric's name."""
        expected = infer_mode(self.monitor or "")
        mode = getattr(self._scheduler, "mode", None)
        if expected is not None and mode in ("min", "max") and mode != expected:
            better = "higher" if expected == "max" else "lower"
            raise ConfigurationError(
                f"LRScheduler monitors {self.monitor!r}, where {better} is better, but the "
                f"ReduceLROnPlateau has mode={mode!r}, so it would cut the learning rate while "
                f"the metric improves. Build it with mode={expected!r}.")

    def on_fit_start(self, loop: Loop) -> None:
        """The checks of `_fit_start`; a timm-protocol scheduler of a resumed run is told
        where the run is (``step(epoch)``, then ``step_update(step)``). A factory's schedule
        is rebuilt here when the restored position changed the run's total (a resume on
        another number of ranks: `hookloop.Loop.total_steps` counts the steps taken there)."""
        if self._factory is not None and self._scheduler is not None:
            self._prepare(loop)
        self._fit_start(loop)
        if self.steps_by_count and loop.state.step:  # a resumed run: the rate of where it is
            self._scheduler.step(loop.position.epoch)
            self._scheduler.step_update(loop.state.step)
        self._device_lowest = None
        if self._scheduler is not None:
            self._check_rates(loop, f"at fit start (step {loop.state.step})", read=True,
                              used=True)

    def after_step(self, loop: Loop) -> None:
        scheduler = self._scheduler
        known, stepping = self._stepping
        if known is not scheduler:
            stepping = "count" if _steps_by_count(scheduler) else "step" if not isinstance(
                scheduler, ReduceLROnPlateau) else None
            self._stepping = (scheduler, stepping)
        if stepping == "count":
            scheduler.step_update(loop.state.step)
        elif stepping == "step" and self.interval == "step":
            scheduler.step()
        else:
            return
        # The usual rates (finite, non-negative Python floats) pass `_check_rates` without a
        # word: checked here without its call, its message or the run's total steps.
        optimizer = getattr(scheduler, "optimizer", None) or loop.optimizer
        for group in optimizer.param_groups:
            rate = group.get("lr")
            if type(rate) is not float or not 0.0 <= rate <= _LARGEST:
                self._check_rates(loop, f"after optimizer step {loop.state.step}")
                return

    def _check_rates(self, loop: Loop, where: str, *, read: bool = False,
                     used: bool = False) -> None:
        """Refuse a rate the schedule made negative (or non-finite): the next optimizer step
        would move the weights up the gradient (a linear decay run past its end does).

        The rate a schedule sets after the fit's last step is used by no step of this fit
        (``used`` False there): it is checked at the next fit's start, if one trains on.

        Python float rates (the usual) are checked at once, without touching the device. A
        tensor rate on an accelerator is not read here (that would sync the host at every
        step): its lowest value is kept on the device and read once per epoch (``read``).
        """
        total = loop.total_steps
        if not used and total is not None and loop.state.step >= total:
            return
        optimizer = getattr(self._scheduler, "optimizer", None) or loop.optimizer
        for index, group in enumerate(optimizer.param_groups):
            rate = group.get("lr")
            if isinstance(rate, torch.Tensor) and rate.device.type not in ("cpu", "meta"):
                lowest = rate.detach().float().nan_to_num(nan=-math.inf).min()
                self._device_lowest = lowest if self._device_lowest is None else \
                    torch.minimum(self._device_lowest, lowest)
                continue
            if isinstance(rate, torch.Tensor):
                rate = float(rate)  # a CPU tensor: no device to wait for
            if isinstance(rate, (int, float)) and (rate < 0 or not math.isfinite(rate)):
                self._refuse_rate(loop, f"set param group {index}'s learning rate to "
                                        f"{rate!r} {where}")
        if read and self._device_lowest is not None:
            lowest_rate, self._device_lowest = float(self._device_lowest), None  # once an epoch
            if lowest_rate < 0:
                self._refuse_rate(loop, f"set a learning rate below 0 (lowest {lowest_rate!r}, or "
                                        f"non-finite) during epoch {loop.state.epoch + 1}, "
                                        f"{where}; a rate on the device is read once per epoch")

    def _refuse_rate(self, loop: Loop, what: str) -> None:
        name = type(self._scheduler).__name__
        raise ConfigurationError(
            f"{self!r}: the {name} {what}. A negative (or non-finite) rate moves the weights "
            "up the gradient, so training would undo itself: the schedule ran past its end (a "
            "linear decay built for fewer steps than the run takes, "
            f"loop.total_steps={loop.total_steps}) or its formula goes below 0. Build the "
            "schedule for the run's length with a factory, LRScheduler(lambda opt, total: "
            "LambdaLR(opt, lambda step: 1 - step / total)), which gets loop.total_steps, or "
            "clamp its formula at 0 (max(0.0, 1 - step / total)).")

    def on_validation_end(self, loop: Loop) -> None:
        if self.is_plateau:
            monitor = self._plateau_monitor()
            if monitor.due(loop):
                self._step_plateau(loop, monitor)

    def on_epoch_end(self, loop: Loop) -> None:
        if not loop.epoch_completed:  # cut short by stop(): the epoch is done again later
            return
        if self.steps_by_count:
            metric = self.monitor is not None and self.monitor in loop.state.metrics
            self._scheduler.step(loop.state.epoch + 1, *(
                (self._plateau_monitor().read(loop),) if metric else ()))
        elif self.is_plateau:
            monitor = self._plateau_monitor()
            if monitor.due(loop, epoch_end=True) and self.monitor in loop.state.metrics:
                self._step_plateau(loop, monitor)
        elif self.interval == "epoch":
            self._scheduler.step()
        self._check_rates(loop, f"at the end of epoch {loop.state.epoch + 1} "
                                f"(step {loop.state.step})", read=True)

    def _step_plateau(self, loop: Loop, monitor: Monitor) -> None:
        """Step the plateau schedule with the metric; on rank 0 say when it lowered a rate."""
        before = _rates(self._scheduler.optimizer)
        self._scheduler.step(monitor.read(loop))
        after = _rates(self._scheduler.optimizer)
        if not self.verbose or after == before or not distributed.is_main():
            return
        state = loop.state
        print(f"LRScheduler: {self.monitor} stopped improving; ReduceLROnPlateau lowered the "
              f"learning rate from {_listed(before)} to {_listed(after)} "
              f"(epoch {state.epoch + 1}/{state.epochs}, step {state.step}).", flush=True)

    def _plateau_monitor(self) -> Monitor:
        assert self._monitor is not None  # a plateau scheduler has a monitor (checked)
        return self._monitor

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The scheduler's own ``state_dict()`` (empty before it is built); for a factory's
        schedule also ``factory_total_steps``, the total it was built for."""
        if self._scheduler is None or not callable(getattr(self._scheduler, "state_dict", None)):
            return {}
        state: dict[str, Any] = self._scheduler.state_dict()
        if self._factory is not None and self._built_total is not None:
            state = {**state, _TOTAL_KEY: self._built_total}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved schedule (the loop calls it after ``setup``).

        A hand-built scheduler loads the state as it is. A factory-built one was just built
        for this fit's total: it is advanced to the saved step count instead, so a run
        resumed with a larger ``epochs`` follows the longer schedule from where it was.
        """
        if not state:
            return
        state = dict(state)
        old_total = state.pop(_TOTAL_KEY, None)
        if self._scheduler is None:
            # A factory's scheduler is built at the next fit (not in validate() alone), and
            # then advanced to the run's step: nothing to load into yet.
            return
        if self.steps_by_count and not callable(getattr(self._scheduler, "load_state_dict",
                                                         None)):
            return
        if self._factory is None or self.is_plateau or self.steps_by_count:
            self._scheduler.load_state_dict(state)
            return
        saved = int(state.get("last_epoch", 0))
        rates = _rates(self._scheduler.optimizer)  # the saved run's (its optimizer is loaded)
        if int(getattr(self._scheduler, "last_epoch", 0)) > saved:  # a rollback: start over
            self._build(self._scheduler.optimizer, self._built_total)  # type: ignore[arg-type]
        self._advance(saved)
        if isinstance(old_total, int) and old_total != self._built_total and saved:
            self._note_stretch(old_total, rates, saved)


_TOTAL_KEY = "factory_total_steps"  # in state_dict: the total a factory's schedule was built for


def _geometry_changed(loop: Loop) -> bool:
    """The run's total counts steps taken at another global batch (another number of ranks)."""
    per_epoch, total = loop.steps_per_epoch, loop.total_steps
    return per_epoch is not None and loop.state.max_steps is None and \
        total != per_epoch * loop.state.epochs


def _rates(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def _listed(rates: list[float]) -> str:
    shown = sorted(set(rates), key=rates.index)
    return ", ".join(f"{rate:.3g}" for rate in shown)
