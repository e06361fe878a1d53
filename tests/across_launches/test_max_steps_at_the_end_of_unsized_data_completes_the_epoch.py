"""Data without a length: a stop (max_steps) that falls on the last batch of the data."""
from __future__ import annotations

from hookloop import Callback

from builders import Unsized, net_batches, net_loop


class Record(Callback):
    def __init__(self):
        self.completed = []

    def on_epoch_end(self, loop):
        self.completed.append(loop.epoch_completed)


def run(train):
    record = Record()
    loop = net_loop([record], train=train, val=net_batches(2, seed=5), sanity_val_batches=0)
    loop.fit(1, max_steps=4)
    return loop, record


def test_max_steps_on_the_last_batch_completes_the_epoch_as_with_a_length():
    data = net_batches(4)
    sized, sized_record = run(list(data))
    unsized, unsized_record = run(Unsized(list(data)))
    assert sized_record.completed == [True]           # the oracle: same data with a len()
    assert unsized_record.completed == sized_record.completed
    assert [sorted(r) for r in unsized.state.history] == [sorted(r) for r in sized.state.history]
