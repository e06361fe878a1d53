"""loop.load_state_dict(state); loop.validate(); loop.fit(): validate() applies the restore
before a factory-built plateau scheduler exists, and the fit still restores its state and
ends as the uninterrupted run."""
from __future__ import annotations

import torch

from hookloop.callbacks import LRScheduler

from builders import StateCapture, net_batches, net_loop, same_weights, weights


def plateau(optimizer, total):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", patience=0,
                                                      factor=0.5)


def run_reference():
    capture = StateCapture()
    schedule = LRScheduler(plateau, monitor="val_loss")
    loop = net_loop([schedule, capture], val=net_batches(2, seed=5), sanity_val_batches=0)
    loop.fit(4)
    return loop, schedule, capture


def test_plateau_factory_restored_then_validate_then_fit():
    """The plateau scheduler built after validate() gets the restored state, and its step
    gets the monitored metric."""
    reference, ref_schedule, capture = run_reference()
    schedule = LRScheduler(plateau, monitor="val_loss")
    loop = net_loop([schedule], val=net_batches(2, seed=5), sanity_val_batches=0)
    loop.load_state_dict(capture.states[1])
    loop.validate()
    loop.fit(4)
    assert schedule.scheduler.state_dict()["best"] == ref_schedule.scheduler.state_dict()["best"]
    assert same_weights(weights(loop), weights(reference))


def test_plateau_factory_restored_then_fit_control():
    reference, ref_schedule, capture = run_reference()
    schedule = LRScheduler(plateau, monitor="val_loss")
    loop = net_loop([schedule], val=net_batches(2, seed=5), sanity_val_batches=0)
    loop.load_state_dict(capture.states[1])
    loop.fit(4)
    assert same_weights(weights(loop), weights(reference))
