"""torchrun script: rank 1 raises in its third batch while rank 0 waits in the all-reduce.

Usage: torchrun --nproc_per_node=2 fail.py OUT_DIR
"""

from __future__ import annotations

from torch import nn
from torch.utils.data import DataLoader

from common import make_model, make_optimizer, rank, regression_data
from hookloop import Callback, Loop
from hookloop.callbacks import DDP


class FailOnRankOne(Callback):
    def on_batch_start(self, loop: Loop) -> None:
        if loop.state.batch_idx == 2 and rank() == 1:
            raise RuntimeError("injected failure on rank 1")


if __name__ == "__main__":
    model = make_model(seed=1)
    loop = Loop(model, make_optimizer(model), DataLoader(regression_data(64, seed=2), batch_size=4),
                loss_fn=nn.functional.mse_loss, callbacks=[DDP(), FailOnRankOne()], device="cpu")
    loop.fit(50)
    print("unreachable: training finished", flush=True)
