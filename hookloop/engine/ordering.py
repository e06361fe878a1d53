"""Checks on a callback stack, run at fit start before the first batch."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hookloop.base.events import HOOKS, Event
from hookloop.callback import Callback
from hookloop.errors import CallbackOrderError, ConfigurationError

__all__ = ["overrides", "check_callbacks", "suggest_order", "LOOP_METRICS", "FOREIGN_EVENTS"]

EVENT_NAMES: tuple[str, ...] = tuple(event.value for event in Event)
_EVENT_LIKE = re.compile(r"^(on|before|after)_[a-z0-9_]+$")


def LOOP_METRICS(val_data: Any) -> set[str]:  # noqa: N802 - reads like a constant at call sites
    """Metrics the loop itself writes: ``train_loss``, and ``val_loss`` with validation data."""
    return {"train_loss", "val_loss"} if val_data is not None else {"train_loss"}


def overrides(callback: Callback, method: str) -> bool:
    """True when ``callback``'s class defines ``method`` differently from `Callback`."""
    return getattr(type(callback), method, None) is not getattr(Callback, method)


def _label(callbacks: Sequence[Callback], index: int) -> str:
    return f"{callbacks[index]!r} (position {index})"


def _matches(callback: Callback, name: str) -> bool:
    if name in callback.roles:
        return True
    if name == "stateful" and overrides(callback, "state_dict"):
        return True
    return any(cls.__name__ == name for cls in type(callback).__mro__)


def suggest_order(callbacks: Sequence[Callback], edges: set[tuple[int, int]]) -> list[Callback]:
    """The user's order changed as little as possible so that every ``(a, b)`` edge has a first.

    Stable: repeatedly takes the earliest callback whose predecessors are all placed.
    """
    remaining = list(range(len(callbacks)))
    placed: list[int] = []
    while remaining:
        for index in remaining:
            if all(before in placed for before, after in edges if after == index):
                placed.append(index)
                remaining.remove(index)
                break
        else:  # a cycle: give up on suggesting
            return list(callbacks)
    return [callbacks[index] for index in placed]


def _order_edges(callbacks: Sequence[Callback], host: object) -> dict[tuple[int, int], str]:
    """Every ``(must_come_first, must_come_after) -> reason`` the stack declares (``host``:
    what the callbacks' ``produces`` is asked with, the loop)."""
    edges: dict[tuple[int, int], str] = {}
    for index, callback in enumerate(callbacks):
        for other_index, other in enumerate(callbacks):
            if other_index == index or type(other) is type(callback):
                continue
            for name, reason in callback.runs_after.items():
                if _matches(other, name):
                    edges.setdefault((other_index, index), reason)
    produced_by: dict[str, int] = {}
    for index, callback in enumerate(callbacks):
        for metric in callback.produces(host):  # type: ignore[arg-type]
            produced_by.setdefault(metric, index)
    for index, callback in enumerate(callbacks):
        for metric in callback.monitors():
            producer = produced_by.get(metric)
            if producer is not None and producer != index:
                edges.setdefault(
                    (producer, index),
                    f"{type(callback).__name__} reads the metric {metric!r} that "
                    f"{type(callbacks[producer]).__name__} writes",
                )
    return edges


def _foreign(frameworks: str, event: str, *names: str) -> dict[str, tuple[str, str]]:
    return {name: (event, frameworks) for name in names}


#: Event names of other training frameworks -> (the hookloop event or hook that MEANS the
#: same, where the name comes from). Spelling similarity misleads here: difflib pairs
#: ``on_batch_begin`` with ``on_batch_end``, the opposite moment.
FOREIGN_EVENTS: dict[str, tuple[str, str]] = {
    # Run start and end.
    **_foreign("Keras/Lightning/Transformers", "on_fit_start", "on_train_begin",
               "on_train_start"),
    **_foreign("fastai", "on_fit_start", "before_fit"),
    **_foreign("Ignite", "on_fit_start", "on_started"),
    **_foreign("Composer", "on_fit_start", "fit_start"),
    **_foreign("Keras/Lightning/Transformers", "on_fit_end", "on_train_end"),
    **_foreign("fastai", "on_fit_end", "after_fit"),
    **_foreign("Ignite", "on_fit_end", "on_completed"),
    **_foreign("Composer", "on_fit_end", "fit_end"),
    # Epochs.
    **_foreign("Keras/Transformers", "on_epoch_start", "on_epoch_begin"),
    **_foreign("Lightning", "on_epoch_start", "on_train_epoch_start"),
    **_foreign("fastai", "on_epoch_start", "before_epoch", "before_train"),
    **_foreign("Ignite", "on_epoch_start", "on_epoch_started"),
    **_foreign("Composer", "on_epoch_start", "epoch_start"),
    **_foreign("Lightning", "on_epoch_end", "on_train_epoch_end"),
    **_foreign("fastai", "on_epoch_end", "after_epoch", "after_train"),
    **_foreign("Ignite", "on_epoch_end", "on_epoch_completed"),
    **_foreign("Composer", "on_epoch_end", "epoch_end"),
    # Training batches.
    **_foreign("Keras", "on_batch_start", "on_batch_begin", "on_train_batch_begin"),
    **_foreign("Lightning", "on_batch_start", "on_train_batch_start"),
    **_foreign("fastai", "on_batch_start", "before_batch"),
    **_foreign("Ignite", "on_batch_start", "on_iteration_started", "on_get_batch_completed"),
    **_foreign("Transformers", "on_batch_start", "on_step_begin"),
    **_foreign("Composer", "on_batch_start", "batch_start", "before_train_batch",
               "before_forward"),
    **_foreign("Keras/Lightning", "on_batch_end", "on_train_batch_end"),
    **_foreign("fastai", "on_batch_end", "after_batch"),
    **_foreign("Ignite", "on_batch_end", "on_iteration_completed"),
    **_foreign("Transformers", "on_batch_end", "on_substep_end"),
    **_foreign("Composer", "on_batch_end", "batch_end", "after_train_batch"),
    # Inside a batch.
    **_foreign("fastai/Composer", "after_forward", "after_pred", "after_loss",
               "before_backward"),
    **_foreign("Lightning", "after_forward", "on_before_backward"),
    **_foreign("Lightning", "after_backward", "on_after_backward"),
    **_foreign("Lightning", "before_step", "on_before_optimizer_step",
               "before_optimizer_step"),
    **_foreign("Transformers", "before_step", "on_pre_optimizer_step"),
    **_foreign("Transformers", "after_step", "on_optimizer_step", "on_step_end"),
    **_foreign("fastai/Lightning", "after_step", "before_zero_grad", "on_before_zero_grad",
               "after_optimizer_step"),
    # Validation.
    **_foreign("Keras", "on_validation_start", "on_test_begin"),
    **_foreign("Lightning", "on_validation_start", "on_validation_epoch_start"),
    **_foreign("fastai", "on_validation_start", "before_validate"),
    **_foreign("Composer", "on_validation_start", "eval_start"),
    **_foreign("Keras", "on_validation_end", "on_test_end"),
    **_foreign("Lightning", "on_validation_end", "on_validation_epoch_end"),
    **_foreign("fastai", "on_validation_end", "after_validate"),
    **_foreign("Transformers", "on_validation_end", "on_evaluate"),
    **_foreign("Composer", "on_validation_end", "eval_end"),
    **_foreign("Keras", "on_validation_batch_start", "on_test_batch_begin",
               "on_validation_batch_begin"),
    **_foreign("Composer", "on_validation_batch_start", "eval_batch_start"),
    **_foreign("Keras", "on_validation_batch_end", "on_test_batch_end"),
    **_foreign("Composer", "on_validation_batch_end", "eval_batch_end"),
    # Failures and checkpoints.
    **_foreign("Ignite", "on_exception", "on_exception_raised"),
    **_foreign("Lightning", "on_exception", "on_keyboard_interrupt"),
    **_foreign("Lightning", "state_dict", "on_save_checkpoint"),
    **_foreign("Lightning", "load_state_dict", "on_load_checkpoint"),
    **_foreign("fastai", "setup", "after_create"),
}


def _event_name_problem(owner: str, attribute: str) -> str | None:
    """The message for a method that looks like an event hookloop does not have, or None.

    Only attributes that could be called are asked about (`_could_be_called`).
    """
    if attribute in EVENT_NAMES or attribute in HOOKS:
        return None
    foreign = FOREIGN_EVENTS.get(attribute)
    if foreign is None and not _EVENT_LIKE.match(attribute):
        return None
    events = f"The events are: {', '.join(EVENT_NAMES)}."
    if foreign is not None:
        target, frameworks = foreign
        what = "hook" if target in HOOKS else "event"
        return (f"{owner}.{attribute} is named like an event of {frameworks}, but hookloop has "
                f"no event {attribute!r}, so it would never be called. The hookloop {what} "
                f"that means the same is {target!r}: rename the method to {target}. {events}")
    close = difflib.get_close_matches(attribute, EVENT_NAMES, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"{owner}.{attribute} looks like an event but hookloop has no event "
            f"{attribute!r}, so it would never be called.{hint} {events}")


def _could_be_called(value: Any, owner: type) -> bool:
    """True when a class attribute could be an event method: what it gives when read from
    an instance is callable (a function, a static or class method, a callable object).

    Data is never an event, whatever its name: a counter ``after_steps = 0``, a string, a
    property (it gives a value) or a ``functools.cached_property``.
    """
    if isinstance(value, property):
        return False
    getter = getattr(type(value), "__get__", None)
    if getter is not None:  # a descriptor: judge what it gives, not the descriptor itself
        try:
            value = getter(value, None, owner)
        except Exception:  # noqa: BLE001 - a descriptor that cannot be read from the class
            return False
    return callable(value)


def _check_event_names(callback: Callback, index: int) -> None:
    for cls in type(callback).__mro__:
        if cls is Callback or cls is object:
            break
        for attribute, value in vars(cls).items():
            if not _could_be_called(value, cls):
                continue
            problem = _event_name_problem(cls.__name__, attribute)
            if problem is not None:
                raise ConfigurationError(problem)


def _check_removed_declarations(callback: Callback) -> None:
    """A ``runs_before`` that would be ignored silently (hookloop no longer has it) is refused."""
    declared = getattr(callback, "runs_before", None)
    if declared is None:
        return
    owner = type(callback).__name__
    names = ", ".join(map(str, declared)) if isinstance(declared, Mapping) else repr(declared)
    raise ConfigurationError(
        f"{owner} declares runs_before ({names}), which hookloop no longer has: it was "
        "removed, so that every ordering constraint is declared in one direction, by the "
        f"callback that must come later. Order the list so that {owner} comes before "
        f"{names}, and declare runs_after = {{'{owner}': 'why'}} on each callback that must "
        f"come after it (delete runs_before from {owner}).")


def check_callbacks(callbacks: Sequence[object], host: object, val_data: Any) -> None:
    """Raise before training when the stack cannot work.

    Checks: every item is a `Callback` instance; no method named like an event that does
    not exist; no ``runs_before`` (removed: declare ``runs_after`` on the later callback);
    ``unique`` classes appear once; no declared conflict; at most one callback routes the
    optimizer step; every ordering constraint holds; every monitored metric is produced
    (by the loop itself, with ``val_data``, or by a callback), and before its reader; no
    two stateful callbacks share a state key. ``host`` is what the callbacks' ``produces``
    is asked with (the loop), held as it is.

    Raises:
        ConfigurationError: for a non-callback, a misnamed event method or a
            ``runs_before``.
        CallbackOrderError: for everything about how the callbacks sit together.
    """
    stack = _instances(callbacks)
    _check_unique(stack)
    _check_conflicts(stack)
    _check_one_router(stack)
    _check_monitored(stack, host, val_data)
    _check_order(stack, host)
    _check_state_keys(stack)


def _instances(callbacks: Sequence[object]) -> list[Callback]:
    """The stack, once every item is known to be a `Callback` instance with sound names."""
    for index, callback in enumerate(callbacks):
        if isinstance(callback, type) and issubclass(callback, Callback):
            raise ConfigurationError(
                f"callbacks[{index}] is the class {callback.__name__}, not an instance: "
                f"write {callback.__name__}(...) in the list."
            )
        if not isinstance(callback, Callback):
            raise ConfigurationError(
                f"callbacks[{index}] is {callback!r} ({type(callback).__name__}), not a "
                "hookloop.Callback. Subclass hookloop.Callback and pass an instance."
            )
        _check_event_names(callback, index)
        _check_removed_declarations(callback)
    return list(callbacks)  # type: ignore[arg-type]


def _check_unique(stack: list[Callback]) -> None:
    seen: dict[type, int] = {}
    for index, callback in enumerate(stack):
        if callback.unique and type(callback) in seen:
            raise CallbackOrderError(
                f"{_label(stack, seen[type(callback)])} and {_label(stack, index)}: "
                f"{type(callback).__name__} can appear only once in a stack. Remove one."
            )
        seen.setdefault(type(callback), index)


def _check_conflicts(stack: list[Callback]) -> None:
    for index, callback in enumerate(stack):
        for other_index, other in enumerate(stack):
            for name, reason in callback.conflicts_with.items():
                if other_index != index and _matches(other, name):
                    raise CallbackOrderError(
                        f"{_label(stack, index)} cannot be used with {_label(stack, other_index)}: "
                        f"{reason}. Remove one of them."
                    )


def _check_one_router(stack: list[Callback]) -> None:
    routers = [index for index, callback in enumerate(stack) if overrides(callback, "optimizer_step")]
    if len(routers) > 1:
        first, second = routers[:2]
        raise CallbackOrderError(
            f"{_label(stack, first)} and {_label(stack, second)} both take the optimizer step "
            "(both override optimizer_step); only one callback may. Remove one of them."
        )


def _check_monitored(stack: list[Callback], host: object, val_data: Any) -> None:
    available = set(LOOP_METRICS(val_data))
    for callback in stack:
        available.update(callback.produces(host))  # type: ignore[arg-type]
    for index, callback in enumerate(stack):
        missing = [metric for metric in callback.monitors() if metric not in available]
        if missing:
            raise CallbackOrderError(
                f"{_label(stack, index)} monitors {missing[0]!r} but nothing produces it. "
                f"Available metrics: {', '.join(sorted(available))}. "
                + ("" if val_data is not None else
                   "Validation metrics need val_data=... on the Loop. ")
                + "Add the callback that computes it (e.g. Metrics(...)) before "
                f"{type(callback).__name__}, or monitor an available metric."
            )


def _check_order(stack: list[Callback], host: object) -> None:
    edges = _order_edges(stack, host)
    for (first, then), reason in edges.items():
        if first > then:
            suggestion = suggest_order(stack, set(edges))
            raise CallbackOrderError(
                f"{_label(stack, then)} must come after {_label(stack, first)}: {reason}. "
                f"Move {type(stack[first]).__name__} before {type(stack[then]).__name__}, for "
                f"example: [{', '.join(repr(callback) for callback in suggestion)}]."
            )


def _check_state_keys(stack: list[Callback]) -> None:
    owners: dict[str, int] = {}
    for index, callback in enumerate(stack):
        name = getattr(callback, "name", None)
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(
                f"{_label(stack, index)}: name must be a non-empty string or None (it is the "
                f"key of the callback's state in checkpoints), got {name!r}.")
        if not overrides(callback, "state_dict"):
            continue
        key = callback.state_key
        if key in owners:
            raise CallbackOrderError(
                f"{_label(stack, owners[key])} and {_label(stack, index)} would both store "
                f"their state under the key {key!r}, and one would overwrite the other in "
                f"checkpoints. Give one a distinct name, e.g. {type(callback).__name__}"
                f"(..., name='{key.lower()}_2')."
            )
        owners[key] = index
