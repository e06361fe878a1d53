"""The run's parts (`RunPart`: each writes, checks and reads its own keys; `merged` makes
`hookloop.loop.Loop.state_dict` of them), and those of the loop's and of others' states:
the loop state's history (`LoopStatePart`, ``loop.history``), each stateful callback's
(`CallbackStates`, ``callbacks``) and each object of ``Loop(state=...)`` (`ExtraStates`,
``state`` and ``state_classes``), written, checked and read here; and the check at fit
start that each of them can be saved (`check_callback_states`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.engine.dispatch import annotate
from hookloop.engine.ordering import overrides
from hookloop.errors import CheckpointError, ConfigurationError, expect_field, expect_int, \
    with_article
from hookloop.runfile.format import CALLBACKS, EPOCH, LOOP, SHARDS, STATE, STEP, find_unplain, \
    register_check
from hookloop.runfile.sharded import gather_for_rank_zero
from hookloop.runfile.weights import Weights, check_optimizer_fits, load_model_weights, \
    load_optimizer_state

if TYPE_CHECKING:
    from hookloop.engine.state import LoopState

__all__ = ["CallbackStates", "ExtraStates", "LoopStatePart", "RunPart", "as_mapping",
           "check_callback_states", "is_learning_rate", "merged"]

#: ``loop.history``: the run's rows of metrics (each with its epoch and step).
HISTORY = "history"
#: Beside ``state`` (the objects of ``Loop(state=...)``): each object's class by name.
STATE_CLASSES = "state_classes"
KEYS = (HISTORY, STATE_CLASSES)
SHARED_WORDS = frozenset((HISTORY,))  # also the loop state's field


def is_learning_rate(key: str) -> bool:
    """True for a history key `hookloop.engine.state.learning_rates` writes (``lr``,
    ``lr_group0``...): a row's record of the optimizer, not a metric.

    Example:
        >>> [is_learning_rate(key) for key in ("lr", "lr_group1", "val_loss")]
        [True, True, False]
    """
    return key == "lr" or key.startswith("lr_group")


class RunPart(Protocol):
    """A part of the run: it writes, checks and reads its own keys of the file.

    ``check`` raises `CheckpointError` naming the field and the fix before any part is
    loaded; `hookloop.loop.Loop` checks every part, then loads every part."""

    def state_dict(self) -> dict[str, Any]: ...

    def check(self, saved: Mapping[str, Any], source: str) -> None: ...

    def load_state_dict(self, saved: Mapping[str, Any], source: str = ...) -> None: ...


def merged(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """`Loop.state_dict`'s layout: the parts' top-level keys, the ``loop`` dict each part
    writes its own keys of merged into one."""
    payload: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key == LOOP:
                payload.setdefault(LOOP, {}).update(value)
            else:
                payload[key] = value
    return payload


_UNFIT = (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError)


def as_mapping(state: Any, source: str | None) -> Mapping[str, Any]:
    """``state`` if it is a mapping (what `Loop.state_dict` returns), else a CheckpointError."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{source or 'the state given'}: expected the mapping "
                              f"Loop.state_dict() returns, got {type(state).__name__}.")
    return state


def _saved_part(saved: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``saved[key]``, its tensors kept in a directory's shards read whole."""
    part, shards = saved.get(key) or {}, saved.get(SHARDS)
    return dict(shards.resolve(part) if shards is not None else part)


class CallbackStates:
    """``callbacks``: each stateful callback's state under its ``state_key`` (DTensors
    gathered to rank 0 when the model's are, `Weights.saving`)."""

    def __init__(self, callbacks: Callable[[], Sequence[Callback]], weights: Weights) -> None:
        self.callbacks, self.weights = callbacks, weights

    def state_dict(self) -> dict[str, Any]:
        states = {callback.state_key: callback.state_dict() for callback in self.callbacks()
                  if type(callback).state_dict is not Callback.state_dict}  # `overrides`, inline
        if self.weights.saving == "full":  # an EMA over shards, gathered as the model
            states = gather_for_rank_zero(states, distributed.rank())
        return {CALLBACKS: states}

    @staticmethod
    def saved(saved: Mapping[str, Any]) -> dict[str, Any]:
        """The callbacks' states in ``saved`` (a checkpoint's payload), by state key."""
        return _saved_part(saved, CALLBACKS)

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        value = saved.get(CALLBACKS) or {}
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{source}: field {CALLBACKS!r} must be a dict, got "
                                  f"{type(value).__name__}.")

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "the state") -> None:
        """Each stateful callback's saved state; a missing or unclaimed one is a warning."""
        states = _saved_part(saved, CALLBACKS)
        for callback in self.callbacks():
            if not overrides(callback, "state_dict"):
                continue
            key = callback.state_key
            if key not in states:
                if distributed.is_main():
                    warnings.warn(f"{source} has no state for {callback!r} (key {key!r}); it "
                                  "starts fresh.", RuntimeWarning, stacklevel=4)
                continue
            try:
                callback.load_state_dict(states.pop(key))
            except _UNFIT as error:
                raise CheckpointError(
                    f"{source}: the state of {callback!r} (field '{CALLBACKS}.{key}') does not "
                    f"fit it: {type(error).__name__}: {error}. It was saved by another version "
                    "or configuration of that callback, or the file was edited.") from error
            except BaseException as exc:
                annotate(exc, callback.load_state_dict)
                raise
        if states and distributed.is_main():
            warnings.warn(
                f"{source} holds state that no callback in the stack claims: "
                f"{', '.join(sorted(states))}. Add those callbacks (with the same name=) to "
                "restore it, or ignore this if you removed them on purpose.", RuntimeWarning,
                stacklevel=4)


class ExtraStates:
    """``state`` and ``state_classes``: the objects of ``Loop(state=...)`` by name."""

    def __init__(self, objects: Mapping[str, Any], weights: Weights) -> None:
        self.objects, self.weights = objects, weights

    def state_dict(self) -> dict[str, Any]:
        states = {name: item.state_dict() for name, item in self.objects.items()}
        if self.weights.saving == "full":
            states = gather_for_rank_zero(states, distributed.rank())
        return {STATE: states,
                STATE_CLASSES: {name: type(item).__qualname__
                                for name, item in self.objects.items()}}

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        """Each object is of the class saved (and an optimizer has the groups saved)."""
        states, classes = saved.get(STATE) or {}, saved.get(STATE_CLASSES) or {}
        for field, value in ((STATE, states), (STATE_CLASSES, classes)):
            if not isinstance(value, Mapping):
                raise CheckpointError(f"{source}: field {field!r} must be a dict, got "
                                      f"{type(value).__name__}.")
        for name, item in self.objects.items():
            theirs = classes.get(name)
            if theirs is not None and theirs != type(item).__qualname__:
                raise CheckpointError(
                    f"{source}: state[{name!r}] was saved from the class {theirs}, but this "
                    f"loop's state[{name!r}] is of the class {type(item).__qualname__}. Pass "
                    "the same kind of object under that name, or another name to start it "
                    "fresh.")
            if isinstance(item, torch.optim.Optimizer) and isinstance(states.get(name), Mapping):
                check_optimizer_fits(item, {}, states[name], f"{source} (field '{STATE}.{name}')")

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "the state") -> None:
        """Load each object; a missing or unclaimed name is a warning."""
        states = _saved_part(saved, STATE)
        for name, item in self.objects.items():
            if name not in states:
                if distributed.is_main():
                    warnings.warn(f"{source} has no state for Loop(state={{{name!r}: ...}}); "
                                  "it starts fresh.", RuntimeWarning, stacklevel=4)
                continue
            state, where = states.pop(name), f"{source} (field '{STATE}.{name}')"
            if isinstance(item, torch.nn.Module):
                load_model_weights(where, item, state)
            elif isinstance(item, torch.optim.Optimizer):
                load_optimizer_state(where, item, state)
            else:
                try:
                    item.load_state_dict(state)
                except _UNFIT as error:
                    raise CheckpointError(f"{where}: the state does not fit state[{name!r}]: "
                                          f"{type(error).__name__}: {error}") from error
        if states and distributed.is_main():
            warnings.warn(f"{source} holds state for {', '.join(sorted(states))}, which this "
                          "loop's state= does not name; it is ignored.", RuntimeWarning,
                          stacklevel=4)


def check_callback_states(callbacks: Sequence[Callback],
                          extra_state: Mapping[str, Any] | None = None) -> None:
    """Each stateful callback's state, and each ``Loop(state=...)`` object's, must
    round-trip through a checkpoint file (checked at fit start, not at the first save).

    Raises:
        ConfigurationError: a callback overriding only one of ``state_dict`` and
            ``load_state_dict``, or a state (of a callback or of an object of ``state=``)
            that ``torch.load(weights_only=True)`` could not read back; the message names
            the callback or the name in ``state=``, and the key.
    """
    for name, item in (extra_state or {}).items():
        problem = find_unplain(item.state_dict(), f"state[{name!r}].state_dict()")
        if problem:
            raise ConfigurationError(
                f"Loop {problem}, which torch.load(weights_only=True) cannot read back from "
                f"a checkpoint, so the first save would fail. Make the state_dict() of "
                f"{with_article(type(item).__name__)} return only tensors, numbers, strings, "
                "None and lists/tuples/dicts of them (a function or an object is rebuilt by "
                "the script, not saved).")
    for callback in callbacks:
        saves, loads = overrides(callback, "state_dict"), overrides(callback, "load_state_dict")
        if saves != loads:
            have, lack = ("state_dict", "load_state_dict") if saves else (
                "load_state_dict", "state_dict")
            raise ConfigurationError(
                f"{callback!r} overrides {have} but not {lack}, so its state would be "
                f"{'saved but never restored' if saves else 'never saved'} on resume. "
                f"Implement {lack} too (or neither).")
        if saves:
            problem = find_unplain(callback.state_dict(), "state_dict()")
            if problem:
                raise ConfigurationError(
                    f"{callback!r} (state key {callback.state_key!r}): {problem}, which "
                    "torch.load(weights_only=True) cannot read back from a checkpoint. "
                    "Return only tensors, numbers, strings, None and lists/tuples/dicts of "
                    "them (e.g. list(a_deque), a_tensor.tolist()).")


class LoopStatePart:
    """The loop state's part of the run file: the history, written, checked and read here;
    at a load, the epoch and step the weights are in, from the position loaded before it."""

    def __init__(self, state: LoopState, position: Callable[[], tuple[int, int, int]]) -> None:
        self.state, self.position = state, position

    def state_dict(self) -> dict[str, Any]:
        return {LOOP: {HISTORY: [dict(row) for row in self.state.history]}}

    @staticmethod
    def check_file(source: str, saved: Mapping[str, Any]) -> None:
        """Each row: a dict of metric names to numbers, with int ``epoch`` and ``step``."""
        history = saved[LOOP].get(HISTORY)
        if history is None:
            return
        expect_field(source, f"{LOOP}.{HISTORY}", history, isinstance(history, list),
                     "a list of dicts")
        for index, row in enumerate(history):
            where = f"{LOOP}.{HISTORY}[{index}]"
            expect_field(source, where, row, isinstance(row, Mapping), "a dict")
            for name in (EPOCH, STEP):
                if name not in row:
                    raise CheckpointError(f"{source}: the checkpoint's field '{where}.{name}' "
                                          "is missing; it cannot be resumed.")
                expect_int(source, f"{where}.{name}", row[name])
            for name, value in row.items():
                expect_field(source, f"{where} (a key)", name, isinstance(name, str), "a str")
                expect_field(source, f"{where}.{name}", value, isinstance(value, (int, float))
                             and not isinstance(value, bool), "a number")

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        self.check_file(source, saved)

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "") -> None:
        state, (epoch, done, step) = self.state, self.position()
        # The epoch the weights are in, as an uninterrupted run shows it: after a whole epoch
        # e (position e + 1, no batch done) that is e, not the epoch that has not started.
        state.epoch = epoch if done or epoch == 0 else epoch - 1
        state.step = step
        state.history = [dict(row) for row in saved[LOOP].get(HISTORY) or []]
        if state.history:  # what fit() returns when the resumed run has nothing left to do
            state.metrics = {key: value for key, value in state.history[-1].items()
                             if key not in (EPOCH, STEP) and not is_learning_rate(key)}


register_check(LoopStatePart.check_file)
