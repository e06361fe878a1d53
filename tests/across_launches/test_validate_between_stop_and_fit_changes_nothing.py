"""validate() between a stop() and the next fit() (a notebook): does it perturb the run?"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback

from builders import net_loop, same_weights, weights


def loaders():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    train = DataLoader(TensorDataset(x[:24], y[:24]), batch_size=4, shuffle=True)
    val = DataLoader(TensorDataset(x[24:], y[24:]), batch_size=4)
    return train, val


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_batch_end(self, loop):
        if loop.state.step == self.step:
            loop.stop("pause")


def test_stop_validate_fit_equals_uninterrupted():
    train, val = loaders()
    reference = net_loop(train=train, val=val, sanity_val_batches=2)
    reference.fit(2)

    train, val = loaders()
    loop = net_loop([StopAt(3)], train=train, val=val, sanity_val_batches=2)
    loop.fit(2)
    loop.callbacks = []
    loop.validate()          # look at the model in the middle of the run
    loop.fit(2)
    assert same_weights(weights(loop), weights(reference))


def test_stop_fit_equals_uninterrupted_control():
    train, val = loaders()
    reference = net_loop(train=train, val=val, sanity_val_batches=2)
    reference.fit(2)
    train, val = loaders()
    loop = net_loop([StopAt(3)], train=train, val=val, sanity_val_batches=2)
    loop.fit(2)
    loop.callbacks = []
    loop.fit(2)
    assert same_weights(weights(loop), weights(reference))
