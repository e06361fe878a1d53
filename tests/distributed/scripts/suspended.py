"""torchrun script: launches that a signal ends at a random moment, and their relaunches.

Usage: torchrun --nproc_per_node=2 suspended.py OUT NAME [NAME...]

Each NAME is one run, in its own checkpoint directory OUT/NAME: a fit of EPOCHS epochs with
``Checkpoint(resume=True)`` (a shuffled loader, dropout, validation: every random stream
matters). ``reference`` is never interrupted. For any other name the test sends a signal to
one rank while the run trains: every rank writes ``NAME.stopped`` (the step it stopped at,
the exit status `Suspended` carries, the files in the directory), then the run is relaunched
in this process with the same configuration (as a new launch of the same command would:
the checkpoint restores every random stream) and trains to the end. Each rank then writes
``NAME.final`` (its weights). A NAME ending in ``!`` is not caught: the process exits with
the status; the test relaunches that NAME (without the ``!``) in the next launch.

Each rank writes ``pid.rank<r>.json`` first and, at the first training batch of a run that
starts from nothing, ``NAME.ready.rank<r>.json``, so the test knows whom to signal and when.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from common import FEATURES, out_dir, rank, regression_data, save, shuffled_loader
from hookloop import Callback, Loop, Suspended
from hookloop.callbacks import DDP, Checkpoint

EPOCHS = 3


class Slow(Callback):
    """Marks the start of training and makes each step last long enough to be hit."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_batch_start(self, loop: Loop) -> None:
        if loop.state.step == 0 and loop.state.batch_idx == 0:
            save(f"{self.name}.ready", {"time": time.time()})

    def on_batch_end(self, loop: Loop) -> None:
        time.sleep(0.03)


def build(name: str) -> Loop:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    directory = out_dir() / name
    loop = Loop(model, optimizer, shuffled_loader(regression_data(48, seed=2), 3, seed=3),
                val_data=DataLoader(regression_data(12, seed=4), batch_size=4),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[DDP(), Slow(name),
                           Checkpoint(directory, every_n_epochs=None, resume=True)])
    return loop


if __name__ == "__main__":
    save("pid", {"pid": os.getpid()})
    for argument in sys.argv[2:]:
        name = argument.rstrip("!")
        loop = build(name)
        try:
            loop.fit(EPOCHS)
        except Suspended as suspended:
            save(f"{name}.stopped", {"step": loop.state.step, "status": suspended.code,
                                     "files": sorted(os.listdir(out_dir() / name)),
                                     "message": str(suspended)})
            if argument.endswith("!"):
                raise
            loop = build(name)  # the relaunch
            loop.fit(EPOCHS)
        save(f"{name}.final", {key: value.detach().clone()
                               for key, value in loop.unwrapped_model.state_dict().items()})
    print(f"rank {rank()} done", flush=True)
