"""`Loop.load_state_dict` applied: a saved run state checked against this run (the
optimizer, the data, the objects of ``state=``), then loaded into the model, the optimizer,
the position, the callbacks and the extra states. Nothing is touched before every check
passed.

Handed the loop's values (`hookloop.engine.run_parts.RunParts`), never the loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.engine.dispatch import annotate
from hookloop.engine.ordering import overrides
from hookloop.errors import CheckpointError, with_article
from hookloop.runfile.format import (
    BATCH_IDX,
    BATCHES_PER_EPOCH,
    CALLBACKS,
    DATA_STATE,
    ENDED,
    EPOCH,
    HISTORY,
    LOOP,
    MODEL,
    OPTIMIZER,
    OPTIMIZER_CLASS,
    PARAM_GROUPS,
    PARAMS,
    RANKS,
    SHARDS,
    STATE,
    STATE_CLASSES,
    STEP,
    STOP_HELD,
    TRAIN_LOSS_SUM,
    TRAIN_SAMPLES,
    WORLD_SIZE,
)
from hookloop.engine.resumable import reshard_problem
from hookloop.engine.state import is_learning_rate
from hookloop.runfile.weights import load_model_weights, load_optimizer_state, load_weights

if TYPE_CHECKING:
    from hookloop.callback import Callback
    from hookloop.engine.run_parts import RunParts

__all__ = ["restore", "check_optimizer_fits", "check_same_data", "check_new_world"]

_UNFIT = (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError)


def restore(parts: RunParts, payload: Mapping[str, Any], source: str) -> None:
    """`Loop.load_state_dict`, applied after setup: raise before touching anything wrong."""
    loop_part = payload.get(LOOP)
    if not isinstance(loop_part, Mapping) or not isinstance(payload.get(MODEL), Mapping) \
            or not isinstance(payload.get(OPTIMIZER), Mapping):
        missing = [key for key in (MODEL, OPTIMIZER, LOOP)
                   if not isinstance(payload.get(key), Mapping)]
        raise CheckpointError(f"{source}: not a training state: {', '.join(missing)} "
                              "missing or not a mapping.")
    check_optimizer_fits(parts.optimizer, loop_part, payload[OPTIMIZER], source)
    check_same_data(parts.batches_per_epoch, loop_part, source)
    check_new_world(parts.train_data, loop_part, payload.get(RANKS) or [], source)
    _check_extra_state(parts.extra_state, payload, source)
    # A file or a directory of shards, into a sharded model or not (hookloop.runfile.weights).
    load_weights(source, parts.model, parts.optimizer, payload)
    if payload.get(SHARDS) is not None:  # DTensors of the callbacks' and extra states
        payload = payload[SHARDS].resolve(payload)
    own = _own_part(parts, payload, loop_part, source)
    _restore_position(parts, loop_part, own)
    _load_extra_state(parts.extra_state, payload, source)
    _load_callback_states(parts.callbacks, payload, source)


def _own_part(parts: RunParts, payload: Mapping[str, Any], loop_part: Mapping[str, Any],
              source: str) -> dict[str, Any]:
    """This rank's part of ``ranks``: its generators, and its loss sums where they are its
    own (the same world size)."""
    ranks = payload.get(RANKS) or [{}]
    rank, world = distributed.rank(), distributed.world_size()
    saved_world = int(loop_part.get(WORLD_SIZE, 1))
    own = dict(ranks[rank] if rank < len(ranks) else ranks[0])
    if rank >= len(ranks):
        warnings.warn(
            f"{source} has no random-generator state for rank {rank} (it was written by "
            f"{saved_world} process(es), or after an exception); rank {rank} uses rank 0's, "
            "so its random draws differ from an uninterrupted run.", RuntimeWarning,
            stacklevel=5)
    if saved_world != world or (world > 1 and len(ranks) < world):
        own.update({TRAIN_LOSS_SUM: None, TRAIN_SAMPLES: 0})  # not this rank's own sums
    return own


def _restore_position(parts: RunParts, loop_part: Mapping[str, Any], own: dict[str, Any]) -> None:
    """The position, the loop's counters and history, and the end the run recorded."""
    position, state, end = parts.position, parts.state, parts.end
    position.load(loop_part, own, parts.device)
    epoch, done, step = position.public
    # The epoch the weights are in, as an uninterrupted run shows it: after a whole epoch e
    # (position e + 1, no batch done) that is e, not the epoch that has not started.
    state.epoch = epoch if done or epoch == 0 else epoch - 1
    state.step = step
    state.history = [dict(row) for row in loop_part.get(HISTORY) or []]
    if state.history:  # what fit() returns when the resumed run has nothing left to do
        state.metrics = {key: value for key, value in state.history[-1].items()
                         if key not in (EPOCH, STEP) and not is_learning_rate(key)}
    end.restored = loop_part.get(ENDED)
    end.held = loop_part.get(STOP_HELD)


def _load_callback_states(callbacks: Sequence[Callback], payload: Mapping[str, Any],
                          source: str) -> None:
    """Each stateful callback's saved state; a missing or unclaimed one is a warning."""
    saved = dict(payload.get(CALLBACKS) or {})
    for callback in callbacks:
        if not overrides(callback, "state_dict"):
            continue
        if callback.state_key in saved:
            key = callback.state_key
            try:
                callback.load_state_dict(saved.pop(key))
            except _UNFIT as error:
                raise CheckpointError(
                    f"{source}: the state of {callback!r} (field '{CALLBACKS}.{key}') does not "
                    f"fit it: {type(error).__name__}: {error}. It was saved by another version "
                    "or configuration of that callback, or the file was edited.") from error
            except BaseException as exc:
                annotate(exc, callback.load_state_dict)
                raise
        elif distributed.is_main():
            warnings.warn(f"{source} has no state for {callback!r} (key "
                          f"{callback.state_key!r}); it starts fresh.", RuntimeWarning,
                          stacklevel=5)
    if saved and distributed.is_main():
        warnings.warn(
            f"{source} holds state that no callback in the stack claims: "
            f"{', '.join(sorted(saved))}. Add those callbacks (with the same name=) to "
            "restore it, or ignore this if you removed them on purpose.", RuntimeWarning,
            stacklevel=5)


def _check_extra_state(extra_state: Mapping[str, Any], payload: Mapping[str, Any],
                       source: str) -> None:
    """Before anything is loaded: each object of ``Loop(state=...)`` is of the class saved
    (and an optimizer has the param-group layout saved)."""
    saved, classes = payload.get(STATE) or {}, payload.get(STATE_CLASSES) or {}
    for field, value in ((STATE, saved), (STATE_CLASSES, classes)):
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{source}: field {field!r} must be a dict, got "
                                  f"{type(value).__name__}.")
    for name, item in extra_state.items():
        theirs = classes.get(name)
        if theirs is not None and theirs != type(item).__qualname__:
            raise CheckpointError(
                f"{source}: state[{name!r}] was saved from the class {theirs}, but this loop's "
                f"state[{name!r}] is of the class {type(item).__qualname__}. Pass the same "
                "kind of object under that name, or another name to start it fresh.")
        if isinstance(item, torch.optim.Optimizer) and isinstance(saved.get(name), Mapping):
            check_optimizer_fits(item, {}, saved[name], f"{source} (field '{STATE}.{name}')")


def _load_extra_state(extra_state: Mapping[str, Any], payload: Mapping[str, Any],
                      source: str) -> None:
    """Load each object of ``Loop(state=...)``; a missing or unclaimed name is a warning."""
    saved = dict(payload.get(STATE) or {})
    for name, item in extra_state.items():
        if name not in saved:
            if distributed.is_main():
                warnings.warn(f"{source} has no state for Loop(state={{{name!r}: ...}}); it "
                              "starts fresh.", RuntimeWarning, stacklevel=5)
            continue
        state, where = saved.pop(name), f"{source} (field '{STATE}.{name}')"
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
    if saved and distributed.is_main():
        warnings.warn(f"{source} holds state for {', '.join(sorted(saved))}, which this loop's "
                      "state= does not name; it is ignored.", RuntimeWarning, stacklevel=5)


def check_new_world(train_data: Any, loop_part: Mapping[str, Any], ranks: Sequence[Any],
                    source: str) -> None:
    """A checkpoint written inside an epoch by another number of ranks: its position, in
    samples of the epoch's order, goes on over the new ranks where the data draws that
    order from a ``DistributedSampler`` (`hookloop.engine.resumable.reshard_problem`); a rank's
    own state of the data (in ``ranks``, the saved ranks' parts), or another order, cannot
    be split or merged: refused, before anything is loaded.

    Raises:
        CheckpointError: naming the data, both numbers of ranks and the fix.
    """
    saved_world, world = int(loop_part.get(WORLD_SIZE, 1)), distributed.world_size()
    if saved_world == world or not int(loop_part.get(BATCH_IDX, 0)):
        return
    epoch = int(loop_part.get(EPOCH, 0)) + 1
    if any(isinstance(part, Mapping) and part.get(DATA_STATE) is not None for part in ranks):
        raise CheckpointError(
            f"{source}: the run was saved inside epoch {epoch} by "
            f"{saved_world} process(es), each with its own state of the training data "
            f"({type(train_data).__name__}.state_dict()), and this run has {world}: a "
            "per-rank data state cannot be split or merged over another number of ranks. "
            f"Relaunch on {saved_world} process(es), or resume from a checkpoint written at an "
            "epoch end, or use a DataLoader over a map-style dataset (its position is kept in "
            "samples).")
    problem = reshard_problem(train_data, loop_part)
    if problem is not None:
        raise CheckpointError(
            f"{source}: the run was saved inside epoch {epoch} by {saved_world} process(es) "
            f"and this run has {world}; the samples of the epoch not trained on yet can be "
            "resharded over the new ranks only when both launches draw the same order from "
            f"a DistributedSampler, but {problem}. Relaunch on {saved_world} process(es), or "
            "resume from a checkpoint written at an epoch end.")


def check_same_data(batches_per_epoch: int | None, loop_part: Mapping[str, Any],
                    source: str) -> None:
    """Another number of training batches per epoch (``batches_per_epoch`` now, same world
    size): refused inside an epoch, where the position would skip batches of other data
    than those trained on; a warning at an epoch end, where the run goes on with the new
    data from the next epoch.

    Raises:
        CheckpointError: the position is inside an epoch and ``len(train_data)`` changed.
    """
    saved, now = loop_part.get(BATCHES_PER_EPOCH), batches_per_epoch
    if saved is None or now is None or int(saved) == now or \
            int(loop_part.get(WORLD_SIZE, 1)) != distributed.world_size():
        return
    done, epoch = int(loop_part.get(BATCH_IDX, 0)), int(loop_part.get(EPOCH, 0))
    if done:
        raise CheckpointError(
            f"{source}: the run was saved after {done} of {saved} batches of epoch {epoch + 1}, "
            f"but train_data now has {now} batches per epoch, so resuming would skip its first "
            f"{done} batch{'es' if done != 1 else ''}, which are not the ones it trained on. "
            "Resume with the training data the "
            "run was saved with, or from a checkpoint written at an epoch end, or start a new "
            "run (Checkpoint(resume=False) in a new directory).")
    if distributed.is_main():
        warnings.warn(
            f"{source}: the run had {saved} batches per epoch and train_data now has {now}: it "
            f"continues from epoch {epoch + 1} with the new data (a schedule built for the run's "
            "total steps is rebuilt for the new total).", RuntimeWarning, stacklevel=4)


def check_optimizer_fits(optimizer: torch.optim.Optimizer, loop_part: Mapping[str, Any],
                         saved: Mapping[str, Any], source: str) -> None:
    """Another optimizer class or param-group layout is refused, naming both."""
    ours = type(optimizer).__qualname__
    theirs = loop_part.get(OPTIMIZER_CLASS)
    if theirs is not None and theirs != ours:
        raise CheckpointError(
            f"{source}: the run was trained with {theirs}, but this loop's optimizer is "
            f"{ours}; its state (momentum buffers, moments, hyper-parameters) cannot be "
            f"loaded into another class. Create {with_article(theirs)} as in the saved run, or "
            "load only the weights with hookloop.load_checkpoint(path, model) and start a new run.")
    layout = [len(group[PARAMS]) for group in optimizer.param_groups]
    groups = saved.get(PARAM_GROUPS)
    saved_layout = ([len(group.get(PARAMS, ())) for group in groups]
                    if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)
                    else loop_part.get(PARAM_GROUPS))
    if saved_layout is not None and list(saved_layout) != layout:
        raise CheckpointError(
            f"{source}: the saved optimizer has param groups of sizes {list(saved_layout)}, "
            f"this loop's {ours} has {layout}. Build the optimizer over the same parameters "
            "in the same groups as the saved run.")
