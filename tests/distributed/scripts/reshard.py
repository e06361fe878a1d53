"""torchrun script: runs stopped inside an epoch and resumed on another number of ranks.

Usage: torchrun --nproc_per_node=N reshard.py OUT RUN [RUN...]

Each RUN is ``NAME:DIR:SAMPLES:BATCH:STOP:EPOCHS:SHARDING``: a fit of EPOCHS epochs over
SAMPLES samples (a shuffled DataLoader of batch size BATCH, which SHARDING, ``ddp`` or
``fsdp`` with sharded checkpoints, shards), with a warmup-cosine
schedule built from ``loop.total_steps``, ``CSVLogger(OUT/DIR/log.csv, every_n_steps=1)`` and
``Checkpoint(OUT/DIR, resume=True)``. STOP > 0
stops the run (resumably, on every rank) after that many optimizer steps; 0 trains to the
end (resuming from OUT/DIR when it holds a checkpoint). Every rank writes
``NAME.rank<r>.json``: the ``[epoch, index]`` of every sample its dataset read in an
epoch, the final learning rate and step, ``loop.total_steps`` at ``on_fit_start``, and the
warnings the fit raised.
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import Dataset

from common import make_model, out_dir, regression_data, save, shuffled_loader
from hookloop import Callback, Loop, Suspended
from hookloop.callbacks import DDP, FSDP, Checkpoint, CSVLogger, LRScheduler
from hookloop.schedules import warmup_cosine

MIN_LR = 0.001


class Indexed(Dataset):
    """The samples of `regression_data`, recording which index each read was for."""

    def __init__(self, samples: int) -> None:
        self.data, self.reads = regression_data(samples, seed=2), []
        self.epoch: int | None = None  # outside an epoch (the loop's checks read a sample)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        if self.epoch is not None:
            self.reads.append([self.epoch, int(index)])
        return self.data[index]


class Watch(Callback):
    """Tells the dataset the epoch it reads for; stops the run resumably after ``stop`` steps."""

    def __init__(self, dataset: Indexed, stop: int) -> None:
        self.dataset, self.stop, self.total_steps = dataset, stop, None

    def on_fit_start(self, loop: Loop) -> None:
        self.total_steps = loop.total_steps  # of the sharded data (DDP puts back the user's)

    def on_epoch_start(self, loop: Loop) -> None:
        self.dataset.epoch = loop.state.epoch

    def on_epoch_end(self, loop: Loop) -> None:
        self.dataset.epoch = None

    def after_step(self, loop: Loop) -> None:  # the ranks' vote may take one step more
        if loop.state.step == self.stop:
            loop.stop("test", resumable=True)


def run(spec: str) -> None:
    name, directory, samples, batch, stop, epochs, sharding = spec.split(":")
    dataset = Indexed(int(samples))
    watch = Watch(dataset, int(stop))
    model = make_model(seed=1)
    schedule = functools.partial(warmup_cosine, warmup_steps=2, min_lr=MIN_LR)
    sharder = DDP() if sharding == "ddp" else FSDP(state_dict="sharded")
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05),
                shuffled_loader(dataset, int(batch), seed=3), loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=[sharder, watch, LRScheduler(schedule),
                                         CSVLogger(out_dir() / directory / "log.csv",
                                                   every_n_steps=1),
                                         Checkpoint(out_dir() / directory, resume=True)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loop.fit(int(epochs))
        except Suspended:
            pass
    save(name, {"reads": dataset.reads, "lr": loop.optimizer.param_groups[0]["lr"],
                "step": loop.state.step, "total_steps": watch.total_steps,
                "warnings": [str(warning.message) for warning in caught]})


if __name__ == "__main__":
    for spec in sys.argv[2:]:
        run(spec)
