"""torchrun script: a slow 2-process run with Checkpoint, to be preempted by SIGTERM.

Usage: torchrun --nproc_per_node=2 preempted.py CKPT_DIR READY_FILE EPOCHS

Rank 0 creates READY_FILE once 3 optimizer steps are done; the test then sends SIGTERM
to torchrun, which forwards it to both workers. Relaunched, it resumes and finishes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torch import nn
from torch.utils.data import DataLoader

from common import make_model, make_optimizer, rank, regression_data
from hookloop import Callback, Loop
from hookloop.callbacks import DDP, Checkpoint


class Slow(Callback):
    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == 3 and rank() == 0:
            Path(sys.argv[2]).touch()
        time.sleep(0.05)


if __name__ == "__main__":
    model = make_model(seed=1)
    loop = Loop(model, make_optimizer(model), DataLoader(regression_data(48, seed=2), batch_size=3),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[DDP(), Slow(), Checkpoint(sys.argv[1], resume=True)])
    loop.fit(int(sys.argv[3]))
    print(f"rank {rank()} finished at step {loop.state.step}", flush=True)
