"""The display callbacks read the device rarely: reads grow by at most one per logging interval."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from rich.console import Console

from hookloop.callbacks import CSVLogger, ProgressBar, TensorBoard

from builders import classification_batches, make_loop, two_layers


def _reads_for(batches: int, count_reads, tmp_path, terminal: bool) -> int:
    # refresh_per_second tiny: the bar's time-throttled loss read happens once an epoch here,
    # whatever the speed of the machine (the first refresh of each epoch).
    bar = ProgressBar(console=Console(file=io.StringIO(), force_terminal=terminal),
                      refresh_per_second=1e-3, plain_every_s=1e6)
    loop = make_loop([TensorBoard(tmp_path / f"tb{batches}{terminal}", every_n_steps=10), bar,
                      CSVLogger(tmp_path / f"log{batches}{terminal}.csv", every_n_steps=10)],
                     model=lambda: two_layers(5, 8, 3, torch.nn.ReLU()),
                     train=lambda: classification_batches(batches), val=slice(3),
                     loss_fn=F.cross_entropy, seed=None)
    before = count_reads["n"]
    loop.fit(2)
    assert len(loop.state.history) == 2
    return count_reads["n"] - before


def test_reads_grow_by_at_most_one_per_ten_steps(count_reads, tmp_path) -> None:
    for terminal in (True, False):
        small, large = (_reads_for(10, count_reads, tmp_path, terminal),
                        _reads_for(100, count_reads, tmp_path, terminal))
        # 2 epochs x 90 more batches: TensorBoard may read once per 10 steps (18 more);
        # CSVLogger reads its kept losses once per flush and the bar once per refresh.
        assert large - small <= 18, (terminal, small, large)
        assert small <= 2 * 2 + 2 * (1 + 1 + 2) + 2, (terminal, small)
