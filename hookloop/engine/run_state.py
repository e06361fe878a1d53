"""The run's state: what `Loop.state_dict` captures, checking at fit start that every state
can be saved, and applying a state at setup (`hookloop.engine.run_restore` restores it).

The loop owns the run; these functions are the part of it that crosses launches. They are
handed the loop's values (`RunParts`), never the loop. The file's layout and its checks are
`hookloop.runfile.format`'s, the run's end `hookloop.engine.run_end`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hookloop import distributed
from hookloop.engine.ordering import overrides
from hookloop.engine.run_parts import RunParts
from hookloop.engine.run_restore import restore
from hookloop.errors import CheckpointError, ConfigurationError, with_article
from hookloop.runfile.format import TRAIN_LOSS_SUM, TRAIN_SAMPLES, find_unplain, run_payload
from hookloop.runfile.sharded import gather_for_rank_zero, layout_of, model_state, optimizer_state

if TYPE_CHECKING:
    from hookloop.callback import Callback

__all__ = ["RunParts", "apply", "capture", "check_mapping", "check_callback_states"]


def apply(parts: RunParts, pending: tuple[Mapping[str, Any], str] | None
          ) -> tuple[Mapping[str, Any], str] | None:
    """At setup: apply the state `Loop.load_state_dict` asked for; return what stays pending.

    A fit consumes it. ``validate()``/``evaluate()``/``predict()`` alone apply it too (the
    weights, the EMA) and leave it for the next fit, whose setup builds what only a fit
    builds (a scheduler from its factory).
    """
    if pending is None:
        return None
    state, source = pending
    restore(parts, state, source)
    return None if parts.fitting else pending


def check_mapping(state: Any, source: str | None) -> Mapping[str, Any]:
    """``state`` if it is a mapping (what `Loop.state_dict` returns), else a CheckpointError."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{source or 'the state given'}: expected the mapping "
                              f"Loop.state_dict() returns, got {type(state).__name__}.")
    return state


def capture(parts: RunParts, *, gather: bool = True) -> dict[str, Any]:
    """`Loop.state_dict`: the whole run, as tensors and plain values (`run_file.run_payload`).

    The model and the optimizer come as `hookloop.runfile.sharded` gives them: a model FSDP
    shards is gathered to rank 0 (``state_dict="full"``: rank 0 holds the state, the
    other ranks none) or kept as this rank's shards (``"sharded"``); so are the DTensors in
    the callbacks' states. Either way every rank must call it.

    Raises:
        CheckpointError: ``gather=False`` (the exception path) with a sharded model, whose
            state cannot be read without every rank.
    """
    module, optimizer, state = parts.model, parts.optimizer, parts.state
    layout = layout_of(module)
    if layout is not None and not gather:
        raise CheckpointError(
            "no checkpoint of the exception: the state of a model FSDP shards is read by "
            "every rank together, and on the exception path the other ranks may be dead or "
            "elsewhere. The newest checkpoint stays the one to resume from; a stop every "
            "rank agrees on (loop.stop(), a stop signal) writes one.")
    shared, own = parts.position.parts()
    world = distributed.world_size()
    if gather:
        ranks = distributed.all_gather_object(own)
    else:
        if world > 1:  # the other ranks' sums are unknown: the resumed epoch recounts
            own.update({TRAIN_LOSS_SUM: None, TRAIN_SAMPLES: 0})
        ranks = [own]
    callbacks = {callback.state_key: callback.state_dict() for callback in parts.callbacks
                 if overrides(callback, "state_dict")}
    extra = {name: item.state_dict() for name, item in parts.extra_state.items()}
    if layout == "full":  # a callback's DTensors (an EMA over shards) gathered as the model
        callbacks, extra = gather_for_rank_zero((callbacks, extra), distributed.rank())
    return run_payload(
        model=model_state(module), optimizer=optimizer_state(module, optimizer),
        position=shared, ranks=ranks, world_size=world,
        batches_per_epoch=parts.batches_per_epoch, optimizer_object=optimizer,
        epochs=state.epochs, max_steps=state.max_steps,
        ended=parts.end.record(state.epochs, state.max_steps, parts.position.epoch),
        held=parts.end.held, history=state.history, callbacks=callbacks, extra=extra,
        extra_classes={name: type(item).__qualname__ for name, item in parts.extra_state.items()})


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
