"""Ctrl-C during a validation every n steps, then fit() again (a notebook): the interrupted
validation runs once more, and the run ends as an uninterrupted one."""
from __future__ import annotations

import pytest

from hookloop import Callback

from builders import net_batches, net_loop, same_weights, weights


class InterruptValidationOnce(Callback):
    def __init__(self, at_step):
        self.at_step, self.done = at_step, False

    def on_validation_batch_end(self, loop):
        if not self.done and loop.fitting and not loop.sanity_checking \
                and loop.state.step == self.at_step:
            self.done = True
            raise KeyboardInterrupt


def rows(history):
    return [(row["epoch"], row["step"]) for row in history if "val_loss" in row]


def test_fit_again_after_ctrl_c_in_step_validation_runs_that_validation():
    val = net_batches(2, seed=5)
    reference = net_loop(val=val, val_every_n_steps=2, val_every_n_epochs=None,
                         sanity_val_batches=0)
    reference.fit(2)

    loop = net_loop([InterruptValidationOnce(at_step=2)], val=val, val_every_n_steps=2,
                    val_every_n_epochs=None, sanity_val_batches=0)
    with pytest.raises(KeyboardInterrupt):
        loop.fit(2)
    loop.fit(2)
    assert same_weights(weights(loop), weights(reference))
    assert rows(loop.state.history) == rows(reference.state.history)
