"""validate() between a stop() and the next fit() (a notebook) changes nothing: the run ends
as the uninterrupted one."""
from __future__ import annotations

from torch.utils.data import DataLoader

from hookloop import Callback

from builders import net_loop, regression_dataset, same_weights, split, weights


def loaders():
    train, val = split(regression_dataset(32, features=4, seed=2), 24)
    # No generator of its own: the order comes from torch's global generator.
    return DataLoader(train, batch_size=4, shuffle=True), DataLoader(val, batch_size=4)


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
