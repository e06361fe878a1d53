"""The loop forces no host-device sync per batch: the number of reads does not grow with data
(``count_reads`` is in tests/conftest.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hookloop import Callback

from builders import classification_batches, make_loop, two_layers


class ListenEverywhere(Callback):
    def on_batch_start(self, loop):
        pass

    def after_step(self, loop):
        pass

    def on_validation_batch_end(self, loop):
        pass


def _reads_for(batches: int, count_reads, sanity_val_batches: int = 0) -> int:
    # SGD: torch's Adam reads its CPU step counter with .item(), which would blur the count.
    loop = make_loop([ListenEverywhere()], model=lambda: two_layers(5, 8, 3, torch.nn.ReLU()),
                     train=lambda: classification_batches(batches), val=lambda train: train,
                     loss_fn=F.cross_entropy, seed=None, sanity_val_batches=sanity_val_batches)
    before = count_reads["n"]
    loop.fit(2)
    return count_reads["n"] - before


def test_host_reads_per_fit_do_not_depend_on_the_number_of_batches(count_reads) -> None:
    small, large = _reads_for(3, count_reads), _reads_for(30, count_reads)
    assert small == large
    assert small <= 4  # one read of the training loss and one of the validation loss per epoch
    # The sanity check before training adds a constant (its validation loss, the RNG put back).
    checked_small, checked_large = _reads_for(3, count_reads, 2), _reads_for(30, count_reads, 2)
    assert checked_small == checked_large <= small + 3
