"""fit() after an exception with GradAccumulation on data without a length whose batches
draw random numbers (augmentation): the look-ahead changes the order of the draws."""
from __future__ import annotations

import pytest
import torch

from hookloop import Callback
from hookloop.callbacks import GradAccumulation

from review_helpers import make_loop, same, weights


class NoisyStream:
    """An iterable without __len__ whose batches get random noise (augmentation)."""

    def __init__(self, n=6):
        g = torch.Generator().manual_seed(3)
        self.items = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g))
                      for _ in range(n)]

    def __iter__(self):
        for x, y in self.items:
            yield x + 0.1 * torch.randn_like(x), y  # draws from torch's global generator


class FailOnce(Callback):
    def __init__(self, at_step):
        self.at_step, self.done = at_step, False

    def on_batch_end(self, loop):
        if not self.done and loop.state.step == self.at_step and loop.state.step_boundary:
            self.done = True
            raise RuntimeError("boom")


@pytest.mark.parametrize("window", [1, 2])
def test_fit_again_after_exception_matches_uninterrupted(window):
    reference = make_loop([GradAccumulation(window)], train=NoisyStream(), sanity_val_batches=0)
    reference.fit(2)
    expected = weights(reference)

    loop = make_loop([GradAccumulation(window), FailOnce(at_step=2)], train=NoisyStream(),
                     sanity_val_batches=0)
    with pytest.raises(RuntimeError):
        loop.fit(2)
    loop.fit(2)
    assert loop.state.step == reference.state.step
    assert same(weights(loop), expected)
