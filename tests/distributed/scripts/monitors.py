"""torchrun script: MemoryMonitor and ThroughputMonitor on 2 ranks (gloo).

Usage: torchrun --nproc_per_node=2 monitors.py OUT_DIR

Rank 1 touches 256 MiB more than rank 0 before training, so its peak RSS is larger; each
rank saves the monitor's value and its own peak read right after it, every epoch. Then a
``validate()``, whose rates are saved too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from common import make_model, make_optimizer, out_dir, rank, regression_data, save
from hookloop import Callback, Loop
from hookloop.callbacks import DDP, MemoryMonitor, ThroughputMonitor
from hookloop.callbacks.memory import peak_rss_bytes


class Own(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_epoch_end(self, loop: Loop) -> None:
        self.rows.append({"metric": loop.state.metrics["peak_memory_mib"],
                          "own": peak_rss_bytes() / 2.0 ** 20})


if __name__ == "__main__":
    out = out_dir()
    ballast = torch.ones(256 * 2 ** 20 // 4) if rank() == 1 else None  # 256 MiB touched
    model = make_model(seed=1)
    own = Own()
    loop = Loop(model, make_optimizer(model), DataLoader(regression_data(32, seed=2), batch_size=4),
                val_data=DataLoader(regression_data(16, seed=3), batch_size=4),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[DDP(), ThroughputMonitor(every_n_steps=2), MemoryMonitor(), own])
    loop.fit(2)
    metrics = loop.validate()
    save("result", {"rows": own.rows, "validate": sorted(metrics),
                    "val_samples_per_s": metrics["val_samples_per_s"]})
