"""A task of an `srun` step (no torchrun): `DDP(requeue=True)` forms the group from SLURM's
variables and trains until the test's SIGUSR1 ends the launch.

Usage (the test sets SLURM's variables, as srun would): python srun_task.py OUT

Each task writes ``pid.task<SLURM_PROCID>.json`` first, ``ready.task<r>.json`` at its
second step, and ``stopped.task<r>.json`` (the world size it trained in, the step it
stopped at, the status) when the launch ends; then the `Suspended` exits the process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from torch import nn

from common import make_model, make_optimizer, regression_data, shuffled_loader
from hookloop import Callback, Loop, Suspended, distributed
from hookloop.callbacks import DDP, Checkpoint

def write(name: str, value: object) -> None:
    out, task = Path(sys.argv[1]), os.environ["SLURM_PROCID"]
    (out / f"{name}.task{task}.json").write_text(json.dumps(value))


class Slow(Callback):
    def on_fit_start(self, loop: Loop) -> None:
        self.world = distributed.world_size()

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == 2:
            write("ready", {})
        time.sleep(0.05)


if __name__ == "__main__":
    write("pid", {"pid": os.getpid()})
    model = make_model(seed=1)
    slow = Slow()
    loop = Loop(model, make_optimizer(model), shuffled_loader(regression_data(96, seed=2), 3, 3),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[DDP(requeue=True), slow, Checkpoint(Path(sys.argv[1]) / "ckpt",
                                                               resume=True)])
    try:
        loop.fit(20)
    except Suspended as ended:
        write("stopped", {"world": slow.world, "step": loop.state.step, "status": ended.code,
                          "rank": os.environ.get("RANK")})
        raise
