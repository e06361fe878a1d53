"""The sanity check: a short validation before training, so a mistake surfaces in seconds.

``Loop(sanity_val_batches=2)`` runs the first two validation batches through the loop's
forward and its validation contexts (autocast, the EMA weights) before the first training
batch, so a metric of the wrong shape or a missing target fails in seconds, not after an
epoch. Its validation events go to the callbacks whose mistakes it is meant to find, and to
those the forward depends on:

* callbacks that produce metrics (``Metrics``...);
* the callback behind ``forward=`` (``forward=callback.method``, or a callback that is
  itself the forward);
* stateful callbacks (with ``state_dict``) that neither watch a metric (``monitors()``) nor
  only report (``rank_zero_only``): a callback keeping an LSTM's hidden state across
  batches, reset in ``on_validation_start``.

Loggers, monitors and checkpoints never see it; the callbacks that do can tell it apart by
``loop.phase is Phase.SANITY_CHECK``.

It changes nothing: its metrics are discarded; the loop's state, every random stream, each
submodule's mode and the state of every stateful callback that hears validation events
(an LSTM's hidden state kept by a callback, a restored one included) are put back; and a
``DataLoader(persistent_workers=True)`` keeps no iterator the check created, so the first
real validation creates it, drawing its seed where a run without the check would.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hookloop import distributed
from hookloop.base.compat import no_new_persistent_iterator
from hookloop.base.phase import Phase, Phases
from hookloop.callback import Callback
from hookloop.engine.dispatch import Table, annotate
from hookloop.engine.ordering import overrides
from hookloop.engine.untouched import untouched

__all__ = ["check", "batches_to_check", "listeners"]

#: ``run(data, prefix, limit=..., events=...)``: the loop's validation pass.
ValidationPass = Callable[..., None]


def batches_to_check(val_data: Any, sanity_val_batches: int) -> int:
    """How many validation batches the check runs: 0 without validation data, with
    ``sanity_val_batches=0``, or for a one-shot iterator (nothing to spare)."""
    if val_data is None or hasattr(val_data, "__next__"):
        return 0
    return sanity_val_batches


_VALIDATION_EVENTS = ("on_validation_start", "on_validation_batch_start",
                      "on_validation_batch_end", "on_validation_end")


@contextmanager
def _states_kept(callbacks: Sequence[Callback]) -> Iterator[None]:
    """Each stateful callback that hears validation events gets its state back afterwards."""
    kept = [(callback, copy.deepcopy(callback.state_dict())) for callback in callbacks
            if overrides(callback, "state_dict")
            and any(overrides(callback, event) for event in _VALIDATION_EVENTS)]
    try:
        yield
    finally:
        for callback, state in kept:
            try:
                callback.load_state_dict(state)
            except BaseException as exc:
                annotate(exc, callback.load_state_dict)
                raise


def _owner(forward: Any) -> Any:
    """The object behind a ``forward=`` callable: a bound method's instance, else itself."""
    while isinstance(forward, functools.partial):
        forward = forward.func
    return getattr(forward, "__self__", forward)


def listeners(callbacks: Sequence[Callback], host: object, forward: Any) -> list[Callback]:
    """The callbacks that hear the check's validation events (see the module docstring);
    ``host`` is what their ``produces`` is asked with (the loop), ``forward`` the loop's."""
    behind = _owner(forward)
    return [callback for callback in callbacks
            if list(callback.produces(host)) or callback is behind  # type: ignore[arg-type]
            or (overrides(callback, "state_dict") and not callback.rank_zero_only
                and not list(callback.monitors()))]


def check(host: object, callbacks: Sequence[Callback], forward: Any, state: Any, model: Any,
          train_data: Any, val_data: Any, sanity_val_batches: int, wrapper: Any,
          phases: Phases, run: ValidationPass, generators: Sequence[torch.Generator]) -> None:
    """Run the check (when `batches_to_check` is not 0) and put everything back.

    Args:
        host: What the events are emitted with (the loop), held as it is.
        callbacks, forward, state, model, train_data, val_data, sanity_val_batches: The
            loop's (``state``: its `LoopState`).
        wrapper: The loop's ``handler_wrapper``.
        phases: The loop's phase tracker (``SANITY_CHECK`` during the check).
        run: The loop's validation pass.
        generators: The training data's generators, put back too.
    """
    batches = batches_to_check(val_data, sanity_val_batches)
    if not batches:
        return
    kept: Any = state.kept("metrics", "history", "batch_idx", "batch", "outputs", "loss",
                           "targets", "batch_size", "training")
    heard = listeners(callbacks, host, forward)
    with phases.entered(Phase.SANITY_CHECK), kept, _states_kept(heard), \
            untouched(model, generators, data=(train_data, val_data)), \
            no_new_persistent_iterator(val_data):
        run(val_data, "val", limit=batches,
            events=Table(heard, host, wrapper, main=distributed.is_main()))
