"""Validation every n steps falling on an epoch's last step, then a resume / fit() again:
that validation is not run twice, and the run ends as the uninterrupted one."""
from __future__ import annotations

import pytest

from hookloop.callbacks import Checkpoint, EarlyStopping

from builders import RaiseAfterStep, net_batches, net_loop, same_weights, weights


def rows(history):
    return [(row["epoch"], row["step"], "val_loss" in row) for row in history]


def test_fit_again_after_exception_at_last_step_does_not_validate_twice():
    val = net_batches(2, seed=5)
    reference = net_loop([EarlyStopping(patience=3)], val=val, val_every_n_steps=4,
                         sanity_val_batches=0)
    reference.fit(3)

    stopper = EarlyStopping(patience=3)
    loop = net_loop([stopper, RaiseAfterStep(4, RuntimeError)], val=val, val_every_n_steps=4,
                    sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        loop.fit(3)
    loop.fit(3)
    assert rows(loop.state.history) == rows(reference.state.history)


def test_resume_from_step_checkpoint_at_last_step_does_not_validate_twice(tmp_path):
    val = net_batches(2, seed=5)
    reference = net_loop([EarlyStopping(patience=3)], val=val, val_every_n_steps=4,
                         sanity_val_batches=0)
    reference.fit(3)
    ref_stopper = reference.callbacks[0]

    # A kill right after the step-4 save.
    first = net_loop([EarlyStopping(patience=3), Checkpoint(tmp_path, every_n_steps=4,
                                                            every_n_epochs=None),
                      RaiseAfterStep(4, RuntimeError)],
                     val=val, val_every_n_steps=4, sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        first.fit(3)
    # A new process: a new loop resuming from the step-4 file.
    stopper = EarlyStopping(patience=3)
    second = net_loop([stopper, Checkpoint(tmp_path, every_n_steps=4, every_n_epochs=None,
                                           resume=True)],
                      val=val, val_every_n_steps=4, sanity_val_batches=0)
    second.fit(3)
    assert rows(second.state.history) == rows(reference.state.history)
    assert (stopper.wait, stopper.best) == (ref_stopper.wait, ref_stopper.best)
    assert same_weights(weights(second), weights(reference))
