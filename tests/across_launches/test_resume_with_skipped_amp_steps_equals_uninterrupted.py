"""AMP float16 with skipped steps: a kill, then a resume from a step checkpoint, ends as an
uninterrupted run (weights, EMA shadow, skipped-step count)."""
from __future__ import annotations

import warnings

import pytest
import torch

from hookloop import Callback
from hookloop.callbacks import AMP, Checkpoint, EMA, LRScheduler

from builders import net_batches, net_loop, same_weights, weights


class Kill(Callback):
    def __init__(self, at_batch):
        self.at, self.n = at_batch, 0

    def on_batch_end(self, loop):
        self.n += 1
        if self.n == self.at:
            raise RuntimeError("killed")


def stack(tmp=None, resume=False, kill=None):
    cbs = [AMP(torch.float16, scaler={"init_scale": 2.0 ** 30, "growth_interval": 2}),
           EMA(0.9),
           LRScheduler(lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, total))]
    if tmp is not None:
        cbs.append(Checkpoint(tmp, every_n_steps=1, every_n_epochs=1, keep_last=None,
                              resume=resume))
    if kill is not None:
        cbs.append(kill)
    return cbs


@pytest.mark.parametrize("kill_at", [2, 5, 7, 10])
def test_resume_with_skipped_steps(tmp_path, kill_at):
    warnings.simplefilter("ignore")
    data = net_batches(6)
    reference = net_loop(stack(), train=data, sanity_val_batches=0)
    reference.fit(2)
    amp = reference.callbacks[0]
    assert amp.skipped_steps > 0
    first = net_loop(stack(tmp_path, kill=Kill(kill_at)), train=data, sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        first.fit(2)
    second = net_loop(stack(tmp_path, resume=True), train=data, sanity_val_batches=0)
    second.fit(2)
    assert second.state.step == reference.state.step
    assert second.callbacks[0].skipped_steps == amp.skipped_steps
    assert same_weights(weights(second), weights(reference))
    assert same_weights(second.callbacks[1].averaged_state_dict(),
                        reference.callbacks[1].averaged_state_dict())
