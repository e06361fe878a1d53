"""The display callbacks read the device rarely: reads grow by at most one per logging interval."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from rich.console import Console

from hookloop import Loop
from hookloop.callbacks import CSVLogger, ProgressBar, TensorBoard
from test_loop_no_sync import count_reads  # noqa: F401  (the fixture)


def _reads_for(batches: int, count_reads, tmp_path, terminal: bool) -> int:
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(batches)]
    # refresh_per_second tiny: the bar's time-throttled loss read happens once an epoch here,
    # whatever the speed of the machine (the first refresh of each epoch).
    bar = ProgressBar(console=Console(file=io.StringIO(), force_terminal=terminal),
                      refresh_per_second=1e-3, plain_every_s=1e6)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:3],
                loss_fn=F.cross_entropy, device="cpu",
                callbacks=[TensorBoard(tmp_path / f"tb{batches}{terminal}", every_n_steps=10), bar,
                           CSVLogger(tmp_path / f"log{batches}{terminal}.csv", every_n_steps=10)])
    before = count_reads["n"]
    loop.fit(2)
    assert len(loop.state.history) == 2
    return count_reads["n"] - before


def test_reads_grow_by_at_most_one_per_ten_steps(count_reads, tmp_path) -> None:  # noqa: F811
    for terminal in (True, False):
        small, large = (_reads_for(10, count_reads, tmp_path, terminal),
                        _reads_for(100, count_reads, tmp_path, terminal))
        # 2 epochs x 90 more batches: TensorBoard may read once per 10 steps (18 more);
        # CSVLogger reads its kept losses once per flush and the bar once per refresh.
        assert large - small <= 18, (terminal, small, large)
        assert small <= 2 * 2 + 2 * (1 + 1 + 2) + 2, (terminal, small)
