"""The run's state: what `Loop.state_dict` gathers, how `Loop.load_state_dict` applies it,
and whether and why the run ended (`RunEnd`).

The loop owns the run; these functions are the part of it that crosses launches. A state
is applied after every callback's ``setup`` and before ``on_fit_start``, so no callback
ever needs a "state arrived late" branch. They talk to the loop's `Position` through its
public methods.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed, signals
from hookloop.callback import Callback
from hookloop.dispatch import annotate
from hookloop.errors import (
    CheckpointError,
    ConfigurationError,
    Suspended,
    Terminated,
    with_article,
)
from hookloop.ordering import overrides
from hookloop.resumable import reshard_problem
from hookloop.rng import rng_state_problem
from hookloop.sharded import gather_for_rank_zero, layout_of, model_state, optimizer_state
from hookloop.state import is_learning_rate
from hookloop.storage import (
    SHARDS_KEY,
    expect_field,
    find_unplain,
    load_model_weights,
    load_optimizer_state,
    load_weights,
)
from hookloop.suspension import REQUESTED, SIGTERM, Suspension, Vote, published

if TYPE_CHECKING:
    from hookloop.loop import Loop
    from hookloop.position import Position
    from hookloop.state import LoopState

__all__ = ["RunEnd", "apply", "capture", "restore", "check_mapping", "check_callback_states",
           "check_optimizer_fits", "check_run_fields"]


class RunEnd:
    """Whether and why the run ended: a stop, its epochs or ``max_steps``; whether this
    launch ends while the run goes on (a `Suspension`); and the end the run being resumed
    recorded, which decides whether a relaunch trains at all.

    A run that ended stays ended when relaunched with the same command: a fit with the same
    ``epochs`` (and no larger ``max_steps``) trains nothing and says why; a larger
    ``epochs``, or a larger or absent ``max_steps``, continues it. A suspended launch
    records no end: the relaunch continues where it stopped.
    """

    __slots__ = ("requested", "reason", "restored", "idle", "suspension", "vote", "held",
                 "_state", "_position")

    def __init__(self, state: LoopState, position: Position) -> None:
        self._state, self._position = state, position  # the loop's: step, epochs done...
        #: `Loop.stop` was called in this fit, or every rank agreed to end the launch.
        self.requested = False
        #: The reason given to it.
        self.reason: str | None = None
        #: The end recorded by the state being restored (None: it had not ended).
        self.restored: Mapping[str, Any] | None = None
        #: This fit had nothing to train (it said so before on_fit_start).
        self.idle = False
        #: The launch end every rank agreed on in this fit (None: none).
        self.suspension: Suspension | None = None
        #: The reason of a stop asked before ``min_epochs``/``min_steps`` were reached: it
        #: takes effect at the first boundary where they are (None: no stop is held).
        self.held: str | None = None
        #: The ranks' vote on ending the launch, asked by signals and resumable stops.
        self.vote = Vote()

    def begin(self) -> None:
        """At every fit start: no stop requested (or held) yet."""
        self.requested, self.reason, self.suspension, self.held = False, None, None, None

    def stop(self, reason: str | None, *, resumable: bool = False, force: bool = False) -> None:
        if resumable:  # takes effect where every rank agrees (see `due`)
            self.vote.ask(REQUESTED, reason or "loop.stop(resumable=True) was called")
        elif force or self.minimum_reached():
            self.requested, self.reason = True, reason
        elif self.held is None:  # the first reason is kept, as a stop keeps its own
            self.held = reason or "loop.stop() was called"
            if distributed.is_main():
                print(f"hookloop: {self.held.rstrip('.')}; {self._minimum()} is not reached "
                      f"({self._position.epoch} epochs done, step {self._state.step}): "
                      "training goes on until it is, then stops.", flush=True)

    def minimum_reached(self) -> bool:
        """``fit(min_epochs=..., min_steps=...)`` are reached: epochs completed (at the
        last boundary) and optimizer steps taken. Counted alike on every rank."""
        state = self._state
        return ((state.min_epochs is None or self._position.epoch >= state.min_epochs)
                and (state.min_steps is None or state.step >= state.min_steps))

    def _minimum(self) -> str:
        state = self._state
        parts = [f"min_epochs={state.min_epochs}" if state.min_epochs else "",
                 f"min_steps={state.min_steps}" if state.min_steps else ""]
        return " and ".join(part for part in parts if part)

    def release(self) -> bool:
        """`requested`, once a held stop took effect (the minimum is reached). Asked at every
        boundary and by ``loop.stop_requested``, so the epoch end that reaches ``min_epochs``
        already sees the stop (``Checkpoint`` saves the stopped run there)."""
        if self.held is not None and not self.requested and self.minimum_reached():
            reason = f"{self.held.rstrip('.')} (held until {self._minimum()} was reached)"
            self.requested, self.reason, self.held = True, reason, None
        return self.requested

    def due(self) -> bool:
        """True when training must end: a stop (a held one once the minimum is reached),
        ``max_steps``, or an agreed launch end."""
        state = self._state
        return self.release() or (state.max_steps is not None and state.step >= state.max_steps)

    def due_at_boundary(self) -> bool:
        """`due` at a step boundary of the training pass, where the ranks also vote on
        ending the launch (a collective under a process group: every rank asks at the same
        boundaries). An end agreed before an epoch's first batch ends that epoch there, so
        its ``on_epoch_end`` (where `Checkpoint` saves) still runs."""
        if self.due():
            return True
        agreed = self.vote.agree()
        if agreed is not None:
            self.requested, self.reason, self.suspension = True, agreed.reason, agreed
            if distributed.is_main():
                print(f"hookloop: ending this launch at step {self._state.step} "
                      f"({agreed.reason}); the process exits with status {agreed.status} "
                      "once the checkpoint is written.", flush=True)
        return self.requested

    def check_steps(self) -> None:
        """After a step: stop once ``max_steps`` is reached."""
        state = self._state
        if state.max_steps is not None and state.step >= state.max_steps:
            self.stop(f"max_steps={state.max_steps} reached", force=True)

    @contextmanager
    def launch(self, *loaders: Any) -> Iterator[None]:
        """Around a fit: signals ask `vote` (the ``loaders``' workers ignore them); a fit
        that ended the launch raises `Suspended` once it returned (every ``on_fit_end``
        ran), unless the run ended at that boundary too (its last epoch), which leaves
        nothing to continue."""
        self.vote.reset()
        with published(self.vote), signals.handled() as taken, \
                signals.sparing_workers(loaders, taken):
            yield
        suspension, state = self.suspension, self._state
        if suspension is None or not self._goes_on():
            return
        # The epoch's live iterator goes now: its DataLoader workers stop through their
        # queues, not by a signal at the interpreter's exit (a later fit replays instead).
        self._position.rewind()
        self.vote.run_actions(suspension)
        signals.quiet_until_exit(taken)
        message = (f"this launch ended at step {state.step} ({suspension.reason}); the run "
                   "goes on: relaunch the same command to continue it")
        if suspension.status == SIGTERM.status:
            raise Terminated(message)
        raise Suspended(message, suspension.status)

    def _goes_on(self) -> bool:
        """This launch ended (a suspension) and the run did not: it continues in the next."""
        state = self._state
        return self.suspension is not None and self.record(
            state.epochs, state.max_steps, self._position.epoch) is None

    def record(self, epochs: int, max_steps: int | None, epochs_done: int) -> dict[str, Any] | None:
        """Why the run ended (for `Loop.state_dict`), or None while it goes on."""
        if self.requested and self.suspension is None:
            reason = self.reason or "loop.stop() was called"
        elif epochs and epochs_done >= epochs:
            reason = _all_epochs(epochs)
        else:
            return None
        return {"reason": reason, "epochs": epochs, "max_steps": max_steps}

    def nothing_to_train(self, epochs: int, max_steps: int | None, epochs_done: int,
                         step: int) -> str | None:
        """Why this fit trains nothing (said once, before on_fit_start), or None.

        When there is a reason, the fit is stopped with it (``stop_requested`` is True).
        """
        reason = self._idle_reason(epochs, max_steps, epochs_done, step)
        self.idle = reason is not None
        if reason is not None:
            self.stop(reason, force=True)
        return reason

    def announce(self) -> None:
        """At the end of a fit that trained: rank 0 prints one line saying why it ended,
        with the epoch numbered as the progress display numbers it (from 1)."""
        state = self._state
        if self.idle or not distributed.is_main():
            return
        why = (self.reason or "loop.stop() was called") if self.requested else \
            _all_epochs(state.epochs)
        if self._goes_on():
            print(f"hookloop: this launch ended at epoch {state.epoch + 1}/{state.epochs}, "
                  f"step {state.step}: {why.rstrip('.')}; the run goes on, relaunch the same "
                  "command to continue it.", flush=True)
            return
        print(f"hookloop: training ended at epoch {state.epoch + 1}/{state.epochs}, step "
              f"{state.step}: {why.rstrip('.')}.", flush=True)

    def _idle_reason(self, epochs: int, max_steps: int | None, epochs_done: int,
                     step: int) -> str | None:
        ended, self.restored = self.restored, None
        if ended is not None:
            more_epochs = epochs > int(ended["epochs"])
            more_steps = ended.get("max_steps") is not None and (
                max_steps is None or max_steps > int(ended["max_steps"]))
            if not (more_epochs or more_steps):
                return (f"the run being resumed already ended ({ended['reason']}), so this fit "
                        f"trains nothing. Pass a larger epochs than {ended['epochs']} to continue "
                        "it, or start a new run.")
        if epochs and epochs_done >= epochs:
            return (f"all {epochs} epochs of this run are done, so this fit trains nothing; "
                    f"pass a larger epochs than {epochs} to train more.")
        if max_steps is not None and step >= max_steps:
            return (f"max_steps={max_steps} is already reached (step {step}), so "
                    "this fit trains nothing; pass a larger max_steps or none.")
        return None


def apply(loop: Loop, position: Position, end: RunEnd,
          pending: tuple[Mapping[str, Any], str] | None) -> tuple[Mapping[str, Any], str] | None:
    """At setup: apply the state `Loop.load_state_dict` asked for; return what stays pending.

    A fit consumes it. ``validate()``/``evaluate()``/``predict()`` alone apply it too (the
    weights, the EMA) and leave it for the next fit, whose setup builds what only a fit
    builds (a scheduler from its factory).
    """
    if pending is None:
        return None
    state, source = pending
    restore(loop, position, end, state, source)
    return None if loop.fitting else pending


def _all_epochs(epochs: int) -> str:
    return "its 1 epoch is done" if epochs == 1 else f"all {epochs} epochs are done"


def check_mapping(state: Any, source: str | None) -> Mapping[str, Any]:
    """``state`` if it is a mapping (what `Loop.state_dict` returns), else a CheckpointError."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{source or 'state'}: expected the mapping Loop.state_dict() "
                              f"returns, got {type(state).__name__}.")
    return state


def capture(loop: Loop, position: Position, ended: Mapping[str, Any] | None, *,
            gather: bool = True, held: str | None = None) -> dict[str, Any]:
    """`Loop.state_dict`: the whole run, as tensors and plain values.

    The model and the optimizer come as `hookloop.sharded` gives them: a model FSDP
    shards is gathered to rank 0 (``state_dict="full"``: rank 0 holds the state, the
    other ranks none) or kept as this rank's shards (``"sharded"``); so are the DTensors in
    the callbacks' states. Either way every rank must call it.

    Raises:
        CheckpointError: ``gather=False`` (the exception path) with a sharded model, whose
            state cannot be read without every rank.
    """
    module, optimizer = loop.unwrapped_model, loop.optimizer
    layout = layout_of(module)
    if layout is not None and not gather:
        raise CheckpointError(
            "no checkpoint of the exception: the state of a model FSDP shards is read by "
            "every rank together, and on the exception path the other ranks may be dead or "
            "elsewhere. The newest checkpoint stays the one to resume from; a stop every "
            "rank agrees on (loop.stop(), a stop signal) writes one.")
    shared, own = position.parts()
    world = distributed.world_size()
    if gather:
        ranks = distributed.all_gather_object(own)
    else:
        if world > 1:  # the other ranks' sums are unknown: the resumed epoch recounts
            own.update(train_loss_sum=None, train_samples=0)
        ranks = [own]
    callbacks = {callback.state_key: callback.state_dict() for callback in loop.callbacks
                 if overrides(callback, "state_dict")}
    extra = {name: item.state_dict() for name, item in loop.extra_state.items()}
    if layout == "full":  # a callback's DTensors (an EMA over shards) gathered as the model
        callbacks, extra = gather_for_rank_zero((callbacks, extra), distributed.rank())
    return {
        "model": model_state(module),
        "optimizer": optimizer_state(module, optimizer),
        "loop": {
            **shared,
            "world_size": world,
            "batches_per_epoch": loop.batches_per_epoch,
            "optimizer_class": type(optimizer).__qualname__,
            "param_groups": [len(group["params"]) for group in optimizer.param_groups],
            "epochs": loop.state.epochs,
            "max_steps": loop.state.max_steps,
            "ended": ended,
            "stop_held": held,  # a stop waiting for min_epochs/min_steps (`RunEnd.held`)
            "history": [dict(row) for row in loop.state.history],
        },
        "ranks": ranks,
        "callbacks": callbacks,
        "state": extra,
        "state_classes": {name: type(item).__qualname__
                          for name, item in loop.extra_state.items()},
    }


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


def restore(loop: Loop, position: Position, end: RunEnd, payload: Mapping[str, Any],
            source: str) -> None:
    """`Loop.load_state_dict`, applied after setup: raise before touching anything wrong."""
    loop_part = payload.get("loop")
    if not isinstance(loop_part, Mapping) or not isinstance(payload.get("model"), Mapping) \
            or not isinstance(payload.get("optimizer"), Mapping):
        missing = [key for key in ("model", "optimizer", "loop")
                   if not isinstance(payload.get(key), Mapping)]
        raise CheckpointError(f"{source}: not a training state: {', '.join(missing)} "
                              "missing or not a mapping.")
    check_optimizer_fits(loop.optimizer, loop_part, payload["optimizer"], source)
    check_same_data(loop, loop_part, source)
    check_new_world(loop, loop_part, payload.get("ranks") or [], source)
    _check_extra_state(loop, payload, source)
    # A file or a directory of shards, into a sharded model or not (hookloop.storage).
    load_weights(source, loop.unwrapped_model, loop.optimizer, payload)
    if payload.get(SHARDS_KEY) is not None:  # DTensors of the callbacks' and extra states
        payload = payload[SHARDS_KEY].resolve(payload)
    ranks = payload.get("ranks") or [{}]
    rank, world = distributed.rank(), distributed.world_size()
    saved_world = int(loop_part.get("world_size", 1))
    own = dict(ranks[rank] if rank < len(ranks) else ranks[0])
    if rank >= len(ranks):
        warnings.warn(
            f"{source} has no random-generator state for rank {rank} (it was written by "
            f"{saved_world} process(es), or after an exception); rank {rank} uses rank 0's, "
            "so its random draws differ from an uninterrupted run.", RuntimeWarning,
            stacklevel=4)
    if saved_world != world or (world > 1 and len(ranks) < world):
        own.update(train_loss_sum=None, train_samples=0)  # not this rank's own sums
    position.load(loop_part, own, loop.device)
    epoch, done, step = position.public
    # The epoch the weights are in, as an uninterrupted run shows it: after a whole epoch e
    # (position e + 1, no batch done) that is e, not the epoch that has not started.
    loop.state.epoch = epoch if done or epoch == 0 else epoch - 1
    loop.state.step = step
    loop.state.history = [dict(row) for row in loop_part.get("history") or []]
    if loop.state.history:  # what fit() returns when the resumed run has nothing left to do
        loop.state.metrics = {key: value for key, value in loop.state.history[-1].items()
                              if key not in ("epoch", "step") and not is_learning_rate(key)}
    end.restored = loop_part.get("ended")
    end.held = loop_part.get("stop_held")
    _load_extra_state(loop, payload, source)
    saved = dict(payload.get("callbacks") or {})
    for callback in loop.callbacks:
        if not overrides(callback, "state_dict"):
            continue
        if callback.state_key in saved:
            key = callback.state_key
            try:
                callback.load_state_dict(saved.pop(key))
            except (TypeError, ValueError, KeyError, AttributeError, IndexError,
                    RuntimeError) as error:
                raise CheckpointError(
                    f"{source}: the state of {callback!r} (field 'callbacks.{key}') does not fit "
                    f"it: {type(error).__name__}: {error}. It was saved by another version or "
                    "configuration of that callback, or the file was edited.") from error
            except BaseException as exc:
                annotate(exc, callback.load_state_dict)
                raise
        elif distributed.is_main():
            warnings.warn(f"{source} has no state for {callback!r} (key "
                          f"{callback.state_key!r}); it starts fresh.", RuntimeWarning,
                          stacklevel=4)
    if saved and distributed.is_main():
        warnings.warn(
            f"{source} holds state that no callback in the stack claims: "
            f"{', '.join(sorted(saved))}. Add those callbacks (with the same name=) to "
            "restore it, or ignore this if you removed them on purpose.", RuntimeWarning,
            stacklevel=4)

def _check_extra_state(loop: Loop, payload: Mapping[str, Any], source: str) -> None:
    """Before anything is loaded: each object of ``Loop(state=...)`` is of the class saved
    (and an optimizer has the param-group layout saved)."""
    saved, classes = payload.get("state") or {}, payload.get("state_classes") or {}
    for field, value in (("state", saved), ("state_classes", classes)):
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{source}: field {field!r} must be a dict, got "
                                  f"{type(value).__name__}.")
    for name, item in loop.extra_state.items():
        theirs = classes.get(name)
        if theirs is not None and theirs != type(item).__qualname__:
            raise CheckpointError(
                f"{source}: state[{name!r}] was saved from the class {theirs}, but this loop's "
                f"state[{name!r}] is of the class {type(item).__qualname__}. Pass the same kind of object "
                "under that name, or another name to start it fresh.")
        if isinstance(item, torch.optim.Optimizer) and isinstance(saved.get(name), Mapping):
            check_optimizer_fits(item, {}, saved[name], f"{source} (field 'state.{name}')")


def _load_extra_state(loop: Loop, payload: Mapping[str, Any], source: str) -> None:
    """Load each object of ``Loop(state=...)``; a missing or unclaimed name is a warning."""
    saved = dict(payload.get("state") or {})
    for name, item in loop.extra_state.items():
        if name not in saved:
            if distributed.is_main():
                warnings.warn(f"{source} has no state for Loop(state={{{name!r}: ...}}); it "
                              "starts fresh.", RuntimeWarning, stacklevel=5)
            continue
        state, where = saved.pop(name), f"{source} (field 'state.{name}')"
        if isinstance(item, torch.nn.Module):
            load_model_weights(where, item, state)
        elif isinstance(item, torch.optim.Optimizer):
            load_optimizer_state(where, item, state)
        else:
            try:
                item.load_state_dict(state)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError,
                    RuntimeError) as error:
                raise CheckpointError(f"{where}: the state does not fit state[{name!r}]: "
                                      f"{type(error).__name__}: {error}") from error
    if saved and distributed.is_main():
        warnings.warn(f"{source} holds state for {', '.join(sorted(saved))}, which this loop's "
                      "state= does not name; it is ignored.", RuntimeWarning, stacklevel=5)


def check_new_world(loop: Loop, loop_part: Mapping[str, Any], ranks: Sequence[Any],
                    source: str) -> None:
    """A checkpoint written inside an epoch by another number of ranks: its position, in
    samples of the epoch's order, goes on over the new ranks where the data draws that
    order from a ``DistributedSampler`` (`hookloop.resumable.reshard_problem`); a rank's
    own state of the data (in ``ranks``, the saved ranks' parts), or another order, cannot
    be split or merged: refused, before anything is loaded.

    Raises:
        CheckpointError: naming the data, both numbers of ranks and the fix.
    """
    saved_world, world = int(loop_part.get("world_size", 1)), distributed.world_size()
    if saved_world == world or not int(loop_part.get("batch_idx", 0)):
        return
    epoch = int(loop_part.get("epoch", 0)) + 1
    if any(isinstance(part, Mapping) and part.get("data_state") is not None for part in ranks):
        raise CheckpointError(
            f"{source}: the run was saved inside epoch {epoch} by "
            f"{saved_world} process(es), each with its own state of the training data "
            f"({type(loop.train_data).__name__}.state_dict()), and this run has {world}: a "
            "per-rank data state cannot be split or merged over another number of ranks. "
            f"Relaunch on {saved_world} process(es), or resume from a checkpoint written at an "
            "epoch end, or use a DataLoader over a map-style dataset (its position is kept in "
            "samples).")
    problem = reshard_problem(loop.train_data, loop_part)
    if problem is not None:
        raise CheckpointError(
            f"{source}: the run was saved inside epoch {epoch} by {saved_world} process(es) "
            f"and this run has {world}; the samples of the epoch not trained on yet can be "
            "resharded over the new ranks only when both launches draw the same order from "
            f"a DistributedSampler, but {problem}. Relaunch on {saved_world} process(es), or "
            "resume from a checkpoint written at an epoch end.")


def check_same_data(loop: Loop, loop_part: Mapping[str, Any], source: str) -> None:
    """Another number of training batches per epoch (same world size): refused inside an
    epoch, where the position would skip batches of other data than those trained on; a
    warning at an epoch end, where the run goes on with the new data from the next epoch.

    Raises:
        CheckpointError: the position is inside an epoch and ``len(train_data)`` changed.
    """
    saved, now = loop_part.get("batches_per_epoch"), loop.batches_per_epoch
    if saved is None or now is None or int(saved) == now or \
            int(loop_part.get("world_size", 1)) != distributed.world_size():
        return
    done, epoch = int(loop_part.get("batch_idx", 0)), int(loop_part.get("epoch", 0))
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
    theirs = loop_part.get("optimizer_class")
    if theirs is not None and theirs != ours:
        raise CheckpointError(
            f"{source}: the run was trained with {theirs}, but this loop's optimizer is "
            f"{ours}; its state (momentum buffers, moments, hyper-parameters) cannot be "
            f"loaded into another class. Create {with_article(theirs)} as in the saved run, or "
            "load only the weights with hookloop.load_checkpoint(path, model) and start a new run.")
    layout = [len(group["params"]) for group in optimizer.param_groups]
    groups = saved.get("param_groups")
    saved_layout = ([len(group.get("params", ())) for group in groups]
                    if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)
                    else loop_part.get("param_groups"))
    if saved_layout is not None and list(saved_layout) != layout:
        raise CheckpointError(
            f"{source}: the saved optimizer has param groups of sizes {list(saved_layout)}, "
            f"this loop's {ours} has {layout}. Build the optimizer over the same parameters "
            "in the same groups as the saved run.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _expect_int(path: str, where: str, value: Any, minimum: int = 0, *,
                optional: bool = False) -> None:
    if optional and value is None:
        return
    expect_field(path, where, value, _is_int(value) and value >= minimum,
                 f"an int >= {minimum}" + (" or None" if optional else ""))


def _check_sample_fields(path: str, loop: Mapping[str, Any]) -> None:
    """Where present: ints ``epoch_samples`` and ``global_batch`` >= 0, an int
    ``step_offset``, a str ``epoch_order`` (what the position in samples needs)."""
    for field in ("epoch_samples", "global_batch"):
        if field in loop:
            _expect_int(path, f"loop.{field}", loop[field])
    if "step_offset" in loop:
        expect_field(path, "loop.step_offset", loop["step_offset"], _is_int(loop["step_offset"]),
                     "an int")
    if "epoch_order" in loop:
        expect_field(path, "loop.epoch_order", loop["epoch_order"],
                     isinstance(loop["epoch_order"], str), "a str (the sampler's order)")


def _check_history(path: str, history: Any) -> None:
    """Each row: a dict of metric names to numbers, with int ``epoch`` and ``step``."""
    expect_field(path, "loop.history", history, isinstance(history, list), "a list of dicts")
    for index, row in enumerate(history):
        where = f"loop.history[{index}]"
        expect_field(path, where, row, isinstance(row, Mapping), "a dict")
        for field in ("epoch", "step"):
            if field not in row:
                raise CheckpointError(f"{path}: the checkpoint's field '{where}.{field}' is "
                                      "missing; it cannot be resumed.")
            _expect_int(path, f"{where}.{field}", row[field])
        for name, value in row.items():
            expect_field(path, f"{where} (a key)", name, isinstance(name, str), "a str")
            expect_field(path, f"{where}.{name}", value, _is_number(value), "a number")


def _check_ended(path: str, ended: Any) -> None:
    expect_field(path, "loop.ended", ended, isinstance(ended, Mapping),
                 "None or a dict with 'reason' and 'epochs'")
    expect_field(path, "loop.ended.reason", ended.get("reason"),
                 isinstance(ended.get("reason"), str), "a str")
    _expect_int(path, "loop.ended.epochs", ended.get("epochs"))
    _expect_int(path, "loop.ended.max_steps", ended.get("max_steps"), 1, optional=True)


def check_run_fields(path: str, payload: Mapping[str, Any]) -> None:
    """Check the loop's part of a training checkpoint (what `capture` writes); name the
    first wrong field.

    ``loop`` is a dict with int ``epoch``, ``batch_idx`` and ``step`` >= 0; where present,
    a bool ``validated``, an int ``world_size`` >= 1, a str ``optimizer_class``, a list of
    ints ``param_groups``, an int ``epochs`` >= 0, ``max_steps`` None or an int >= 1, a list
    ``history`` of rows (dicts of numbers with int ``epoch`` and ``step``) and ``ended``
    None or a dict (str ``reason``, int ``epochs``, ``max_steps`` None or an int), and
    ``stop_held`` None or a str. Each
    rank's part in ``ranks`` is a dict whose loss sums and generator states
    (`hookloop.rng.rng_state_problem`) have their types. A value of another type (a text
    ``world_size``, a float ``step``) is refused rather than converted.

    Raises:
        CheckpointError: naming ``path`` and the field.

    Example:
        >>> check_run_fields("x.pt", {"loop": {"epoch": 1, "batch_idx": 0, "step": -4}})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: the checkpoint's field 'loop.step' is int (-4), expected an int >= 0. The file was not written by this version of hookloop or was edited; resume from another file.
    """
    if "loop" not in payload:
        raise CheckpointError(
            f"{path}: a training checkpoint without its 'loop' field (the position to "
            "resume from); it cannot be resumed.")
    loop = payload["loop"]
    expect_field(path, "loop", loop, isinstance(loop, Mapping), "a dict")
    for field in ("epoch", "batch_idx", "step"):
        if field not in loop:
            raise CheckpointError(f"{path}: the checkpoint's field 'loop.{field}' is missing; "
                                  "it cannot be resumed.")
        _expect_int(path, f"loop.{field}", loop[field])
    _check_sample_fields(path, loop)
    if "validated" in loop:
        expect_field(path, "loop.validated", loop["validated"],
                     isinstance(loop["validated"], bool), "a bool")
    if "world_size" in loop:
        _expect_int(path, "loop.world_size", loop["world_size"], 1)
    if loop.get("optimizer_class") is not None:
        expect_field(path, "loop.optimizer_class", loop["optimizer_class"],
                     isinstance(loop["optimizer_class"], str), "a str (the class name)")
    if loop.get("param_groups") is not None:
        groups = loop["param_groups"]
        expect_field(path, "loop.param_groups", groups, isinstance(groups, list) and all(
            _is_int(size) and size >= 0 for size in groups), "a list of ints >= 0")
    if "epochs" in loop:
        _expect_int(path, "loop.epochs", loop["epochs"])
    if "max_steps" in loop:
        _expect_int(path, "loop.max_steps", loop["max_steps"], 1, optional=True)
    if loop.get("history") is not None:
        _check_history(path, loop["history"])
    if loop.get("ended") is not None:
        _check_ended(path, loop["ended"])
    if loop.get("stop_held") is not None:
        expect_field(path, "loop.stop_held", loop["stop_held"],
                     isinstance(loop["stop_held"], str), "a str (a held stop's reason)")
    for index, part in enumerate(payload.get("ranks") or []):
        where = f"ranks[{index}]"
        expect_field(path, where, part, isinstance(part, Mapping), "a dict")
        if "train_samples" in part:
            _expect_int(path, f"{where}.train_samples", part["train_samples"])
        if part.get("train_loss_sum") is not None:
            value = part["train_loss_sum"]
            expect_field(path, f"{where}.train_loss_sum", value,
                         isinstance(value, torch.Tensor), "a tensor or None")
        if "mark_batches" in part:
            _expect_int(path, f"{where}.mark_batches", part["mark_batches"])
        workers = part.get("workers_rng")
        if workers is not None:
            expect_field(path, f"{where}.workers_rng", workers, isinstance(workers, list),
                         "a list (a generator state or None for each DataLoader worker)")
        for field, state in [(name, part.get(name)) for name in
                             ("rng", "epoch_rng", "prefetch_rng", "mark_rng")] + \
                [(f"workers_rng[{i}]", item) for i, item in enumerate(workers or ())]:
            problem = rng_state_problem(state) if state is not None else None
            if problem is not None:
                inner, value, expected = problem
                expect_field(path, f"{where}.{field}" + (f".{inner}" if inner else ""), value,
                             False, expected)
