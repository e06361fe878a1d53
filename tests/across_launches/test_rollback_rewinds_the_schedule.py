"""In-process rollback (loop.load_state_dict of an older state) with a factory schedule: the
schedule rewinds with the weights, and the branch trained again ends where the first did."""
from __future__ import annotations

import functools

import torch

from hookloop import Callback
from hookloop.callbacks import LRScheduler
from hookloop.schedules import warmup_cosine

from builders import StateCapture, net_loop, same_weights, weights


def test_rollback_in_process_rewinds_a_factory_schedule():
    capture = StateCapture()
    schedule = LRScheduler(functools.partial(warmup_cosine, warmup_steps=2))
    loop = net_loop([schedule, capture], sanity_val_batches=0)
    loop.fit(3)
    final = weights(loop)
    lr_final = loop.optimizer.param_groups[0]["lr"]
    # Roll back to the end of epoch 0 and train the same two epochs again.
    loop.load_state_dict(capture.states[0])
    loop.fit(3)
    assert schedule.scheduler.last_epoch == loop.state.step == 12
    assert loop.optimizer.param_groups[0]["lr"] == lr_final
    assert same_weights(weights(loop), final)


def test_rollback_in_process_then_check_lr_right_after_restore():
    capture = StateCapture()
    schedule = LRScheduler(functools.partial(warmup_cosine, warmup_steps=2))
    loop = net_loop([schedule, capture], sanity_val_batches=0)
    loop.fit(3)
    lr_after_epoch0 = capture.states[0]["optimizer"]["param_groups"][0]["lr"]
    seen = []

    class Probe(Callback):
        def on_fit_start(self, loop):
            seen.append((schedule.scheduler.last_epoch, loop.optimizer.param_groups[0]["lr"]))

    loop.callbacks.append(Probe())
    loop.load_state_dict(capture.states[0])
    loop.fit(3)
    assert seen[0] == (4, lr_after_epoch0)


def test_rollback_in_process_silent_with_a_schedule_without_total_steps():
    """CosineAnnealingLR has no total_steps attribute, so no length check can catch a
    schedule left at the later step: the rollback must rewind it all the same."""
    capture = StateCapture()
    schedule = LRScheduler(lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=total))
    loop = net_loop([schedule, capture], sanity_val_batches=0)
    loop.fit(3)
    final = weights(loop)
    loop.load_state_dict(capture.states[0])
    loop.fit(3)
    assert schedule.scheduler.last_epoch == loop.state.step == 12
    assert same_weights(weights(loop), final)
