"""fit() after an exception with GradAccumulation on data without a length whose batches
draw random numbers (augmentation): the replayed window draws them in the uninterrupted
order, though the look-ahead that finds the last batch reads one batch early."""
from __future__ import annotations

import pytest
import torch

from hookloop.callbacks import GradAccumulation

from builders import RaiseAfterStep, net_loop, same_weights, weights


class NoisyStream:
    """An iterable without __len__ whose batches get random noise (augmentation)."""

    def __init__(self, n=6):
        g = torch.Generator().manual_seed(3)
        self.items = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g))
                      for _ in range(n)]

    def __iter__(self):
        for x, y in self.items:
            yield x + 0.1 * torch.randn_like(x), y  # draws from torch's global generator


@pytest.mark.parametrize("window", [1, 2])
def test_fit_again_after_exception_matches_uninterrupted(window):
    reference = net_loop([GradAccumulation(window)], train=NoisyStream(), sanity_val_batches=0)
    reference.fit(2)
    expected = weights(reference)

    loop = net_loop([GradAccumulation(window), RaiseAfterStep(2, RuntimeError, boundary=True)],
                    train=NoisyStream(), sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        loop.fit(2)
    loop.fit(2)
    assert loop.state.step == reference.state.step
    assert same_weights(weights(loop), expected)
