"""Validation every n steps falling on an epoch's last step, then a resume / fit() again."""
from __future__ import annotations

import pytest
import torch

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping

from review_helpers import make_data, make_loop, same, weights


class FailOnce(Callback):
    """Raise after the on_batch_end of the given step (a kill right after a save)."""

    def __init__(self, at_step):
        self.at_step, self.done = at_step, False

    def on_batch_end(self, loop):
        if not self.done and loop.state.step == self.at_step:
            self.done = True
            raise RuntimeError("boom")


def rows(history):
    return [(row["epoch"], row["step"], "val_loss" in row) for row in history]


def test_fit_again_after_exception_at_last_step_does_not_validate_twice():
    val = make_data(2, seed=5)
    reference = make_loop([EarlyStopping(patience=3)], val=val, val_every_n_steps=4,
                          sanity_val_batches=0)
    reference.fit(3)

    stopper = EarlyStopping(patience=3)
    loop = make_loop([stopper, FailOnce(at_step=4)], val=val, val_every_n_steps=4,
                     sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        loop.fit(3)
    loop.fit(3)
    assert rows(loop.state.history) == rows(reference.state.history)


def test_resume_from_step_checkpoint_at_last_step_does_not_validate_twice(tmp_path):
    val = make_data(2, seed=5)
    reference = make_loop([EarlyStopping(patience=3)], val=val, val_every_n_steps=4,
                          sanity_val_batches=0)
    reference.fit(3)
    ref_stopper = reference.callbacks[0]

    first = make_loop([EarlyStopping(patience=3), Checkpoint(tmp_path, every_n_steps=4,
                                                             every_n_epochs=None),
                       FailOnce(at_step=4)],
                      val=val, val_every_n_steps=4, sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        first.fit(3)
    # A new process: a new loop resuming from the step-4 file.
    stopper = EarlyStopping(patience=3)
    second = make_loop([stopper, Checkpoint(tmp_path, every_n_steps=4, every_n_epochs=None,
                                            resume=True)],
                       val=val, val_every_n_steps=4, sanity_val_batches=0)
    second.fit(3)
    assert rows(second.state.history) == rows(reference.state.history)
    assert (stopper.wait, stopper.best) == (ref_stopper.wait, ref_stopper.best)
    assert same(weights(second), weights(reference))
