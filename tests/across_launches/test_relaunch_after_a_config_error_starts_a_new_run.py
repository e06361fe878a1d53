"""A configuration error before the first batch leaves the checkpoint directory empty, so the
fixed relaunch starts a new run."""
from __future__ import annotations

import os

import pytest
import torch

from hookloop import ConfigurationError
from hookloop.callbacks import Checkpoint, LRScheduler

from builders import net_loop


def onecycle(loop, total):
    return torch.optim.lr_scheduler.OneCycleLR(loop.optimizer, max_lr=0.1, total_steps=total)


def test_too_short_schedule_leaves_no_file_and_the_fixed_relaunch_starts(tmp_path):
    loop = net_loop(sanity_val_batches=0)
    loop.callbacks = [LRScheduler(onecycle(loop, 3)), Checkpoint(tmp_path)]
    with pytest.raises(ConfigurationError, match="total_steps=3"):
        loop.fit(2)  # 8 steps needed: refused before the first batch
    assert os.listdir(tmp_path) == []
    # The user fixes the schedule and runs the same script again (a new run, resume=False).
    fixed = net_loop(sanity_val_batches=0)
    fixed.callbacks = [LRScheduler(onecycle(fixed, 8)), Checkpoint(tmp_path)]
    fixed.fit(2)


def test_fixed_relaunch_is_not_refused_as_an_earlier_run(tmp_path):
    """The refused fit wrote nothing, so the relaunch is a new run, not "a directory that
    already holds checkpoints of an earlier run"."""
    loop = net_loop(sanity_val_batches=0)
    loop.callbacks = [LRScheduler(onecycle(loop, 3)), Checkpoint(tmp_path)]
    with pytest.raises(ConfigurationError):
        loop.fit(2)
    fixed = net_loop(sanity_val_batches=0)
    fixed.callbacks = [LRScheduler(onecycle(fixed, 8)), Checkpoint(tmp_path)]
    fixed.fit(2)
    assert fixed.state.step == 8
