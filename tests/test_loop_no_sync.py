"""The loop forces no host-device sync per batch: the number of reads does not grow with data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, Loop

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@pytest.fixture
def count_reads(monkeypatch):
    counts = {"n": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


class ListenEverywhere(Callback):
    def on_batch_start(self, loop):
        pass

    def after_step(self, loop):
        pass

    def on_validation_batch_end(self, loop):
        pass


def _reads_for(batches: int, count_reads, sanity_val_batches: int = 0) -> int:
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(batches)]
    # SGD: torch's Adam reads its CPU step counter with .item(), which would blur the count.
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data,
                loss_fn=F.cross_entropy, callbacks=[ListenEverywhere()], device="cpu",
                sanity_val_batches=sanity_val_batches)
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
