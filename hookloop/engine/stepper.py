"""`OptimizerStep`: the optimizer step at a step boundary, counted only when it happened."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hookloop.distributed import world_size
from hookloop.engine.forward import ForwardRule, check_loss
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.engine.dispatch import Table
    from hookloop.engine.state import LoopState

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """Takes the step at a step boundary: ``before_step``, then the step itself (routed
    through the one callback that overrides ``optimizer_step``, AMP's ``scaler.step``, or
    a plain ``optimizer.step()``), and says whether the optimizer really stepped.

    A step is observed through an optimizer step hook, so a step a GradScaler skipped
    (inf/NaN gradients) or a callback cancelled in ``before_step`` is not counted. An
    optimizer without step hooks (a duck-typed one) is trusted: every call counts.

    An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``: a ``closure``
    parameter without a default) is stepped by a router that passes its own closure
    (`closure_given` refuses one that passes none), else given one by the loop
    (`closure`): its first call returns the
    batch's loss the loop just computed, with the gradients its backward left (the weights
    have not moved yet, so a recomputation would give the same); every later call
    recomputes the current batch's loss at the optimizer's new trial weights, as a
    hand-written closure does: ``zero_grad``, the forward and the loss inside the loop's
    contexts (``train_step_context``, ``forward_context``: autocast, ``no_sync``), the
    ``after_forward`` event (so a loss a callback replaces there is the one optimized),
    the ``scale_loss`` hooks, ``backward``. No other event fires in it.
    """

    __slots__ = ("cancelled", "stepped", "_observed", "_checked", "_closure", "_recompute",
                 "_handle")

    def __init__(self) -> None:
        #: A callback called ``loop.cancel_step()`` at this boundary.
        self.cancelled = False
        #: The optimizer really stepped at the current boundary.
        self.stepped = False
        self._observed = True
        self._checked = False  # the first routed step of the fit was checked
        self._closure = False  # the optimizer's step needs a closure (LBFGS)
        self._recompute: Recompute | None = None  # what a closure recomputes (`prepare`)
        self._handle: Any = None  # the step hook of the running fit, while one is registered

    @contextmanager
    def observing(self, optimizer: Any) -> Iterator[None]:
        """For one fit: watch ``optimizer.step`` through its step hook, where it has one."""
        register = getattr(optimizer, "register_step_post_hook", None)
        handle = self._handle = register(self._mark) if register is not None else None
        self._observed, self._checked = handle is not None, False
        self._closure = needs_closure(optimizer)
        try:
            yield
        finally:
            self._handle = None
            if handle is not None:
                handle.remove()

    def _mark(self, *_: Any) -> None:
        self.stepped = True

    def prepare(self, state: LoopState, rule: Callable[[], ForwardRule],
                model: Callable[[], Any], accumulation_steps: int, routed: bool = True) -> None:
        """After setup: what a closure optimizer's closure recomputes (the current batch of
        ``state`` by ``rule()`` on ``model()``, the rule and the model of the moment) and
        over how many batches a step accumulates.

        ``routed=False`` (no callback routes the step): every step is the loop's own call of
        ``optimizer.step``, which stepped once it returned (its step hook would say just
        that): the hook goes, the call is trusted, and a step pays no hook call."""
        self._recompute = Recompute(state, rule, model, accumulation_steps)
        if not routed and self._handle is not None:
            self._handle.remove()
            self._handle, self._observed = None, False

    def take(self, optimizer: Any, scaler: Any, table: Table) -> bool:
        """``before_step``, then the step unless cancelled; True when the optimizer stepped.

        ``scaler``: AMP's ``GradScaler`` or None; ``table``: the fit's dispatch table."""
        self.cancelled = False
        for handler in table.before_step:  # inline, as the loop calls the per-batch events
            handler(table.host)
        self.stepped = False
        if self.cancelled:
            return False
        if table.step is None and self._closure:
            self._closure_step(optimizer, table)
        elif table.step is None:
            optimizer.step()
        else:
            with closure_given(optimizer, table) if self._closure else nullcontext():
                said = table.call(table.step)
            if said is True and not self.stepped:  # the router updated the weights itself
                self.stepped = True
            elif not self._checked:
                self._check_routed(scaler, table)
        if not self._observed:  # an optimizer without step hooks: trust the call
            self.stepped = True
        return self.stepped

    def _closure_step(self, optimizer: Any, table: Table) -> None:
        """The step of a closure optimizer, checked at the fit's first (before any weight
        moves); the batch's own outputs and loss stay the state's after it."""
        recompute = self._recompute
        assert recompute is not None, "OptimizerStep.prepare runs at every setup"
        if not self._checked:
            self._checked = True
            check_closure_stack(optimizer, recompute.accumulation_steps)
        state = recompute.state
        outputs, loss = state.outputs, state.loss
        optimizer.step(closure(optimizer, table, recompute))
        state.outputs, state.loss = outputs, loss

    def _check_routed(self, scaler: Any, table: Table) -> None:
        """The first routed step of a fit must really step (or say that it did)."""
        self._checked = True
        if self.stepped or not self._observed or scaler is not None:
            return  # a GradScaler may skip a step: that is not the router's mistake
        owner = type(getattr(table.step, "__self__", None)).__name__
        raise ConfigurationError(
            f"{owner}.optimizer_step returned without calling loop.optimizer.step(), so the "
            "loop saw no optimizer step: state.step would stay at 0, after_step would never "
            "fire, and schedules, EMA and checkpoints would not advance. Call "
            "loop.optimizer.step() (or scaler.step(loop.optimizer)) inside optimizer_step; if "
            "it updates the weights another way, return True from it; to skip a step on "
            "purpose, call loop.cancel_step() in before_step.")


def needs_closure(optimizer: Any) -> bool:
    """True when ``optimizer.step`` has a ``closure`` parameter without a default (LBFGS).

    Example:
        >>> import torch
        >>> weight = [torch.nn.Parameter(torch.zeros(1))]
        >>> needs_closure(torch.optim.LBFGS(weight)), needs_closure(torch.optim.SGD(weight))
        (True, False)
    """
    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or an odd callable: call it as before
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


class Recompute(NamedTuple):
    """What a closure recomputes: the current batch of ``state`` by ``rule()`` on ``model()``."""

    state: LoopState
    rule: Callable[[], ForwardRule]
    model: Callable[[], Any]
    accumulation_steps: int


def check_closure_stack(optimizer: Any, accumulation_steps: int) -> None:
    """Refuse, before its first step, what a closure optimizer cannot do through the loop:
    the closure re-evaluates the current batch in this one process.

    Raises:
        ConfigurationError: the step accumulates several batches (the closure could
            re-evaluate only the last, a different objective), or several processes train
            (each rank's line search would re-evaluate a different number of times, each
            time an all-reduce: the ranks would hang).
    """
    name = type(optimizer).__name__
    if accumulation_steps > 1:
        problem = (f"the step accumulates {accumulation_steps} batches and a closure can "
                   f"re-evaluate only the last one, so {name} would compare losses and "
                   "gradients of different objectives: leave GradAccumulation out (a larger "
                   "batch gives the same window)")
    elif world_size() > 1:
        problem = (f"{world_size()} processes train, and each rank's {name} decides alone how "
                   "often to re-evaluate, each time a gradient all-reduce, so the ranks would "
                   "wait for each other forever: train with it in one process")
    else:
        return
    raise ConfigurationError(f"{name}.step needs a closure, which the loop gives it by "
                             f"re-evaluating the current batch; but {problem}.")


@contextmanager
def closure_given(optimizer: Any, table: Table) -> Iterator[None]:
    """While a callback routes a closure optimizer's step: its call of ``optimizer.step``
    must pass a closure (its own, as a hand-written loop's; the loop's own closure is for
    an unrouted step). One without is refused before the optimizer runs, so no weight moves
    (AMP's GradScaler calls ``step()`` without one, and refuses closures anyway).

    The closure is the router's: what it re-evaluates, and on several processes whether
    every rank's line search agrees, is up to it, as in a hand-written loop.

    Raises:
        ConfigurationError: the router called ``optimizer.step`` without a closure.
    """
    own = getattr(optimizer, "__dict__", {})
    owned = "step" in own  # an instance wrapper (a scheduler's): put back after
    previous, real = own.get("step"), optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if (args[0] if args else kwargs.get("closure")) is None:
            owner = type(getattr(table.step, "__self__", None)).__name__
            name = type(optimizer).__name__
            raise ConfigurationError(
                f"{name}.step needs a closure (it re-evaluates the loss), but {owner} routes "
                f"the optimizer step and calls {name}.step() without one. Pass one from "
                f"{owner}.optimizer_step, loop.optimizer.step(closure) as in a hand-written "
                f"loop, or leave {owner} out: the loop then gives {name} a closure itself (a "
                "GradScaler, as AMP's, cannot step a closure optimizer).")
        return real(*args, **kwargs)

    try:
        optimizer.step = step
    except AttributeError:  # __slots__: not watchable; the optimizer's own error then
        yield
        return
    try:
        yield
    finally:
        if vars(optimizer).get("step") is step:  # else the router wrapped it since: keep it
            if owned:
                optimizer.step = previous
            else:
                del optimizer.step


def closure(optimizer: Any, table: Table, recompute: Recompute) -> Callable[[], torch.Tensor]:
    """The closure a closure optimizer's ``step`` calls (see `OptimizerStep`): the loss of
    the current batch, first as the loop computed it, then recomputed at each call."""
    state, first = recompute.state, [True]
    batch = state.batch

    def evaluate() -> torch.Tensor:
        if first:
            first.clear()
            assert state.loss is not None
            return state.loss.detach()
        optimizer.zero_grad(set_to_none=True)
        with table.entered(table.train_step_context):
            with table.entered(table.forward_context):
                state.outputs, state.loss = recompute.rule().compute(recompute.model(), batch)
            state.loss = check_loss(state.loss, training=True)
            if table.after_forward:
                table.emit(table.after_forward)
            loss = state.loss
            for scale in table.scale_loss:
                loss = table.call(scale, loss)
            loss.backward()
        return state.loss.detach()

    return evaluate
