"""A factory schedule rebuilt for a longer run (fit(2) then fit(4)) follows the new
schedule from the run's step: checked against the closed form of CosineAnnealingLR."""
from __future__ import annotations

import math

import torch

from hookloop import Callback
from hookloop.callbacks import LRScheduler

from builders import net_loop

BASE = 0.05


class Rates(Callback):
    def __init__(self):
        self.rates = {}

    def on_batch_start(self, loop):
        self.rates[loop.state.step] = loop.optimizer.param_groups[0]["lr"]


def cosine(step, total):
    return BASE * (1 + math.cos(math.pi * step / total)) / 2


def test_fit_2_then_fit_4_follows_the_4_epoch_cosine():
    rates = Rates()
    schedule = LRScheduler(lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=total))
    loop = net_loop([schedule, rates], lr=BASE, sanity_val_batches=0)
    loop.fit(2)   # 8 steps
    loop.fit(4)   # 16 steps in all: steps 8..15 follow the 16-step cosine
    for step in range(8, 16):
        assert math.isclose(rates.rates[step], cosine(step, 16), rel_tol=1e-6), step
