"""The sanity check: a short validation before training, so a mistake surfaces in seconds.

``Loop(sanity_val_batches=2)`` runs the first two validation batches through the loop's
forward, its validation contexts (autocast, the EMA weights) and the metric producers'
validation events before the first training batch, so a metric of the wrong shape or a
missing target fails before an epoch of training is spent. It changes nothing: its metrics
are discarded, and the loop's state, every random stream and each submodule's mode are put
back afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.dispatch import Table
from hookloop.phase import Phase, Phases
from hookloop.untouched import untouched

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["check", "batches_to_check", "listeners"]

#: ``run(data, prefix, limit=..., events=...)``: the loop's validation pass.
ValidationPass = Callable[..., None]


def batches_to_check(loop: Loop) -> int:
    """How many validation batches the check runs: 0 without validation data, with
    ``sanity_val_batches=0``, or for a one-shot iterator (nothing to spare)."""
    if loop.val_data is None or hasattr(loop.val_data, "__next__"):
        return 0
    return loop.sanity_val_batches


def listeners(loop: Loop) -> list[Callback]:
    """The callbacks that hear the check's validation events: those that produce metrics
    (``Metrics``...), whose mistakes it is meant to find. Loggers, monitors and checkpoints
    never see it."""
    main = distributed.is_main()
    return [callback for callback in loop.callbacks
            if (main or not callback.rank_zero_only) and list(callback.produces(loop))]


def check(loop: Loop, phases: Phases, run: ValidationPass,
          generators: Sequence[torch.Generator]) -> None:
    """Run the check (when `batches_to_check` is not 0) and put everything back.

    Args:
        loop: The loop about to train.
        phases: The loop's phase tracker (``SANITY_CHECK`` during the check).
        run: The loop's validation pass.
        generators: The training data's generators, put back too.
    """
    batches = batches_to_check(loop)
    if not batches:
        return
    kept: Any = loop.state.kept("metrics", "history", "batch_idx", "batch", "outputs", "loss",
                                "targets", "batch_size", "training")
    with phases.entered(Phase.SANITY_CHECK), kept, \
            untouched(loop.model, generators, data=(loop.train_data, loop.val_data)):
        run(loop.val_data, "val", limit=batches,
            events=Table(listeners(loop), loop.handler_wrapper))
