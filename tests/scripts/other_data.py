"""A run that a test kills and relaunches with another training set.

Usage: other_data.py DIR BATCHES [--kill-at-step N]
"""

import os
import sys

import torch
import torch.nn.functional as F

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint


class Kill(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop):
        if loop.state.step == self.step:
            os._exit(9)  # like a SIGKILL, before this step's checkpoint: nothing runs after it


def main() -> None:
    directory, batches = sys.argv[1], int(sys.argv[2])
    kill = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--kill-at-step" else None
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(2, 4), torch.randint(0, 2, (2,))) for _ in range(batches)]
    callbacks = [Checkpoint(directory, every_n_steps=1, keep_last=None, resume=True)]
    if kill is not None:
        callbacks.insert(0, Kill(kill))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                callbacks=callbacks, device="cpu", sanity_val_batches=0)
    print("step", loop.fit(3).step)


if __name__ == "__main__":
    main()
