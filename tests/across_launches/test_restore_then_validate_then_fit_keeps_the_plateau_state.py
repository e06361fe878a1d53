"""loop.load_state_dict(state); loop.validate(); loop.fit(): the restore is applied by
validate(), before a factory-built scheduler exists."""
from __future__ import annotations

import copy

import pytest
import torch

from hookloop import Callback
from hookloop.callbacks import LRScheduler

from review_helpers import make_data, make_loop, same, weights


def plateau(optimizer, total):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", patience=0,
                                                      factor=0.5)


class Capture(Callback):
    def __init__(self):
        self.states = {}

    def on_epoch_end(self, loop):
        self.states[loop.state.epoch] = copy.deepcopy(loop.state_dict())


def run_reference():
    capture = Capture()
    schedule = LRScheduler(plateau, monitor="val_loss")
    loop = make_loop([schedule, capture], val=make_data(2, seed=5), sanity_val_batches=0)
    loop.fit(4)
    return loop, schedule, capture


def test_plateau_factory_restored_then_validate_then_fit():
    reference, ref_schedule, capture = run_reference()
    schedule = LRScheduler(plateau, monitor="val_loss")
    loop = make_loop([schedule], val=make_data(2, seed=5), sanity_val_batches=0)
    loop.load_state_dict(capture.states[1])
    loop.validate()
    loop.fit(4)  # TypeError: ReduceLROnPlateau.step() missing 'metrics'
    assert schedule.scheduler.state_dict()["best"] == ref_schedule.scheduler.state_dict()["best"]
    assert same(weights(loop), weights(reference))


def test_plateau_factory_restored_then_fit_control():
    reference, ref_schedule, capture = run_reference()
    schedule = LRScheduler(plateau, monitor="val_loss")
    loop = make_loop([schedule], val=make_data(2, seed=5), sanity_val_batches=0)
    loop.load_state_dict(capture.states[1])
    loop.fit(4)
    assert same(weights(loop), weights(reference))
